"""`megatrain train` on vision-language models: image data (LLaMA-Factory's `images` column and
`<image>` markers) through the processor, the language stack compiled by megatrain and the vision
tower eager (frozen or trained), checkpoints and resume, and the HF export.

Tiny LLaVA and Qwen2.5-VL models with a byte-level BPE tokenizer trained in-process (offline).
Qwen2.5-VL's processor needs torchvision for its video half, which has no CPU build on this
machine's registry; its tests use the real Qwen2-VL image processor and token expansion with the
video half left out (`ImagesOnlyQwenProcessor`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megacompile.cli import main
from megacompile.train.hparams.config import from_mapping
from megacompile.train.data import CHATML, IGNORE, build_examples, collate
from megacompile.train.data.images import ImageError, image_inputs
from megacompile.train.trainer import LOG_NAME, load_model, train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)


def _tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    texts = [line for f in EXAMPLES.glob("*.json*") for line in f.read_text().splitlines()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=1, special_tokens=SPECIAL)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  bos_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def _special(tok) -> dict:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    return dict(vocab_size=len(tok), eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|im_end|>"],
                bos_token_id=ids["<|endoftext|>"]), ids


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    """A tiny LLaVA (CLIP tower on 8x8 images in 2x2 patches: 16 image tokens) and its processor."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    path = tmp_path_factory.mktemp("llava")
    tok = _tokenizer()
    special, ids = _special(tok)
    images = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=2, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(path)
    cfg = LlavaConfig(text_config={**TEXT, **special, "model_type": "llama"},
                      vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2,
                                         projection_dim=16),
                      image_token_id=ids["<image>"], vision_feature_layer=-1, **special)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(cfg).save_pretrained(path)
    return path


def config(model_dir, tmp_path, **kw):
    base = dict(model_name_or_path=str(model_dir), dataset="mllm_demo", dataset_dir=str(EXAMPLES),
                output_dir=str(tmp_path / "out"), cutoff_len=128, per_device_train_batch_size=2,
                learning_rate=1e-3, max_steps=3, logging_steps=1, save_steps=2, device="cpu", seed=0)
    return from_mapping({**base, **kw})


def test_llava_image_examples_expand_and_mask(llava_dir, tmp_path):
    cfg = config(llava_dir, tmp_path)
    model, tok, processor = load_model(cfg, torch.device("cpu"))
    images = image_inputs(cfg, model, processor)
    examples, counts = build_examples(cfg, tok, images)
    assert len(examples) == 12 and counts["dropped"] == 0
    image_id = model.config.image_token_id
    for ex in examples:
        assert ex.images and sum(t == image_id for t in ex.input_ids) == 16   # one 8x8 image, CLS dropped
        assert all(y == IGNORE for t, y in zip(ex.input_ids, ex.labels) if t == image_id)
    batch = collate(examples[:2], tok.pad_token_id, images=images)
    assert batch["pixel_values"].shape == (2, 3, 8, 8)
    # train_on_prompt trains the prompt text, never the image tokens
    on_prompt = build_examples(config(llava_dir, tmp_path, train_on_prompt=True), tok, images)[0][0]
    assert all(y == IGNORE for t, y in zip(on_prompt.input_ids, on_prompt.labels) if t == image_id)
    assert sum(y != IGNORE for y in on_prompt.labels) > sum(y != IGNORE for y in examples[0].labels)


def log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]


def vision_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "vision_tower" in k or "projector" in k}


