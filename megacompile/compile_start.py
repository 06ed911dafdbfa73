"""What must change on a model before Dynamo traces it, done by a Dynamo compile-start callback.

Dynamo calls its start callbacks before it traces a frame. For the outermost module compiled with
`backend="megatrain"` this one
  * installs transformers' output-capturing hooks the config asks for (output_hooks.py): their
    registration cannot be traced, and the router logits' auxiliary loss needs them;
  * selects megatrain's segment attention (attention.py) unless the compile options say
    `attention="transformers"`: transformers' SDPA path builds a [batch, 1, seq, seq] mask under
    tracing; the segment path never does. A model segment attention cannot run keeps its own;
  * lifts every gradient whose dtype differs from its parameter's off the parameter until the
    compile ends (the end callback puts the same tensors back):

        start:  p (bf16), p.grad (fp32, the micro-batches so far)  ->  p.grad = None, kept aside
        trace:  Dynamo wraps p; nothing else runs
        end:    p.grad = the kept tensor (same object, same version)

    Why: a low-precision parameter's gradient is fp32 on the host (runtime/store.py), and Dynamo
    refuses to wrap a parameter whose grad dtype differs from its own ("dtype mismatch between
    tensor and its gradient": a graph break). It checks only when it wraps one, in a trace, and
    no guard reads grads, so the compiled graph's guards hold either way. A trace with gradients
    present is any recompile inside an accumulated step: the second micro-batch padded to a new
    length. The gradients stay on `param.grad` between micro-batches otherwise, because a user's
    torch optimizer and `clip_grad_norm_` read them there; the guard is satisfied by
    construction instead of by the runtime owning gradient storage.

`torch._dynamo.reset()` drops Dynamo's callbacks; `register()` runs on import of megacompile and
again in the backend (both callbacks). A compile right after a reset misses the start callback:
the backend then does its work itself (`prepare_late`) and, where that changed the model,
raises `Retrace`, which makes Dynamo trace the frame again from the start (its own restart
mechanism), now with segment attention and the hooks. The graph in hand was traced before that
and is dropped, so a model never trains with transformers' seq x seq mask because of a reset
(Dynamo does not guard on the attention implementation: selecting it without a new trace would
change nothing). Gradients are the exception: Dynamo breaks the graph on a low-precision
parameter's fp32 gradient while it traces, before the backend is called, and the error says to
call megacompile.reset() (capture.py).

    compile after reset:  trace (sdpa mask) -> backend: prepare_late -> Retrace
                          trace again (segment attention) -> backend: prepared -> compiled
"""
from __future__ import annotations

import contextlib
import gc
import logging
import weakref

import torch
from torch._dynamo.exc import TensorifyScalarRestartAnalysis

from . import attention, dynamo_regions, output_hooks
from .capture import current_tx, find_layer_stack, outermost_compiled_module
from .errors import UnsupportedModelError
from .compile_progress import CLOCK
from .runtime.store import assign_grad

log = logging.getLogger(__name__)


def _megatrain_wrapper(compiled):
    """torch.compile's wrapper of the backend when it is megatrain's (it holds the options), else None."""
    obj = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if obj is None:
            return None
        name = getattr(obj, "compiler_name", None)
        if isinstance(name, str):
            return obj if name == "megatrain" else None
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return None


def _options(wrapper) -> dict:
    """The compile options as given to torch.compile (the backend checks them all)."""
    options = (getattr(wrapper, "kwargs", None) or {}).get("options") or {}
    return options if isinstance(options, dict) else {}


def _given(options: dict, name: str, default):
    """Option `name` as given, or `default` where it is missing or of another type (a wrong value
    is refused by the backend)."""
    value = options.get(name, default)
    return value if isinstance(value, type(default)) else default


def prepare(model: torch.nn.Module, options: dict | None = None) -> None:
    """Make `model` ready to be traced by megatrain, as compile `options` (as given) ask: hooks,
    the attention implementation, and each decoder layer's forward as a compile region of its
    kind (dynamo_regions.py)."""
    options = options if isinstance(options, dict) else {}
    output_hooks.install_requested_hooks(model)
    if _given(options, "attention", "segments") == "segments":
        why = attention.select(model)
        if why:
            log.info("megatrain: %s keeps transformers' attention (%s)", type(model).__name__, why)
    try:
        prefix, layers = find_layer_stack(model)
    except UnsupportedModelError:   # (the backend refuses it, with this error)
        return
    disabled = options.get("disable_passes", ())   # (a name or a list of names)
    disabled = (disabled,) if isinstance(disabled, str) else tuple(disabled) if isinstance(disabled, (list, tuple)) \
        else ()
    if not dynamo_regions.wanted(_given(options, "dynamo_regions", "auto"), len(layers), disabled):
        dynamo_regions.uninstall(model, layers)
    elif (why := dynamo_regions.install(model, layers, prefix)) is not None:
        log.info("megatrain: Dynamo traces every decoder layer of %s (%s)", type(model).__name__, why)


class Retrace(TensorifyScalarRestartAnalysis):
    """Trace this frame again: megatrain prepared the model after the trace began. (Dynamo lets
    this restart family through from a backend, where it wraps other errors, and restarts the
    frame's analysis; a subclass, so its reason is ours.)"""


