"""Write e2e_losses.json: LLaMA-Factory 0.9.5's own first losses for its qwen3_full_sft.yaml
example on a tiny Llama (tests/test_lf_e2e.py trains the same YAML with megatrain and compares).

Regenerate (LLaMA-Factory in /work/lfenv, not a test dependency) from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python tests/data/lf_reference/e2e_generate.py /work/lfenv/bin/llamafactory-cli

What it does, in megatrain's venv:
1. builds the tiny model folder with `build_model` (a 2-layer Llama, seed 0, and a byte-level BPE
   tokenizer trained on the data files below; the test builds the very same folder, and the JSON keeps
   its digest so a drifted build fails loudly instead of comparing different models);
2. writes the data folder with `write_data`: LF's data/dataset_info.json (the registry copy
   registry_dataset_info.json, all 104 entries), identity.json (LF's first two identity records,
   from records.json) and alpaca_en_demo.json (examples/data/alpaca_demo.json, 16 records);
3. writes LF's examples/train_full/qwen3_full_sft.yaml (qwen3_full_sft.yaml here, verbatim) with
   the changes of `lf_yaml` and runs `llamafactory-cli train` on it in that folder (dataset_dir
   is LF's default "data"), on the CPU, with LF's default seed (42) and its default shuffling;
4. stores the per-step losses of trainer_state.json's log_history.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[2] / "examples" / "data"
MAX_STEPS = 5

# the keys changed in LF's YAML, for both trainers: the run's length and log interval, and fp32
# (a CPU run; bf16 losses would differ in the third digit between any two implementations)
CHANGES = {"bf16": "false", "max_steps": str(MAX_STEPS), "logging_steps": "1"}
# LLaMA-Factory only: DeepSpeed is not installed there and is for GPUs (megatrain notes the key and ignores it)
LF_ONLY_DROP = ("deepspeed",)
# the runs: as the YAML is (LF's shuffled order, seed 42), and in the data's order
RUNS = {"shuffled": {}, "in_order": {"disable_shuffling": "true"}}


def lf_yaml(model_dir: str, output_dir: str, lf: bool, extra: dict[str, str] | None = None) -> str:
    """qwen3_full_sft.yaml with model_name_or_path, output_dir and CHANGES set (and `extra`, e.g.
    megatrain's own keys); for LLaMA-Factory (`lf`) without the LF_ONLY_DROP keys."""
    text = (HERE / "qwen3_full_sft.yaml").read_text()
    changes = {"model_name_or_path": model_dir, "output_dir": output_dir, **CHANGES, **(extra or {})}
    lines = []
    for line in text.splitlines():
        key = line.split(":", 1)[0]
        if lf and key in LF_ONLY_DROP:
            continue
        if key in changes:
            line = f"{key}: {changes.pop(key)}"
        lines.append(line)
    lines += [f"{k}: {v}" for k, v in changes.items()]   # keys the YAML does not have
    return "\n".join(lines) + "\n"


def write_data(folder: Path) -> Path:
    """`folder`/data: LF's dataset_info.json and the two data sets the YAML names."""
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "registry_dataset_info.json", data / "dataset_info.json")
    identity = json.loads((HERE / "records.json").read_text())["identity"]["records"]
    (data / "identity.json").write_text(json.dumps(identity, indent=1))
    shutil.copy(EXAMPLES / "alpaca_demo.json", data / "alpaca_en_demo.json")
    return data


def build_model(path: Path) -> str:
    """A tiny Llama (2 layers, hidden 32) and a ChatML byte-level BPE tokenizer in `path`;
    returns the digest of the folder's files (weights, tokenizer, configs)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    path.mkdir(parents=True, exist_ok=True)
    # trained on the data it trains on only (another file's edit must not change the model)
    texts = [line for f in (HERE / "records.json", EXAMPLES / "alpaca_demo.json")
             for line in f.read_text().splitlines()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  bos_token="<|endoftext|>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return model_digest(path)


def model_digest(path: Path) -> str:
    """SHA-256 over the weights and the tokenizer's vocabulary and merges (not the JSON layout of
    the configs, which versions of transformers write differently)."""
    from safetensors.torch import load_file
    h = hashlib.sha256()
    for name, tensor in sorted(load_file(str(path / "model.safetensors")).items()):
        h.update(name.encode() + tensor.float().numpy().tobytes())
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    h.update(json.dumps([tokenizer["model"]["vocab"], tokenizer["model"]["merges"]], sort_keys=True).encode())
    return h.hexdigest()


def _run(cli: str, folder: Path, name: str, extra: dict[str, str]) -> dict:
    """One llamafactory-cli train run in `folder`: its logged losses, grad norms and learning rates."""
    (folder / f"{name}.yaml").write_text(lf_yaml(str(folder / "model"), str(folder / name), lf=True, extra=extra))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DISABLE_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([cli, "train", f"{name}.yaml"], cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stdout[-4000:] + done.stderr[-4000:])
    rows = json.loads((folder / name / "trainer_state.json").read_text())["log_history"]
    return {"extra": extra, "losses": [r["loss"] for r in rows if "loss" in r],
            "grad_norms": [r["grad_norm"] for r in rows if "grad_norm" in r],
            "learning_rates": [r["learning_rate"] for r in rows if "learning_rate" in r]}


def main(cli: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        digest = build_model(tmp / "model")
        write_data(tmp)
        out = {"llamafactory": "0.9.5", "model_digest": digest, "max_steps": MAX_STEPS, "changes": CHANGES,
               "lf_only_dropped": list(LF_ONLY_DROP),
               "runs": {name: _run(cli, tmp, name, extra) for name, extra in RUNS.items()}}
        (HERE / "e2e_losses.json").write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llamafactory-cli")
