"""Vision-language models train their language stack with megatrain, with image inputs.

For Qwen2.5-VL (window-attention vision tower, 3-D rotary positions) and LLaVA (CLIP tower +
projector): 3 AdamW steps of `megacompile.vlm.compile(model, vision=...)` match eager
`model(**batch)` with the vision tower frozen or trained (fp32 losses rtol 1e-4, weights 1e-4),
the language stack lowers one layer body, and its resident weights stay within the slot budget.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForImageTextToText, LlavaConfig, Qwen2_5_VLConfig

import megacompile
from conftest import Fp32MasterReference
from megacompile import vlm

VOCAB, IMAGE = 160, 150
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def qwen2_5_vl_batch(g, b, s):
    """4x4 patches per image -> 4 image tokens after the 2x2 merge, between vision start/end."""
    ids = torch.randint(3, 140, (b, s), generator=g)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = 152, IMAGE, 153
    return dict(input_ids=ids, pixel_values=torch.randn(b * 16, 12, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]] * b), mm_token_type_ids=(ids == IMAGE).int())


def llava_batch(g, b, s):
    """An 8x8 image in 2x2 patches -> 16 image tokens (the CLS feature is dropped)."""
    ids = torch.randint(3, 140, (b, s), generator=g)
    ids[:, 1:17] = IMAGE
    return dict(input_ids=ids, pixel_values=torch.randn(b, 3, 8, 8, generator=g))


VLMS = {
    "qwen2_5_vl": (lambda: Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=1, window_size=4,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153),
        qwen2_5_vl_batch),
    "llava": (lambda: LlavaConfig(
        text_config={**TEXT, "model_type": "llama"},
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=2, projection_dim=16),
        image_token_id=IMAGE, vision_feature_layer=-1), llava_batch),
}


def tiny_vlm(name, dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(VLMS[name][0]()).to(dtype).train()


def vlm_batch(name, step, b=2, s=24, pad=0):
    g = torch.Generator().manual_seed(step)
    batch = VLMS[name][1](g, b, s)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, s - pad:] = 0   # right padding: the image tokens stay in place
    labels = batch["input_ids"].clone()
    labels[batch["input_ids"] == IMAGE] = -100
    labels[mask == 0] = -100
    return {**batch, "attention_mask": mask, "labels": labels}


def run(name, call, opt, steps):
    losses = []
    for i in range(steps):
        loss = call(**vlm_batch(name, i, pad=i)).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def frozen_copy(model, vision):
    ref = copy.deepcopy(model)
    if vision == "frozen":
        for mod in vlm.vision_modules(ref).values():
            mod.requires_grad_(False)
    return ref


@pytest.mark.parametrize("vision", ["frozen", "train"])
@pytest.mark.parametrize("name", sorted(VLMS))
def test_vlm_language_stack_trains_like_eager(name, vision):
    model = tiny_vlm(name)
    ref = frozen_copy(model, vision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    slots = 2
    cmodel = vlm.compile(model, vision=vision, options={"device": "cpu", "slots": slots, "debug_residency": True})
    params = [p for p in model.parameters() if p.requires_grad]
    ours = run(name, cmodel, torch.optim.AdamW(params, lr=1e-3), 3)
    theirs = run(name, ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3), 3)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=0)
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=lambda m: f"{pname}: {m}")
    vision_names = [n for n in before if n.startswith(tuple(vlm.vision_modules(model)))]
    moved = [n for n in vision_names if not torch.equal(before[n], dict(model.named_parameters())[n])]
    assert (len(moved) > 0) == (vision == "train"), moved
    s = megacompile.stats(cmodel.compiled)
    assert s["layers"] == 2 and s["distinct_layer_bodies"] == 1 and s["distinct_backward_layer_bodies"] == 1
    layers = model.model.language_model.layers
    largest = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    outer = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".layers." not in n and n not in vision_names)
    assert s["peak_device_weight_bytes"] <= slots * max(largest, outer)
    assert s["compiled_graphs"] <= 2   # the padding change may specialise once


@pytest.mark.parametrize("name", sorted(VLMS))
def test_vlm_trains_in_bf16_with_fp32_masters(name):
    model = tiny_vlm(name, torch.bfloat16)
    ref = Fp32MasterReference(frozen_copy(model, "frozen"), lr=1e-3)
    cmodel = vlm.compile(model, vision="frozen", options={"device": "cpu"})
    ours = run(name, cmodel, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3), 2)
    theirs = run(name, ref, ref, 2)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1.6e-2, atol=1e-2)
    trained = [p for p in model.parameters() if p.requires_grad]
    diff = torch.cat([(megacompile.master_weight(p) - m).detach().abs().flatten()
                      for p, m in zip(trained, ref.masters)])
    assert diff.max() <= 2 * 2 * 1e-3 and diff.mean() < 1e-4, (diff.max(), diff.mean())


def test_vlm_compiled_directly_says_how():
    model = tiny_vlm("qwen2_5_vl")
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    with pytest.raises(Exception, match="megacompile.vlm.compile"):
        cmodel(**vlm_batch("qwen2_5_vl", 0), use_cache=False)


def test_vlm_refuses_text_models_and_unknown_modes():
    from transformers import AutoModelForCausalLM, LlamaConfig
    text = AutoModelForCausalLM.from_config(LlamaConfig(**TEXT))
    with pytest.raises(megacompile.UnsupportedModelError, match="compile it directly"):
        vlm.compile(text)
    with pytest.raises(megacompile.ConfigError, match="frozen, train"):
        vlm.compile(tiny_vlm("llava"), vision="partial")
