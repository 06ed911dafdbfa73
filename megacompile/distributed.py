"""Data parallelism over torch.distributed: who this process is, its process groups, and how
the ranks agree.

    torchrun --nproc-per-node N -m megacompile.cli train cfg.yaml
        every rank:  setup() -> Topology(world=N, rank=r, local=N, local_rank=r, node=0, nodes=1)
                     init_process_group("cpu:gloo[,cuda:nccl]"), a node group (the ranks sharing
                     one host copy of the state) and a gloo group for host-side agreement

A Topology is plain data that both the compiler side and the runtime read (no pass or runtime
object in it). `SINGLE` is the one-process topology: nothing is distributed. `agree(topo, fn)`
runs a check on every rank and makes a refusal on one rank a refusal on all (the same error
type, naming the ranks), so no rank goes on alone into a collective its peers never enter.
A collective that fails (a peer died, or it timed out) is raised as `DistributedError`, which
says which and points at the peer's log.

No home-made transport: torch.distributed's gloo (CPU) and NCCL (CUDA) backends do the
communication; the CPU build of torch has no NCCL, so the CPU runs "cpu:gloo" only.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import uuid
import weakref
from dataclasses import dataclass, field

import torch

from .errors import ConfigError, MegatrainError

log = logging.getLogger("megatrain.distributed")

#: LLaMA-Factory's / Hugging Face's default ddp_timeout (seconds)
DEFAULT_TIMEOUT_S = 1800.0


class DistributedError(MegatrainError):
    """A collective failed: a peer rank crashed, or did not arrive within the timeout."""

    exit_code = 4


@dataclass(frozen=True)
class Topology:
    """This process in a data-parallel job. `local` ranks per node share one host copy of the
    model state (runtime/node_heap.py); `nodes` replicate it."""
    world: int = 1
    rank: int = 0
    local: int = 1
    local_rank: int = 0
    node: int = 0
    nodes: int = 1
    run_id: str = "single"
    timeout_s: float = DEFAULT_TIMEOUT_S
    node_group: object = None    # the ranks of this node (the state's owners), the default backend: device collectives
    node_host_group: object = None   # the same ranks over gloo: host-side barriers and objects
    host_group: object = None    # a gloo group over the world: agreement, objects, barriers on the host
    mesh: object = None          # DeviceMesh of this node's ranks, dimension "shard" (for DTensor users)
    replicate_group: object = None   # this local rank on every node (HSDP: all-reduce of its gradient parts)
    # what the processes of this job share per topology (the node heap: runtime/node_heap.py), made
    # at first use by whoever needs it
    shared: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def writer(self) -> bool:
        """The rank that writes output_dir, logs and trackers (rank 0)."""
        return self.rank == 0

    @property
    def leader(self) -> bool:
        """The node's first rank: creates the node's shared memory."""
        return self.local_rank == 0

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.world} (node {self.node} of {self.nodes}, local rank {self.local_rank} "
                f"of {self.local})")


SINGLE = Topology()


def from_env() -> dict | None:
    """torchrun's variables, or None when this process was not started by a launcher."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local = int(env.get("LOCAL_WORLD_SIZE", world))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"WORLD_SIZE={env.get('WORLD_SIZE')} but the launcher's {e} is missing or not a number: "
                          "start the ranks with torchrun (torchrun --nproc-per-node N -m megacompile.cli train "
                          "config.yaml).") from None
    if world % local:
        raise ConfigError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: every node must run "
                          "the same number of ranks (torchrun --nproc-per-node).")
    return {"world": world, "rank": rank, "local": local, "local_rank": local_rank, "node": rank // local,
            "nodes": world // local, "run_id": env.get("TORCHELASTIC_RUN_ID") or ""}


def backend_for(device: torch.device) -> str:
    """The process group backend: gloo for the host side always, NCCL for CUDA tensors when this
    torch has it (the CPU wheel does not: "cpu:gloo,cuda:nccl" fails there)."""
    import torch.distributed as dist
    if device.type == "cuda" and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    if device.type == "cuda":
        raise ConfigError("more than one rank on CUDA needs NCCL, which this torch build lacks: install a CUDA build "
                          "of torch.")
    return "cpu:gloo"


def setup(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> Topology:
    """The Topology of this process: from torchrun's environment (initialising the default
    process group if nobody did), from an already-initialised default group (library use),
    else SINGLE. Also splits the host's cores between the node's ranks (torchrun sets
    OMP_NUM_THREADS=1, which would leave the host optimizer one core per rank)."""
    import torch.distributed as dist
    env = from_env()
    if env is None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return SINGLE
    if not dist.is_available():   # pragma: no cover - every supported torch has it
        raise ConfigError("this torch build has no torch.distributed: run one process.")
    if dist.is_initialized() and dist.distributed_c10d._get_default_group() in _CURRENT:
        return _CURRENT[dist.distributed_c10d._get_default_group()]
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        kwargs = {}
        if device.type == "cuda":
            torch.cuda.set_device(env["local_rank"])
            kwargs["device_id"] = torch.device("cuda", env["local_rank"])
        dist.init_process_group(backend_for(device), timeout=timeout, **kwargs)
    if env is None:   # library use: a group started by the caller, one node assumed unless LOCAL_WORLD_SIZE says
        world, rank = dist.get_world_size(), dist.get_rank()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        env = {"world": world, "rank": rank, "local": local, "local_rank": rank % local, "node": rank // local,
               "nodes": world // local, "run_id": ""}
    host_group = dist.new_group(backend="gloo", timeout=timeout)
    _check_nodes(env, host_group)
    # shard within a node (its ranks share the state), replicate across nodes: torchrun numbers
    # ranks node by node, so a node's ranks are consecutive. (Groups made here, not by
    # init_device_mesh, whose subgroups would take torch's default timeout, not ddp_timeout.)
    spans = [list(range(n * env["local"], (n + 1) * env["local"])) for n in range(env["nodes"])]
    # (new_group is collective: every rank makes every node's groups, in the same order)
    node_groups = [dist.new_group(ranks, timeout=timeout) for ranks in spans]
    node_host_groups = [dist.new_group(ranks, backend="gloo", timeout=timeout) for ranks in spans]
    # the same local rank on every node: its parts of the state are replicas (HSDP: their
    # gradients are all-reduced after each node's reduce-scatter)
    replicas = [dist.new_group([n * env["local"] + r for n in range(env["nodes"])], timeout=timeout)
                for r in range(env["local"])]
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh.from_group(node_groups[env["node"]], device.type, mesh=spans[env["node"]],
                                 mesh_dim_names=("shard",))
    ids = [env["run_id"] or uuid.uuid4().hex]
    dist.broadcast_object_list(ids, src=0, group=host_group)   # one name for the node heap's files
    threads = max(1, len(os.sched_getaffinity(0)) // env["local"]) if hasattr(os, "sched_getaffinity") else 1
    torch.set_num_threads(threads)
    topo = Topology(env["world"], env["rank"], env["local"], env["local_rank"], env["node"], env["nodes"],
                    ids[0], timeout_s, node_groups[env["node"]], node_host_groups[env["node"]], host_group, mesh,
                    replicas[env["local_rank"]])
    log.info("data parallel: %s, %d host threads", topo.describe(), threads)
    _CURRENT[dist.distributed_c10d._get_default_group()] = topo
    return topo


#: default process group -> its Topology (made once per group: its subgroups are collective to make)
_CURRENT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def current(device: torch.device) -> Topology:
    """The Topology of the initialised default process group (set up on first use), or SINGLE."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return SINGLE
    topo = _CURRENT.get(dist.distributed_c10d._get_default_group())
    return topo if topo is not None else setup(device)


def _check_nodes(env: dict, group) -> None:
    """Every rank of a node must be on one machine (they share its memory): torchrun numbers
    ranks node by node, so ranks [n*local, (n+1)*local) share a boot id and a launcher."""
    import torch.distributed as dist
    me = (socket.gethostname(), _boot_id(), os.environ.get("GROUP_RANK", "0"))
    seen = [None] * env["world"]
    dist.all_gather_object(seen, me, group=group)
    for n in range(env["nodes"]):
        members = seen[n * env["local"]:(n + 1) * env["local"]]
        if len({m[1:] for m in members}) > 1:
            raise ConfigError(f"ranks {n * env['local']}-{(n + 1) * env['local'] - 1} should share one machine but run "
                              f"on {sorted({m[0] for m in members})}: launch one torchrun per machine with "
                              "--nproc-per-node set to its GPU count.")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:   # pragma: no cover - not Linux
        return socket.gethostname()


def end(topo: Topology) -> None:
    """Leave the job cleanly: a last barrier, then the process group goes."""
    import torch.distributed as dist
    if topo.enabled and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier(group=topo.host_group)
        dist.destroy_process_group()


# collectives on the host ---------------------------------------------------------------
@contextlib.contextmanager
def collective(topo: Topology, what: str):
    """Turn a failed collective into a DistributedError saying what went wrong."""
    try:
        yield
    except MegatrainError:
        raise
    except RuntimeError as e:
        if not topo.enabled:
            raise
        text = str(e)
        if "imed out" in text or "Timeout" in text:
            why = (f"a peer did not arrive within {topo.timeout_s:g} s (ddp_timeout): it hangs or is much slower; "
                   "see its log")
        elif "closed by peer" in text or "Connection reset" in text or "Broken pipe" in text or "crash" in text:
            why = "a peer rank crashed or was killed: see its log for the cause"
        else:
            why = text.splitlines()[0][:300] if text else type(e).__name__
        raise DistributedError(f"{topo.describe()}: {what} failed: {why}.") from None


def all_gather_into(out: torch.Tensor, part: torch.Tensor, group, async_op: bool = False):
    """out <- every rank's `part`, in rank order (in place when `part` is out's own slice); with
    `async_op`, the work to wait for."""
    import torch.distributed as dist
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # (renamed in torch 2.13)
    return fn(out, part, group=group, async_op=async_op)


def reduce_scatter_into(part: torch.Tensor, full: torch.Tensor, group) -> None:
    """part <- this rank's slice of the sum of every rank's `full`."""
    import torch.distributed as dist
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor   # (renamed in torch 2.13)
    fn(part, full, group=group)


def all_sum(topo: Topology, values: list[float], what: str = "an all-reduce", group=None) -> list[float]:
    """The sums over the world (or `group`) of a few host scalars (float64), in one all-reduce."""
    if not topo.enabled:
        return list(values)
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    with collective(topo, what):
        dist.all_reduce(t, group=group if group is not None else topo.host_group)
    return t.tolist()


def barrier(topo: Topology, what: str = "a barrier", group=None) -> None:
    if not topo.enabled:
        return
    import torch.distributed as dist
    with collective(topo, what):
        dist.barrier(group=group if group is not None else topo.host_group)


def broadcast(topo: Topology, value, what: str = "a broadcast"):
    """Rank 0's `value` on every rank (a picklable host object: decisions, notes)."""
    if not topo.enabled:
        return value
    import torch.distributed as dist
    box = [value]
    with collective(topo, what):
        dist.broadcast_object_list(box, src=0, group=topo.host_group)
    return box[0]


def agree(topo: Topology, fn, *args, **kwargs):
    """Run `fn(*args, **kwargs)` on every rank. If it raised a MegatrainError on any rank, raise
    on every rank an error of the first failing rank's type, naming the ranks and its message:
    a run refused on one rank is refused on all (the same exit code everywhere)."""
    if not topo.enabled:
        return fn(*args, **kwargs)
    import torch.distributed as dist
    result, error = None, None
    try:
        result = fn(*args, **kwargs)
    except MegatrainError as e:
        error = e
    seen = [None] * topo.world
    mine = None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
    with collective(topo, "agreeing on a check"):
        dist.all_gather_object(seen, mine, group=topo.host_group)
    failed = [(r, s) for r, s in enumerate(seen) if s is not None]
    if not failed:
        return result
    if error is not None and failed[0][0] == topo.rank:
        raise error
    rank, (module, name, text) = failed[0]
    cls = _error_class(module, name)
    others = f" (and on ranks {', '.join(str(r) for r, _ in failed[1:])})" if len(failed) > 1 else ""
    raise cls(f"on rank {rank}{others}: {text}") from None


def _error_class(module: str, name: str) -> type:
    import importlib
    try:
        cls = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, MegatrainError):
            return cls
    except (ImportError, AttributeError):
        pass
    return MegatrainError
