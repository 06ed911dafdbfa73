"""megatrain::segment_attention (megacompile/ir_ops.py, CPU kernel runtime/kernels/
segment_attention.py): causal attention within segments from int32 segment ids [b, s], no
[s, s] mask. Against attention with the dense mask those ids stand for, in float64: outputs
and the gradients of q, k, v, for padding, packed documents, holes, sliding windows and
grouped-query heads; a padding query's output is zero."""
from __future__ import annotations

import re

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


def chunked(q, k, v, seg, window, scale, chunks, op=None):
    """The op over `chunks` query chunks of q (tensor_split's sizes: the first ones one longer),
    each against the whole K and V (`q_start`), outputs concatenated."""
    op = op or torch.ops.megatrain.segment_attention
    s = q.shape[2]
    sizes = [(s + chunks - 1 - i) // chunks for i in range(chunks)]
    starts = [sum(sizes[:i]) for i in range(chunks)]
    outs = [op(part, k, v, seg, window, scale, start) for part, start in zip(q.split(sizes, 2), starts)]
    return torch.cat([o for o, _ in outs], 2), torch.cat([lse for _, lse in outs], 2), sizes, starts


@settings(max_examples=15, deadline=None)
@given(docs=st.lists(st.integers(1, 9), min_size=1, max_size=4), left=st.integers(0, 3), hole=st.booleans(),
       window=st.sampled_from([0, 1, 2, 5]), kv_heads=st.sampled_from([1, 2, 4]), chunks=st.integers(1, 6),
       dv=st.sampled_from([None, 12]), seed=st.integers(0, 9))
def test_query_chunks_equal_the_whole_attention(docs, left, hole, window, kv_heads, chunks, dv, seed):
    """A query chunk (`q_start`) attends the whole K and V as its queries do in the whole op:
    keys before the chunk (run as an unmasked prefix merged by log-sum-exp), the chunk's own
    causally, windows cutting across chunk borders; dk and dv summed over the chunks."""
    row = [-1] * left + [n for n, length in enumerate(docs) for _ in range(length)]
    if hole and len(row) > left + 2:
        row[left + 1] = -1
    seg = ids(row)
    g = torch.Generator().manual_seed(seed)
    s = seg.shape[1]
    q, k, v = (torch.randn(1, h, s, size, generator=g, dtype=torch.float64).requires_grad_()
               for h, size in ((4, 8), (kv_heads, 8), (kv_heads, dv or 8)))
    w = torch.randn(1, 4, s, dv or 8, generator=g, dtype=torch.float64)
    out, _, *_ = chunked(q, k, v, seg, window, 0.3, min(chunks, s))
    ref = dense_reference(q, k, v, seg, window, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, e, name in zip(got, want, "qkv"):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=f"d{name}")


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, window_size_left,
                     window_size_right):
    """torch's varlen flash attention's contract on packed [T, h, d] tokens, in math (the CPU has
    no flash kernel): causal within each cu_seqlens run, aligned at the runs' ends where a query
    run is shorter than its key run, a left window in packed positions, K/V heads shared by
    groups of query heads; returns (out, lse [h, T], ...)."""
    out, lse = q.new_zeros(q.shape[:-1] + v.shape[-1:]), q.new_zeros((q.shape[1], q.shape[0]))
    groups = q.shape[1] // k.shape[1]
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qs, ks, vs = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        i, j = torch.arange(b - a)[:, None] + (d - c) - (b - a), torch.arange(d - c)[None, :]
        allowed = (j <= i) & ((i - j) <= window_size_left if window_size_left >= 0 else True)
        scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1)
        lse[:, a:b] = scores.logsumexp(-1)
    return out, lse, None, None, None


def _varlen_backward_stand_in(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *,
                              scale, window_size_left, window_size_right):
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        o = _varlen_stand_in(q_, k_, v_, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
                             window_size_left=window_size_left, window_size_right=window_size_right)[0]
        return torch.autograd.grad(o, (q_, k_, v_), dout)


