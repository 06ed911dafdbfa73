"""Errors megatrain raises on bad input. Each message says what to change.

The command line maps them to exit codes (README, "Errors"):
    2  MegatrainError (a usage, config, data, model or checkpoint error: the message says what to change)
    3  CannotFitError (the run does not fit the machine: host RAM or device memory)
    4  TrainingError (training ran but failed: diverged, non-finite weights, trained nothing)
    1  anything else: an internal error (a bug; the traceback is printed)
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
