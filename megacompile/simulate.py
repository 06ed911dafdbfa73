"""Discrete-event simulation of a schedule on a hardware profile.

Three streams, as the runtime has them: `h2d` (weight prefetches), `compute` (waits, bodies,
evicts) and `d2h` (gradient offloads). Steps are issued in schedule order by the compute
stream, which is where the runtime issues them:
  * a prefetch starts when it is issued and the link is free, and lasts bytes / h2d bandwidth;
  * a wait ends when its segment's weights have arrived;
  * a run starts when the previous run ended, and lasts the body's estimated seconds;
  * a grad_offload starts when its run ended and the d2h link is free;
  * a checkpoint offload starts when its run ended and the d2h link is free; a reload starts
    when it is issued and the h2d link is free, and the run it is for starts only after it.
With `optimizer_s_per_byte`, a fourth stream, `host`, runs the optimizer (runtime/adamw.py):
  * optimizer="backward" (HostAdamW overlap="backward", the norm not clipped): an update
    starts when its grad_offload ended and the host is free, and lasts the offloaded gradient
    bytes * optimizer_s_per_byte;
  * optimizer="forward" (overlap="forward", or a clipped step under overlap="backward": the
    last step's update runs under this forward): the host updates the segments back to back
    from t0 in the order the forward fetches them, each lasting its weight bytes *
    optimizer_s_per_byte, and a segment's prefetch starts only after its update.
With `ssd` (the NVMe state tier: read and write GB/s, state bytes per optimizer byte), a fifth
stream, `ssd`, moves each update's masters/moments: `tier_read` of update i starts when the drive
is free (read ahead in update order, one update ahead of the one running), the update starts
only after it, and `tier_write` follows the update when the drive is free (reads and writes
share the drive, as tier_plan.py's closed form takes them).
On a profile without overlap (the CPU playing the accelerator) every copy blocks the compute
stream, which is what the synchronous CPU runtime does; so does the optimizer (it shares the
cores with the compute).
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware


@dataclass(frozen=True)
class SegmentCost:
    name: str
    weight_bytes: int    # bytes its prefetch moves
    grad_bytes: int      # bytes its grad_offload moves
    seconds: float       # estimated body time on the profile


@dataclass(frozen=True)
class TimedStep:
    op: str
    stream: str
    segment: int
    group: str
    nbytes: int
    start: float
    end: float


def simulate(steps, costs: list[SegmentCost], hw: Hardware, t0: float = 0.0,
             optimizer_s_per_byte: float | None = None, optimizer: str = "backward",
             ssd: tuple[float, float, float] | None = None) -> list[TimedStep]:
    """Start and end time of every step of `steps` (a Schedule's steps), plus the optimizer's
    updates when `optimizer_s_per_byte` is given: after each grad_offload (optimizer="backward")
    or before each prefetch (optimizer="forward")."""
    if optimizer not in ("backward", "forward"):
        raise ValueError(f"optimizer={optimizer!r}: 'backward' or 'forward'")
    before_prefetch = optimizer_s_per_byte is not None and optimizer == "forward"
    after_offload = optimizer_s_per_byte is not None and optimizer == "backward"
    clock = {"h2d": t0, "compute": t0, "d2h": t0, "host": t0, "ssd": t0, "comm": t0}
    arrived: dict[int, float] = {}
    # the updates in the order they run (with ssd: read one ahead of the one running)
    updates = [(s.segment, s.nbytes or (costs[s.segment].grad_bytes if s.op == "grad_offload" else 0))
               for s in steps if (after_offload and s.op == "grad_offload")
               or (before_prefetch and s.op in ("prefetch", "prefetch_shard"))]
    read: list[float] = []   # when update i's state has arrived

    def tier_read(i: int) -> None:
        while ssd is not None and len(read) <= min(i, len(updates) - 1):
            k, nbytes = updates[len(read)]
            start = clock["ssd"]
            end = clock["ssd"] = start + nbytes * ssd[2] / (ssd[0] * 1e9)
            read.append(end)
            out.append(TimedStep("tier_read", "ssd", k, costs[k].name, int(nbytes * ssd[2]), start, end))
    reloaded: dict[int, float] = {}   # segment -> when its last checkpoint reload arrives
    ran: dict[int, float] = {}
    ran_updates: list[int] = []
    out = []

    def update(k: int, nbytes: int, start: float) -> float:
        """The host's update of segment k's weights from `start`; returns its end."""
        i = len(ran_updates)
        ran_updates.append(k)
        if ssd is not None:
            tier_read(i + 1)   # (this update's state, and the next one's ahead)
            start = max(start, read[i])
        end = clock["host"] = start + nbytes * optimizer_s_per_byte
        if not hw.overlap:   # (the CPU: the optimizer takes the cores from the compute)
            clock["compute"] = end
        out.append(TimedStep("optimizer", "host", k, costs[k].name, nbytes, start, end))
        if ssd is not None:
            w_start = max(clock["ssd"], end)
            w_end = clock["ssd"] = w_start + nbytes * ssd[2] / (ssd[1] * 1e9)
            out.append(TimedStep("tier_write", "ssd", k, costs[k].name, int(nbytes * ssd[2]), w_start, w_end))
        return end

    def prefetch(k: int, nbytes: int) -> tuple[float, float]:
        ready = t0
        if before_prefetch:
            ready = update(k, nbytes, max(clock["host"], t0 if hw.overlap else clock["compute"]))
        start = max(clock["h2d"], clock["compute"], ready)
        end = start + nbytes / (hw.h2d_gbps * 1e9)
        clock["h2d"] = arrived[k] = end
        if not hw.overlap:
            clock["compute"] = end
        return start, end

    def wait(k: int, nbytes: int) -> tuple[float, float]:
        start = clock["compute"]
        end = clock["compute"] = max(start, arrived[k])
        return start, end

    def run(k: int, nbytes: int) -> tuple[float, float]:
        start = clock["compute"] = max(clock["compute"], reloaded.get(k, t0))
        end = clock["compute"] = ran[k] = start + costs[k].seconds
        return start, end

    def copy_out(k: int, nbytes: int) -> tuple[float, float]:   # gradients or a checkpoint, after run k
        start = max(clock["d2h"], ran[k])
        end = clock["d2h"] = start + nbytes / (hw.d2h_gbps * 1e9)
        if not hw.overlap:
            clock["compute"] = end
        return start, end

    def evict(k: int, nbytes: int) -> tuple[float, float]:   # instantaneous, on the compute stream
        return clock["compute"], clock["compute"]

    def reload(k: int, nbytes: int) -> tuple[float, float]:    # a checkpoint in, before run k
        start = max(clock["h2d"], clock["compute"])
        end = clock["h2d"] = start + nbytes / (hw.h2d_gbps * 1e9)
        reloaded[k] = max(reloaded.get(k, t0), end)
        if not hw.overlap:
            clock["compute"] = end
        return start, end

    # data parallelism, as the runtime runs the collectives: an all-gather on the comm stream once
    # its part arrived (its segment's wait waits for it; it runs under the bodies before), a
    # reduce-scatter on the compute stream after its run (its offload reads the result at once)
    def peer(nbytes: int) -> float:   # a collective's seconds over the peer links
        return nbytes / (hw.peer_gbps * 1e9) + hw.peer_latency_us * 1e-6

    def gather(k: int, nbytes: int) -> tuple[float, float]:
        start = max(clock["comm"], arrived[k])
        end = clock["comm"] = arrived[k] = start + peer(nbytes)
        return start, end

    def reduce(k: int, nbytes: int) -> tuple[float, float]:
        start = max(clock["compute"], ran[k])
        end = clock["compute"] = ran[k] = start + peer(nbytes)
        return start, end

    # one handler per schedule op (the executor and the memory plan have theirs)
    handlers = {"prefetch": prefetch, "wait": wait, "run": run, "grad_offload": copy_out, "evict": evict,
                "offload": copy_out, "reload": reload, "prefetch_shard": prefetch, "all_gather": gather,
                "reduce_scatter": reduce}
    for step in steps:
        k, cost = step.segment, costs[step.segment]
        nbytes = step.nbytes or (cost.grad_bytes if step.op == "grad_offload" else 0)
        if step.moved is not None:   # (a sharded fetch: its slot is whole, its copy a part)
            nbytes = step.moved
        start, end = handlers[step.op](k, nbytes)
        out.append(TimedStep(step.op, step.stream, k, cost.name, nbytes, start, end))
        if step.op == "grad_offload" and after_offload:   # (the update after its gradients left)
            update(k, nbytes, max(clock["host"], end))
    return out


def grad_bytes(steps, costs: list[SegmentCost]) -> int:
    """Gradient bytes the grad_offload steps of `steps` move (the optimizer's share of each)."""
    return sum(s.nbytes or costs[s.segment].grad_bytes for s in steps if s.op == "grad_offload")


def fetched_bytes(steps) -> int:
    """Weight bytes the prefetch steps of `steps` move (the optimizer's share of each)."""
    return sum(s.nbytes for s in steps if s.op in ("prefetch", "prefetch_shard"))


def optimizer_bytes(steps, costs: list[SegmentCost], optimizer: str) -> int:
    """The bytes simulate()'s `optimizer` mode spreads the optimizer's time over: the offloaded
    gradients ("backward") or the fetched weights ("forward")."""
    return grad_bytes(steps, costs) if optimizer == "backward" else fetched_bytes(steps)


def busy_seconds(timed: list[TimedStep]) -> dict[str, float]:
    """Seconds each stream of `timed` works (waits and evictions are not work): the one with the
    most is what binds the step (plan_compare.py names it)."""
    busy: dict[str, float] = {}
    for s in timed:
        if s.op not in ("wait", "evict"):
            busy[s.stream] = busy.get(s.stream, 0.0) + s.end - s.start
    return busy


def makespan(timed: list[TimedStep], t0: float = 0.0) -> float:
    return max((s.end for s in timed), default=t0)
