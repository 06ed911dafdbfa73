"""Hypothesis strategies: random decoder-style models (layer stacks) for property tests.

A model is an embedding, an `nn.ModuleList` of blocks, a final norm and a head. Blocks differ in
width and op mix (several layer kinds), may add skip connections from earlier layers, and the
head may be tied to the embedding, and blocks may share modules (several layers reading the
same weights). Everything is small enough that
one compile + step takes a second or two.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

VOCAB = 64


@dataclass(frozen=True)
class BlockSpec:
    kind: str          # "mlp" | "gated" | "attn"
    inner: int         # inner width
    skip_from: int     # -1: none, else add the output of that earlier layer (long skip)


@dataclass(frozen=True)
class StackSpec:
    hidden: int
    blocks: tuple[BlockSpec, ...]
    tie_head: bool
    bias: bool
    share: bool = False  # mlp blocks of equal width reuse the first one's projections (Zamba2-like)


class Block(nn.Module):
    def __init__(self, hidden: int, spec: BlockSpec, bias: bool):
        super().__init__()
        self.spec = spec
        self.norm = nn.LayerNorm(hidden)
        if spec.kind == "attn":
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
            self.proj = nn.Linear(hidden, hidden, bias=bias)
        else:
            self.up = nn.Linear(hidden, spec.inner, bias=bias)
            if spec.kind == "gated":
                self.gate = nn.Linear(hidden, spec.inner, bias=False)
            self.down = nn.Linear(spec.inner, hidden, bias=bias)

    def forward(self, x):
        h = self.norm(x)
        if self.spec.kind == "attn":
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            h = self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        elif self.spec.kind == "gated":
            h = self.down(F.silu(self.gate(h)) * self.up(h))
        else:
            h = self.down(torch.tanh(self.up(h)))
        return x + h


class RandomStack(nn.Module):
    def __init__(self, spec: StackSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(VOCAB, spec.hidden)
        self.layers = nn.ModuleList(Block(spec.hidden, b, spec.bias) for b in spec.blocks)
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, VOCAB, bias=False)
        if spec.tie_head:
            self.head.weight = self.embed.weight
        if spec.share:
            owners: dict[int, Block] = {}
            for block in self.layers:
                if block.spec.kind == "mlp":
                    owner = owners.setdefault(block.spec.inner, block)
                    block.up, block.down = owner.up, owner.down

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        outs = []
        for block in self.layers:
            x = block(x)
            if block.spec.skip_from >= 0:
                x = x + 0.5 * outs[block.spec.skip_from]
            outs.append(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB).float(), labels.view(-1))


@st.composite
def stack_specs(draw, max_layers: int = 5) -> StackSpec:
    hidden = draw(st.sampled_from([8, 16, 24]))
    n = draw(st.integers(1, max_layers))
    blocks = []
    for i in range(n):
        kind = draw(st.sampled_from(["mlp", "gated", "attn"]))
        inner = draw(st.sampled_from([hidden, 2 * hidden, 3 * hidden]))
        skip = draw(st.integers(-1, i - 1)) if i > 0 and draw(st.booleans()) else -1
        blocks.append(BlockSpec(kind, inner, skip))
    return StackSpec(hidden, tuple(blocks), draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))


def stack_and_batch(spec: StackSpec, seed: int):
    """The model of `spec` with weights from `seed`, and a batch (ids, labels) drawn from it."""
    torch.manual_seed(seed)
    model = RandomStack(spec)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 6), generator=g)
    labels = torch.randint(0, VOCAB, (2, 6), generator=g)
    return model, ids, labels


def compiled_step(model: nn.Module, ids, labels, options: dict):
    """One forward + backward of `model` under torch.compile(backend="megatrain") on the CPU
    (Dynamo reset first: each model compiles afresh); the loss."""
    torch._dynamo.reset()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", **options})
    loss = cmodel(ids, labels)
    loss.backward()
    return loss
