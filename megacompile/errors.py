"""Errors megatrain raises on bad input. Each message says what to change."""


class MegatrainError(RuntimeError):
    """Base class of every error megatrain raises on purpose."""


class UnsupportedModelError(MegatrainError):
    """The model is not a decoder-only LM megatrain can split into layers."""


class GraphBreakError(MegatrainError):
    """Dynamo could not capture the model as one graph."""


class ConfigError(MegatrainError, ValueError):
    """An option or config key is unknown or has an impossible value."""


class ResidencyError(MegatrainError):
    """A layer body was about to read a weight that is not resident on the device."""
