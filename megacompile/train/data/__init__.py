"""The training data, as LLaMA-Factory reads it: the registry (registry.py: dataset_info.json),
the sources (sources.py: files or the Hub, sampled and mixed), the converters and the encoding of
one record (records.py, encode.py, templates.py, jinja_template.py, tool_formats.py, images.py),
the stage's processor (processor/: supervised for sft, pretrain for pt),
the tokenized cache (tokenize_cache.py), the train/eval split (split.py), packing
(packing.py), streaming (stream.py) and the examples of a run (loader.py: build_examples, the
batches and their order). It reads the config (hparams) and nothing else of the training
package.

`megacompile.train.data`'s names are loader.py's (the module this package was).
"""
from .loader import (  # noqa: F401
    ATTR_KEYS, DataError, DatasetAttr, load_registry, FILE_TYPES, data_path, hub_reachable, alpaca_messages,
    sharegpt_messages, check_conversation, record_tools, chat_template, encode_chat, pretrain_tokens, pt_separator,
    packs, data_cutoff_len, encode_record, ALPACA_COLUMNS, SHAREGPT_COLUMNS, UNMAPPED_IGNORED, SHAREGPT_TAGS,
    PT_COLUMNS, CHATML, check_datasets, skip_summary, data_template, build_examples, examples_of, fingerprint,
    pack, show_example, PAD_MULTIPLE, padded_length, collate, SEQUENCE_INPUTS, lengths_vary, run_batches,
    mark_lengths_dynamic, Order)
from .examples import IGNORE, Example, Examples  # noqa: F401
