"""The rows of benchmarks/peers.py, each run in its own process (`peers.py ... --row NAME`).

Every row trains the same model (overlap.py's SHAPES, random weights) on the same tokens with
the same optimizer maths: AdamW (lr 1e-5, betas 0.9/0.999, eps 1e-8, weight decay 0.01, no
clipping) on fp32 master weights, bf16 compute, per-layer activation checkpointing. The limit
and the peers compute the loss in token chunks (`chunked_loss`): megatrain's fused LM head +
loss keeps no whole logits either, and a 128K vocabulary's fp32 logits at 32K-64K tokens alone
would not fit beside the model.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import megacompile
import overlap   # (benchmarks/, on the path when peers.py runs as a script)
from eager_baseline import checkpoint_every_layer

# Host optimizer traffic per parameter per step, counted from each optimizer's passes (not
# measured): megatrain's HostAdamW reads master, grad, m, v and writes master, m, v and the bf16
# transfer copy in one pass (runtime/adamw.py); torch's fused AdamW reads p, g, m, v and writes
# p, m, v (FSDP2 ships the fp32 master itself); DeepSpeedCPUAdam the same, then ZeRO-3 copies the
# fp32 partition into its bf16 one (read 4, write 2).
HOST_OPT = {"megatrain": "30 (theory)", "fsdp2-offload": "28 (theory)", "deepspeed-zero3-offload": "34 (theory)"}


def row_args(args, **changes) -> argparse.Namespace:
    """The namespace overlap.py's functions read, from peers.py's arguments."""
    values = dict(model=args.model, layers=args.layers, dtype="bf16", slots=args.slots, lowering=args.lowering,
                  attention=args.attention, max_grad_norm=0.0, warmup=args.warmup, steps=args.steps)
    values.update(changes)
    return argparse.Namespace(**values)


def chunked_loss(lm, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The causal LM loss of `ids` (labels = ids, shifted, mean over tokens, as the model's own)
    with the LM head and cross-entropy run per `chunk` tokens under checkpointing."""
    hidden = lm.model(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, lm.config.hidden_size)
    labels = ids[:, 1:].reshape(-1)

    def piece(h, y):
        return F.cross_entropy(lm.lm_head(h).float(), y, reduction="sum")
    total = sum(checkpoint(piece, hidden[i:i + chunk], labels[i:i + chunk], use_reentrant=False)
                for i in range(0, labels.numel(), chunk))
    return total / labels.numel()


class LossModel(torch.nn.Module):
    """The causal LM with its chunked loss as forward: FSDP2's root and DeepSpeed's engine
    wrap this module, so their hooks see the LM head's calls."""

    def __init__(self, lm, chunk: int):
        super().__init__()
        self.lm, self.chunk = lm, chunk

    def forward(self, ids):
        return chunked_loss(self.lm, ids, self.chunk)


def count_params(args, layers: int) -> int:
    return sum(p.numel() for p in overlap.build(row_args(args, layers=layers), "meta").parameters())


def limit_layers(args, device, tokens: int) -> int:
    """The most layers (up to --layers) whose GPU-resident step fits: about 18 B/param (bf16
    weights and grads, fp32 masters, grads and moments) plus the checkpoints and one layer's
    recompute; --limit-layers N forces N."""
    if args.limit_layers or device.type != "cuda":
        return args.limit_layers or args.layers
    shape = overlap.SHAPES[args.model]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    room = 0.88 * torch.cuda.get_device_properties(device).total_memory
    one, two = count_params(args, 1), count_params(args, 2)
    for layers in range(args.layers, 0, -1):
        params = one + (layers - 1) * (two - one)
        need = 18 * params + tokens * (2 * hidden * layers + 12 * inter + 24 * hidden)
        if need <= room:
            return layers
    return 1


def limit_row(args, device, data):
    layers = limit_layers(args, device, data.numel())
    a = row_args(args, layers=layers)
    model, step = overlap.limit_step(a, device, data, loss=lambda m, d: chunked_loss(m, d, args.loss_chunk))
    note = f"{layers} of {args.layers} layers (GPU memory)" if layers != args.layers else ""
    return model, step, {"layers": layers, "h2d": 0, "d2h": 0, "host_opt": "0", "note": note}


def megatrain_row(args, device, data, overlap_mode):
    model, step = overlap.megatrain_step(row_args(args), device, data, overlap_mode, overlap.ENGINE)

    def extra():
        s = megacompile.stats(model)
        return {"h2d": s.get("h2d_bytes"), "d2h": s.get("d2h_bytes")}
    return model, step, {"host_opt": HOST_OPT["megatrain"], "extra": extra,
                         "note": f"lowering {args.lowering}, attention {args.attention}"}


def _init_process_group(device) -> None:
    import torch.distributed as dist
    store = tempfile.NamedTemporaryFile(prefix="peers_pg_", delete=False).name
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)