@pytest.mark.parametrize("seg,window,dv", [
    (ids([0] * 12, [-1, -1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]), 0, None),   # padding, packing, rows differ
    (ids([-1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1], [0] * 12), 3, None),    # windows
    (ids([-1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, -1]), 0, 12),               # MLA: V's head size differs
    (ids([-1] * 12), 0, None),                                           # nothing to attend
])
def test_cuda_kernel_packing_on_the_cpu(monkeypatch, seg, window, dv):
    """The CUDA kernel's packing (valid tokens gathered into cu_seqlens runs, head sizes padded to
    multiples of 8, outputs, lse and gradients scattered back in the op's layouts), run on the
    CPU around a math stand-in of torch's varlen flash op: the dense mask's results."""
    from megacompile.runtime.kernels import segment_attention_cuda as cuda_kernel
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _varlen_stand_in)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", _varlen_backward_stand_in)
    g = torch.Generator().manual_seed(3)
    b, s = seg.shape
    q = torch.randn(b, s, 4, 8, generator=g, dtype=torch.float64).transpose(1, 2)   # (HF's layout)
    k = torch.randn(b, s, 2, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(b, 2, s, dv or 8, generator=g, dtype=torch.float64)
    out, lse = cuda_kernel._flash_forward(q, k, v, seg, window, 0.3)
    ref_out, ref_lse = torch.ops.megatrain.segment_attention(q, k, v, seg, window, 0.3)
    torch.testing.assert_close(out, ref_out)
    assert out.stride() == ref_out.stride()
    valid = (seg >= 0)[:, None, :].expand_as(lse)
    torch.testing.assert_close(lse[valid].double(), ref_lse[valid])   # (flash's lse is fp32: bf16 inputs)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = cuda_kernel._flash_backward(dout, q, k, v, out, lse, seg, window, 0.3)
    want = torch.ops.megatrain.segment_attention_backward(dout, q, k, v, ref_out, ref_lse, seg, window, 0.3)
    for a, e, name in zip(got, want, "qkv"):
        torch.testing.assert_close(a, e, msg=f"d{name}")
        assert a.stride() == e.stride(), name


@pytest.mark.parametrize("seg,window", [
    (ids([0] * 12, [-1, -1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]), 0),
    (ids([-1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]), 3),
])
def test_cuda_kernel_packing_of_query_chunks_on_the_cpu(monkeypatch, seg, window):
    """The CUDA kernel's packing of a query chunk: the chunk's queries against each segment's
    keys up to its last query (runs of unequal length, causal at their ends), through the math
    stand-in of torch's varlen flash op: the CPU kernel's chunks, outputs and gradients."""
    from megacompile.runtime.kernels import segment_attention_cuda as cuda_kernel
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _varlen_stand_in)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", _varlen_backward_stand_in)
    g = torch.Generator().manual_seed(5)
    b, s = seg.shape
    q, k, v = (torch.randn(b, s, h, 8, generator=g, dtype=torch.float64).transpose(1, 2) for h in (4, 2, 2))
    want_out, want_lse, sizes, starts = chunked(q, k, v, seg, window, 0.3, 3)
    got_out, got_lse, *_ = chunked(q, k, v, seg, window, 0.3, 3, op=cuda_kernel._flash_forward)
    torch.testing.assert_close(got_out, want_out)
    valid = (seg >= 0)[:, None, :].expand_as(got_lse)
    torch.testing.assert_close(got_lse[valid].double(), want_lse[valid])
    dout = torch.randn(want_out.shape, generator=g, dtype=torch.float64)
    for part, n, start in zip(range(3), sizes, starts):
        args = (dout[:, :, start:start + n], q[:, :, start:start + n], k, v, want_out[:, :, start:start + n],
                want_lse[:, :, start:start + n], seg, window, 0.3, start)
        for a, e in zip(cuda_kernel._flash_backward(*args), torch.ops.megatrain.segment_attention_backward(*args)):
            torch.testing.assert_close(a, e)


