"""The random generators' states as plain JSON, so a checkpoint never holds a pickle.

    capture() -> {"python": [3, [625 ints], null], "numpy": ["MT19937", [624 ints], pos, has_gauss, cached],
                  "torch": "<base64 of torch.get_rng_state()>", "cuda": ["<base64>", ...]}
    restore(state)   validates every part first, then sets the generators (nothing is set when a part is bad)

A pickled state (torch.save of random.getstate() and NumPy's state) would be read back with
`weights_only=False`, which runs whatever the file says: a crafted checkpoint folder could then
execute code on resume. JSON cannot.
"""
from __future__ import annotations

import base64
import random
from typing import Any

import torch


class RNGStateError(ValueError):
    """The saved state is not one these generators can take."""


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _bytes_tensor(text: Any, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise RNGStateError(f"{what}: expected a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise RNGStateError(f"{what}: not base64") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def capture() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": _b64(torch.get_rng_state())}
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _ints(value: Any, n: int | None, what: str) -> list[int]:
    if not isinstance(value, list) or (n is not None and len(value) != n) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in value):
        raise RNGStateError(f"{what}: expected {n or 'a list of'} unsigned 32-bit integers")
    return value


def check(state: Any) -> tuple:
    """The generators' states parsed from `state`; raises RNGStateError, sets nothing."""
    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise RNGStateError("expected an object with 'python' and 'torch' states")
    py = state["python"]
    if not (isinstance(py, list) and len(py) == 3 and isinstance(py[0], int)
            and (py[2] is None or isinstance(py[2], float))):
        raise RNGStateError("python: expected [version, [625 integers], gauss_next]")
    python = (py[0], tuple(_ints(py[1], 625, "python")), py[2])
    cpu = _bytes_tensor(state["torch"], "torch")
    if cpu.numel() != torch.get_rng_state().numel():
        raise RNGStateError(f"torch: {cpu.numel()} bytes, this torch keeps {torch.get_rng_state().numel()}")
    numpy_state = None
    if "numpy" in state:
        np_ = state["numpy"]
        if not (isinstance(np_, list) and len(np_) == 5 and np_[0] == "MT19937" and isinstance(np_[2], int)
                and isinstance(np_[3], int) and isinstance(np_[4], (int, float))):
            raise RNGStateError("numpy: expected ['MT19937', [624 integers], pos, has_gauss, cached_gaussian]")
        import numpy as np
        numpy_state = ("MT19937", np.array(_ints(np_[1], 624, "numpy"), dtype=np.uint32), np_[2], np_[3],
                       float(np_[4]))
    cuda = None
    if "cuda" in state and torch.cuda.is_available():
        if not isinstance(state["cuda"], list):
            raise RNGStateError("cuda: expected a list of base64 strings")
        cuda = [_bytes_tensor(s, "cuda") for s in state["cuda"]]
    return python, cpu, numpy_state, cuda


def restore(state: Any) -> None:
    """Set Python's, NumPy's, torch's (and CUDA's, when saved and present) generators."""
    python, cpu, numpy_state, cuda = check(state)
    try:   # python's setstate checks the position index itself; numpy checks `pos`
        random.setstate(python)
        torch.set_rng_state(cpu)
        if numpy_state is not None:
            import numpy as np
            np.random.set_state(numpy_state)
        if cuda is not None and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    except (ValueError, TypeError, RuntimeError) as e:
        raise RNGStateError(str(e)) from None


def from_legacy(path) -> dict[str, Any]:
    """An `rng.pt` of an earlier megatrain (a torch.save of the generators' states), read with
    weights_only=True: plain containers, tensors and NumPy arrays only, so a crafted file is
    refused instead of executed."""
    import numpy as np
    try:
        from numpy._core.multiarray import _reconstruct   # NumPy 2
    except ImportError:  # pragma: no cover - NumPy 1
        from numpy.core.multiarray import _reconstruct
    allowed = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        raw = torch.load(path, weights_only=True)
    if not isinstance(raw, dict) or "python" not in raw or "torch" not in raw:
        raise RNGStateError("expected a dict with 'python' and 'torch' states")
    version, internal, gauss = raw["python"]
    out: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": _b64(raw["torch"])}
    if "numpy" in raw:
        name, keys, pos, has_gauss, cached = raw["numpy"]
        out["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return out
