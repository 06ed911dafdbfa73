"""megatrain::segment_attention (megacompile/ir_ops.py, CPU kernel runtime/kernels/
segment_attention.py): causal attention within segments from int32 segment ids [b, s], no
[s, s] mask. Against attention with the dense mask those ids stand for, in float64: outputs
and the gradients of q, k, v, for padding, packed documents, holes, sliding windows and
grouped-query heads; a padding query's output is zero."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megacompile  # noqa: F401  (registers the kernels)


def dense_reference(q, k, v, seg, window, scale):
    """softmax(q k^T) v under the mask the ids describe: same segment, causal, in the window."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = seg.shape[1]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0) & (j <= i)
    if window > 0:
        allowed &= (i - j) < window
    valid = seg >= 0
    allowed |= (~valid[:, :, None]) & (i == j)   # (a padding row attends itself; its output is zeroed)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v) * valid[:, None, :, None]


def check(seg, window=0, heads=4, kv_heads=2, d=8, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    b, s = seg.shape
    q, k, v = (torch.randn(b, h, s, size, generator=g, dtype=torch.float64).requires_grad_()
               for h, size in ((heads, d), (kv_heads, d), (kv_heads, dv or d)))
    w = torch.randn(b, heads, s, dv or d, generator=g, dtype=torch.float64)
    scale = d ** -0.5
    out, lse = torch.ops.megatrain.segment_attention(q, k, v, seg, window, scale)
    ref = dense_reference(q, k, v, seg, window, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert lse.shape == (b, heads, s) and lse.dtype == torch.float64
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, e, name in zip(got, want, "qkv"):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=f"d{name}")


def ids(*rows):
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("seg,window", [
    (ids([0] * 12), 0),                                           # one sequence
    (ids([-1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0]), 0),           # left padding
    (ids([0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1]), 0),          # right padding
    (ids([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]), 0),              # three packed documents
    (ids([0, 0, -1, 0, 0, 0, 1, 1, 1, -1, 1, 1]), 0),            # holes inside segments
    (ids([0] * 12, [-1, -1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]), 0),  # rows of a batch differ
    (ids([0] * 12), 4),                                           # sliding window
    (ids([-1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]), 3),             # window, padding, packing
])
def test_segment_attention_equals_the_dense_mask(seg, window):
    check(seg, window)


@pytest.mark.parametrize("dv", [4, 12])
def test_value_head_size_may_differ(dv):
    """MLA (DeepSeek-V3, Kimi): V's head size differs from Q's and K's."""
    check(ids([-1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]), 0, dv=dv)
    check(ids([0] * 12), 3, dv=dv)


@settings(max_examples=15, deadline=None)
@given(docs=st.lists(st.integers(1, 9), min_size=1, max_size=4), left=st.integers(0, 3), right=st.integers(0, 3),
       window=st.sampled_from([0, 1, 2, 5]), kv_heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 9))
def test_segment_attention_over_random_layouts(docs, left, right, window, kv_heads, seed):
    row = [-1] * left + [n for n, length in enumerate(docs) for _ in range(length)] + [-1] * right
    check(ids(row), window, kv_heads=kv_heads, seed=seed)


