"""Tests kept out of CI for time (marked `slow` at collection), each with the test that covers the
same ground in CI. CI has 2 cores and the team's target is 30 minutes for `.ci/run`; on
2026-12-07 the parallel part alone took 3,286 s there (`python -m pytest ... --junitxml`, this
list was chosen from the per-test times of that run: 7,907 worker-seconds over 1,077 tests).
Most of a test's time is Dynamo and AOTAutograd tracing its tiny model (issue 37); these are the
second and third variants of what one CI test already proves. Run them with `-m slow`.

An entry names a test id as pytest prints it (file::name or file::name[params]); one that no
longer matches a collected test fails the run (tests/conftest.py), so the list cannot rot.
"""
from __future__ import annotations

# (test id, what runs in CI instead)
SLOW_IN_CI: dict[str, str] = {
    # bf16 with fp32 masters: the master path is one for all families; CI keeps a dense, an MoE,
    # a sliding-window, a hybrid linear-attention, a mamba hybrid, an MLA and a sinks family
    **{f"test_families.py::test_family_trains_in_bf16_with_fp32_masters[{name}]":
       "fp32 parity of this family (test_family_trains_like_eager) and bf16 of llama, qwen3_moe, "
       "gemma3_text, qwen3_next, jamba, deepseek_v3, gpt_oss"
       for name in ("bamba", "ernie4_5", "exaone4", "falcon_h1", "gemma2", "glm4", "glm4_moe", "granitemoehybrid",
                    "hunyuan_v1_dense", "lfm2", "lfm2_moe", "llama4_text", "minimax", "mistral", "mixtral",
                    "nemotron_h", "olmo2", "olmo3", "olmo_hybrid", "phi3", "qwen2", "qwen3", "qwen3_5_moe_text",
                    "qwen3_5_text", "recurrent_gemma", "smollm3", "zamba2")},
    # the pairwise matrix: its two slowest rows (fp16 + accumulation + packing + eval + resume)
    "test_config_matrix.py::test_row_trains_like_eager_and_resumes_bit_for_bit"
    "[fp16-accum3-batch1-full-on-on-jinja-pt-cosine-resume]": "the other fp16, resume and packing rows",
    "test_config_matrix.py::test_row_trains_like_eager_and_resumes_bit_for_bit"
    "[fp16-accum1-batch1-lora-off-on-qwen3_nothink-pt-cosine-fresh]": "the other fp16, LoRA and eval rows",
    # data parallel: two ranks equal one process, and a dead rank's clear error, stay in CI
    "test_data_parallel.py::test_two_ranks_train_like_one_process_at_twice_the_batch[qwen3_moe-backward]":
        "[llama-false]; routed experts under one process in test_routed_experts",
    "test_data_parallel.py::test_lora_under_two_ranks_trains_like_one_process": "[llama-false]; test_lora",
    "test_data_parallel.py::test_bf16_accumulation_under_two_ranks_trains_like_one_process":
        "[llama-false]; test_accumulation",
    "test_data_parallel.py::test_two_nodes_replicate_and_train_like_one_process":
        "test_the_node_holds_one_copy_of_the_state",
    "test_data_parallel.py::test_library_ranks_equal_one_process_with_tied_weights": "[llama-false]",
    # benchmark smoke runs (the scripts themselves; their figures are never asserted)
    "test_benchmarks.py::test_long_context_benchmark_smoke_run": "test_offload_checkpoints, test_tile_mlp",
    "test_benchmarks.py::test_overlap_benchmark_smoke_run": "test_host_adamw's overlapped steps",
    # signals and interrupts
    "test_faults.py::test_sigterm_unwinds_like_ctrl_c_and_the_run_resumes":
        "test_interrupts [save-Terminated] (SIGTERM during a save, then resumed)",
    **{f"test_interrupts.py::test_an_interrupt_says_what_is_true_and_its_advice_works[{case}]":
       "[save-Terminated] and [compile-KeyboardInterrupt]"
       for case in ("save-KeyboardInterrupt", "eval before the first save-KeyboardInterrupt",
                    "export-KeyboardInterrupt")},
    "test_train.py::test_overlapped_optimizer_trains_exactly_like_the_plain_step":
        "test_host_adamw::test_overlapped_step_equals_the_step_after_the_backward",
    "test_train.py::test_a_step_that_cannot_fit_the_device_is_refused_before_training":
        "test_faults::test_cannot_fit_exits_3",
    "test_train.py::test_quickstart_config_trains_the_embedded_model":
        "test_lf_examples [train_full/qwen3_full_sft.yaml] (megatrain train on the embedded SmolLM2); "
        "test_train::test_quickstart_config_is_a_valid_config",
    # long context: llama's step at 8K and the layer checkpoints on the host stay in CI
    "test_offload_checkpoints.py::test_checkpoints_on_the_host_are_bit_identical[qwen3_next]": "[llama]",
    "test_offload_checkpoints.py::test_long_context_step_at_8k_tokens_equals_the_plain_one_and_eager"
    "[mistral-packed]": "[llama-left]; packing in test_train, test_config_matrix",
    "test_offload_checkpoints.py::test_long_context_step_at_8k_tokens_equals_the_plain_one_and_eager"
    "[mixtral-left]": "[llama-left]",
    # fine-tuning variants
    "test_freeze.py::test_train_freeze_resumes_bit_for_bit_and_exports":
        "test_config_matrix's freeze rows (resumed bit for bit)",
    "test_lora.py::test_fp32_lora_matches_eager_peft[0.3]": "[0.0]; dropout in test_dropout_actually_changes_the_loss",
    "test_lf_examples.py::test_example_trains_or_is_refused_before_any_step[train_lora/qwen3_lora_sft.yaml]":
        "[train_full/qwen3_full_sft.yaml]; LoRA in test_lora",
    "test_lf_examples.py::test_example_trains_or_is_refused_before_any_step[train_lora/qwen3_preprocess.yaml]":
        "[train_full/qwen3_full_sft.yaml]",
    "test_accumulation.py::test_accumulated_low_precision_steps_over_new_lengths_match_fp32_eager"
    "[dtype0-torch-full]": "[dtype1-host-full], [dtype2-host-freeze]",
    "test_accumulation.py::test_accumulated_low_precision_steps_over_new_lengths_match_fp32_eager"
    "[dtype3-torch-freeze]": "[dtype1-host-full], [dtype2-host-freeze]",
    "test_train_tier.py::test_training_with_the_tier_equals_training_without_it[False]": "[backward]",
    # planner and graph paths
    "test_plan.py::test_100b_class_prediction": "test_plan's other predictions; test_inspect's presets",
    "test_routed_experts.py::test_routed_experts_in_bf16_match_the_full_transfer":
        "test_routed_experts_train_like_eager (fp32)",
    # presets of one architecture at other sizes (the same layer classes and attention layout;
    # head counts and widths differ): the smallest of each inspects in CI
    **{f"test_inspect.py::test_every_preset_inspects[{big}]": f"[{small}] (same model_type and layer layout)"
       for big, small in (("llama-3-70b", "llama-3-8b"), ("llama-3.1-405b", "llama-3-8b"),
                          ("qwen2.5-14b", "qwen2.5-7b"), ("qwen2.5-32b", "qwen2.5-7b"), ("qwen2.5-72b", "qwen2.5-7b"),
                          ("qwen3-14b", "qwen3-8b"), ("qwen3-32b", "qwen3-8b"), ("mixtral-8x22b", "mixtral-8x7b"),
                          ("qwen2.5-vl-72b", "qwen2.5-vl-7b"), ("gpt-oss-20b", "gpt-oss-120b"))},
    "test_layer_regions.py::test_the_regional_trace_gives_the_whole_graph_program[zamba2]": "[llama], [qwen3_next]",
    "test_layer_regions.py::test_the_regional_trace_gives_the_whole_graph_program[gemma3_text]":
        "[llama], [qwen3_next]",
}
