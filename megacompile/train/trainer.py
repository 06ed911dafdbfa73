"""The training loop behind `megatrain train`.

    config -> preflight (host RAM) -> data (registry, template, masks; one example printed)
           -> torch.compile(model, backend="megatrain") -> HostAdamW on fp32 masters + LR schedule
           -> steps: accumulate micro-batches (loss normalised by the step's trained tokens),
              clip, skip non-finite steps, log (tqdm, JSONL, TensorBoard), checkpoint
           -> HF model folder in output_dir (+ loss plot)
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import torch

from ..errors import ConfigError, MegatrainError
from ..hardware import host_memory_bytes
from .. import vlm
from ..options import Options
from ..presets import keep_layers
from ..runtime.adamw import HostAdamW
from ..vlm import is_vlm
from . import checkpoint
from .config import TrainConfig
from .data import IGNORE, Order, build_examples, collate, show_example
from .images import image_inputs

LOG_NAME = "train_log.jsonl"


class PreflightError(MegatrainError):
    """The run cannot fit this machine; the message says what to change."""


# model ------------------------------------------------------------------------------
def _dtype(config: TrainConfig, device: torch.device, checkpoint_dtype=None) -> torch.dtype:
    if config.torch_dtype != "auto":
        return getattr(torch, config.torch_dtype)
    if device.type == "cuda":
        return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    return torch.float32


def load_model(config: TrainConfig, device: torch.device):
    """(model, tokenizer, processor); the processor (images) only for a vision-language model."""
    source = config.model_name_or_path
    processor = None
    if source.startswith("embedded:"):
        if source != "embedded:smollm2":
            raise ConfigError(f"model_name_or_path={source!r}: the embedded model is embedded:smollm2.")
        from ..embedded import load_smollm2
        model, tokenizer = load_smollm2(torch_dtype=_dtype(config, device, torch.bfloat16),
                                        num_layers=config.num_layers)
    else:
        from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                                  AutoTokenizer)
        remote = config.trust_remote_code
        try:
            hf_config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
            vision = getattr(hf_config, "vision_config", None) is not None
            if vision:   # a VLM: its processor carries the tokenizer and the image processor
                processor = AutoProcessor.from_pretrained(source, trust_remote_code=remote)
                tokenizer = processor.tokenizer
            else:
                tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=remote)
        except OSError as e:
            raise ConfigError(f"model_name_or_path={source!r}: {str(e).splitlines()[0]}") from None
        if config.num_layers:
            keep_layers(hf_config, config.num_layers)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(source, config=hf_config, trust_remote_code=remote,
                                     dtype=_dtype(config, device, getattr(hf_config, "dtype", None)))
    model.config.use_cache = False
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token   # padding is masked by position, never by id
    return model.train(), tokenizer, processor


_RECURRENT = ("Mamba", "DeltaNet", "Recurrent", "ShortConv", "LinearAttention", "Lightning", "Lru")
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}


def check_packing(model) -> None:
    """Packing relies on a block-diagonal attention mask; a recurrent or linear-attention layer
    would carry its state from one packed sample into the next."""
    if is_vlm(model):
        raise ConfigError(f"packing: true with the vision-language model {model.config.model_type}: its "
                          "positions are computed per sample (3-D for Qwen-VL). Set packing: false.")
    recurrent = sorted({type(m).__name__ for m in model.modules() if any(s in type(m).__name__ for s in _RECURRENT)})
    layer_types = set(getattr(model.config, "layer_types", None) or ()) - _ATTENTION_LAYERS
    if recurrent or layer_types:
        raise ConfigError(f"packing: true with {model.config.model_type}: its {', '.join(recurrent or layer_types)} "
                          "layers would carry state from one packed sample into the next. Set packing: false.")


def preflight(model, device: torch.device, vision: str = "frozen") -> str:
    """Host RAM the store needs against what the machine has (refuses a run that cannot fit)."""
    from ..plan import _fmt, host_bytes, vision_device_bytes
    need = host_bytes(model, device.type)
    have = host_memory_bytes()
    params = sum(p.numel() for p in model.parameters())
    on_device = vision_device_bytes(model, vision)
    text = (f"[megatrain] {params / 1e6:.1f}M parameters; host RAM needed {_fmt(need.total)} "
            f"(masters {_fmt(need.masters)}, AdamW {_fmt(need.optimizer_state)}, transfer copies "
            f"{_fmt(need.transfer_copy)}, grads {_fmt(need.grads)}) of {_fmt(have)}; device {device}"
            + (f" (vision tower, {vision}: {_fmt(on_device)} on it)" if on_device else ""))
    if need.total > have:
        raise PreflightError(f"{text}: not enough host RAM. Add {_fmt(need.total - have)}, train a smaller model, "
                             "or freeze part of it.")
    return text


def _hardware(config: TrainConfig, device: torch.device, dtype: torch.dtype):
    """The profile the plan simulates: the `hardware` option, else this machine's (the CPU's
    measured rates; a CUDA GPU's closest built-in profile with its real free memory)."""
    import dataclasses

    from ..hardware import BUILTIN, load_hardware
    spec = config.megatrain.get("hardware")
    if spec is not None:
        return load_hardware(spec, dtype)
    if device.type == "cpu":   # memory figures only: rooflines instead of timing every body
        return dataclasses.replace(load_hardware("cpu", dtype), measure_ops=False)
    profile = Options.from_mapping(config.megatrain).hardware_profile() or BUILTIN["h100"]
    free, _ = torch.cuda.mem_get_info(device)
    return dataclasses.replace(profile, device_memory_gib=free / 2**30)


