"""`megatrain train` on long documents (`stage: pt`): a block of several thousand tokens trains
with the layer checkpoints on the host and the MLPs tiled, and a million-token cutoff_len is a
valid config."""
from __future__ import annotations

import json

from test_train import config, tiny_dir  # noqa: F401 (a fixture)

from megacompile.train.hparams.config import from_mapping
from megacompile.train.trainer import train


def test_pretraining_on_one_long_document(tiny_dir, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    data.mkdir()
    words = " ".join(f"token{i % 97} line{i % 13}" for i in range(6000))
    (data / "book.jsonl").write_text(json.dumps({"text": words}) + "\n")
    (data / "dataset_info.json").write_text(json.dumps({"book": {"file_name": "book.jsonl",
                                                                 "columns": {"prompt": "text"}}}))
    cfg = config(tiny_dir, tmp_path, stage="pt", dataset="book", dataset_dir=str(data), cutoff_len=4096,
                 per_device_train_batch_size=1, max_steps=1, save_steps=1,
                 offload_checkpoints="always", mlp_tiles=4)   # (backend options are top-level keys)
    state = train(cfg, progress=False)
    assert state["step"] == 1 and 4000 <= state["trained_tokens"] <= 4095


def test_a_million_token_cutoff_len_is_a_valid_config(tmp_path):
    cfg = from_mapping({"model_name_or_path": "m", "output_dir": str(tmp_path / "o"), "dataset": "d",
                        "stage": "pt", "cutoff_len": 1 << 20, "packing": True})
    assert cfg.cutoff_len == 1 << 20