def fsdp2_row(args, device, data):
    """FSDP2 on one GPU: fully_shard per decoder layer and on the root, fp32 parameters offloaded
    to (pinned) host memory by CPUOffloadPolicy, bf16 compute with fp32 gradient reduction, and
    torch's AdamW on the host parameters. On the CPU (a dry run) there is nothing to offload to:
    the same sharding under gloo without the policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    _init_process_group(device)
    mesh = init_device_mesh(device.type, (1,))
    lm = overlap.build(row_args(args, dtype="fp32"), device)   # (fp32 masters: the shards FSDP2 keeps)
    checkpoint_every_layer(lm)
    model = LossModel(lm, args.loss_chunk)
    policy = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy() if device.type == "cuda" else OffloadPolicy())
    for layer in lm.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    # (fused: one multi-threaded pass per tensor, torch's fastest AdamW on host tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def step():
        overlap.sync(device)
        t0 = time.perf_counter()
        model(data).backward()
        overlap.sync(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        overlap.sync(device)
        t2 = time.perf_counter()
        return {"step": t2 - t0, "fwd_bwd": t1 - t0, "optimizer": t2 - t1}
    layer_params = sum(p.numel() for p in lm.model.layers.parameters())
    total = sum(p.numel() for p in model.parameters())
    # (theory: each unshard copies the fp32 shard up and casts it on the GPU; layers are unsharded
    # for the forward and again for recompute + backward, the root once; fp32 gradients come down)
    offload = device.type == "cuda"
    h2d = f"~{(8 * layer_params + 4 * (total - layer_params)) / total:.1f} (theory)" if offload else "n/a (no offload)"
    return lm, step, {"h2d": h2d, "d2h": "~4 (theory)" if offload else "n/a (no offload)",
                      "host_opt": HOST_OPT["fsdp2-offload"],
                      "note": "" if offload else "CPU run: gloo, no CPUOffloadPolicy (nothing to offload to)"}


def deepspeed_config(batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10**9, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                       "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                  "offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}}}


def deepspeed_row(args, device, data):
    """DeepSpeed ZeRO-3, parameters and optimizer offloaded to pinned host memory, bf16 with its
    fp32 master partitions, DeepSpeedCPUAdam in AdamW mode (what the config's "AdamW" becomes
    with the optimizer offloaded), torch checkpointing per decoder layer."""
    import deepspeed
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False)
    lm = overlap.build(row_args(args), device)
    checkpoint_every_layer(lm)
    model = LossModel(lm, args.loss_chunk)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(data.shape[0]))
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in lm.parameters())

    def step():
        overlap.sync(device)
        t0 = time.perf_counter()
        engine.backward(engine(data))
        overlap.sync(device)
        t1 = time.perf_counter()
        engine.step()
        overlap.sync(device)
        t2 = time.perf_counter()
        return {"step": t2 - t0, "fwd_bwd": t1 - t0, "optimizer": t2 - t1}
    # (theory: a bf16 fetch per use, forward, recompute and backward unless kept between the last two)
    optimizer = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
    return lm, step, {"params": params, "h2d": "~4-6 (theory)", "d2h": "~2 (theory)",
                      "host_opt": HOST_OPT["deepspeed-zero3-offload"],
                      "note": f"deepspeed {deepspeed.__version__}, {optimizer}"}


ROWS = {"limit": limit_row,
        "megatrain": lambda a, d, x: megatrain_row(a, d, x, False),
        "megatrain+bwd": lambda a, d, x: megatrain_row(a, d, x, "backward"),
        "fsdp2-offload": fsdp2_row,
        "deepspeed-zero3-offload": deepspeed_row}


def run_row(args, name: str, result_path: str) -> None:
    """Build row `name`, time --warmup + --steps steps, and write what is known to `result_path`
    (JSON) after each step, so a row its timeout cuts short still reports the steps it ran."""
    if args.deepspeed_site and name.startswith("deepspeed"):
        import sys
        sys.path.append(args.deepspeed_site)   # (after the image's own packages: only what it lacks)
    device = torch.device(args.device)
    torch.manual_seed(0)
    data = torch.randint(0, overlap.SHAPES[args.model]["vocab_size"], (args.tokens // args.seq, args.seq),
                         device=device)
    result = {"row": name, "layers": args.layers, "times": [], "first": None,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    def save():
        result["host_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if device.type == "cuda":
            result["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        with open(result_path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(result_path + ".tmp", result_path)
    try:
        t = time.perf_counter()
        model, step, info = ROWS[name](args, device, data)
        extra = info.pop("extra", None)
        result.update(info)
        result.setdefault("params", sum(p.numel() for p in model.parameters()))
        result["build_s"] = time.perf_counter() - t
        print(f"  {name}: built in {result['build_s']:.1f} s, {result['params'] / 1e6:.1f}M parameters", flush=True)
        save()

        for i in range(args.warmup + args.steps):
            parts = step()
            if i == 0:   # (compiles, autotuning and first-touch allocations land here)
                result["first"] = parts["step"]
                print(f"  {name}: first step {parts['step']:.2f} s", flush=True)
            elif i >= args.warmup:
                result["times"].append(parts)
            if extra:
                result.update(extra())
            save()
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        save()
        raise
