"""A Hugging Face model folder's files, as `save_pretrained` writes them: the weights
(one model.safetensors, or shards of at most MAX_SHARD_SIZE and their index) and the model
files from_pretrained needs besides them (config.json, the generation config, the tokenizer's or
processor's files). Written by checkpoints, LoRA adapters and the final export alike.

    write_weights({"model.embed_tokens.weight": t, ...}, folder)
    write_model_files(model, tokenizer, folder)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"   # save_pretrained's shard size before transformers 5 (5.x writes 50 GB shards)


def write_weights(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """`tensors` as save_pretrained writes them: one model.safetensors, or shards of at most
    MAX_SHARD_SIZE and their index (huggingface_hub plans the shards, as for save_pretrained)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(folder / filename))
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_model_files(model: torch.nn.Module, saver, folder: Path) -> None:
    """config.json (with the model's architecture, as save_pretrained writes it), the generation
    config and the tokenizer's or processor's files: what from_pretrained needs besides weights."""
    import copy
    config = copy.deepcopy(model.config)   # (the live model's config is not changed)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(folder)
    if saver is not None:
        saver.save_pretrained(folder)
