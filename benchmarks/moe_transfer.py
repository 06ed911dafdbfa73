"""Bytes moved per training step by MoE models, with and without routing-aware expert transfer.

For tiny models shaped like real MoE families (expert count and top-k of Mixtral, Qwen3-MoE,
GPT-OSS and DeepSeek-V3; small widths), prints per step: the weight bytes, the share of them
in routed experts, host-to-device and device-to-host bytes with the full transfer and with
`routed_experts=True`, their ratio, and the median CPU step time of each. The routers are
untrained (close to uniform, as load balancing makes trained routers), so the idle share of
experts is about (1 - k/E) ** tokens: routing-aware transfer saves bytes when a step has few
tokens for its expert count, and nothing once every expert gets a token.

    python benchmarks/moe_transfer.py [--tokens 8 64 512 --steps 3]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import megacompile

SHAPES = {   # model_type, config overrides (expert count and top-k of the real family)
    "mixtral (8 experts, top-2)": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3-moe (128, top-8)": ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8,
                                             "moe_intermediate_size": 32}),
    "gpt-oss (128, top-4)": ("gpt_oss", {"num_local_experts": 128, "num_experts_per_tok": 4}),
    "deepseek-v3 (256, top-8, 1 shared)": ("deepseek_v3", {
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 32,
        "first_k_dense_replace": 0, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_group": 1, "topk_group": 1}),
}
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, use_cache=False)


def build(model_type: str, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**COMMON, **overrides})).train()


def expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if p.dim() == 3 and ".experts." in n)


def measure(model, tokens: int, routed: bool, steps: int) -> tuple[dict, float]:
    megacompile.reset()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "routed_experts": routed})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, seq = (1, tokens) if tokens <= 512 else (tokens // 512, 512)
    times, figures = [], []
    for i in range(steps + 1):
        ids = torch.randint(0, COMMON["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(i))
        t0 = time.perf_counter()
        cmodel(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if i:  # the first step compiles
            times.append(time.perf_counter() - t0)
            figures.append(megacompile.stats(cmodel))
    median = {k: statistics.median(f[k] for f in figures) for k in ("h2d_bytes", "d2h_bytes")}
    return {**figures[-1], **median}, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="substrings of the shapes to run")
    args = ap.parse_args()
    print(f"{'model':36} {'tokens':>6} {'weights':>9} {'experts':>7} {'h2d full':>9} {'h2d routed':>10} "
          f"{'ratio':>5} {'d2h full':>9} {'d2h routed':>10} {'ratio':>5} {'step full':>9} {'routed':>7}")
    for label, (model_type, overrides) in SHAPES.items():
        if args.only and not any(s in label for s in args.only):
            continue
        base = build(model_type, overrides)
        share = expert_bytes(base) / sum(p.numel() * p.element_size() for p in base.parameters())
        for tokens in args.tokens:
            full, t_full = measure(copy.deepcopy(base), tokens, False, args.steps)
            ours, t_ours = measure(copy.deepcopy(base), tokens, True, args.steps)
            print(f"{label:36} {tokens:6d} {full['weight_bytes'] / 2**20:8.2f}M {share:7.0%} "
                  f"{full['h2d_bytes'] / 2**20:8.2f}M {ours['h2d_bytes'] / 2**20:9.2f}M "
                  f"{ours['h2d_bytes'] / full['h2d_bytes']:5.2f} {full['d2h_bytes'] / 2**20:8.2f}M "
                  f"{ours['d2h_bytes'] / 2**20:9.2f}M {ours['d2h_bytes'] / full['d2h_bytes']:5.2f} "
                  f"{t_full * 1e3:7.0f}ms {t_ours * 1e3:5.0f}ms", flush=True)


if __name__ == "__main__":
    main()
