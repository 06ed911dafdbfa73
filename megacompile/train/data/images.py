"""Images in training data, for vision-language models (LLaMA-Factory's convention).

A record lists its image files in the `images` column (paths relative to `media_dir`, which
defaults to `dataset_dir`) and marks where each goes with `<image>` in the text:

    {"messages": [{"role": "user", "content": "<image>What shape is this?"},
                  {"role": "assistant", "content": "A red square."}],
     "images": ["images/red_square.png"]}

Records without markers get theirs at the start of the first user turn. Each marker becomes the
model's own image markup, expanded to as many image tokens as the processor will make features
(Qwen-VL: `<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>`; LLaVA: N x `<image>`), so
the conversation is tokenized and masked like text; image tokens are never trained on. At batch
time the images are loaded again and processed into `pixel_values` (+ grids) for the vision
tower, and `mm_token_type_ids` for models that place images by token type (Qwen-VL's 3-D
rotary positions). An example whose image tokens `cutoff_len` would cut is dropped.
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch

from ...errors import MegatrainError

MARKER = "<image>"


class ImageError(MegatrainError, ValueError):
    """An image is missing, unreadable, or does not match its `<image>` markers."""


class ImageInputs:
    """Turns `<image>` markers and image files into a VLM's token markup and batch inputs."""

    def __init__(self, processor, model, media_dir: str | Path, max_pixels: int, min_pixels: int):
        if not hasattr(processor, "image_processor"):
            raise ImageError(f"{type(processor).__name__} has no image processor: the model folder must hold the "
                             "VLM's processor files (preprocessor_config.json), as saved by processor.save_pretrained.")
        self.processor = processor
        self.media_dir = Path(media_dir)
        self.max_pixels, self.min_pixels = max_pixels, min_pixels
        config = model.config
        self.image_token_id = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
        tok = processor.tokenizer
        start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
        # Qwen-VL wraps each image's tokens in vision start/end tokens; LLaVA does not
        self.wrap = (tok.convert_ids_to_tokens(start), tok.convert_ids_to_tokens(end)) if start and end else ("", "")
        self.token_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters

    # -- files --------------------------------------------------------------------------------
    def load(self, path: str):
        from PIL import Image, UnidentifiedImageError
        full = Path(path) if Path(path).is_absolute() else self.media_dir / path
        try:
            image = Image.open(full).convert("RGB")
        except FileNotFoundError:
            raise ImageError(f"image {str(full)!r} does not exist (image paths are relative to media_dir, "
                             f"{str(self.media_dir)!r}).") from None
        except (UnidentifiedImageError, OSError) as e:
            raise ImageError(f"image {str(full)!r} cannot be read ({e}): is the file complete?") from None
        pixels = image.width * image.height
        if pixels > self.max_pixels or pixels < self.min_pixels:   # bound the tokens per image
            scale = math.sqrt((self.max_pixels if pixels > self.max_pixels else self.min_pixels) / pixels)
            image = image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))))
        return image

    def process(self, paths: list[str]) -> dict[str, torch.Tensor]:
        return dict(self.processor.image_processor(images=[self.load(p) for p in paths], return_tensors="pt"))

    # -- text ---------------------------------------------------------------------------------
    def expand(self, messages: list[dict], images: list[str], name: str) -> tuple[list[dict], int]:
        """`messages` with every `<image>` replaced by its image's token markup; the image tokens."""
        markers = sum(m["content"].count(MARKER) for m in messages)
        if markers == 0:
            first = next(i for i, m in enumerate(messages) if m["role"] == "user")
            messages = [dict(m) for m in messages]
            messages[first]["content"] = MARKER * len(images) + messages[first]["content"]
            markers = len(images)
        if markers != len(images):
            raise ImageError(f"data set {name!r}: a record has {markers} {MARKER} markers but {len(images)} images "
                             f"({images!r:.200}): put one {MARKER} where each image goes.")
        inputs = self.process(images)
        markup = [self.wrap[0] + self.processor.replace_image_token(inputs, i) + self.wrap[1]
                  for i in range(len(images))]
        tokens = sum(self.count(self.processor.tokenizer(m, add_special_tokens=False)["input_ids"]) for m in markup)
        out, k = [], 0
        for m in messages:
            parts = m["content"].split(MARKER)
            text = parts[0]
            for part in parts[1:]:
                text += markup[k] + part
                k += 1
            out.append({**m, "content": text})
        return out, tokens

    def count(self, input_ids: list[int]) -> int:
        return sum(1 for t in input_ids if t == self.image_token_id)

    # -- batches ------------------------------------------------------------------------------
    def batch(self, paths: list[str], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The vision inputs of a batch whose examples hold `paths` (in order)."""
        out = self.process(paths) if paths else {}
        if self.token_types:
            out["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        return out


def image_inputs(config, model, processor) -> ImageInputs | None:
    """The image handling for a VLM run (None for a text-only model)."""
    from ...vlm import is_vlm
    if processor is None or not is_vlm(model):
        return None
    return ImageInputs(processor, model, config.media_dir or config.dataset_dir, config.image_max_pixels,
                       config.image_min_pixels)
