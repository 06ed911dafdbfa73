"""Evaluation during training: a no-grad loss through the compiled model, on a held-out set.

    check_config(config)                          do_eval / val_size / eval_dataset / eval_strategy /
                                                  eval_steps refused when they contradict each other
    split = eval_set(config, tokenizer, images, examples, counts)
                                                  -> EvalSet(train, examples, note): val_size holds out
                                                  training examples, eval_dataset builds its own
    when = Schedule(config, total, steps_per_epoch)    when.due(step) -> evaluate after this step?
    loss, tokens, seconds = evaluate(cmodel, model, optimizer, examples, batch_size, pad_id, images)

The keys are LLaMA-Factory's / the HF Trainer's: `eval_strategy: steps` evaluates every
`eval_steps` steps (None: logging_steps; a float < 1 is that fraction of the run's steps, rounded
up, as HF) and at the end; `epoch` at each epoch's end and at the end of the run (HF evaluates
after its last, possibly partial, epoch too); `do_eval: true` with `eval_strategy: no` once at
the end (LLaMA-Factory's do_eval after training). The loss is averaged over every trained token
of the eval set (a token-weighted mean, as the training loss is with num_items_in_batch), not
over batches.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from ..errors import CannotFitError, ConfigError
from .data.split import holdout_indices  # noqa: F401 (API: megacompile.train.evaluate.holdout_indices)
from .data.loader import IGNORE, DataError, build_examples, collate, lengths_vary, mark_lengths_dynamic

STRATEGIES = ("no", "steps", "epoch")


def _has_eval_set(config) -> bool:
    return config.val_size > 0 or bool(config.eval_dataset)


def check_config(config) -> None:
    """Refuse evaluation keys that contradict each other or would be silently ignored."""
    if config.eval_strategy not in STRATEGIES:
        raise ConfigError(f"eval_strategy={config.eval_strategy!r}: use one of {', '.join(STRATEGIES)}.")
    if config.val_size < 0:
        raise ConfigError(f"val_size={config.val_size}: use a fraction in (0, 1) or a whole number of examples.")
    if config.val_size > 1 and not float(config.val_size).is_integer():
        raise ConfigError(f"val_size={config.val_size}: above 1 it is a number of examples; use a whole number, or a "
                          "fraction in (0, 1).")
    if config.val_size > 0 and config.eval_dataset:   # (LLaMA-Factory refuses both at once too)
        raise ConfigError(f"val_size={config.val_size} and eval_dataset={config.eval_dataset!r}: set one of them "
                          "(val_size holds out training examples, eval_dataset names other data sets).")
    if config.per_device_eval_batch_size < 1:
        raise ConfigError(f"per_device_eval_batch_size={config.per_device_eval_batch_size}: must be at least 1.")
    evaluates = config.do_eval or config.eval_strategy != "no"
    if evaluates and not _has_eval_set(config):
        what = f"eval_strategy: {config.eval_strategy}" if config.eval_strategy != "no" else "do_eval: true"
        raise ConfigError(f"{what} needs an eval set: set val_size (e.g. 0.1, held out from the training data) or "
                          "eval_dataset (data set names).")
    if _has_eval_set(config) and not evaluates:
        key = f"val_size={config.val_size}" if config.val_size > 0 else f"eval_dataset={config.eval_dataset!r}"
        raise ConfigError(f"{key} gives an eval set that is never evaluated (eval_strategy: no, do_eval: false): set "
                          f"eval_strategy: steps (or epoch), or do_eval: true to evaluate at the end, or remove it.")
    if config.eval_steps is not None:
        if config.eval_strategy != "steps":
            raise ConfigError(f"eval_steps={config.eval_steps} applies only with eval_strategy: steps (it is "
                              f"{config.eval_strategy}): set eval_strategy: steps, or remove eval_steps.")
        steps = config.eval_steps
        if steps <= 0 or (steps > 1 and not float(steps).is_integer()):
            raise ConfigError(f"eval_steps={steps}: use a whole number of steps, or a fraction in (0, 1) of the "
                              "run's steps.")


# -- the eval set --------------------------------------------------------------------------------

@dataclass
class EvalSet:
    train: list          # the training examples (without the held-out ones)
    examples: list       # the eval examples ([] without evaluation)
    note: str = ""       # for the log: where the eval examples come from
    # eval_on_each_dataset: {data set name: its eval examples}, each evaluated and logged on its own
    parts: dict | None = None


def eval_set(config, tokenizer, images, examples: list, counts: dict) -> EvalSet:
    """The training examples and the eval examples of a run.

    `val_size`: build_examples split the mixed records as LLaMA-Factory does (before
    tokenization, with its permutation) and made the examples of each side: `examples` are the
    training ones, counts["held_out"] the eval ones.
    `eval_dataset`: those data sets, encoded as the training data is (same template, cutoff_len,
    packing, max_samples), as LLaMA-Factory does; with eval_on_each_dataset each set on its own
    (LF's return_dict: loaded, sampled and encoded separately), in `parts`.
    """
    if config.val_size > 0:
        held = counts["held_out"]
        return EvalSet(examples, held, f"evaluation: {len(held)} examples from the {counts['held_out_records']} of "
                                       f"{counts['samples']} records held out by val_size={config.val_size:g} (the "
                                       "records LLaMA-Factory's split holds out)")
    if config.eval_dataset:
        fields = {f.name for f in dataclasses.fields(config)}
        # the eval data sets through the training data's own path; not through a tokenized
        # cache, which holds the training set
        changes = {"tokenized_path": None} if "tokenized_path" in fields else {}
        names = [n.strip() for n in config.eval_dataset.split(",") if n.strip()]
        sets = {n: n for n in names} if config.eval_on_each_dataset else {"": ",".join(names)}
        parts, samples = {}, 0
        for name, dataset in sets.items():
            try:
                held, eval_counts = build_examples(dataclasses.replace(config, **changes, dataset=dataset), tokenizer,
                                                   images)
            except DataError as e:   # (its messages speak of training data)
                raise DataError(f"eval_dataset={dataset!r}: {e}") from None
            parts[name], samples = held, samples + eval_counts["samples"]
        if config.eval_on_each_dataset:
            return EvalSet(examples, [e for p in parts.values() for e in p],
                           "evaluation: eval_dataset " + ", ".join(f"{n} ({len(p)} examples)" for n, p in parts.items())
                           + f" from {samples} samples, each logged as eval_<name>_loss", parts)
        return EvalSet(examples, parts[""], f"evaluation: {len(parts[''])} examples from eval_dataset "
                                            f"{config.eval_dataset} ({samples} samples)")
    return EvalSet(examples, [])


# -- when ----------------------------------------------------------------------------------------

class Schedule:
    """Which steps end with an evaluation (see the module docstring)."""

    def __init__(self, config, total: int, steps_per_epoch: int):
        self.strategy = config.eval_strategy
        self.total, self.steps_per_epoch = total, steps_per_epoch
        self.at_end = config.do_eval or config.eval_strategy != "no"
        every = config.eval_steps if config.eval_steps is not None else config.logging_steps
        self.every = math.ceil(every * total) if every < 1 else int(every)   # (HF rounds a fraction up)
        self.every = max(self.every, 1)

    def due(self, step: int) -> bool:
        if not self.at_end:
            return False
        if step >= self.total:
            return True
        if self.strategy == "steps":
            return step % self.every == 0
        if self.strategy == "epoch":
            return step % self.steps_per_epoch == 0
        return False


# -- the loss ------------------------------------------------------------------------------------

def trained_tokens(batch: dict) -> int:
    """Tokens of a collated batch whose next-token loss counts (labels are shifted by the model)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def evaluate(cmodel, model, optimizer, examples: list, batch_size: int, pad_id: int, images=None, topo=None) \
        -> tuple[float, int, float]:
    """(mean loss per trained token, trained tokens, seconds) of `examples` under the current
    weights, through the compiled model with no autograd: no activations are saved for a
    backward, no gradient is made, the optimizer is not touched.

    An overlapped optimizer step (overlap_optimizer) may still be writing the weights:
    `synchronize()` first, so every weight read is the updated one (a megatrain fetch would wait
    for each weight anyway; waiting here keeps the eval's timing its own). The model is put in
    eval mode (dropout off, as HF's evaluate) and back in train mode after.

    Data parallel (`topo`, megacompile/distributed.py): rank r evaluates batches r, r + ranks, ...
    and the sums are added over the ranks; every rank runs as many forwards as the busiest (the
    forwards' collectives pair up), a rank out of batches repeating its last one uncounted."""
    from ..distributed import SINGLE, all_sum
    topo = topo or SINGLE
    t0 = time.perf_counter()
    optimizer.synchronize()
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    starts = list(range(0, len(examples), batch_size))
    # (batch start, whether it counts): one process all of them; a rank its own, then repeats
    # of its last (or of the first) uncounted until it ran as many forwards as the busiest rank
    mine = starts[topo.rank::topo.world]
    plan = [(mine[min(j, len(mine) - 1)] if mine else 0, j < len(mine))
            for j in range(-(-len(starts) // topo.world))]
    vary = lengths_vary(examples, [range(k, min(k + batch_size, len(examples))) for k, _ in plan])
    try:
        with torch.no_grad():
            for k, counts in plan:
                batch = collate(examples[k: k + batch_size], pad_id, images=images)
                if vary:
                    mark_lengths_dynamic(batch)
                n = trained_tokens(batch) if counts else 0
                if n == 0 and not topo.enabled:   # (several ranks: every forward runs, its collectives pair up)
                    continue
                # the loss summed over the batch's tokens / n: times n is the batch's sum
                try:
                    out = cmodel(**batch, num_items_in_batch=torch.tensor(max(n, 1)), use_cache=False)
                except torch.OutOfMemoryError:   # (the preflight planned the training batch, not this one)
                    rows, length = batch["input_ids"].shape
                    raise CannotFitError(f"evaluation ran out of device memory on a batch of {rows} x {length} "
                                         "tokens: lower per_device_eval_batch_size "
                                         f"(now {batch_size}) and resume from the last checkpoint.") from None
                if n:
                    total += float(out.loss) * n
                    tokens += n
    finally:
        model.train(was_training)
    total, tokens = all_sum(topo, [total, tokens], "the all-reduce of the evaluation loss")
    tokens = int(tokens)
    return (total / tokens if tokens else float("nan")), tokens, time.perf_counter() - t0