def test_cuda_fallback_tiles_backward_on_the_cpu():
    """The CUDA fallback's backward (each tile's forward recomputed under autograd through the
    public SDPA), run on the CPU: the CPU kernel's gradients."""
    from megacompile.runtime.kernels import segment_attention as tiles_kernel
    from megacompile.runtime.kernels import segment_attention_cuda as cuda_kernel
    g = torch.Generator().manual_seed(4)
    seg = ids([-1, 0, 0, -1, 0, 0, 1, 1, 1, 1, 1, 1])
    q, k, v = (torch.randn(1, h, 12, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out, lse = torch.ops.megatrain.segment_attention(q, k, v, seg, 2, 0.3)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = tiles_kernel.tiled_backward(dout, q, k, v, out, lse, seg, 2, 0.3, cuda_kernel._tile_backward)
    want = torch.ops.megatrain.segment_attention_backward(dout, q, k, v, out, lse, seg, 2, 0.3)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    seg = ids([0] * 12)   # (a query chunk whose queries see keys before it: a prefix mask)
    out, lse = torch.ops.megatrain.segment_attention(q[:, :, 5:], k, v, seg, 0, 0.3, 5)
    got = tiles_kernel.tiled_backward(dout[:, :, 5:], q[:, :, 5:], k, v, out, lse, seg, 0, 0.3,
                                      cuda_kernel._tile_backward, 5, merge=False)
    want = torch.ops.megatrain.segment_attention_backward(dout[:, :, 5:], q[:, :, 5:], k, v, out, lse, seg, 0, 0.3, 5)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


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


def _seq_by_seq(programs, seq: int) -> list[str]:
    """Values of the programs' compiled graphs and bodies with two dimensions equal to `seq`."""
    found = []
    for program in programs:
        for done in program.compiled.values():
            for gm in [done.graph, *done.bodies.values()]:
                for n in gm.graph.nodes:
                    val = n.meta.get("val")
                    if isinstance(val, torch.Tensor) and sum(int(d) == seq for d in val.shape) >= 2:
                        found.append(f"{n.name} {tuple(val.shape)}")
    return found


def _quadratic(model) -> list[str]:
    from megacompile.backend import programs_of
    return _seq_by_seq(programs_of(model), S)


def test_the_backend_selects_segment_attention_itself():
    """torch.compile(model, backend="megatrain") on an unmodified model, left-padded: the backend
    selects segment attention before Dynamo traces, so no value of any compiled body has two
    dimensions equal to the sequence length, with eager transformers' loss and gradients; the
    option attention="transformers" keeps the model's SDPA and its dense mask (the check is live)."""
    import copy

    from conftest import tiny_model
    ids, layouts = _layouts()
    kw = layouts["left"]
    labels = ids.masked_fill(kw["attention_mask"] == 0, -100)
    base = tiny_model("llama", layers=2)
    results = {}
    for choice in ("transformers", "segments"):
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        megacompile.compile_start.register()   # (reset drops Dynamo's compile-start callbacks)
        want = model(ids, labels=labels, use_cache=False, **kw).loss.item()
        model.zero_grad()
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "attention": choice})
        loss = cmodel(input_ids=ids, labels=labels, use_cache=False, **kw).loss
        loss.backward()
        results[choice] = (want, loss.item(), _quadratic(model), model.config._attn_implementation)
    assert results["transformers"][2], "the dense-mask path should show seq x seq values (the check is live)"
    assert results["transformers"][3] == "sdpa"
    assert results["segments"][2] == [], results["segments"][2]
    assert results["segments"][3] == "megatrain_segment"
    assert results["segments"][1] == pytest.approx(results["segments"][0], rel=1e-5)
    assert results["segments"][1] == pytest.approx(results["transformers"][1], rel=1e-5)


def test_a_compile_right_after_a_dynamo_reset_still_gets_segment_attention(caplog):
    """torch._dynamo.reset() drops the compile-start callback, so the first trace keeps
    transformers' attention; the backend then selects segment attention and has Dynamo trace the
    frame again (compile_start.Retrace): the compiled graph holds no seq x seq value, one graph,
    the loss equal to eager's, and the log says what happened."""
    import copy
    import logging

    from conftest import tiny_model
    ids, layouts = _layouts()
    kw = layouts["left"]
    labels = ids.masked_fill(kw["attention_mask"] == 0, -100)
    model = tiny_model("llama", layers=2)
    want = copy.deepcopy(model)(input_ids=ids, labels=labels, use_cache=False, **kw).loss.item()
    torch._dynamo.reset()
    megacompile.compile_start.unregister()   # (what torch._dynamo.reset() itself does to it)
    with caplog.at_level(logging.INFO, logger="megatrain.compile"):
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        loss = cmodel(input_ids=ids, labels=labels, use_cache=False, **kw).loss
        loss.backward()
    assert "traced without megatrain's compile-start callback" in caplog.text and "segment attention" in caplog.text
    assert model.config._attn_implementation == "megatrain_segment"
    assert _quadratic(model) == [] and megacompile.stats(cmodel)["compiled_graphs"] == 1
    assert loss.item() == pytest.approx(want, rel=1e-5)


