"""The training loop behind `megatrain train`.

    config (checked) -> output_dir (locked, checked: run_dir.py) -> the resumed checkpoint (read,
           compared with the config: resume.py) -> data sets (registered, inside dataset_dir)
           -> model source (folder / Hub id, tokenizer; model_source.py) -> preflight on the meta
           model (host RAM, device plan: preflight.py) -> examples (one printed; the eval set held
              out or built: evaluate.py; fingerprinted)
           -> weights loaded -> torch.compile(model, backend="megatrain") -> HostAdamW on fp32
              masters + LR schedule -> the old run's files deleted / a resumed branch's retired
           -> steps: accumulate micro-batches (loss normalised by the step's trained tokens),
              clip, skip non-finite steps (stop after max_consecutive_skipped_steps in a row),
              check the updated weights are finite, log (tqdm, JSONL with TFLOP/s and MFU: flops.py,
              trackers), evaluate when due (no-grad eval loss: evaluate.py), checkpoint (an HF folder)
           -> HF model folder in output_dir (LoRA: the adapter, and with merge_lora the merged
              model in output_dir/merged; + loss plot); a run that trained nothing fails
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from .. import distributed, log as logs, vlm
from ..distributed import SINGLE, Topology, agree, all_sum
from ..errors import ConfigError, InternalError, TrainingError, megatrain_error_in
from ..runtime.adamw import HostAdamW, Overlap
from ..runtime.state_tier import StateTier
from ..runtime.tier_io import TierIOError
from ..vlm import is_vlm
from . import ranks
from .hparams import schedule
from .hparams.config import TrainConfig
from .data import stream
from .data.images import image_inputs
from .data.loader import (IGNORE, Order, build_examples, check_datasets, collate, data_template, fingerprint,
                          lengths_vary, mark_lengths_dynamic, run_batches, show_example, skip_summary)
from .model import lora
from .model.finetuning import apply_finetuning
from .model.model_source import ModelSource
from .checkpoint import format as checkpoint, resume
from .evaluate import EvalSet, Schedule as EvalSchedule, check_config as check_eval_config, eval_set, evaluate
from .flops import FlopCounter, device_peak
from .preflight import PreflightError, check_device, choose_tier, plan_check, preflight  # noqa: F401 (PreflightError: API)
from .report import open_reporter
from .run_dir import EXPORT_MANIFEST, LOG_NAME, RunDir, read_log, run_files

log = logs.get("train")


def load_model(config: TrainConfig, device: torch.device):
    """(model, tokenizer, processor); the processor (images) only for a vision-language model."""
    return ModelSource(config, device).load()


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


def make_optimizer(model, config: TrainConfig, device: torch.device, tier=None) -> HostAdamW:
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
                     overlap=overlap, tier=tier)


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


# the loop ---------------------------------------------------------------------------
def say(text: str) -> None:
    """One line of the run log (the `megatrain.train` logger; train() shows it on stdout)."""
    log.info(text)


def train(config: TrainConfig, *, stop_at_step: int | None = None, progress: bool = True) -> dict:
    """Run a training job; returns the final trainer state. `stop_at_step` ends the run early
    (after that step's checkpoint, if one is due), as an interruption would. Everything that can
    be checked is checked before the model's weights are loaded, and nothing in output_dir is
    deleted or moved before the first step starts."""
    device = check_device(config)
    topo = distributed.setup(device, config.ddp_timeout)   # (torchrun: data parallel over its ranks)
    # the run log is this function's user interface: rank 0's (the others say only what goes wrong)
    logs.console()
    if not topo.writer:
        logs.console().setLevel("WARNING")
    try:
        agree(topo, ranks.check_config, config, topo)
        if topo.enabled and device.type == "cuda":
            device = torch.device("cuda", topo.local_rank)
        with contextlib.ExitStack() as cleanup:   # (the state tier's files go at the end)
            # only rank 0 owns output_dir (its lock, its checks, its files); the others follow its decisions
            run = agree(topo, lambda: cleanup.enter_context(RunDir(config)) if topo.writer else None)
            run = run if topo.writer else ranks.Follower(config, distributed.broadcast(topo, None))
            if topo.writer:
                distributed.broadcast(topo, run.resume_from)
            state = _train(config, run, device, stop_at_step, progress, cleanup, topo)
        distributed.barrier(topo, "the end of the run")
        return state
    finally:
        distributed.end(topo)


def _resume_point(run: RunDir, config: TrainConfig) -> checkpoint.Loaded | None:
    """The checkpoint to resume from, read and checked; with resume_from_checkpoint: true a
    damaged newest checkpoint falls back to the newest one that loads (and says so)."""
    if run.resume_from is None:
        return None
    # with the state tier, the masters stay on disk until they go into it (one tensor at a time)
    stream = True if config.nvme is not None else None
    if config.resume_from_checkpoint is not True:
        return checkpoint.read(run.resume_from, stream=stream)
    damaged = []
    for path in reversed(checkpoint.checkpoints(run.out)):
        try:
            loaded = checkpoint.read(path, stream=stream)
        except checkpoint.CheckpointError as e:
            damaged.append(str(e).split(". ")[0])
            continue
        for why in damaged:
            say(f"[megatrain] {why}: resuming from the earlier {path.name} instead.")
        return loaded
    raise checkpoint.CheckpointError(f"resume_from_checkpoint: true, but no checkpoint in {run.out} loads: "
                                     + "; ".join(damaged) + ". Start the run again in a new output_dir.")


def _check_resume(loaded: checkpoint.Loaded, config: TrainConfig, world: int = 1) -> list[str]:
    """Refuse the config changes that break the equivalence with the resumed run; returns the
    ones that are applied. The world size may change where the global micro-batch does not."""
    saved = loaded.trainer.get("config") or {}
    saved_world = (loaded.trainer.get("world") or {}).get("size", 1)
    refused, applied = resume.changes(saved, config.to_dict(), "data_fingerprint" in loaded.trainer,
                                      saved_world, world)
    if refused:
        raise ConfigError(f"resuming {loaded.path} with {'; '.join(refused)}: these decide the sample order or what is "
                          "trained, so the run would not continue the one in the checkpoint. Set them back, or start a "
                          "new run in another output_dir.")
    return applied


def _apply_hyper(optimizer, scheduler, config: TrainConfig, total: int) -> None:
    """After a resume: the config's learning rate and optimizer hyper-parameters, not the
    checkpoint's (torch restores both from the state dicts). Unchanged values give the same lr."""
    # (the scheduler was built from this run's config: its lambdas are this run's schedule, and
    # load_state_dict brought back only the step count and the checkpoint's base lr)
    scheduler.base_lrs = [config.learning_rate for _ in optimizer.param_groups]
    for group, decay, factor in zip(optimizer.param_groups, (config.weight_decay, 0.0), scheduler.lr_lambdas):
        group.update(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=decay,
                     initial_lr=config.learning_rate, lr=config.learning_rate * factor(scheduler.last_epoch))
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _last_checkpoint(out: Path) -> str:
    found = checkpoint.checkpoints(out)
    return f"the last checkpoint is {found[-1]}" if found else "no checkpoint was written"


def _tier_error(e: BaseException) -> TierIOError | None:
    """The state tier's I/O error behind `e` (an overlapped step re-raises it as its cause)."""
    while e is not None:
        if isinstance(e, TierIOError):
            return e
        e = e.__cause__
    return None


def _check_weights(optimizer, names: dict[int, str], step: int, out: Path, topo: Topology = SINGLE) -> None:
    bad = [names.get(id(p), "?") for p in optimizer.nonfinite()]
    # (data parallelism: each rank checked its own pieces; a bad one anywhere stops every rank)
    if all_sum(topo, [len(bad)], "agreeing on finite weights")[0] and not bad:
        bad = ["weights another rank updated"]
    if bad:
        raise TrainingError(f"the optimizer step {step} left NaN or inf in {', '.join(bad[:3])}"
                            f"{' ...' if len(bad) > 3 else ''}: the run diverged. Lower learning_rate (or "
                            f"weight_decay, or raise warmup_steps) and resume; {_last_checkpoint(out)}.")


def _train(config: TrainConfig, run: RunDir, device: torch.device, stop_at_step: int | None, progress: bool,
           cleanup: contextlib.ExitStack, topo: Topology = SINGLE) -> dict:
    out = run.out
    for note in [*config.notes, *run.notes]:   # (config.notes: LLaMA-Factory keys megatrain has no use for)
        say(f"[megatrain] {note}")
    if topo.enabled:
        say(f"[megatrain] data parallel: {topo.world} ranks ({topo.nodes} node(s) x {topo.local}), one host copy of "
            f"the state per node; global micro-batch {config.per_device_train_batch_size * topo.world}")
    # (a tracker's missing package is said before anything loads)
    reporter = agree(topo, open_reporter, config) if topo.writer else agree(topo, lambda: None)
    loaded = agree(topo, _resume_point, run, config)
    applied = agree(topo, _check_resume, loaded, config, topo.world) if loaded is not None else []
    agree(topo, check_eval_config, config)
    sources = agree(topo, check_datasets, config)
    _seed(config.seed + topo.rank)   # (each rank its own dropout; the sample order is seeded apart: data.Order)
    source = ModelSource(config, device)
    arch = source.meta_model()
    if topo.enabled and is_vlm(arch):   # (the same model on every rank: each refuses alike)
        raise ConfigError(f"{arch.config.model_type}: a vision-language model does not run with more than one rank "
                          "yet. Run it in one process.")
    tuning = apply_finetuning(arch, config)   # (the preflight counts what trains; bad module names fail here)
    if tuning:
        say(tuning)
    if config.packing and config.stage == "sft":
        check_packing(arch)
    placement, ssd = agree(topo, choose_tier, arch, device, config)
    say(agree(topo, preflight, arch, device, config.vision, placement, ssd))
    say("[megatrain] planning the step (the first layers are compiled on the meta device; seconds to a minute) ...")
    say(agree(topo, plan_check, arch, config, device, placement, ssd))
    images = image_inputs(config, arch, source.processor)
    if config.streaming:
        data = _stream_data(config, source.tokenizer, images, sources)
    else:   # rank 0 tokenizes first (into the cache); the others then read it
        first = agree(topo, lambda: _data(config, source.tokenizer, images, sources, topo) if topo.writer else None)
        rest = agree(topo, lambda: None if topo.writer else _data(config, source.tokenizer, images, sources, topo))
        data = first if topo.writer else rest
    examples, split, order, steps_per_epoch, data_fingerprint = data
    if loaded is not None and loaded.trainer.get("data_fingerprint", data_fingerprint) != data_fingerprint:
        changed = resume.data_changes(loaded.trainer.get("config") or {}, config.to_dict())
        raise ConfigError(f"resuming {loaded.path} with other training examples ("
                          + ("; ".join(changed) if changed else "the data files' contents changed") + "): the data "
                          "position in the checkpoint would point into different samples. Resume with the data it was "
                          "trained on, or start a new run in another output_dir.")
    total = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    finished = loaded is not None and loaded.step >= total
    if finished and export_step(out) == loaded.step:
        raise ConfigError(f"{loaded.path} is the end of the run (step {loaded.step} of {total}) and its model is "
                          f"exported in {out}: nothing to train. Raise max_steps (or num_train_epochs) to train on.")

    model, tokenizer, processor = source.load()
    apply_finetuning(model, config)   # before compile: the store makes masters only for what trains
    # the trainer reads only the loss: the LM head and the loss run fused, no [tokens, vocab] logits
    # (with several ranks each loss is already divided by every rank's tokens: the gradients add up)
    compile_options = {"logits": "drop", "grad_reduce": "sum", **config.megatrain}
    if device.type == "cuda" and compile_options.get("device_budget") is None:
        # the device half of the preflight: the backend plans the step's peak before any training
        # work and refuses a schedule that does not fit in the free device memory
        free, _ = torch.cuda.mem_get_info(device)
        compile_options["device_budget"] = int(free * 0.95)
    if is_vlm(model):   # language stack compiled, vision side eager on the device (megacompile/vlm.py)
        cmodel = vlm.compile(model, vision=config.vision, options=compile_options)
    else:
        cmodel = torch.compile(model, backend="megatrain", options=compile_options)
    tier = None
    if placement != "none":   # (before the optimizer: the masters move into the tier's files now)
        tier = StateTier(list(model.named_parameters()), list(ssd.paths), placement, queue_depth=ssd.queue_depth)
        cleanup.callback(tier.close)
        from ..units import fmt_bytes
        say(f"[megatrain] state tier: {placement} of {len(tier)} parameters, {fmt_bytes(tier.nbytes)} x 2 "
            f"slots under {', '.join(str(p) for p in ssd.paths)}"
            + (f" (removed {len(tier.reclaimed)} files a killed run left)" if tier.reclaimed else ""))
    optimizer = make_optimizer(model, config, device, tier)
    scheduler = schedule.make_scheduler(optimizer, config, total)
    state = {"step": 0, "trained_tokens": 0, "skipped_steps": 0, "seconds": 0.0}
    if loaded is not None:
        saved = checkpoint.apply(loaded, model, optimizer)   # (pinned by the host arenas)
        scheduler.load_state_dict(saved["scheduler"])
        order.load_state_dict(saved["data"])
        state = saved["state"]
        _apply_hyper(optimizer, scheduler, config, total)
        del loaded.masters, loaded.optimizer   # (their copies are in the store and the optimizer now)
        say(f"[megatrain] resumed from {loaded.path} at step {state['step']}"
            + (f"; changed since, applied from here: {'; '.join(applied)}" if applied else ""))
        if config.streaming and order.consumed:
            say(f"[megatrain] the stream reads past the {order.consumed} examples of its epoch {order.epoch} that "
                "were trained on (tokenized again, not trained) to reach the checkpoint's position")
    if finished:
        agree(topo, lambda: _export(out, model, processor or tokenizer, state["step"], config.merge_lora)
              if topo.writer else None)
        say(f"[megatrain] nothing trained: {loaded.path} is the end of the run (step {state['step']} of {total}) "
            f"and its export was missing (the run stopped before it was written); the model is exported to {out} "
            "now")
        return state

    def start():
        for note in run.start(state["step"]):   # the old run's files go, or a resumed branch's later ones retire
            say(f"[megatrain] {note}")
        (out / LOG_NAME).touch()   # first: the trackers' folders count as this run's only next to its log (run_dir.py)
        reporter.start(out, config)
    agree(topo, start if topo.writer else lambda: None)
    names = {id(p): n for n, p in model.named_parameters()}
    peak_tflops, peak_why = device_peak(config, device, next(model.parameters()).dtype)
    say(f"[megatrain] MFU in the log is against the {peak_why}")
    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=state["step"], disable=not progress or not topo.writer, desc="train",
               dynamic_ncols=True)
    try:
        ran, skipped = _loop(config, cmodel, model, optimizer, scheduler, order, examples, images, tokenizer, state,
                             total, steps_per_epoch, data_fingerprint, reporter, bar, out, stop_at_step,
                             evals=(EvalSchedule(config, total, steps_per_epoch), split.parts or split.examples),
                             flops=(FlopCounter(model), peak_tflops), saver=processor or tokenizer, topo=topo)
    except (OSError, RuntimeError) as e:
        tier_error = _tier_error(e)
        if tier_error is not None:   # the state tier's files: the checkpoints are untouched
            raise TrainingError(f"step {state['step'] + 1}: the state tier's I/O failed ({tier_error}); the optimizer "
                                f"state in its files is lost with this run: {_last_checkpoint(out)}. Free the drive "
                                "(or fix it), then resume with resume_from_checkpoint: true.") from None
        if isinstance(e, OSError):
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise checkpoint.DiskSpaceError(f"the file system of {out} is full ({e}); {_last_checkpoint(out)}, "
                                            "complete: make room, then resume with resume_from_checkpoint: "
                                            "true.") from None
        # the plan's peak was not the real one
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        raise PreflightError(f"step {state['step'] + 1} ran out of {device} memory "
                             f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}): lower "
                             "per_device_train_batch_size (raise gradient_accumulation_steps to keep the effective "
                             f"batch) or cutoff_len, then resume; {_last_checkpoint(out)}.") from None
    finally:
        bar.close()
        if optimizer.armed:   # a step that failed mid-backward: undo its speculative updates
            try:
                optimizer.discard()
            except (OSError, RuntimeError) as e:   # (a failed tier cannot undo: the error above says so)
                if _tier_error(e) is None:
                    raise
    optimizer.synchronize()
    _check_weights(optimizer, names, state["step"], out, topo)
    if reporter is not None:
        reporter.close()
    if ran and 2 * skipped > ran:
        raise TrainingError(f"{skipped} of this run's {ran} steps were skipped (non-finite loss or gradient norm): the "
                            "model trained little or nothing, so it is not exported. Lower learning_rate, check the "
                            f"data for NaN/inf; {_last_checkpoint(out)}.")
    if state["step"] >= total:
        def export():
            _export(out, model, processor or tokenizer, state["step"], config.merge_lora)
            _plot(out)
        agree(topo, export if topo.writer else lambda: None)
        say(f"[megatrain] done: {state['step']} steps, {state['trained_tokens']} trained tokens, "
            f"{state['skipped_steps']} skipped; the model is in {out}")
    return state


