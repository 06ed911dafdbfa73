"""Write lora_e2e_losses.json: LLaMA-Factory 0.9.5's own first losses for LoRA on the tiny Llama of
e2e_generate.py (tests/test_lora.py trains the same YAML with megatrain and compares).

Regenerate (LLaMA-Factory in /work/lfenv, not a test dependency) from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python tests/data/lf_reference/lora_e2e_generate.py /work/lfenv/bin/llamafactory-cli

It builds the same model folder and data as e2e_generate.py (its functions) and runs LF's
qwen3_full_sft.yaml with e2e_generate's CHANGES and LORA below: finetuning_type lora, rank 8 on every
linear layer, no dropout (LF's default; with dropout the two trainers draw the masks from different
generator streams), a learning rate at which the adapters move the loss within 5 steps.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LORA = {"finetuning_type": "lora", "learning_rate": "1.0e-3", "lora_rank": "8", "lora_target": "all",
        "lora_dropout": "0.0"}


def e2e():
    """e2e_generate.py as a module (build_model, write_data, lf_yaml, _run)."""
    spec = importlib.util.spec_from_file_location("lf_e2e_generate", HERE / "e2e_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(cli: str) -> None:
    gen = e2e()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        digest = gen.build_model(tmp / "model")
        gen.write_data(tmp)
        out = {"llamafactory": "0.9.5", "model_digest": digest, "max_steps": gen.MAX_STEPS, "changes": gen.CHANGES,
               "lora": LORA, "run": gen._run(cli, tmp, "lora", LORA)}
        (HERE / "lora_e2e_losses.json").write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llamafactory-cli")
