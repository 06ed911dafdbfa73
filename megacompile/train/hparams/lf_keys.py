"""LLaMA-Factory's training keys and what megatrain does with each: the compatibility table.

    translate({"bf16": True, "deepspeed": "ds_z3.json", "lr": 1}, known=set_of_our_keys)
      -> Translated(values={"torch_dtype": "bfloat16"},
                    notes=["LLaMA-Factory key deepspeed: ignored: megatrain trains on one accelerator ..."],
                    refused=[], unknown=["lr"])

A key of an LLaMA-Factory SFT/PT config (its ModelArguments, DataArguments,
FinetuningArguments, GeneratingArguments and the Seq2SeqTrainingArguments it inherits) is one of:
  - a TrainConfig field of the same name and meaning (not listed here: config.py has them);
  - MAPPED: translated into megatrain's keys (bf16 -> torch_dtype, neat_packing -> packing, ...);
  - NOTED: accepted and ignored, with one note at the start of the run saying what megatrain does
    instead (deepspeed, gradient_checkpointing, dataloader_num_workers, ...);
  - REFUSED: an error with the reason, unless the value is one that changes nothing (LLaMA-Factory's
    default: `quantization_bit: null` passes, `quantization_bit: 4` is refused).
The documentation's page docs/llamafactory.md shows this table, made from it (docs/hooks.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# -- NOTED: accepted; what megatrain does instead (one note line per distinct text) ---------------
_ONE_DEVICE = ("megatrain streams the weights from host RAM and runs its own data parallelism under torchrun "
               "(docs/data-parallel.md), not DeepSpeed, FSDP or DDP")
_RECOMPUTE = "megatrain always recomputes each decoder layer in the backward (activation checkpointing is its schedule)"
_KERNELS = "the megatrain backend chooses the attention and fused kernels itself"
_LOADER = "batches are collated in the training process (nothing to parallelise: the step waits on the weights)"
_CHECKPOINT = ("a checkpoint always holds the fp32 weights, optimizer, scheduler, data position and RNG state "
               "(resume continues bit for bit), in safetensors/JSON")
_LOGGING = ("the progress bar and output_dir/train_log.jsonl (loss, lr, grad_norm, tokens_per_s, trained_tokens) "
            "every logging_steps; report_to adds TensorBoard or wandb")
_INFERENCE = "it configures generation or inference, and megatrain train does not generate"
_EXPORT = "output_dir already holds the trained model as a Hugging Face folder (no export step)"
_HUB = "the Hub token comes from the environment (HF_TOKEN or huggingface-cli login)"
_METHOD_OFF = "it configures a method that is off in this config (its switch is refused when turned on)"
_PROFILER = "megatrain inspect --format chrome-trace shows the step's schedule instead of a torch profile"

NOTED: dict[str, str] = {
    **dict.fromkeys(("deepspeed", "ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
                     "ddp_broadcast_buffers", "ddp_static_graph", "fsdp", "fsdp_config",
                     "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params", "local_rank",
                     "log_on_each_node", "save_on_each_node", "accelerator_config", "parallelism_config",
                     "log_level_replica", "ray_num_workers", "ray_init_kwargs",
                     "master_addr", "master_port", "data_shared_file_system", "hyper_parallel_args",
                     "torch_empty_cache_steps", "low_cpu_mem_usage", "offload_folder", "quantization_device_map"),
                    _ONE_DEVICE),
    **dict.fromkeys(("gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
                     "activation_checkpointing_kwargs", "disable_gradient_checkpointing", "use_reentrant_gc",
                     "use_unsloth_gc"), _RECOMPUTE),
    **dict.fromkeys(("flash_attn", "enable_liger_kernel", "use_liger_kernel", "liger_kernel_config", "use_unsloth",
                     "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_v1_kernels", "tf32",
                     "use_cache", "use_kv_cache"), _KERNELS),
    **dict.fromkeys(("dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
                     "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
                     "remove_unused_columns", "length_column_name"),
                    _LOADER),
    "average_tokens_across_devices": "with several ranks the loss is always divided by the trained tokens of all of "
                                     "them (one process at the global batch gives the same gradients)",
    "dataloader_drop_last": "an epoch's last incomplete micro-batch is always dropped (every step has the same shape)",
    **dict.fromkeys(("save_only_model", "restore_callback_states_from_checkpoint", "enable_jit_checkpoint",
                     "save_safetensors"), _CHECKPOINT),
    **dict.fromkeys(("log_level", "logging_first_step", "logging_dir", "include_num_input_tokens_seen",
                     "include_tokens_per_second", "include_effective_tokens_per_second", "disable_tqdm",
                     "print_param_status", "skip_memory_metrics", "debug", "project",
                     "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"), _LOGGING),
    "logging_nan_inf_filter": "a step with a non-finite loss or gradient norm is skipped and counted (skipped_steps)",
    "plot_loss": "the loss plot output_dir/training_loss.png is always drawn",
    "do_train": "megatrain train always trains",
    "full_determinism": "the sample order and the data are seeded by seed; kernels run as the backend lowers them",
    "ignore_pad_token_for_loss": "padding is never trained (its labels are always ignored)",
    "sortish_sampler": _INFERENCE,
    "prediction_loss_only": "evaluation computes the loss only (the LM head and loss are fused, no logits)",
    **dict.fromkeys(("eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object",
                     "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval", "metric_for_best_model",
                     "greater_is_better"), "evaluation is the loss in torch_dtype through the compiled model"),
    **dict.fromkeys(("generation_max_length", "generation_num_beams", "generation_config", "eval_num_beams",
                     "do_sample", "temperature", "top_p", "top_k", "num_beams", "max_length", "max_new_tokens",
                     "repetition_penalty", "length_penalty", "skip_special_tokens", "infer_backend", "infer_dtype",
                     "vllm_maxlen", "vllm_gpu_util", "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config",
                     "sglang_maxlen", "sglang_mem_fraction", "sglang_tp_size", "sglang_config",
                     "sglang_lora_backend"), _INFERENCE),
    **dict.fromkeys(("export_dir", "export_size", "export_device", "export_quantization_bit",
                     "export_quantization_dataset", "export_quantization_nsamples", "export_quantization_maxlen",
                     "export_legacy_format", "export_hub_model_id"), _EXPORT),
    **dict.fromkeys(("hf_hub_token", "ms_hub_token", "om_hub_token", "hub_token", "hub_private_repo", "hub_model_id",
                     "hub_strategy", "hub_always_push", "hub_revision"), _HUB),
    **dict.fromkeys(("enable_torch_profiler", "profiler_output_dir", "profiler_wait_steps", "profiler_warmup_steps",
                     "profiler_active_steps", "profiler_repeat", "profiler_record_shapes", "profiler_profile_memory",
                     "profiler_with_stack", "profile_modules"), _PROFILER),
    # options of methods that are switched off unless their switch (refused below) is on
    **dict.fromkeys(("module_dropout", "oft_rank",
                     "oft_block_size", "oft_target", "pref_beta", "pref_ftx", "pref_bco_weight", "pref_loss",
                     "dpo_label_smoothing", "kto_chosen_weight", "kto_rejected_weight", "simpo_gamma",
                     "ppo_buffer_size", "ppo_epochs", "ppo_score_norm", "ppo_target", "ppo_whiten_rewards",
                     "ref_model", "ref_model_adapters", "ref_model_quantization_bit", "reward_model",
                     "reward_model_adapters", "reward_model_quantization_bit", "reward_model_type", "ld_alpha",
                     "galore_target", "galore_rank", "galore_update_interval", "galore_scale", "galore_proj_type",
                     "galore_layerwise", "apollo_target", "apollo_rank", "apollo_update_interval", "apollo_scale",
                     "apollo_proj", "apollo_proj_type", "apollo_scale_type", "apollo_layerwise",
                     "apollo_scale_front", "badam_mode", "badam_start_block", "badam_switch_mode",
                     "badam_switch_interval", "badam_update_ratio", "badam_mask_mode", "badam_verbose",
                     "swanlab_project", "swanlab_workspace", "swanlab_run_name", "swanlab_mode", "swanlab_api_key",
                     "swanlab_logdir", "swanlab_lark_webhook_url", "swanlab_lark_secret", "asft_alpha",
                     "eaft_alpha", "quantization_method", "quantization_type", "double_quantization",
                     "init_special_tokens", "fp8_backend", "fp8_enable_fsdp_float8_all_gather",
                     "kt_weight_path", "kt_expert_checkpoint_path", "kt_use_lora_experts", "kt_lora_expert_num",
                     "kt_lora_expert_intermediate_size"), _METHOD_OFF),
    **dict.fromkeys(("video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video",
                     "audio_sampling_rate"), "megatrain trains on text and images (a data set with videos or audios "
                                             "is refused)"),
}


# -- REFUSED: (the values that change nothing, why another value is refused) ----------------------
_NOT_YET = "not supported by megatrain yet"
REFUSED: dict[str, tuple[tuple, str]] = {
    "adapter_name_or_path": ((None,), "continuing or merging an existing LoRA adapter is not supported yet "
                                      "(finetuning_type: lora starts new adapters)"),
    "adapter_folder": ((None,), "continuing or merging an existing LoRA adapter is not supported yet"),
    "create_new_adapter": ((False,), "it needs adapter_name_or_path, which is not supported yet"),
    "use_dora": ((False,), "DoRA is not supported yet (finetuning_type: lora trains plain LoRA)"),
    "pissa_init": ((False,), "PiSSA initialisation is not supported yet (LoRA starts as peft's default init)"),
    "pissa_iter": ((16,), "PiSSA initialisation is not supported yet"),
    "pissa_convert": ((False,), "PiSSA initialisation is not supported yet"),
    "loraplus_lr_ratio": ((None,), "LoRA+ (a larger learning rate for lora_B) is not supported yet"),
    "loraplus_lr_embedding": ((1e-6,), "LoRA+ is not supported yet"),
    "cache_dir": ((None,), "set HF_HOME (or HF_HUB_CACHE) for where models are downloaded"),
    "use_fast_tokenizer": ((True,), "megatrain loads the tokenizer with AutoTokenizer's default (the fast one)"),
    "resize_vocab": ((False,), "resizing the vocabulary is " + _NOT_YET),
    "split_special_tokens": ((False,), _NOT_YET),
    "add_tokens": ((None,), "adding tokens to the tokenizer is " + _NOT_YET),
    "add_special_tokens": ((None,), "adding tokens to the tokenizer is " + _NOT_YET),
    "new_special_tokens_config": ((None,), "adding tokens to the tokenizer is " + _NOT_YET),
    "model_revision": (("main",), "give a local folder of that revision (huggingface-cli download --revision)"),
    "rope_scaling": ((None,), "RoPE scaling: put it in the model's config.json instead"),
    "shift_attn": ((False,), "LongLoRA's shifted sparse attention is " + _NOT_YET),
    "mixture_of_depths": ((None,), "mixture-of-depths is " + _NOT_YET),
    "moe_aux_loss_coef": ((None,), "set output_router_logits: true and router_aux_loss_coef in the model's "
                                   "config.json (docs/compile.md: MoE router auxiliary loss)"),
    "upcast_layernorm": ((False,), "norms run in torch_dtype with fp32 master weights; upcasting is " + _NOT_YET),
    "upcast_lmhead_output": ((False,), "the fused LM-head loss already reduces in fp32"),
    "train_from_scratch": ((False,), "megatrain fine-tunes or continues pre-training from the given weights"),
    "quantization_bit": ((None,), "megatrain trains full-precision weights (fp32 masters), not quantized (QLoRA)"),
    "image_do_pan_and_scan": ((False,), _NOT_YET),
    "crop_to_patches": ((False,), _NOT_YET),
    "use_kt": ((False,), "KTransformers is " + _NOT_YET),
    "use_llama_pro": ((False,), "LLaMA Pro block expansion is " + _NOT_YET),
    "use_adam_mini": ((False,), "megatrain's optimizer is AdamW on the host (runtime/adamw.py)"),
    "use_galore": ((False,), "megatrain's optimizer is AdamW on the host (runtime/adamw.py)"),
    "use_apollo": ((False,), "megatrain's optimizer is AdamW on the host (runtime/adamw.py)"),
    "use_badam": ((False,), "megatrain's optimizer is AdamW on the host (runtime/adamw.py)"),
    "use_muon": ((False,), "megatrain's optimizer is AdamW on the host (runtime/adamw.py)"),
    "optim": (("adamw_torch", "adamw_torch_fused", "adamw_hf"),
              "megatrain's optimizer is AdamW on the host (runtime/adamw.py): use adamw_torch or leave optim out"),
    "optim_args": ((None, ""), "megatrain's AdamW takes adam_beta1, adam_beta2, adam_epsilon and weight_decay"),
    "optim_target_modules": ((None,), "megatrain's optimizer is AdamW on the host (runtime/adamw.py)"),
    "use_mca": ((False,), "Megatron-Core training is not megatrain's: it trains on one accelerator"),
    "use_hyper_parallel": ((False,), "megatrain trains on one accelerator"),
    "use_dft_loss": ((False,), "megatrain trains on the cross-entropy loss; this loss is " + _NOT_YET),
    "use_asft_loss": ((False,), "megatrain trains on the cross-entropy loss; this loss is " + _NOT_YET),
    "use_eaft_loss": ((False,), "megatrain trains on the cross-entropy loss; this loss is " + _NOT_YET),
    "freeze_multi_modal_projector": ((True,), "vision: frozen | train decides the whole vision side in megatrain"),
    "freeze_language_model": ((False,), "megatrain trains the language model (vision: train adds the vision tower)"),
    "compute_accuracy": ((False,), "the LM head and the loss are fused: there are no logits to compute accuracy from"),
    "early_stopping_steps": ((None,), "early stopping is " + _NOT_YET),
    "use_swanlab": ((False,), "SwanLab is not supported: use report_to: wandb or tensorboard"),
    "fp8": ((False,), "FP8 training is " + _NOT_YET),
    "label_smoothing_factor": ((0, 0.0), "label smoothing is " + _NOT_YET),
    "neftune_noise_alpha": ((None,), "NEFTune is " + _NOT_YET),
    "auto_find_batch_size": ((False,), "run `megatrain plan config.yaml` to find the largest batch that fits"),
    "data_seed": ((None,), "the sample order follows seed (give the same seed for both)"),
    "load_best_model_at_end": ((False,), "output_dir gets the last step's model; the checkpoints stay there"),
    "eval_on_start": ((False,), _NOT_YET),
    "eval_delay": ((0, 0.0, None), _NOT_YET),
    "include_for_metrics": ((None, []), "evaluation computes the loss only"),
    "label_names": ((None, ["labels"]), "megatrain trains on the labels it builds from the data"),
    "ignore_data_skip": ((False,), "a resumed run always continues at the checkpoint's data position"),
    "do_predict": ((False,), "prediction (generation) is not part of megatrain train"),
    "predict_with_generate": ((False,), "prediction (generation) is not part of megatrain train"),
    "push_to_hub": ((False,), "upload output_dir yourself (huggingface-cli upload)"),
    "logging_strategy": (("steps",), "megatrain logs every logging_steps (use a large logging_steps for fewer)"),
    "save_strategy": (("steps",), "megatrain saves every save_steps (use a large save_steps for fewer)"),
    "train_sampling_strategy": (("random",), "use disable_shuffling: true to read the examples in order"),
    "group_by_length": ((False,), "grouping samples by length is " + _NOT_YET),
}

#: LLaMA-Factory stages megatrain refuses, with the reason
STAGES_REFUSED = {
    "rm": "reward-model training is not supported yet (stage: sft or pt)",
    "ppo": "PPO (RLHF) is not supported yet (stage: sft or pt)",
    "dpo": "DPO (preference pairs) is not supported yet (stage: sft or pt)",
    "kto": "KTO is not supported yet (stage: sft or pt)",
}

#: the mapped keys (see _map); listed for the documentation's table and the completeness test
MAPPED = {
    "bf16": "true -> torch_dtype: bfloat16",
    "fp16": "true -> torch_dtype: float16",
    "pure_bf16": "true -> torch_dtype: bfloat16 (megatrain keeps fp32 master weights and AdamW state anyway)",
    "neat_packing": "true -> packing: true (megatrain's packing is always neat: positions restart per sample, "
                    "no attention across samples)",
    "freeze_vision_tower": "true -> vision: frozen; false -> vision: train",
    "use_cpu": "true -> device: cpu",
}


@dataclass
class Translated:
    values: dict[str, Any] = field(default_factory=dict)   # megatrain keys, ready for TrainConfig
    notes: list[str] = field(default_factory=list)          # one line per distinct "what megatrain does instead"
    refused: list[str] = field(default_factory=list)        # "key: value: reason"
    unknown: list[str] = field(default_factory=list)        # in no table


def _map(key: str, value: Any, mapping: dict[str, Any], out: Translated) -> None:
    """Translate one MAPPED key into megatrain's keys (a conflict with the key it maps to is refused)."""
    def set_key(ours: str, ours_value: Any) -> None:
        given = mapping.get(ours, out.values.get(ours, ours_value))
        if given != ours_value:
            out.refused.append(f"{key}: {value!r} means {ours}: {ours_value}, but {ours} is {given!r}: set one of them")
        else:
            out.values[ours] = ours_value
    if key in ("bf16", "fp16", "pure_bf16"):
        if value is True:
            set_key("torch_dtype", "float16" if key == "fp16" else "bfloat16")
        elif value not in (False, None):
            out.refused.append(f"{key}: {value!r}: expected true or false")
    elif key == "neat_packing":
        if value is True:
            if mapping.get("stage", "sft") != "sft":
                out.refused.append("neat_packing: true: packing of separate samples is for stage: sft (stage: pt "
                                   "chunks its raw text anyway)")
            else:
                set_key("packing", True)
        elif value not in (False, None):
            out.refused.append(f"neat_packing: {value!r}: expected true or false")
    elif key == "use_cpu":
        if value is True:
            set_key("device", "cpu")
        elif value is not False:
            out.refused.append(f"use_cpu: {value!r}: expected true or false")
    elif key == "freeze_vision_tower":
        if value in (True, False):
            set_key("vision", "frozen" if value else "train")
        else:
            out.refused.append(f"freeze_vision_tower: {value!r}: expected true or false")


