"""Vision-language models: train the language stack with megatrain, images included.

    from megacompile import vlm
    cmodel = vlm.compile(model, vision="frozen", options={"device": "cuda"})
    out = cmodel(**processor(text=..., images=..., return_tensors="pt"), labels=labels)
    out.loss.backward()

Why a wrapper: a VLM's vision tower cannot be captured in one graph (Qwen2.5-VL sizes its
windows with `grid_thw.tolist()`, its 3-D rotary positions come from a Python loop over
images), and it is small (0.4-0.7B parameters against 7-72B in the language stack). So the
vision tower and the multimodal projector run eagerly on the device, and the compiled model
(embeddings, every decoder layer, final norm, LM head and loss: one graph, streamed layer by
layer from host memory) receives their output through transformers' `mm_encoder_outputs`:

    pixel_values ──vision tower + projector (eager, on the device)──> image features ─┐
    input_ids ──────────────────────── compiled model: embed, scatter features, layers, head, loss
    (Qwen-VL) input_ids, grids ──3-D rotary positions (eager)──> position_ids ────────┘

`vision="frozen"` stops the vision parameters' gradients (and runs the tower without autograd);
`vision="train"` lets the gradient of the image features flow back from the compiled graph into
the tower, whose parameters then stay on the device and are updated there by your optimizer
(in their own dtype: cast the tower to fp32 first for fp32 updates). The language stack's
weights, fp32 masters and optimizer state live in the host store as for any decoder-only model.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .errors import ConfigError, UnsupportedModelError
from .options import Options

VISION_MODES = ("frozen", "train")
# batch keys the vision side consumes (they never reach the compiled graph)
_VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes",
                "second_per_grid_ts")


def is_vlm(model: nn.Module) -> bool:
    """A transformers vision-language model: its base model encodes images for the language stack."""
    base = getattr(model, "model", None)
    return base is not None and hasattr(base, "get_image_features") and hasattr(base, "language_model")


def vision_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of the base model that are not the language stack (vision tower, projector)."""
    base = model.model
    text = base.language_model
    return {f"model.{name}": mod for name, mod in base.named_children()
            if mod is not text and any(True for _ in mod.parameters())}


def store_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters megatrain keeps in its host store: all of them, except a VLM's vision side,
    which lives on the device."""
    if not is_vlm(model):
        return list(model.parameters())
    vision = {id(p) for m in vision_modules(model).values() for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in vision]


class VisionLanguageModel(nn.Module):
    """`model` with its language stack compiled by megatrain and its vision side run eagerly."""

    def __init__(self, model: nn.Module, vision: str = "frozen", options: dict | None = None):
        super().__init__()
        if not is_vlm(model):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a transformers vision-language model (no model.get_image_features "
                "and model.language_model); compile it directly: torch.compile(model, backend='megatrain').")
        if vision not in VISION_MODES:
            raise ConfigError(f"vision={vision!r}: use one of {', '.join(VISION_MODES)}.")
        self.model = model
        self.vision = vision
        self.device = Options.from_mapping(options).torch_device
        for mod in vision_modules(model).values():
            if vision == "frozen":
                mod.requires_grad_(False)
            mod.to(self.device)  # small: it lives on the device, outside the host store
        # not a registered submodule: the state dict stays the model's own
        self.__dict__["compiled"] = torch.compile(model, backend="megatrain", options=options)

    def encode(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The compiled model's arguments: `batch` with its images (and videos) replaced by their
        encoder outputs and, for models with 3-D rotary positions, the positions precomputed."""
        base = self.model.model
        kwargs = {k: v for k, v in batch.items() if k not in _VISION_KEYS}
        encoded = {}
        grad = torch.enable_grad() if self.vision == "train" and torch.is_grad_enabled() else torch.no_grad()
        with grad:
            for kind, key, method in (("image", "pixel_values", "get_image_features"),
                                      ("video", "pixel_values_videos", "get_video_features")):
                if batch.get(key) is not None:
                    encoded[kind] = self._features(getattr(base, method), batch, key)
        if encoded:
            kwargs["mm_encoder_outputs"] = encoded
        if kwargs.get("position_ids") is None and hasattr(base, "compute_3d_position_ids"):
            positions = base.compute_3d_position_ids(
                input_ids=batch.get("input_ids"), image_grid_thw=batch.get("image_grid_thw"),
                video_grid_thw=batch.get("video_grid_thw"), second_per_grid_ts=batch.get("second_per_grid_ts"),
                inputs_embeds=None, attention_mask=batch.get("attention_mask"), cache=None,
                mm_token_type_ids=batch.get("mm_token_type_ids"))
            if positions is not None:
                kwargs["position_ids"] = positions
        kwargs["use_cache"] = False
        return kwargs

    def _features(self, method, batch: dict[str, Any], key: str):
        from transformers.modeling_outputs import BaseModelOutputWithPooling
        params = inspect.signature(method).parameters
        args = {next(iter(params)): batch[key].to(self.device)}  # pixel_values / pixel_values_videos
        config = self.model.config
        for name in params:
            if name in args or name == "kwargs":
                continue
            if batch.get(name) is not None:
                value = batch[name]
                args[name] = value.to(self.device) if isinstance(value, torch.Tensor) else value
            elif getattr(config, name, None) is not None:  # e.g. LLaVA's vision_feature_layer
                args[name] = getattr(config, name)
        out = method(**args, return_dict=True)
        features = out.pooler_output
        if not isinstance(features, torch.Tensor):
            # one tensor, not one per image: the number of images per batch must not change the
            # graph's input count (each change would recompile the whole model)
            features = torch.cat(list(features), dim=0)
        return BaseModelOutputWithPooling(pooler_output=[features])

    def forward(self, **batch):
        kwargs = self.encode(batch)
        # transformers checks "image tokens == image features" with a tensor condition; Dynamo
        # needs scalar capture to keep that check in the graph instead of breaking it.
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return self.compiled(**kwargs)


def compile(model: nn.Module, vision: str = "frozen", options: dict | None = None) -> VisionLanguageModel:  # noqa: A001
    """Compile a transformers VLM for training: language stack by megatrain, vision side eager."""
    return VisionLanguageModel(model, vision=vision, options=options)
