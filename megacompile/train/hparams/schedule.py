"""The learning-rate schedule: Hugging Face's, so a run's lr sequence is LLaMA-Factory's.

    warmup_steps(config, total)           -> 2 for warmup_steps: 2, ceil(0.1 * total) for 0.1
    make_scheduler(optimizer, config, total) -> torch LambdaLR from transformers.get_scheduler
    check(config)                         -> ConfigError for an unknown type or bad lr_scheduler_kwargs

The scheduler is a LambdaLR whose lambdas are functools.partial objects: its state_dict holds
only numbers (base_lrs, last_epoch, ...) and an empty dict per lambda, so it goes into the
checkpoint's trainer.json as JSON, and a resumed run rebuilds the lambdas from its own config.
"""
from __future__ import annotations

import math

import torch

from ...errors import ConfigError

#: Hugging Face's scheduler types that are a function of the step (SchedulerType)
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
#: types refused, with the reason
REFUSED = {
    "reduce_lr_on_plateau": "it lowers the lr when an evaluation metric stops improving, and megatrain's schedule is "
                            "a function of the step (resumable bit for bit)",
    "greedy": "it adapts the lr to the training loss from step to step, and megatrain's schedule is a function of "
              "the step",
}


def warmup_steps(config, total: int) -> int:
    """Warmup steps as Hugging Face counts them (TrainingArguments.get_warmup_steps): warmup_steps
    >= 1 is a number of steps, a fraction below 1 is ceil(fraction * total); LLaMA-Factory's
    warmup_ratio is such a fraction (transformers 5.0-5.1 fold it into warmup_steps; the config
    refuses both at once)."""
    steps = config.warmup_steps or config.warmup_ratio
    return int(steps) if steps >= 1 else math.ceil(total * steps)


def make_scheduler(optimizer: torch.optim.Optimizer, config, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers.get_scheduler(config.lr_scheduler_type) over `total` steps, with
    lr_scheduler_kwargs passed on (e.g. {"min_lr_rate": 0.1} for cosine_with_min_lr)."""
    from transformers import get_scheduler
    try:
        return get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(config, total),
                             num_training_steps=total, scheduler_specific_kwargs=dict(config.lr_scheduler_kwargs))
    except (TypeError, ValueError, AssertionError) as e:   # kwargs the schedule does not take, or bad values
        raise ConfigError(f"lr_scheduler_type={config.lr_scheduler_type!r} with lr_scheduler_kwargs="
                          f"{config.lr_scheduler_kwargs!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                          ". Give only the keyword arguments of that schedule (transformers.get_scheduler).") from None


def notes(config) -> list[str]:
    """What the run should be told about its schedule: `constant` has no warmup in Hugging Face
    (and LLaMA-Factory), so a warmup given with it does nothing."""
    if config.lr_scheduler_type == "constant" and (config.warmup_steps or config.warmup_ratio):
        return ["lr_scheduler_type: constant has no warmup (as in Hugging Face and LLaMA-Factory), so "
                "warmup_steps/warmup_ratio are not used: use constant_with_warmup for a warmup."]
    return []


def check(config) -> None:
    """Refuse an unknown or step-less scheduler type, and kwargs the schedule does not take,
    before anything loads (the schedule is built once on a throwaway optimizer)."""
    name = config.lr_scheduler_type
    if name in REFUSED:
        raise ConfigError(f"lr_scheduler_type={name!r} is not supported: {REFUSED[name]}. Use one of "
                          f"{', '.join(SCHEDULERS)}.")
    if name not in SCHEDULERS:
        raise ConfigError(f"lr_scheduler_type={name!r}: use one of {', '.join(SCHEDULERS)}.")
    if name in ("constant", "constant_with_warmup") and config.lr_scheduler_kwargs:
        # (transformers.get_scheduler passes them to no function for these two: they would do nothing)
        raise ConfigError(f"lr_scheduler_type={name!r} takes no lr_scheduler_kwargs (got "
                          f"{config.lr_scheduler_kwargs!r}): remove them.")
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.learning_rate)
    # (a long run, so that any warmup fits; the real length is known once the data is read)
    scheduler = make_scheduler(probe, config, total=10_000)
    try:
        for step in (0, 1, 9_999):
            scheduler.lr_lambdas[0](step)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"lr_scheduler_kwargs={config.lr_scheduler_kwargs!r} for {name}: {e}.") from None