def _data(config: TrainConfig, tokenizer, images, sources: dict, topo: Topology = SINGLE):
    """The tokenized training data: (examples, eval split, order, steps per epoch, fingerprint).
    The order is over global micro-batches (every rank's together: data parallelism)."""
    examples, counts = build_examples(config, tokenizer, images)
    for name, where in sources.items():
        say(f"[megatrain] data set {name}: {where} ({counts['records'][name]} records)")
    packed = f" (packed from {counts['packed_from']})" if "packed_from" in counts else ""
    cut = (f", {counts['dropped_images']} dropped: cutoff_len cut into an image" if "dropped_images" in counts
           else "") + (f", {skip_summary(counts)}" if counts.get("malformed") else "")
    say(f"[megatrain] {len(examples)} examples{packed} from {counts['samples']} samples ({counts['dropped']} dropped: "
        f"no reply left within cutoff_len={config.cutoff_len}{cut}); the first one, [[not trained]]:\n"
        f"{show_example(tokenizer, examples[0])}")
    split = eval_set(config, tokenizer, images, examples, counts)   # (val_size: fewer to train on)
    examples = split.train
    if split.note:
        say(f"[megatrain] {split.note}")
    batch, accum = config.per_device_train_batch_size, config.gradient_accumulation_steps
    order = Order(len(examples), batch * topo.world, config.seed, shuffle=not config.disable_shuffling)
    steps_per_epoch = order.batches_per_epoch // accum
    if steps_per_epoch == 0:
        ranks = f" x {topo.world} ranks" if topo.enabled else ""
        raise ConfigError(f"{len(examples)} examples make no full step of per_device_train_batch_size={batch}{ranks} x "
                          f"gradient_accumulation_steps={accum}: lower them or add data.")
    return examples, split, order, steps_per_epoch, fingerprint(examples)