def plan_check(model, config: TrainConfig, device: torch.device) -> str:
    """The device half of the preflight, from `megatrain plan`: the step's device peak at
    per_device_train_batch_size x cutoff_len against the usable device memory (on the CPU, the
    RAM left after the host store). Refuses a run that cannot fit, saying what to change."""
    from ..plan import _fmt, plan_model
    dtype = next(model.parameters()).dtype
    batch = config.per_device_train_batch_size
    options = {k: v for k, v in config.megatrain.items() if k in ("recompute", "recompute_head", "logits")}
    plan = plan_model(model.config, hardware=_hardware(config, device, dtype), seq=config.cutoff_len, batch=batch,
                      slots=config.megatrain.get("slots", 2), dtype=dtype, max_batch=batch, options=options,
                      vision=config.vision)
    est = next((b for b in plan.batches if b.batch == batch), None)   # None: not even batch 1 fits
    if est is None or est.device_peak_bytes > plan.device_capacity:
        raise PreflightError(f"[megatrain] plan: batch {batch} x cutoff_len {config.cutoff_len} does not fit the "
                             f"{_fmt(plan.device_capacity)} usable on {device} ({plan.hardware['name']} profile). "
                             + " ".join(plan.problems) + " In the config: lower per_device_train_batch_size (raise "
                             "gradient_accumulation_steps to keep the effective batch) or cutoff_len.")
    text = (f"[megatrain] plan: device peak {_fmt(est.device_peak_bytes)} at batch {batch} x cutoff_len "
            f"{config.cutoff_len} of {_fmt(plan.device_capacity)} usable on {device} (resident weights "
            f"{_fmt(plan.device_weight_bytes)}); about {est.step_seconds * config.gradient_accumulation_steps:.2f} "
            f"s/step ({plan.hardware['name']} profile)")
    return text


# schedule ---------------------------------------------------------------------------
def lr_lambda(config: TrainConfig, total: int):
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if config.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if config.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return max(0.0, 1.0 - progress)   # linear
    return factor


def make_optimizer(model, config: TrainConfig, device: torch.device) -> HostAdamW:
    """AdamW on the host (runtime/adamw.py: one pass per parameter that also refreshes its
    transfer copy; on host threads during the backward and the next forward as `overlap_optimizer`
    says, by default "backward" on CUDA); no weight decay on biases and norms."""
    overlap = config.overlap_optimizer
    if overlap is None:
        overlap = "backward" if device.type == "cuda" else False
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]   # biases, norms
    return HostAdamW([{"params": decay, "weight_decay": config.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}],
                     lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
                     overlap=overlap)