def retrace(reason: str) -> None:
    """Raise Retrace from the backend. The new trace takes another path through the code it
    prepared (the attention's mask function): Dynamo's speculation log, kept across restarts to
    replay the same path, would refuse it, so it is cleared first."""
    tx = current_tx()
    if tx is not None:
        tx.speculation_log.clear()
    raise Retrace(restart_reason=reason)


def prepare_late(model: torch.nn.Module, attention_choice: str) -> str | None:
    """From the backend, in a compile that began without the start callback (torch._dynamo.reset()
    dropped it): select segment attention and install the output hooks, as the callback does.
    Returns what changed the model (the backend then raises Retrace), or None: nothing to change,
    or this compile already traced the model again once. (Gradients are not lifted here: their
    graph break comes before the backend is called, and says to call megacompile.reset().)"""
    if model in _LATE:
        return None
    changed = []
    if output_hooks.install_requested_hooks(model):
        changed.append("transformers' output hooks")
    # (why_not: a model segment attention can run; a plain nn.Module has no transformers config)
    if attention_choice == "segments" and attention.why_not(model) is None \
            and model.config.get_text_config(decoder=True)._attn_implementation != attention.NAME:
        if attention.select(model) is None:
            changed.append("segment attention")
    if changed:
        _LATE.add(model)
    return ", ".join(changed) or None


def late(model: torch.nn.Module, attention_choice: str) -> None:
    """From the backend, on the graph it compiles: warn when a model segment attention can run
    still has transformers' attention (the start callback and `prepare_late` both selected it;
    only transformers refusing the implementation leaves it so)."""
    if attention_choice != "segments" or attention.why_not(model) is not None:
        return
    if model.config.get_text_config(decoder=True)._attn_implementation != attention.NAME:
        log.warning("megatrain: %s keeps transformers' attention, whose mask grows with seq x seq: transformers did "
                    "not accept megatrain's segment attention for it (megacompile/attention.py select). Long "
                    "sequences need far more device memory this way.", type(model).__name__)


class LiftedGrads:
    """Gradients taken off their parameters for the length of one compile (module docstring)."""

    def __init__(self) -> None:
        self._held: list[tuple[weakref.ref, torch.Tensor]] = []
        self.active = False   # a compile that began with the start callback is in progress

    def lift(self, model: torch.nn.Module) -> int:
        """Take off every gradient of `model` whose dtype is not its parameter's; returns how many."""
        for p in model.parameters():
            grad = p.grad
            if grad is not None and grad.dtype != p.dtype:
                self._held.append((weakref.ref(p), grad))
                p.grad = None
        return len(self._held)

    def restore(self) -> None:
        """Put every lifted gradient back on its parameter (a parameter given a new gradient
        meanwhile keeps it: nothing runs between start and end that would)."""
        held, self._held = self._held, []
        for ref, grad in held:
            p = ref()
            if p is not None and p.grad is None:
                assign_grad(p, grad)


_LIFTED = LiftedGrads()   # (Dynamo runs one compile at a time: its callbacks pair start and end)
_LATE: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()   # models prepare_late traced again, this compile


class GcPause:
    """Python's cyclic garbage collector off from the start of a megatrain compile to its end (as
    it was before, after): Dynamo's trace and the backend make hundreds of thousands of objects,
    and every full collection walks them all (at 64 layers of a tiny Llama, two thirds of putting
    the layer calls back in line). What the compile leaves behind is collected later as usual."""

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> bool:
        """Pause it; whether this call did (False: already paused, or off by the user's choice)."""
        if self.paused or not gc.isenabled():
            return False
        gc.disable()
        self.paused = True
        return True

    def resume(self) -> None:
        if self.paused:
            gc.enable()
            self.paused = False


_GC = GcPause()


@contextlib.contextmanager
def gc_paused():
    """The collector paused for a block, unless the compile already paused it (the backend's, for
    a compile that began without the start callback: after torch._dynamo.reset())."""
    paused = _GC.pause()
    try:
        yield
    finally:
        if paused:
            _GC.resume()


def _on_compile_start(_args) -> None:
    _LIFTED.active = True
    compiled = outermost_compiled_module()
    wrapper = _megatrain_wrapper(compiled) if compiled is not None else None
    if wrapper is not None:
        _GC.pause()
        CLOCK.start(type(compiled._orig_mod).__name__)
        prepare(compiled._orig_mod, _options(wrapper))
        if _LIFTED.lift(compiled._orig_mod):
            log.debug("megatrain: fp32 gradients lifted off low-precision parameters while Dynamo traces")


def _on_compile_end(_args) -> None:
    _GC.resume()
    _LATE.clear()
    CLOCK.stop()
    _LIFTED.active = False
    _LIFTED.restore()


def prepared_this_compile() -> bool:
    """Whether the compile in progress began with megatrain's start callback (a compile right
    after torch._dynamo.reset() did not: the backend registers the callbacks again only then)."""
    return _LIFTED.active


def register() -> None:
    """Register the compile-start and compile-end callbacks where they are not (idempotent)."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None:
        return
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)
    if _on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_on_compile_end)


def unregister() -> None:
    """Remove the callbacks (torch._dynamo.reset() does the same)."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is not None and _on_compile_start in handler.start_callbacks:
        handler.remove_start_callback(_on_compile_start)
    if handler is not None and _on_compile_end in handler.end_callbacks:
        handler.remove_end_callback(_on_compile_end)