def _stream_data(config: TrainConfig, tokenizer, images, sources: dict):
    """streaming: true (stream.py): the same five, with no examples held and no epoch length."""
    for name, where in sources.items():
        say(f"[megatrain] data set {name}: {where} (streamed)")
    data = stream.open_stream(config, tokenizer, data_template(config, tokenizer), images)
    say("[megatrain] streaming the examples "
        f"(shuffle buffer {config.buffer_size if not config.disable_shuffling else 0}"
        f"); the first one, [[not trained]]:\n{show_example(tokenizer, data.first)}")
    if config.eval_dataset:   # (a separate eval set is small: tokenized whole, through the cache)
        split = eval_set(dataclasses.replace(config, streaming=False), tokenizer, images, [], {})
    else:
        split = EvalSet([], data.held_out, f"evaluation: the stream's first {len(data.held_out)} examples, held out "
                        "by val_size" if len(data.held_out) else "")
    if split.note:
        say(f"[megatrain] {split.note}")
    return None, split, data.order, None, data.fingerprint


def _loop(config, cmodel, model, optimizer, scheduler, order, examples, images, tokenizer, state, total,
          steps_per_epoch, data_fingerprint, reporter, bar, out, stop_at_step, evals=None, flops=None,
          saver=None, topo: Topology = SINGLE) -> tuple[int, int]:
    """The training steps, from state["step"] to `total` (or `stop_at_step`); returns how many
    steps ran and how many of them were skipped. `evals`: (evaluate.Schedule, eval examples);
    `flops`: (flops.FlopCounter, the device's peak TFLOP/s) for the log's tflops and mfu;
    `saver`: the tokenizer (or processor) each checkpoint holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    accum = config.gradient_accumulation_steps
    counter, peak_tflops = flops if flops is not None else (None, 0.0)
    window: list[tuple[float, int, float, float]] = []   # (loss, trained tokens, seconds, FLOPs) since the last log
    ran = skipped = streak = 0   # steps of this invocation, skipped ones, skipped in a row
    per = config.per_device_train_batch_size
    mine = slice(topo.rank * per, (topo.rank + 1) * per)   # this rank's part of each global micro-batch
    # the micro-batches this run computes differ in length (on any rank): the first compile then
    # takes any length, one compile instead of one for the first length and one more, symbolic,
    # for the second; all equal: one compile for that length
    vary = lengths_vary(examples, run_batches(order, (total - state["step"]) * accum, topo.world))
    with open(out / LOG_NAME if topo.writer else os.devnull, "a") as log:   # (rank 0 writes the run log)
        while state["step"] < total:
            t0 = time.perf_counter()
            picked = [order.next_examples(examples)[mine] for _ in range(accum)]
            micro = [collate(b, tokenizer.pad_token_id, images=images) for b in picked]
            if vary:
                micro = [mark_lengths_dynamic(mb) for mb in micro]
            tokens = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in micro)
            # (the loss is a sum over tokens / the step's trained tokens over every rank: the ranks'
            # gradients then add up to one process's at the global batch)
            tokens = int(all_sum(topo, [tokens], "the all-reduce of the step's token count")[0])
            count = torch.tensor(max(tokens, 1))
            loss = 0.0
            for i, mb in enumerate(micro):
                # sum over tokens / the step's trained tokens: accumulation gives the mean over the step
                try:
                    out_mb = cmodel(**mb, num_items_in_batch=count, use_cache=False)
                except Exception as e:   # (one of ours it recognised: the report says where in the run)
                    internal = _internal(e)
                    if internal is None:
                        raise
                    raise internal.with_facts(step=state["step"] + 1, micro_batch=f"{i + 1} of {len(micro)}",
                                              shape="x".join(map(str, mb["input_ids"].shape))) from None
                if i == 0:   # every weight has been fetched, so the last step's updates are all done
                    _check_weights(optimizer, names, state["step"], out, topo)
                if i == len(micro) - 1:
                    optimizer.arm()   # overlap_optimizer=backward: layers update as their gradients land
                out_mb.loss.backward()
                loss += out_mb.loss.item()
            loss = all_sum(topo, [loss], "the all-reduce of the loss")[0]   # (each rank's share of the mean)
            norm = optimizer.grad_norm()
            # clipping by the global norm: the factor is applied inside the optimizer's pass
            # (runtime/adamw.py), not by a pass of its own over the gradients; updates made during
            # the backward are kept when it is 1 and redone otherwise
            clip = min(1.0, config.max_grad_norm / (norm + 1e-6)) if config.max_grad_norm > 0 else 1.0
            ran += 1
            if math.isfinite(loss) and math.isfinite(norm):
                optimizer.step(grad_scale=clip)
                streak = 0
            else:
                optimizer.discard()
                state["skipped_steps"] += 1
                skipped += 1
                streak += 1
                if topo.writer:
                    bar.write(f"[megatrain] step {state['step'] + 1}: non-finite loss ({loss}) or gradient norm "
                              f"({norm}); the optimizer step is skipped, the weights are unchanged.")
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]   # the lr this step used: HF logs it (taken before the scheduler moves)
            scheduler.step()
            state["step"] += 1
            seconds = time.perf_counter() - t0
            state["trained_tokens"] += tokens
            state["seconds"] += seconds
            window.append((loss, tokens, seconds,
                           sum(counter.example(ex) for b in picked for ex in b) if counter is not None else 0.0))
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / seconds:.0f}")
            bar.update(1)
            if state["step"] % config.logging_steps == 0 or state["step"] == total:
                row = {"step": state["step"], "loss": sum(w[0] for w in window) / len(window), "lr": lr,
                       "tokens_per_s": sum(w[1] for w in window) / max(sum(w[2] for w in window), 1e-9),
                       "grad_norm": norm, "skipped_steps": state["skipped_steps"],
                       "epoch": _epoch(state, steps_per_epoch, order), "trained_tokens": state["trained_tokens"]}
                if counter is not None:   # model FLOPs of the window's steps per second (flops.py)
                    row["tflops"] = sum(w[3] for w in window) / max(sum(w[2] for w in window), 1e-9) / 1e12
                    row["mfu"] = row["tflops"] / peak_tflops if peak_tflops > 0 else None
                row["peak_device_bytes"] = _peak_device_bytes(cmodel)
                if optimizer.mode is Overlap.BACKWARD:   # is the optimizer under the backward paying off?
                    row["optimizer_overlap"] = dict(optimizer.counters)   # (cumulative counts)
                log.write(json.dumps(row) + "\n")
                log.flush()
                if reporter is not None:
                    reporter.log(row, state["step"], prefix="train")   # report_to's trackers (report.py)
                window = []
            if streak >= config.max_consecutive_skipped_steps:
                first = state["step"] - streak + 1
                raise TrainingError(f"{streak} steps in a row (steps {first}-{state['step']}) had a non-finite loss or "
                                    "gradient norm and were skipped: the run is diverging, or its data or weights hold "
                                    "NaN/inf. Lower learning_rate (or raise warmup_steps) and resume, or raise "
                                    f"max_consecutive_skipped_steps; {_last_checkpoint(out)}.")
            if evals is not None and evals[0].due(state["step"]):   # (as HF: evaluate, then save)
                optimizer.synchronize()
                _check_weights(optimizer, names, state["step"], out, topo)
                # eval_on_each_dataset: {name: examples}, logged as eval_<name>_loss (HF's names); else one set
                for name, held in (evals[1] if isinstance(evals[1], dict) else {"": evals[1]}).items():
                    key = f"eval_{name}_" if name else "eval_"
                    eval_loss, eval_tokens, eval_seconds = evaluate(cmodel, model, optimizer, held,
                                                                    config.per_device_eval_batch_size,
                                                                    tokenizer.pad_token_id, images, topo)
                    row = {"step": state["step"], "epoch": _epoch(state, steps_per_epoch, order),
                           key + "loss": eval_loss, key + "tokens": eval_tokens, key + "seconds": eval_seconds}
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    if reporter is not None:
                        reporter.log({f"{name}_loss" if name else "loss": eval_loss}, state["step"], prefix="eval")
                    if topo.writer:
                        bar.write(f"[megatrain] step {state['step']}: {key}loss {eval_loss:.4f} over {eval_tokens} "
                                  "tokens")
            if state["step"] % config.save_steps == 0 or state["step"] == total:
                optimizer.synchronize()
                _check_weights(optimizer, names, state["step"], out, topo)   # (also: every rank's updates are in)
                trainer_state = {"scheduler": scheduler.state_dict(), "data": order.state_dict(), "state": state,
                                 "config": config.to_dict(), "data_fingerprint": data_fingerprint}
                if topo.enabled:   # (resuming with another world size keeps the global micro-batch)
                    trainer_state["world"] = {"size": topo.world, "local": topo.local, "nodes": topo.nodes,
                                              "global_micro_batch": per * topo.world}
                # rank 0 writes the node's shared state; the others wait for it (a failure stops all)
                agree(topo, lambda: checkpoint.save(out, state["step"], model, optimizer, trainer_state,
                                                    config.save_total_limit, saver=saver) if topo.writer else None)
            if stop_at_step is not None and state["step"] >= stop_at_step:
                break
    return ran, skipped


def _internal(e: Exception) -> InternalError | None:
    """The InternalError behind `e` (Dynamo wraps the backend's errors), if it is one."""
    found = megatrain_error_in(e)
    return found if isinstance(found, InternalError) else None


def _epoch(state: dict, steps_per_epoch: int | None, order) -> float:
    """The log's epoch: steps over steps per epoch; a stream's completed passes (its length is unknown)."""
    return state["step"] / steps_per_epoch if steps_per_epoch else float(order.epoch)


def _peak_device_bytes(cmodel) -> int | None:
    """The device memory peak of the last step (megacompile.stats), None if it has none."""
    from ..backend import stats
    try:
        return stats(cmodel)["peak_device_bytes"]
    except (ValueError, KeyError):   # (a model the backend has not run, e.g. a wrapper)
        return None


def export_step(out: Path) -> int | None:
    """The step whose model the folder's export holds (its manifest), or None."""
    try:
        return json.loads((out / EXPORT_MANIFEST).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None


def _export(out: Path, model, saver, step: int, merge: bool = False) -> None:
    """The Hugging Face model folder in output_dir (a LoRA run: the adapter, and with `merge`
    the merged model in output_dir/merged): written next to it, then moved in file by
    file, and listed in megatrain_export.json (written last: a later overwrite_output_dir
    removes exactly these files; its absence means the export did not finish)."""
    from safetensors import SafetensorError
    tmp = out / ".export.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    ours = set(run_files(out))   # (what an earlier export of this folder wrote, before its manifest goes)
    (out / EXPORT_MANIFEST).unlink(missing_ok=True)
    try:
        if lora.is_lora(model):   # as LLaMA-Factory's output_dir after LoRA: the adapter (lora.py)
            lora.save_adapter(model, tmp)
            if merge:
                lora.save_merged(model, tmp / "merged", saver)
        else:
            model.save_pretrained(tmp)
        saver.save_pretrained(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        # never over a file megatrain did not write (run_dir refused such a folder at the start;
        # this holds for a name it could not foresee, or a file put there during the run)
        theirs = [n for n in files if (out / n).exists() and out / n not in ours]
        if theirs:
            aside = out / f"export-step-{step}"
            if aside.exists():
                raise OSError(errno.EEXIST, f"{aside} exists")
            os.replace(tmp, aside)
            raise checkpoint.CheckpointError(
                f"the model is exported to {aside}, not into {out}: {out} holds {', '.join(theirs[:4])}, which "
                "megatrain did not write, and an export never replaces another's file. Move the files from "
                f"{aside} where you want them; {_last_checkpoint(out)}.")
        sizes = {}
        for name in files:
            sizes[name] = None if (tmp / name).is_dir() else (tmp / name).stat().st_size
            if (out / name).is_dir():
                shutil.rmtree(out / name)
            os.replace(tmp / name, out / name)
        (out / EXPORT_MANIFEST).write_text(json.dumps({"step": step, "files": files, "sizes": sizes}, indent=1))
    except (OSError, SafetensorError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise checkpoint.CheckpointError(
            f"exporting the model to {out} failed ({reason}); {_last_checkpoint(out)}, complete: make room, then run "
            "again with resume_from_checkpoint: true to export it.") from None
    shutil.rmtree(tmp, ignore_errors=True)


def _plot(out: Path) -> None:
    """training_loss.png: the training loss per logged step, and the eval loss where there is one."""
    rows, _ = read_log(out / LOG_NAME)
    train_rows = [r for r in rows if isinstance(r.get("loss"), (int, float))]
    eval_rows = [r for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    if not train_rows and not eval_rows:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train")
    if eval_rows:
        ax.plot([r["step"] for r in eval_rows], [r["eval_loss"] for r in eval_rows], marker="o", label="eval")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    fig.tight_layout()
    fig.savefig(out / "training_loss.png", dpi=100)
    plt.close(fig)
