"""Where a training run's model comes from, checked in the order that fails soonest.

    source = ModelSource(config, device)   model_name_or_path resolved (a folder, a Hub id or
                                           embedded:smollm2): it exists, holds a config and weights,
                                           is a decoder-only LM; its tokenizer (and a VLM's processor)
    source.meta_model()                    the architecture on the meta device, no weights: what the
                                           host RAM and device preflights and the image markup need
    source.load()                          the weights, the slow part, once everything else is known

Every problem is a ConfigError (or UnsupportedModelError) that names the folder or id and says
what to change, never transformers' own traceback.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def checkpoint_dtype(config, device: torch.device, saved=None) -> torch.dtype:
    """torch_dtype: auto is the checkpoint's bf16/fp16 on CUDA (else bf16), float32 on the CPU."""
    if config.torch_dtype != "auto":
        return getattr(torch, config.torch_dtype)
    if device.type == "cuda":
        return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16
    return torch.float32


def _looks_like_path(source: str) -> bool:
    """Meant as a folder rather than a Hub id (`org/name`, or a bare legacy name)."""
    return (source.startswith(("/", "./", "../", "~", "\\")) or source in (".", "..") or source.count("/") > 1
            or "\\" in source or (len(source) > 1 and source[1] == ":"))


class ModelSource:
    def __init__(self, config, device: torch.device):
        self.config, self.device = config, device
        self.processor = None
        self._model = None   # embedded:smollm2 comes whole
        source = config.model_name_or_path
        if source.startswith("embedded:"):
            self._embedded(source)
            return
        path = Path(source).expanduser()
        if path.exists():
            self._check_folder(path)
        elif _looks_like_path(source):
            raise ConfigError(f"model_name_or_path={source!r}: no such folder ({path.resolve()} does not exist). "
                              "Give the folder of a Hugging Face model, or a Hub id such as Qwen/Qwen2.5-7B.")
        elif not _hub_available():
            raise ConfigError(f"model_name_or_path={source!r} is not a local folder, and the Hugging Face Hub is not "
                              "reachable from this machine (offline): download the model elsewhere and give its "
                              "folder, or set HF_HUB_OFFLINE=1 to read it from the local Hugging Face cache.")
        self._load_config(source)

    # -- small files ---------------------------------------------------------------------------
    def _embedded(self, source: str) -> None:
        if source != "embedded:smollm2":
            raise ConfigError(f"model_name_or_path={source!r}: the embedded model is embedded:smollm2.")
        from ...embedded import load_smollm2
        self._check_layers(30)
        self._model, self.tokenizer = load_smollm2(
            torch_dtype=checkpoint_dtype(self.config, self.device, torch.bfloat16), num_layers=self.config.num_layers)
        self.hf_config = self._model.config

    def _check_folder(self, path: Path) -> None:
        source = self.config.model_name_or_path
        if not path.is_dir():
            raise ConfigError(f"model_name_or_path={source!r} is a file: give the folder of a Hugging Face model "
                              "(with config.json and its weights).")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model_name_or_path={source!r}: {path} holds no config.json, so it is not a "
                              "Hugging Face model folder (save one with model.save_pretrained(folder)).")
        if not any((path / f).is_file() for f in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
            raise ConfigError(f"model_name_or_path={source!r}: {path} holds no weights (none of "
                              f"{', '.join(WEIGHT_FILES)}); copy the model's weight files into it.")

    def _load_config(self, source: str) -> None:
        from transformers import AutoConfig, AutoProcessor, AutoTokenizer

        from ...meta_model import check_decoder_only
        remote = self.config.trust_remote_code
        try:
            self.hf_config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model_name_or_path={source!r}: its config cannot be read ({_first_line(e)}).") from None
        check_decoder_only(self.hf_config, source)
        text = self.hf_config.get_text_config(decoder=True)
        self._check_layers(getattr(text, "num_hidden_layers", None))
        try:
            if self.is_vlm:   # its processor carries the tokenizer and the image processor
                self.processor = AutoProcessor.from_pretrained(source, trust_remote_code=remote)
                self.tokenizer = self.processor.tokenizer
            else:
                self.tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=remote)
        except Exception as e:   # noqa: BLE001 - tokenizers fail with OSError, ValueError, TypeError, ...
            raise ConfigError(f"model_name_or_path={source!r}: its tokenizer cannot be loaded ({_first_line(e)}); the "
                              "folder needs the tokenizer files (tokenizer.json or its vocabulary), as saved by "
                              "tokenizer.save_pretrained.") from None
        if self.config.num_layers:
            from ...presets import keep_layers
            keep_layers(self.hf_config, self.config.num_layers)

    def _check_layers(self, layers: int | None) -> None:
        n = self.config.num_layers
        if n is not None and layers is not None and n > layers:
            raise ConfigError(f"num_layers={n}, but {self.config.model_name_or_path} has {layers} decoder layers: "
                              f"use at most {layers} (or leave num_layers unset for all of them).")

    @property
    def is_vlm(self) -> bool:
        return getattr(self.hf_config, "vision_config", None) is not None

    @property
    def dtype(self) -> torch.dtype:
        return checkpoint_dtype(self.config, self.device, getattr(self.hf_config, "dtype", None))

    # -- the model -----------------------------------------------------------------------------
    def _auto(self):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        return AutoModelForImageTextToText if self.is_vlm else AutoModelForCausalLM

    def meta_model(self) -> torch.nn.Module:
        """The model's architecture on the meta device (no memory), in the dtype it will train in
        (a new one each call, also for the embedded model: the preflight applies the fine-tuning
        method to it, and load() must return the model without it)."""
        with torch.device("meta"):
            model = self._auto().from_config(self.hf_config, dtype=self.dtype,
                                             trust_remote_code=self.config.trust_remote_code)
        return model.train()

    def load(self):
        """(model, tokenizer, processor): the weights loaded, in train mode, no KV cache."""
        model = self._model
        if model is None:
            source = self.config.model_name_or_path
            try:
                model = self._auto().from_pretrained(source, config=self.hf_config, dtype=self.dtype,
                                                     trust_remote_code=self.config.trust_remote_code)
            except (OSError, ValueError, RuntimeError) as e:
                raise ConfigError(f"model_name_or_path={source!r}: its weights cannot be loaded ({_first_line(e)}). "
                                  "Check that the weight files are complete.") from None
        model.config.use_cache = False
        tokenizer = self.tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token   # padding is masked by position, never by id
        return model.train(), tokenizer, self.processor


def _hub_available() -> bool:
    from ..data.sources import hub_reachable
    return os.environ.get("HF_HUB_OFFLINE") == "1" or hub_reachable()