def test_attention_option_is_checked():
    from megacompile.errors import ConfigError
    from megacompile.options import Options
    with pytest.raises(ConfigError, match="option attention='flash'.*'segments'.*'transformers'"):
        Options.from_mapping({"attention": "flash"})


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_families_segment_attention_cannot_run_keep_theirs_and_say_why(family, caplog):
    """The two families segment attention cannot run (softcapping, sinks) keep transformers'
    attention, say why, and train like eager, left-padded. (Every other family trains through
    segment attention in tests/test_families.py, which checks the selection too.)"""
    import copy
    import logging

    from families import tiny_family_model
    from conftest import batch
    from megacompile import attention
    from megacompile.errors import UnsupportedModelError
    ref = tiny_family_model(family)
    ours = copy.deepcopy(ref)
    ids, mask, labels = batch(2, 8, seed=0, pad_left=2)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    want.backward()
    torch._dynamo.reset()
    megacompile.compile_start.register()
    with caplog.at_level(logging.INFO, logger="megacompile.compile_start"):
        cmodel = torch.compile(ours, backend="megatrain", options={"device": "cpu"})
        got = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    implementation = ours.config.get_text_config(decoder=True)._attn_implementation
    assert implementation != attention.NAME
    assert re.search("keeps transformers' attention .*(softcaps|sinks)", caplog.text), caplog.text
    with pytest.raises(UnsupportedModelError, match="softcaps|sinks"):
        attention.use(ours)


@pytest.mark.parametrize("preset,seq", [("llama-3-8b", 65537), ("qwen2.5-7b", 32771)])
def test_plans_hold_no_seq_by_seq_value_at_long_sequences(preset, seq):
    """`inspect`/`plan` capture the model on the meta device with the attention a real run
    selects: at 64K tokens no planned value of any graph or body has two dimensions equal to the
    sequence (the dense mask was 4 GiB per bool copy there), and the prologue's transient is
    O(seq) (was 12 GiB for three mask tensors)."""
    from megacompile.inspect import build_meta_model, capture_program
    model, _ = build_meta_model(preset, 2, torch.bfloat16)
    program = capture_program(model, 1, seq, 2)
    assert _seq_by_seq([program], seq) == []
    prologue = program.compiled["forward"].body(0)
    assert program.compiled["forward"].plan.transient[program.compiled["forward"].body_of[0]] < 64 * seq * 64, \
        prologue.graph


def test_no_op_of_a_training_step_allocates_a_seq_by_seq_tensor():
    """At 1000 tokens (no other dimension of the model is 1000), left-padded and with packed
    documents: a dispatch mode inside megatrain's executor (where the compiled bodies run)
    records every op output; none has two dimensions equal to the sequence. The same check on the
    model compiled with transformers' attention finds its dense mask (the check is live)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from conftest import tiny_model
    from megacompile.runtime.executor import DirectionRunner
    seq = 1000

    class Shapes(TorchDispatchMode):
        supports_higher_order_operators = True   # (run_and_save_rng_state in the bodies: run as is)

        def __init__(self):
            super().__init__()
            self.found = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and sum(d == seq for d in t.shape) >= 2:
                    self.found.add(f"{func} {tuple(t.shape)}")
            return out

    ids = torch.randint(3, 100, (2, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :300] = 0
    packed = torch.cat([torch.arange(400), torch.arange(600)])[None].expand(2, seq)
    found = {}
    original = DirectionRunner.__call__
    for choice in ("segments", "transformers"):
        probe = Shapes()

        def call(runner, args):
            with probe:
                return original(runner, args)
        torch._dynamo.reset()
        model = tiny_model("llama", layers=2, max_position_embeddings=2 * seq)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "attention": choice})
        DirectionRunner.__call__ = call
        try:
            for kw in ({"attention_mask": mask}, {"position_ids": packed}):
                cmodel(input_ids=ids, labels=ids, use_cache=False, **kw).loss.backward()
        finally:
            DirectionRunner.__call__ = original
        found[choice] = probe.found
    assert found["transformers"], "transformers' attention should show its dense mask"
    assert found["segments"] == set(), found["segments"]
