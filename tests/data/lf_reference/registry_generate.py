"""Reference record choices of LLaMA-Factory 0.9.5 for tests/test_lf_registry.py.

Run with LLaMA-Factory's own environment (not a test dependency):

    /work/lfenv/bin/python tests/data/lf_reference/registry_generate.py

It writes registry_sampling.json: for each case (data sets of N records whose prompts are
"<set> <i>", num_samples, max_samples, mix_strategy, interleave_probs, seed), the records
LLaMA-Factory's loader chooses, in order, as [set, i] pairs. The loader runs as in a training
run: NumPy's global generator seeded with `seed` (transformers.set_seed), then
llamafactory.data.loader._get_merged_dataset on a registry in a temporary folder.
"""
import json
import tempfile
from pathlib import Path

import transformers
from llamafactory.data.loader import _get_merged_dataset
from llamafactory.hparams import DataArguments, ModelArguments

OUT = Path(__file__).with_name("registry_sampling.json")
SIZES = {"a": 7, "b": 3, "c": 12}
CASES = [
    {"dataset": "a", "num_samples": {"a": 4}},
    {"dataset": "a", "num_samples": {"a": 15}},                  # oversampled
    {"dataset": "a,c", "num_samples": {"a": 5, "c": 20}, "seed": 7},
    {"dataset": "a,b", "num_samples": {"b": 9}, "max_samples": 5},
    {"dataset": "a,b,c", "mix_strategy": "interleave_under"},
    {"dataset": "a,b,c", "mix_strategy": "interleave_over"},
    {"dataset": "a,b", "mix_strategy": "interleave_under", "interleave_probs": "0.8,0.2", "seed": 3},
    {"dataset": "a,b,c", "mix_strategy": "interleave_over", "interleave_probs": "0.2,0.5,0.3"},
    {"dataset": "c,a", "mix_strategy": "interleave_over", "num_samples": {"a": 10}, "max_samples": 8},
]


def main() -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        info = {}
        for name, n in SIZES.items():
            records = [{"instruction": f"{name} {i}", "input": "", "output": "x"} for i in range(n)]
            (Path(tmp) / f"{name}.json").write_text(json.dumps(records))
        for case in CASES:
            info = {name: {"file_name": f"{name}.json", **({"num_samples": case["num_samples"][name]}
                                                           if name in case.get("num_samples", {}) else {})}
                    for name in SIZES}
            (Path(tmp) / "dataset_info.json").write_text(json.dumps(info))
            seed = case.get("seed", 42)
            data_args = DataArguments(dataset=case["dataset"], dataset_dir=tmp, max_samples=case.get("max_samples"),
                                      mix_strategy=case.get("mix_strategy", "concat"),
                                      interleave_probs=case.get("interleave_probs"))
            training_args = transformers.Seq2SeqTrainingArguments(output_dir=str(Path(tmp) / "out"), seed=seed)
            transformers.set_seed(seed)
            ds = _get_merged_dataset(data_args.dataset, ModelArguments(model_name_or_path="none"), data_args,
                                     training_args, stage="sft")
            chosen = [p[0]["content"].split() for p in ds["_prompt"]]
            results.append({**case, "seed": seed, "sizes": SIZES, "chosen": [[s, int(i)] for s, i in chosen]})
    OUT.write_text(json.dumps(results, indent=0) + "\n")
    print(f"wrote {OUT} ({len(results)} cases)")


if __name__ == "__main__":
    main()
