"""`megatrain train`: the training product, laid out as LLaMA-Factory's is, imports running one way:

    hparams/      the config and its keys (LLaMA-Factory's, the tier's, the schedule's)
    data/         registry, sources, converters, templates, encoding, cache, split, packing, loader
    model/        where the model comes from, which weights train (full, freeze, LoRA), its HF folder
    checkpoint/   format, files, the NVMe tier's moments, RNG state, resume checks
    trainer.py    the loop, with evaluate.py, report.py, flops.py, preflight.py, run_dir.py, ranks.py

hparams -> data -> model -> checkpoint -> the loop (tests/test_layering.py checks it).

The modules of the flat layout before it (`megacompile.train.config`, `.data`, `.lora`, ...) still
import, with a DeprecationWarning naming the new path, for one release.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: the flat layout's modules (as stop 52 shipped them) -> their place now (`data` and `checkpoint`
#: are packages that export their old module's names, so they need no entry)
MOVED = {
    "config": "hparams.config", "lf_keys": "hparams.lf_keys", "tier_keys": "hparams.tier_keys",
    "keys_help": "hparams.keys_help", "schedule": "hparams.schedule",
    "registry": "data.registry", "sources": "data.sources", "templates": "data.templates",
    "jinja_template": "data.jinja_template", "tool_formats": "data.tool_formats", "encode": "data.encode",
    "packing": "data.packing", "stream": "data.stream", "tokenize_cache": "data.tokenize_cache",
    "examples": "data.examples", "images": "data.images",
    "model_source": "model.model_source", "finetuning": "model.finetuning", "lora": "model.lora",
    "freeze": "model.freeze",
    "checkpoint_tier": "checkpoint.tier", "rng_state": "checkpoint.rng_state", "resume": "checkpoint.resume",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `megacompile.train.<old>` as the module it became (the same module object, so a
    monkeypatch through either name reaches both)."""

    def find_spec(self, name, path=None, target=None):
        old = name[len(__name__) + 1:] if name.startswith(__name__ + ".") else None
        if old not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = f"{__name__}.{MOVED[spec.name[len(__name__) + 1:]]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass   # (create_module returned the module, already run under its new name)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
