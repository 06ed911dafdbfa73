"""One data processor per stage, as LLaMA-Factory's `data/processor/`: `supervised.py` (stage
sft: chat records, encoded turn by turn) and `pretrain.py` (stage pt: raw text, concatenated
into blocks), behind the small base in `base.py`. A new stage is a new processor here, not a
branch in the loader.

    processor = processor_for("sft")
    template = processor.template(config, tokenizer)
    rows = processor.encode(batch, indices, attr, config, tokenizer, template, images)
    examples, dropped = processor.examples(table, config, tokenizer, batches)
"""
from __future__ import annotations

from ....errors import ConfigError
from .base import DatasetProcessor
from .pretrain import PretrainProcessor
from .supervised import SupervisedProcessor

PROCESSORS: dict[str, type[DatasetProcessor]] = {"sft": SupervisedProcessor, "pt": PretrainProcessor}


def processor_for(stage: str) -> type[DatasetProcessor]:
    """The processor of `stage` (the config has refused any other stage before data is read)."""
    if stage not in PROCESSORS:
        raise ConfigError(f"stage={stage!r}: the data processors are {', '.join(PROCESSORS)}.")
    return PROCESSORS[stage]