def translate(mapping: dict[str, Any], known: set[str]) -> Translated:
    """Sort a config's keys: megatrain's own (`known`) pass through, LLaMA-Factory's are mapped,
    noted or refused, the rest are unknown. LLaMA-Factory's `packing: null` (its default: on for
    stage pt) is megatrain's default too, so the key is dropped."""
    out = Translated()
    noted: dict[str, list[str]] = {}
    for key, value in mapping.items():
        if key == "packing" and value is None:
            continue
        if key in known:   # (a mapped key that means otherwise was refused by _map)
            out.values[key] = value
        elif key in MAPPED:
            _map(key, value, mapping, out)
        elif key in NOTED:
            noted.setdefault(NOTED[key], []).append(key)
        elif key in REFUSED:
            harmless, why = REFUSED[key]
            if not any(value == ok and type(value) is type(ok) or value is ok for ok in harmless):
                out.refused.append(f"{key}: {value!r}: {why}")
        else:
            out.unknown.append(key)
    stage = mapping.get("stage")
    if isinstance(stage, str) and stage in STAGES_REFUSED:
        out.refused.append(f"stage: {stage}: {STAGES_REFUSED[stage]}")
        out.values.pop("stage", None)
    out.notes = [f"LLaMA-Factory key{'s' if len(keys) > 1 else ''} {', '.join(keys)}: ignored; {text}."
                 for text, keys in noted.items()]
    return out
