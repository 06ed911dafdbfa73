"""LLaMA-Factory's own example YAML (examples/train_full/qwen3_full_sft.yaml) and its
data/dataset_info.json train end to end with `megatrain train`, and the first losses equal the
ones LLaMA-Factory 0.9.5's trainer logged for the same model, data, template, seed and order.

The reference (tests/data/lf_reference/e2e_losses.json) comes from e2e_generate.py there, which
says how to regenerate it. Only model_name_or_path, output_dir, the run's length and log
interval (max_steps, logging_steps) and bf16 (the CPU runs in fp32) are changed in the YAML, and
megatrain's own `device: cpu` is added. The data are shuffled as LF shuffles them (seed 42): the
equal losses show the same sample order too (HF's sampler draws torch.randperm(n) from a
generator seeded with seed + epoch, as megatrain's Order does). The first losses, the gradient
norms and the learning rates are compared.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megacompile.cli import main

REF = Path(__file__).resolve().parent / "data" / "lf_reference"


def _generator():
    spec = importlib.util.spec_from_file_location("lf_e2e_generate", REF / "e2e_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads((REF / "e2e_losses.json").read_text())


# shuffled: the YAML as it is (LF's seeded order); in_order: disable_shuffling: true on both sides
@pytest.mark.parametrize("run", ["shuffled", pytest.param("in_order", marks=pytest.mark.slow)])
def test_llamafactory_example_yaml_trains_with_llamafactorys_losses(tmp_path, monkeypatch, own_cache, reference,
                                                                     run):
    gen = _generator()
    want = reference["runs"][run]
    digest = gen.build_model(tmp_path / "model")
    assert digest == reference["model_digest"], "the tiny model differs from the one LLaMA-Factory trained: " \
                                                "regenerate e2e_losses.json (e2e_generate.py)"
    gen.write_data(tmp_path)
    config = tmp_path / "qwen3_full_sft.yaml"
    config.write_text(gen.lf_yaml(str(tmp_path / "model"), str(tmp_path / "out"), lf=False,
                                  extra={**want["extra"], "device": "cpu"}))
    monkeypatch.chdir(tmp_path)   # dataset_dir is LLaMA-Factory's default, "data"
    assert main(["train", str(config), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    losses = [r["loss"] for r in steps]
    assert len(losses) == reference["max_steps"]
    assert losses == pytest.approx(want["losses"], abs=5e-6), (losses, want["losses"])
    assert [r["grad_norm"] for r in steps] == pytest.approx(want["grad_norms"], rel=1e-4)
    # the schedule (LF's cosine with warmup_ratio 0.1)
    assert [r["lr"] for r in steps] == pytest.approx(want["learning_rates"], abs=1e-12)