# output dir -------------------------------------------------------------------------
def prepare_output(config: TrainConfig) -> Path | None:
    """Create output_dir; returns the checkpoint to resume from, if any."""
    out = Path(config.output_dir)
    existing = checkpoint.checkpoints(out)
    if config.resume_from_checkpoint not in (None, False):
        if config.resume_from_checkpoint is True:
            if not existing:
                raise ConfigError(f"resume_from_checkpoint: true, but {out} holds no complete checkpoint.")
            return existing[-1]
        path = Path(str(config.resume_from_checkpoint))
        if not path.is_dir():
            raise ConfigError(f"resume_from_checkpoint={str(path)!r} does not exist.")
        return path
    if existing or (out / LOG_NAME).exists():
        if not config.overwrite_output_dir:
            raise ConfigError(f"output_dir {out} already holds a run: set resume_from_checkpoint: true to continue "
                              "it, or overwrite_output_dir: true to start over (its checkpoints are then deleted).")
        for old in existing:
            shutil.rmtree(old)
        (out / LOG_NAME).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return None


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


# the loop ---------------------------------------------------------------------------
def train(config: TrainConfig, *, stop_at_step: int | None = None, progress: bool = True) -> dict:
    """Run a training job; returns the final trainer state. `stop_at_step` ends the run early
    (after that step's checkpoint, if one is due), as an interruption would."""
    options = Options.from_mapping(config.megatrain)
    device = options.torch_device
    resume_from = prepare_output(config)
    _seed(config.seed)
    model, tokenizer, processor = load_model(config, device)
    if config.packing and config.stage == "sft":
        check_packing(model)
    print(preflight(model, device, config.vision), flush=True)
    print(plan_check(model, config, device), flush=True)
    images = image_inputs(config, model, processor)
    examples, counts = build_examples(config, tokenizer, images)
    packed = f" (packed from {counts['packed_from']})" if "packed_from" in counts else ""
    cut = (f", {counts['dropped_images']} dropped: cutoff_len cut into an image" if "dropped_images" in counts
           else "")
    print(f"[megatrain] {len(examples)} examples{packed} from {counts['samples']} samples "
          f"({counts['dropped']} dropped: no reply left within cutoff_len={config.cutoff_len}{cut}); the first one, "
          f"[[not trained]]:\n{show_example(tokenizer, examples[0])}", flush=True)

    batch, accum = config.per_device_train_batch_size, config.gradient_accumulation_steps
    order = Order(len(examples), batch, config.seed)
    steps_per_epoch = order.batches_per_epoch // accum
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(examples)} examples make no full step of per_device_train_batch_size={batch} x "
                          f"gradient_accumulation_steps={accum}: lower them or add data.")
    total = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)

    # the trainer reads only the loss: the LM head and the loss run fused, no [tokens, vocab] logits
    compile_options = {"logits": "drop", **config.megatrain}
    if device.type == "cuda" and compile_options.get("device_budget") is None:
        # the device half of the preflight: the backend plans the step's peak before any training
        # work and refuses a schedule that does not fit in the free device memory
        free, _ = torch.cuda.mem_get_info(device)
        compile_options["device_budget"] = int(free * 0.95)
    if is_vlm(model):   # language stack compiled, vision side eager on the device (megacompile/vlm.py)
        cmodel = vlm.compile(model, vision=config.vision, options=compile_options)
    else:
        cmodel = torch.compile(model, backend="megatrain", options=compile_options)
    optimizer = make_optimizer(model, config, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, total))
    state = {"step": 0, "trained_tokens": 0, "skipped_steps": 0, "seconds": 0.0}
    if resume_from is not None:
        saved = checkpoint.load(resume_from, model, optimizer)   # (pinned by the host arenas)
        scheduler.load_state_dict(saved["scheduler"])
        order.load_state_dict(saved["data"])
        state = saved["state"]
        _truncate_log(Path(config.output_dir) / LOG_NAME, state["step"])
        print(f"[megatrain] resumed from {resume_from} at step {state['step']}", flush=True)

    out = Path(config.output_dir)
    writer = _tensorboard(config, out)
    window: list[tuple[float, int, float]] = []   # (loss, trained tokens, seconds) since the last log
    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=state["step"], disable=not progress, desc="train", dynamic_ncols=True)
    with open(out / LOG_NAME, "a") as log:
        while state["step"] < total:
            t0 = time.perf_counter()
            micro = [collate([examples[i] for i in order.next()], tokenizer.pad_token_id, images=images)
                     for _ in range(accum)]
            tokens = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in micro)
            count = torch.tensor(max(tokens, 1))
            loss = 0.0
            for i, mb in enumerate(micro):
                # sum over tokens / the step's trained tokens: accumulation gives the mean over the step
                out_mb = cmodel(**mb, num_items_in_batch=count, use_cache=False)
                if i == len(micro) - 1:
                    optimizer.arm()   # overlap_optimizer=backward: layers update as their gradients land
                out_mb.loss.backward()
                loss += out_mb.loss.item()
            norm = optimizer.grad_norm()
            # clipping by the global norm: the factor is applied inside the optimizer's pass
            # (runtime/adamw.py), not by a pass of its own over the gradients; updates made during
            # the backward are kept when it is 1 and redone otherwise
            clip = min(1.0, config.max_grad_norm / (norm + 1e-6)) if config.max_grad_norm > 0 else 1.0
            if math.isfinite(loss) and math.isfinite(norm):
                optimizer.step(grad_scale=clip)
            else:
                optimizer.discard()
                state["skipped_steps"] += 1
                bar.write(f"[megatrain] step {state['step'] + 1}: non-finite loss ({loss}) or gradient norm ({norm});"
                          " the optimizer step is skipped, the weights are unchanged.")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            state["step"] += 1
            seconds = time.perf_counter() - t0
            state["trained_tokens"] += tokens
            state["seconds"] += seconds
            window.append((loss, tokens, seconds))
            lr = scheduler.get_last_lr()[0]
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / seconds:.0f}")
            bar.update(1)
            if state["step"] % config.logging_steps == 0 or state["step"] == total:
                row = {"step": state["step"], "loss": sum(w[0] for w in window) / len(window), "lr": lr,
                       "tokens_per_s": sum(w[1] for w in window) / max(sum(w[2] for w in window), 1e-9),
                       "grad_norm": norm, "skipped_steps": state["skipped_steps"],
                       "epoch": state["step"] / steps_per_epoch, "trained_tokens": state["trained_tokens"]}
                if optimizer.backward:   # is the optimizer under the backward paying off? (cumulative counts)
                    row["optimizer_overlap"] = dict(optimizer.counters)
                log.write(json.dumps(row) + "\n")
                log.flush()
                if writer is not None:
                    for key in ("loss", "lr", "tokens_per_s", "grad_norm"):
                        writer.add_scalar(f"train/{key}", row[key], state["step"])
                window = []
            if state["step"] % config.save_steps == 0 or state["step"] == total:
                optimizer.synchronize()
                checkpoint.save(out, state["step"], model, optimizer,
                                {"scheduler": scheduler.state_dict(), "data": order.state_dict(), "state": state,
                                 "config": config.to_dict()}, config.save_total_limit)
            if stop_at_step is not None and state["step"] >= stop_at_step:
                break
    bar.close()
    optimizer.synchronize()
    if writer is not None:
        writer.close()
    if state["step"] >= total:
        model.save_pretrained(out)
        (processor or tokenizer).save_pretrained(out)
        _plot(out)
        print(f"[megatrain] done: {state['step']} steps, {state['trained_tokens']} trained tokens, "
              f"{state['skipped_steps']} skipped; the model is in {out}", flush=True)
    return state


def _truncate_log(path: Path, step: int) -> None:
    """Drop the log rows an interrupted run wrote after the checkpoint it resumes from."""
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(line + "\n" for line in rows if json.loads(line)["step"] <= step))


def _tensorboard(config: TrainConfig, out: Path):
    if config.report_to != "tensorboard":
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("report_to: tensorboard needs the tensorboard package (pip install tensorboard), "
                          "or use report_to: jsonl.") from None
    return SummaryWriter(str(out / "runs"))


def _plot(out: Path) -> None:
    rows = [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines() if line.strip()]
    if not rows:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    fig.tight_layout()
    fig.savefig(out / "training_loss.png", dpi=100)
    plt.close(fig)
