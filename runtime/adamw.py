"""The host optimizer: AdamW over each parameter's fp32 buffers in one pass that also writes
its low-precision transfer copy.

    HostAdamW.step(grad_scale=c)       per trainable parameter p, one kernel call:
        master, grad, exp_avg, exp_avg_sq  --(AdamW, grads scaled by c)-->  master, exp_avg, exp_avg_sq
                                                                        └-> transfer copy (bf16/fp16)

Why not torch.optim.AdamW: with megatrain's store, a bf16 model's optimizer step is AdamW on the
fp32 masters (28 bytes/param of memory traffic in torch's fused CPU kernel) then a copy of each
master into its bf16 transfer copy (6 more), then a clipping pass over the gradients before it
(8 more). Here the clipping factor and the copy are fused into the update: 30 bytes/param in
one pass (`csrc/adamw.cpp`, compiled on first use with torch's C++ extension builder and cached
under ~/.cache/torch_extensions; `benchmarks/cpu_adam.py` measures it against torch).

The update follows torch.optim.AdamW's formulas in its operation order (tested against it), and
the state has AdamW's keys and dtypes (step, exp_avg, exp_avg_sq in fp32), so checkpoints are
interchangeable with torch's AdamW. Parameters the kernel cannot take (not fp32 on the CPU,
e.g. a VLM's vision tower trained on the GPU) are updated by torch's functional AdamW, with
state in their own dtype as torch.optim.AdamW would keep it. Without a C++ compiler the kernel
falls back to torch's fused AdamW plus a copy (a warning says so once).
"""
from __future__ import annotations

import enum
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.profiler import record_function

from .host_kernels import kernel, squared_norm
from .store import LOW_PRECISION, master_entry, entry_of

#: HostAdamW's `overlap` values (also accepted by `megatrain train`'s overlap_optimizer)
OVERLAP_MODES = (False, True, "none", "forward", "backward")


class Overlap(enum.Enum):
    """When HostAdamW's updates run (the `overlap` argument)."""
    NONE = "none"           # in step(), before it returns
    FORWARD = "forward"     # on a host thread from step() on, under the next forward
    BACKWARD = "backward"   # as FORWARD, and from arm() on each weight's as its gradient lands

    @classmethod
    def of(cls, value: bool | str) -> "Overlap":
        return {False: cls.NONE, True: cls.FORWARD}.get(value) or cls(value)


class Speculation(enum.Enum):
    """Where an overlap="backward" optimizer is between steps (the class docstring's protocol)."""
    READY = "ready"     # the next arm() speculates
    ARMED = "armed"     # between arm() and step()/discard(): updates start as gradients land
    PAUSED = "paused"   # the last step was clipped: the next arm() does nothing, step() updates


def _hyper(group: dict) -> tuple:
    """A parameter group's (lr, beta1, beta2, eps, weight_decay), as `_update` takes them."""
    return (group["lr"], *group["betas"], group["eps"], group["weight_decay"])


def _order(p) -> int:
    """The order the forward reads `p` (-1: not in the store)."""
    entry = entry_of(p)
    return entry.order if entry is not None else -1


def _available_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):   # not on Linux: no rollback copies, no speculation
        return 0


def _take(t: torch.Tensor, pieces) -> torch.Tensor:
    """The elements `pieces` of a tensor, flat, in a new tensor."""
    flat = t.view(-1)
    return torch.cat([flat[a:b] for a, b in pieces]) if pieces else flat.new_empty(0)


def _put(t: torch.Tensor, pieces, values: torch.Tensor) -> None:
    """Write `values` (as `_take` made them) back into the elements `pieces` of `t`."""
    flat, at = t.view(-1), 0
    for a, b in pieces:
        flat[a:b].copy_(values[at:at + b - a])
        at += b - a


def _fallback(master, grad, exp_avg, exp_avg_sq, low, step_t, lr, beta1, beta2, eps, weight_decay, grad_scale):
    g = grad if grad_scale == 1.0 else grad * grad_scale
    torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if low is not None:
        low.copy_(master)


class HostAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) for megatrain's host store. Same arguments as
    torch.optim.AdamW (no amsgrad/maximize); `step(grad_scale=c)` multiplies the gradients by
    `c` inside the update (the global-norm clipping factor, without a pass of its own).
    Overlapped updates (below) run the kernel on `host_threads` threads (default: all cores but
    two, so the training thread that launches the device's work keeps a core).

    `overlap=True` (or "forward"): `step()` returns at once and a host thread updates the weights
    in the order the forward reads them; the next forward's fetch of a weight waits for that
    weight's update only (`WeightEntry.ready`), so the optimizer runs under the next step's data
    preparation and forward. It is exact, with no rollback: the step starts after the backward,
    when the global norm (clipping factor) and the finiteness of the gradients are known.
    `synchronize()` waits for the step (checkpoint saving, reading weights outside a megatrain
    forward); `step`, `state_dict`, `load_state_dict` and `zero_grad(set_to_none=False)` call it.

    `overlap="backward"`: in addition, `arm()` before the step's last backward makes each
    weight's update start on a host thread as soon as its gradient is complete on the host
    (runtime/grad_offload.py tells), under the backward of the layers before it:

        backward:   body L ── body L-1 ── body L-2 ── ... ── body 0 ┐
        grads:          └ land L ──┴ land L-1 ──┴ ...                ├ grad_norm()  step(c)
        optimizer:            └ snapshot L, AdamW(c=1) L ──┴ ...     ┘  c == 1: kept
                                                                        c != 1 / skipped: rollback
    The clipping factor c depends on the global norm, known only after the whole backward, so
    these updates are speculative (c = 1) and exact by rollback: before updating a weight its
    master, moments and step count are copied aside (12 bytes/param, kept between steps, at most
    `rollback_bytes`; weights beyond that budget wait for `step()`). `step(grad_scale=c)` keeps
    the speculative updates when c == 1 and the gradient is the one they read; otherwise (the
    norm was clipped, the gradient was changed in place, a hyper-parameter changed) it restores
    the copy and updates again with c (on the host thread that runs the forward overlap). After
    a clipped step the next `arm()` does nothing (counted as "paused") until a step is not
    clipped: while clipping lasts, speculation would only cost. Between the armed backward and
    `step()` no megatrain forward or backward may run (they would read updated weights): they
    raise an error. `discard()` (a step skipped for non-finite gradients; also `zero_grad()`
    without a step) restores every copy. Results equal the non-overlapped step's bit for bit
    (tests/test_host_adamw.py). `grad_norm()` is the global L2 norm of the gradients, with the
    speculatively updated weights' norms taken as they land.

    `tier=StateTier(...)` (runtime/state_tier.py): the moments (and with placement "all" the fp32
    masters) of the large parameters live in files on NVMe; their update reads each tile into a
    bounce buffer, runs the same kernel on it and writes it back, with reads ahead in the order
    the updates come (`arm()`: the backward's, last layer first; `step()`: the forward's). A
    speculative update writes the tier's other slot, so its rollback copies nothing: only a
    master kept in RAM is copied aside (4 bytes/param). Bit for bit the all-in-RAM results
    (tests/test_state_tier.py); `state[p]` holds only the step count of a tiered parameter and
    `state_dict()` reads its moments from the tier.
    """

    # the store's optimizer hooks leave this optimizer's parameters alone: it reads the fp32
    # masters and writes the transfer copies itself
    updates_transfer_copies = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, overlap: bool | str = False, rollback_bytes: int | None = None,
                 host_threads: int | None = None, tier=None):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"HostAdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"HostAdamW: overlap={overlap!r}; use False, True/'forward' (under the next forward) "
                             "or 'backward' (each layer's update starts during the backward)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.mode = Overlap.of(overlap)
        # the state tier (runtime/state_tier.py) holding the moments (and masters) of the large
        # parameters on NVMe; their `state` holds only the step count
        self.tier = tier
        # threads of an overlapped update: all cores but two, left to the training thread (which
        # launches the device's kernels) and the gradient worker
        self.host_threads = host_threads if host_threads is not None else max(1, (os.cpu_count() or 2) - 2)
        # one host thread runs every update off the training thread (speculative ones during the
        # backward, the overlapped step under the next forward): made at first use
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future | None = None   # the overlapped step in flight
        self._error: BaseException | None = None
        # overlap="backward": speculative updates (see the class docstring)
        self.rollback_bytes = rollback_bytes
        self.speculation = Speculation.READY
        self._offloaders: set = set()   # listened to while armed
        self._hyper: dict[nn.Parameter, tuple] = {}        # parameter -> its group's hyper-parameters
        self._spec: dict[nn.Parameter, tuple] = {}         # updated during this backward: (grad, version, hyper)
        self._norms: dict[nn.Parameter, float] = {}  # their gradients' squared norms, taken as they landed
        self._snap: dict[nn.Parameter, tuple] = {}         # rollback copies, kept between steps
        self._snap_bytes = 0
        self._futures: list[Future] = []
        self.counters = {"speculated": 0, "kept": 0, "rolled_back": 0, "over_budget": 0, "paused": 0}
        # parameter -> whether its last update left a NaN or inf in its weights (nonfinite())
        self._nonfinite: dict[nn.Parameter, bool] = {}
        self._topo = None   # data parallelism: megacompile.distributed.Topology, found at first use

    @staticmethod
    def _buffers(p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the tensor AdamW updates, the transfer copy to refresh or None)."""
        entry = master_entry(p)
        if entry is not None:
            return entry.master, entry.transfer
        return p.data, None

    @staticmethod
    def _pieces(p) -> list[tuple[int, int]] | None:
        """Data parallelism: the element ranges of `p` this rank updates (None: all of it)."""
        entry = entry_of(p)
        return entry.pieces if entry is not None else None

    def _topology(self):
        """The node's ranks whose pieces make up the gradients (data parallelism)."""
        if self._topo is None:
            from ..distributed import current
            self._topo = current(torch.device("cpu"))
        return self._topo

    def _squares(self, p, grad, threads: int = 0) -> float:
        """sum(grad ** 2) over the elements this rank updates: as the gradient's landing took it
        (runtime/store.py `landed_squares`, no pass of its own), or now."""
        pieces = self._pieces(p)
        if pieces is None:
            entry = entry_of(p)
            landed = entry.landed_squares(grad) if entry is not None else None
            return landed if landed is not None else squared_norm(grad, threads)
        flat = grad.view(-1)
        return sum(squared_norm(flat[a:b], threads) for a, b in pieces)

    # overlap="backward" ---------------------------------------------------------------
    def arm(self) -> None:
        """The next backward is this step's last (after any gradient accumulation): update each
        weight as soon as its gradient is complete. Needs overlap="backward" (else a no-op)."""
        if self.mode is not Overlap.BACKWARD or self.speculation is Speculation.ARMED:
            return
        if self.speculation is Speculation.PAUSED:   # the last step was clipped: this one updates in step()
            self.counters["paused"] += 1
            return
        self.synchronize()
        if self.rollback_bytes is None:
            # decided once: half of what the host has free, less the moments not allocated yet
            # (they come with the first update)
            unborn = sum(2 * self._buffers(p)[0].numel() * 4 for g in self.param_groups for p in g["params"]
                         if not self.state[p] and not self._tiered(p))
            self.rollback_bytes = max(0, _available_host_bytes() - unborn) // 2
        self._hyper = {p: _hyper(g) for g in self.param_groups for p in g["params"]}
        self.speculation = Speculation.ARMED
        if self.tier is not None:   # read the state ahead in the order the gradients land (last layer first)
            self.tier.expect(sorted(self._hyper, key=lambda p: -_order(p)))
        # the gradient paths of the programs that read these weights (runtime/grad_offload.py)
        self._offloaders = {o for g in self.param_groups for p in g["params"] if (e := entry_of(p)) is not None
                            for o in e.offloaders}
        for offloader in self._offloaders:
            offloader.listen(self._on_gradient, self._guard)

    @property
    def armed(self) -> bool:
        """Between `arm()` and `step()` / `discard()`."""
        return self.speculation is Speculation.ARMED

    def _guard(self) -> str | None:
        if self._spec:
            return ("megatrain: a forward or backward after the backward that HostAdamW.arm() was for: the weights "
                    "already hold that step's updates. Call arm() right before the step's last backward (after its "
                    "forward), then step() or discard() before the next forward.")
        return None

    def _on_gradient(self, entry) -> None:
        """(grad_offload worker) `entry`'s gradient is complete: start its update."""
        p = entry.param_ref()
        if (self.speculation is not Speculation.ARMED or p is None or p not in self._hyper or p in self._spec
                or p.grad is None):
            return
        weights, _ = self._buffers(p)
        if not self._snapshot_fits(p, weights):
            self.counters["over_budget"] += 1
            return
        self._spec[p] = (p.grad, p.grad._version, self._hyper[p])   # claimed; filled in by the update
        entry.ready.clear()   # a read of this weight waits for its update
        self._futures.append(self._host().submit(self._speculate, p, entry))

    def _host(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-optimizer")
        return self._pool

    def _tiered(self, p) -> bool:
        return self.tier is not None and p in self.tier

    def _snapshot_fits(self, p, weights) -> bool:
        if p in self._snap:
            return True
        # a tiered parameter's state before the update stays in its committed slot on disk: only
        # a master kept in RAM is copied
        pieces = self._pieces(p)
        numel = weights.numel() if pieces is None else sum(b - a for a, b in pieces)
        need = (0 if self.tier.holds_master(p) else numel * 4) if self._tiered(p) else 3 * numel * 4
        if self._snap_bytes + need > self.rollback_bytes:
            return False
        self._snap_bytes += need
        self._snap[p] = None   # allocated on the optimizer thread
        return True

    @torch.no_grad()
    def _speculate(self, p, entry) -> None:
        try:
            grad, version, hyper = self._spec[p]
            self._init_state(p)
            weights, _ = self._buffers(p)
            state = self.state[p]
            snap = self._snap[p]
            pieces = self._pieces(p)
            if pieces is not None:   # (data parallelism: only this rank's pieces change)
                snap = self._snap[p] = (*(_take(t, pieces) for t in (weights, state["exp_avg"], state["exp_avg_sq"])),
                                        state["step"].clone())
            elif snap is None and self._tiered(p):
                snap = self._snap[p] = (None if self.tier.holds_master(p) else torch.empty_like(weights),
                                        None, None, torch.zeros(()))
            elif snap is None:
                snap = self._snap[p] = (torch.empty_like(weights), torch.empty_like(state["exp_avg"]),
                                        torch.empty_like(state["exp_avg_sq"]), torch.zeros(()))
            if pieces is None:
                for dst, src in zip(snap, (weights, state.get("exp_avg"), state.get("exp_avg_sq"), state["step"])):
                    if dst is not None:
                        dst.copy_(src)
            self._norms[p] = self._squares(p, grad, self.host_threads)
            self._update(p, grad, hyper, 1.0, self.host_threads, speculative=True)
            self.counters["speculated"] += 1
        finally:
            entry.ready.set()

    def _wait_speculation(self) -> None:
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()

    def _rollback(self, p) -> None:
        weights, low = self._buffers(p)
        state = self.state[p]
        master, exp_avg, exp_avg_sq, step = self._snap[p]
        pieces = self._pieces(p)
        if pieces is not None:
            for dst, src in ((weights, master), (state["exp_avg"], exp_avg), (state["exp_avg_sq"], exp_avg_sq)):
                _put(dst, pieces, src)
            state["step"].copy_(step)
            if low is not None:
                _put(low, pieces, master)
                master_entry(p).synced_version = p._version
            self._nonfinite.pop(p, None)
            self.counters["rolled_back"] += 1
            return
        if self._tiered(p):   # its committed slot on disk still holds the state before the update
            self.tier.discard(p)
            if self.tier.holds_master(p):
                master = self.tier.read(p, "master")
            else:
                weights.copy_(master)
        else:
            weights.copy_(master)
            state["exp_avg"].copy_(exp_avg)
            state["exp_avg_sq"].copy_(exp_avg_sq)
        state["step"].copy_(step)
        if low is not None:
            low.copy_(master)   # the transfer copy is the master rounded, as the update writes it
            master_entry(p).synced_version = p._version
        self._nonfinite.pop(p, None)
        self.counters["rolled_back"] += 1

    def _disarm(self) -> dict:
        """Stop speculating; returns {parameter: (gradient read, its version, hyper)} updated."""
        for offloader in self._offloaders:
            offloader.unlisten(self._on_gradient, self._guard)
        self._offloaders = set()
        if self.speculation is Speculation.ARMED:   # (a paused one stays paused)
            self.speculation = Speculation.READY
        self._wait_speculation()
        spec, self._spec = self._spec, {}
        return spec

    @torch.no_grad()
    def discard(self) -> None:
        """Undo this backward's speculative updates (the step is skipped)."""
        for p in self._disarm():
            self._rollback(p)
        self._norms = {}

    @staticmethod
    def _read_this_grad(p, spec: tuple | None) -> bool:
        """Whether a speculative update (`spec`: gradient, its version, hyper) read `p.grad` as it is now."""
        return spec is not None and spec[0] is p.grad and spec[1] == p.grad._version

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm of the gradients (as torch.nn.utils.get_total_norm; the weights updated
        during the backward contribute the norm taken when their gradient landed)."""
        self._wait_speculation()
        total = 0.0   # (squares summed in double, in parameter order: the same sum in every mode)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                valid = self._read_this_grad(p, self._spec.get(p))
                total += self._norms[p] if valid else self._squares(p, p.grad)
        if any(self._pieces(p) is not None for g in self.param_groups for p in g["params"]):
            # data parallelism: each rank summed its pieces; the node's ranks hold every element once
            from ..distributed import all_sum
            topo = self._topology()
            total = all_sum(topo, [total], "the all-reduce of the gradient norm", topo.node_host_group)[0]
        return math.sqrt(total)

    # --------------------------------------------------------------------------------
    def _init_state(self, p) -> None:
        state = self.state[p]
        entry = entry_of(p)
        if entry is not None and entry.moments is not None and state.get("exp_avg") is not entry.moments[0]:
            # data parallelism: the moments are the node's shared ones; loaded ones (a resume) go
            # into them for the pieces this rank owns (each rank writes its own)
            state.setdefault("step", torch.tensor(0.0))
            for key, shared in zip(("exp_avg", "exp_avg_sq"), entry.moments):
                if key in state:
                    _put(shared, entry.pieces, _take(state[key].to(torch.float32), entry.pieces))
                state[key] = shared
            return
        if not state:
            weights, _ = self._buffers(p)
            state["step"] = torch.tensor(0.0)
            if self._tiered(p):   # (the tier starts with zero moments)
                return
            state["exp_avg"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(weights, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        with record_function("megatrain.optimizer.step"):   # (updates on worker threads: until handed off)
            return self._step(closure, grad_scale)

    def _step(self, closure, grad_scale: float):
        self.synchronize()
        spec = self._disarm() if self.armed else {}
        self._norms = {}
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # speculate in the next backward only if this step was not clipped: while the norm is
        # clipped, the copies and rollbacks would be paid for nothing (exact either way)
        if self.mode is Overlap.BACKWARD:
            self.speculation = Speculation.READY if grad_scale == 1.0 else Speculation.PAUSED
        work = []   # (order, parameter, its gradient, hyper-parameters, undo a speculative update first)
        for group in self.param_groups:
            hyper = _hyper(group)
            for p in group["params"]:
                done = spec.pop(p, None)
                undo = done is not None
                if undo and grad_scale == 1.0 and self._read_this_grad(p, done) and done[2] == hyper:
                    if self._tiered(p):
                        self.tier.commit(p)
                    self.counters["kept"] += 1
                    continue
                # (otherwise: clipped, or the gradient or the hyper-parameters changed since)
                if p.grad is None:
                    if undo:
                        self._rollback(p)
                    continue
                self._init_state(p)
                entry = entry_of(p)
                work.append((entry.order if entry is not None else -1, p, p.grad, hyper, undo))
        for p in spec:   # updated during the backward but not a parameter of any group now
            self._rollback(p)
        work.sort(key=lambda w: w[0])   # the order the forward reads the weights
        if self.tier is not None:
            self.tier.expect([w[1] for w in work])
        later = [w for w in work if w[0] >= 0] if self.mode is not Overlap.NONE else []
        for _, p, grad, hyper, undo in work if not later else [w for w in work if w[0] < 0]:   # outside the store: now
            self._update(p, grad, hyper, grad_scale, undo=undo)
        if later:
            for w in later:
                entry_of(w[1]).ready.clear()
            self._running = self._host().submit(self._run, later, grad_scale)
        return loss

    def _run(self, work, grad_scale: float) -> None:
        try:
            for _, p, grad, hyper, undo in work:
                try:   # (a rollback, too, runs here: it is as long as a third of the update)
                    self._update(p, grad, hyper, grad_scale, self.host_threads, undo=undo)
                finally:
                    entry_of(p).ready.set()
        except BaseException as e:  # re-raised by synchronize() in the training thread
            self._error = e
            for w in work:
                entry_of(w[1]).ready.set()

    def synchronize(self) -> None:
        """Wait for an overlapped step to finish (re-raising its error, if any)."""
        if self._running is not None:
            self._running.result()   # (_run keeps its error for below)
            self._running = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("megatrain: the overlapped optimizer step failed") from error

    def _update(self, p, grad, hyper, grad_scale: float, threads: int = 0, undo: bool = False,
                speculative: bool = False) -> None:
        """One parameter's update; `threads` > 0 runs the kernel on that many threads of its own
        (a host thread next to the training thread), 0 on torch's intra-op pool. `undo`: restore
        the copy taken before this step's speculative update first. `speculative`: a tiered
        parameter's update is kept by `tier.commit` (step()) or undone by `_rollback`."""
        if undo:
            self._rollback(p)
        lr, beta1, beta2, eps, wd = hyper
        weights, low = self._buffers(p)
        state = self.state[p]
        if self._tiered(p):
            ext = kernel()
            if ext is None or grad.dtype != torch.float32 or not grad.is_contiguous():
                raise RuntimeError("megatrain: the state tier needs the fused host AdamW kernel (a C++ compiler and "
                                   "ninja) and fp32 host gradients")
            state["step"] += 1
            master = None if self.tier.holds_master(p) else weights
            bad = self.tier.update(p, grad, low, master, ext, hyper, int(state["step"].item()), grad_scale, threads,
                                   speculative=speculative)
            self._nonfinite[p] = bad > 0
            if low is not None:
                master_entry(p).synced_version = p._version
            return
        pieces = self._pieces(p)
        if pieces is not None:
            self._update_pieces(p, grad, hyper, grad_scale, threads, pieces, weights, low, state)
            return
        fast = (weights.device.type == "cpu" and weights.dtype == torch.float32 and weights.is_contiguous()
                and grad.dtype == torch.float32 and grad.is_contiguous()
                and (low is None or low.dtype in LOW_PRECISION))
        ext = kernel() if fast else None
        if not fast:   # e.g. a VLM's vision tower on the GPU: torch's AdamW, in its dtype
            g = grad if grad_scale == 1.0 else grad * grad_scale
            torch.optim.adamw.adamw(   # (counts the step itself)
                [weights], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], foreach=False,
                capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None, amsgrad=False,
                beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, maximize=False)
            if low is not None:
                low.copy_(weights)
            self._nonfinite[p] = not bool(torch.isfinite(weights).all())
        elif ext is not None:
            state["step"] += 1
            bad = ext.adamw_step(weights, grad, state["exp_avg"], state["exp_avg_sq"], low, lr, beta1, beta2, eps, wd,
                                 int(state["step"].item()), grad_scale, threads)
            self._nonfinite[p] = bad > 0 if bad is not None else not bool(torch.isfinite(weights).all())
        else:
            state["step"] += 1
            _fallback(weights, grad, state["exp_avg"], state["exp_avg_sq"], low, state["step"], lr, beta1, beta2,
                      eps, wd, grad_scale)
            self._nonfinite[p] = not bool(torch.isfinite(weights).all())
        if low is not None:
            master_entry(p).synced_version = p._version

    def _update_pieces(self, p, grad, hyper, grad_scale, threads, pieces, weights, low, state) -> None:
        """(data parallelism) The update of the elements `pieces` of `p` alone: the same kernel
        on flat views (it is element-wise: bit for bit its whole-tensor result there)."""
        lr, beta1, beta2, eps, wd = hyper
        state["step"] += 1
        step = int(state["step"].item())
        ext = kernel() if grad.dtype == torch.float32 and weights.dtype == torch.float32 else None
        views = [t.view(-1) if t is not None else None
                 for t in (weights, grad, state["exp_avg"], state["exp_avg_sq"], low)]
        bad = 0
        for a, b in pieces:
            w, g, m, v, lo = (t[a:b] if t is not None else None for t in views)
            if ext is not None:
                found = ext.adamw_step(w, g, m, v, lo, lr, beta1, beta2, eps, wd, step, grad_scale, threads)
                bad += found if found is not None else int(not bool(torch.isfinite(w).all()))
            else:
                _fallback(w, g, m, v, lo, state["step"].clone(), lr, beta1, beta2, eps, wd, grad_scale)
                bad += int(not bool(torch.isfinite(w).all()))
        self._nonfinite[p] = bad > 0
        if low is not None:
            master_entry(p).synced_version = p._version

    def nonfinite(self) -> list[nn.Parameter]:
        """The parameters whose last update left a NaN or inf in their weights (counted by the
        update itself). Read it after `synchronize()`, or once a megatrain forward has read the
        weights (each fetch waits for its weight's update)."""
        return [p for p, bad in list(self._nonfinite.items()) if bad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.armed:   # gradients dropped without a step: its speculative updates are undone
            self.discard()
        if not set_to_none:   # zeroing in place would race with an overlapped step reading them
            self.synchronize()
        else:   # the next backward writes into them if nothing else holds them then (store.py);
            # only low-precision weights' (their fp32 gradients are always new tensors; an fp32
            # weight's may be the device gradient itself on the CPU, where a spare would only idle)
            for group in self.param_groups:
                for p in group["params"]:
                    entry = master_entry(p) if p.grad is not None else None
                    if entry is not None:
                        entry.spare_grad = p.grad
        super().zero_grad(set_to_none=set_to_none)

    def _indexed(self) -> list[nn.Parameter]:
        """The parameters in state_dict() index order."""
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self, moments: bool = True):
        """torch's AdamW state dict. The tier's moments are read into it, unless `moments` is False
        (then its parameters' entries hold only their step: checkpoints stream them instead)."""
        if self.armed:
            raise RuntimeError("HostAdamW.state_dict() between arm() and step(): the state holds speculative "
                               "updates; call step() or discard() first")
        self.synchronize()
        sd = super().state_dict()
        if self.tier is not None and moments:
            for i, p in enumerate(self._indexed()):
                if self._tiered(p) and i in sd["state"]:   # (a new dict: torch's holds the live state's)
                    sd["state"][i] = {**sd["state"][i], "exp_avg": self.tier.read(p, "exp_avg"),
                                      "exp_avg_sq": self.tier.read(p, "exp_avg_sq")}
        return sd

    def load_state_dict(self, state_dict) -> None:
        """As torch's; the tiered parameters' moments in it go into the tier (absent: the tier's stay)."""
        if self.armed:
            self.discard()
        self.synchronize()
        moved = {}
        if self.tier is not None:
            state = dict(state_dict["state"])
            for i, p in enumerate(self._indexed()):
                if self._tiered(p) and i in state:
                    kept = dict(state[i])
                    moved[p] = {k: kept.pop(k) for k in ("exp_avg", "exp_avg_sq") if k in kept}
                    state[i] = kept
            state_dict = {**state_dict, "state": state}
        super().load_state_dict(state_dict)
        for p, arrays in moved.items():
            if arrays:
                self.tier.write(p, **{k: v.to(torch.float32) for k, v in arrays.items()})
        # torch casts state to the parameter's dtype: a bf16 parameter's moments belong to its
        # fp32 master (checkpoint.load shows the masters while loading, so this is a no-op there)
        for p, state in self.state.items():
            weights, _ = self._buffers(p)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != weights.dtype:
                    state[key] = state[key].to(weights.dtype)