def test_its_graph_holds_no_seq_by_seq_tensor():
    """Traced, the op is one node with O(s) outputs: the fake shapes hold no [s, s] value."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(1, 4, 4096, 8)
        kv = torch.empty(1, 2, 4096, 8)
        out, lse = torch.ops.megatrain.segment_attention(q, kv, kv, torch.empty(1, 4096, dtype=torch.int32), 0, 0.3)
    assert out.shape == q.shape and lse.shape == (1, 4, 4096)


# the transformers side: megacompile/attention.py ---------------------------------------------
S = 24   # (no other dimension of the tiny model is 24: a [.., 24, 24] value is a seq x seq one)


def _pair(family="llama"):
    import copy

    from conftest import tiny_model
    from megacompile import attention
    ref = tiny_model(family, layers=2)
    ours = copy.deepcopy(ref)
    attention.use(ours)
    return ref, ours


def _layouts():
    ids = torch.randint(3, 100, (2, S), generator=torch.Generator().manual_seed(0))
    left = torch.ones(2, S, dtype=torch.long)
    left[1, :7] = 0
    right = torch.ones(2, S, dtype=torch.long)
    right[1, S - 5:] = 0
    packed = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]),
                          torch.cat([torch.arange(5), torch.arange(9), torch.arange(10)])])
    return ids, {"none": {}, "left": {"attention_mask": left}, "right": {"attention_mask": right},
                 "packed": {"position_ids": packed}}


@pytest.mark.parametrize("layout", ["none", "left", "right", "packed"])
def test_segment_attention_model_equals_transformers_sdpa(layout):
    """Segment ids from transformers' own mask rule: the same logits on every real token as its
    dense-mask SDPA path (packed rows: as if each document ran alone), and the same gradients."""
    ref, ours = _pair()
    ids, layouts = _layouts()
    kw = layouts[layout]
    real = kw.get("attention_mask", torch.ones(2, S, dtype=torch.long)).bool()
    labels = ids.masked_fill(~real, -100)
    want, got = ref(ids, labels=labels, use_cache=False, **kw), ours(ids, labels=labels, use_cache=False, **kw)
    torch.testing.assert_close(got.logits[real], want.logits[real], rtol=1e-5, atol=1e-5)
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    if layout == "packed":   # each document alone, with the reference model
        alone = torch.cat([ref(ids[0:1, :10], use_cache=False).logits, ref(ids[0:1, 10:], use_cache=False).logits], 1)
        torch.testing.assert_close(got.logits[0:1], alone, rtol=1e-5, atol=1e-5)


def test_compiled_with_segment_attention_no_value_is_seq_by_seq():
    """Through megatrain's backend, left-padded: the loss and gradients of eager transformers, and
    no value of any compiled body has two dimensions equal to the sequence length (the dense
    mask path has several: checked on the same model with transformers' SDPA)."""
    from megacompile.backend import programs_of

    def quadratic(model) -> list[str]:
        found = []
        for program in programs_of(model):
            for done in program.compiled.values():
                graphs = [done.graph, *done.bodies.values()]
                for gm in graphs:
                    for n in gm.graph.nodes:
                        val = n.meta.get("val")
                        if isinstance(val, torch.Tensor) and sum(int(d) == S for d in val.shape) >= 2:
                            found.append(f"{n.name} {tuple(val.shape)}")
        return found

    ids, layouts = _layouts()
    kw = layouts["left"]
    labels = ids.masked_fill(kw["attention_mask"] == 0, -100)
    losses = {}
    for name, model in zip(("ref", "ours"), _pair()):
        torch._dynamo.reset()
        eager_loss = model(ids, labels=labels, use_cache=False, **kw).loss.item()
        model.zero_grad()
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        loss = cmodel(input_ids=ids, labels=labels, use_cache=False, **kw).loss
        loss.backward()
        losses[name] = (eager_loss, loss.item(), quadratic(model))
    assert losses["ref"][2], "the dense-mask path should show seq x seq values (the check is live)"
    assert losses["ours"][2] == [], losses["ours"][2]
    assert losses["ours"][1] == pytest.approx(losses["ours"][0], rel=1e-5)
    assert losses["ours"][1] == pytest.approx(losses["ref"][1], rel=1e-5)


@pytest.mark.parametrize("family", sorted(__import__("families").FAMILIES))
def test_every_family_trains_through_segment_attention(family):
    """The family matrix with segment attention, left-padded, through megatrain's backend: the
    loss and gradients of eager transformers; the two it cannot run are refused by name."""
    import copy

    from families import tiny_family_model
    from conftest import batch
    from megacompile import attention
    from megacompile.errors import UnsupportedModelError
    ref = tiny_family_model(family)
    ours = copy.deepcopy(ref)
    if family in ("gemma2", "gpt_oss"):
        with pytest.raises(UnsupportedModelError, match="softcaps|sinks"):
            attention.use(ours)
        return
    attention.use(ours)
    ids, mask, labels = batch(2, 8, seed=0, pad_left=2)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    want.backward()
    cmodel = torch.compile(ours, backend="megatrain", options={"device": "cpu"})
    got = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