@pytest.mark.parametrize("vision", ["frozen", "train"])
def test_llava_trains_from_config_and_exports(llava_dir, tmp_path, vision):
    """4 steps on the sample image data: finite losses, the vision tower moves only with
    vision: train, and the exported folder reloads with its processor to the trained weights."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    state = train(config(llava_dir, tmp_path, vision=vision, max_steps=4), progress=False)
    out = tmp_path / "out"
    assert state["step"] == 4 and all(math.isfinite(r["loss"]) for r in log_rows(out))
    before = vision_weights(AutoModelForImageTextToText.from_pretrained(llava_dir))
    after = vision_weights(AutoModelForImageTextToText.from_pretrained(out))
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert (len(moved) > 0) == (vision == "train"), moved[:3]
    assert AutoProcessor.from_pretrained(out).image_processor.crop_size == {"height": 8, "width": 8}


def test_llava_resume_continues_like_the_uninterrupted_run(llava_dir, tmp_path):
    """Interrupted after step 2 and resumed (vision tower trained): the same losses and weights."""
    from safetensors.torch import load_file
    full = train(config(llava_dir, tmp_path / "a", vision="train", max_steps=4), progress=False)
    train(config(llava_dir, tmp_path / "b", vision="train", max_steps=4), progress=False, stop_at_step=2)
    resumed = train(config(llava_dir, tmp_path / "b", vision="train", max_steps=4, resume_from_checkpoint=True),
                    progress=False)
    assert resumed["step"] == full["step"] == 4
    a, b = log_rows(tmp_path / "a" / "out"), log_rows(tmp_path / "b" / "out")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    wa = load_file(str(tmp_path / "a" / "out" / "checkpoint-4" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "out" / "checkpoint-4" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_image_data_errors(llava_dir, tmp_path, capsys):
    """Marker/image mismatches, missing and corrupt files, images for a text-only model, packing."""
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    ok = {"role": "user", "content": "<image>Describe it."}, {"role": "assistant", "content": "A shape."}
    cases = {
        "two_markers": ([{"role": "user", "content": "<image><image>Describe."}, ok[1]], ["x.png"],
                        "2 <image> markers but 1 images"),
        "missing": (list(ok), ["images/none.png"], "does not exist"),
        "corrupt": (list(ok), ["images/broken.png"], "cannot be read"),
    }
    info = {}
    for name, (messages, images, _) in cases.items():
        (data / f"{name}.json").write_text(json.dumps([{"messages": messages, "images": images}]))
        info[name] = {"file_name": f"{name}.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                               "assistant_tag": "assistant"}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    cfg = config(llava_dir, tmp_path, dataset_dir=str(data))
    model, tok, processor = load_model(cfg, torch.device("cpu"))
    images = image_inputs(cfg, model, processor)
    for name, (_, _, message) in cases.items():
        with pytest.raises(ImageError, match=message):
            build_examples(config(llava_dir, tmp_path, dataset_dir=str(data), dataset=name), tok, images)
    assert main(["train", str(_yaml(tmp_path, llava_dir, packing=True)), "--no-progress"]) == 2
    assert "packing: true with the vision-language model" in capsys.readouterr().err


def _yaml(tmp_path, model_dir, **kw) -> Path:
    import yaml
    cfg = {**dict(model_name_or_path=str(model_dir), dataset="mllm_demo", dataset_dir=str(EXAMPLES), cutoff_len=128,
                  max_steps=1, device="cpu", output_dir=str(tmp_path / "y")), **kw}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_images_for_a_text_only_model_are_refused(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = _tokenizer()
    special, _ids = _special(tok)
    path = tmp_path / "llama"
    tok.save_pretrained(path)
    LlamaForCausalLM(LlamaConfig(**TEXT, **special)).save_pretrained(path)
    assert main(["train", str(_yaml(tmp_path, path)), "--no-progress"]) == 2
    assert "text-only model" in capsys.readouterr().err


# Qwen2.5-VL ---------------------------------------------------------------------------------
def _qwen_processor(tok):
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImagesOnlyQwenProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without its video half (which needs torchvision)."""

        def __init__(self, image_processor, tokenizer):   # (no super().__init__: it would build the video processor)
            self.image_processor, self.tokenizer = image_processor, tokenizer
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

        def save_pretrained(self, path, **kw):
            self.tokenizer.save_pretrained(path)
            self.image_processor.save_pretrained(path)

    # 16x16 images (image_max_pixels) in 2x2 patches, merged 2x2: 16 image tokens
    images = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=1, merge_size=2, min_pixels=16,
                                      max_pixels=32 * 32)
    return ImagesOnlyQwenProcessor(images, tok)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    path = tmp_path_factory.mktemp("qwen_vl")
    tok = _tokenizer()
    special, ids = _special(tok)
    cfg = Qwen2_5_VLConfig(
        text_config={**TEXT, **special, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=1, window_size=4,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], **special)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(path)
    processor = _qwen_processor(tok)
    processor.save_pretrained(path)
    return path, processor


def test_qwen2_5_vl_first_step_loss_equals_eager(qwen_dir, tmp_path, monkeypatch):
    """Images wrapped in vision start/end, 3-D positions from mm_token_type_ids and the grids:
    the first logged loss equals eager Qwen2.5-VL on the same batch, and training goes on."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from megacompile.train.data import Order
    path, processor = qwen_dir
    monkeypatch.setattr(AutoProcessor, "from_pretrained", lambda *a, **k: processor)
    cfg = config(path, tmp_path, image_max_pixels=16 * 16, learning_rate=1e-2)
    model, tok, proc = load_model(cfg, torch.device("cpu"))
    images = image_inputs(cfg, model, proc)
    examples, _ = build_examples(cfg, tok, images)
    first = examples[0].input_ids
    k = first.index(model.config.vision_start_token_id)
    assert first[k + 17] == model.config.vision_end_token_id
    assert set(first[k + 1: k + 17]) == {model.config.image_token_id}
    batch = collate([examples[i] for i in Order(len(examples), 2, cfg.seed).next()], tok.pad_token_id, images=images)
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8]] * 2
    assert (batch["mm_token_type_ids"] == 1).sum() == 32
    eager = AutoModelForImageTextToText.from_pretrained(path)(**batch).loss.item()

    state = train(cfg, progress=False)
    rows = log_rows(tmp_path / "out")
    assert state["step"] == 3 and rows[0]["loss"] == pytest.approx(eager, rel=1e-5)
    assert rows[-1]["loss"] < rows[0]["loss"]
