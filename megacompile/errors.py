"""Errors megatrain raises on bad input. Each message says what to change.

The command line maps them to exit codes (docs/errors.md):
    2  MegatrainError (a usage, config, data, model or checkpoint error: the message says what to change)
    3  CannotFitError (the run does not fit the machine: host RAM or device memory)
    4  TrainingError (training ran but failed: diverged, non-finite weights, trained nothing)
    1  InternalError (a failure megatrain diagnosed as its own: one line with the facts to report)
       and anything else: an internal error (a bug; the traceback is printed)
"""


class MegatrainError(RuntimeError):
    """Base class of every error megatrain raises on purpose."""

    exit_code = 2


class UnsupportedModelError(MegatrainError):
    """The model is not a decoder-only LM megatrain can split into layers."""


class GraphBreakError(MegatrainError):
    """Dynamo could not capture the model as one graph."""


class ConfigError(MegatrainError, ValueError):
    """An option or config key is unknown or has an impossible value."""


class ContractError(ConfigError):
    """A pipeline whose passes cannot run together: a pass (or the runtime) reads a metadata key
    that no enabled pass before it writes (usually: disable_passes switched its writer off)."""


class ResidencyError(MegatrainError):
    """A layer body was about to read a weight that is not resident on the device."""


class CannotFitError(MegatrainError):
    """The model or the step does not fit this machine (host RAM or device memory)."""

    exit_code = 3


class TrainingError(MegatrainError):
    """Training started but failed: it diverged, made non-finite weights, or trained nothing."""

    exit_code = 4


class InternalError(MegatrainError):
    """A failure of megatrain's own making that it recognised, e.g. a graph break inside what
    megatrain prepared (a parameter it keeps an fp32 gradient for, its attention, its hooks):
    never the user's to fix. The message says so and carries the facts of a bug report;
    `with_facts` adds the caller's (the trainer's step and micro-batch)."""

    exit_code = 1

    def __init__(self, what: str, facts: dict | None = None):
        self.what, self.facts = what, dict(facts or {})
        super().__init__(str(self))

    def with_facts(self, **facts) -> "InternalError":
        return InternalError(self.what, {**self.facts, **facts})

    def __str__(self) -> str:
        import platform

        import torch
        try:
            import transformers
            versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
        except ImportError:  # pragma: no cover
            versions = f"torch {torch.__version__}"
        facts = "; ".join(f"{k}: {v}" for k, v in self.facts.items())
        return (f"{self.what}. This is a megatrain bug, not a problem with your model or config: please report it "
                f"with these facts ({facts}{'; ' if facts else ''}{versions}, Python {platform.python_version()}).")


def megatrain_error_in(e: BaseException) -> MegatrainError | None:
    """The MegatrainError behind `e`: itself, the error Dynamo wrapped (`inner_exception` of
    BackendCompilerFailed) or one in its chain of causes (`__cause__`/`__context__`)."""
    seen, todo = set(), [e]
    while todo:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, MegatrainError):
            return err
        todo += [getattr(err, "inner_exception", None), err.__cause__, err.__context__]
    return None
