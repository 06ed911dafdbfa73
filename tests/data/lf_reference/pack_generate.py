"""Write pack_reference.json: LLaMA-Factory 0.9.5's packed examples (tests/test_lf_pack.py
compares megatrain's packing with them).

Run with LLaMA-Factory's interpreter, on the SmolLM2 tokenizer saved as generate.py says:

    /work/lfenv/bin/python tests/data/lf_reference/pack_generate.py /tmp/smollm2_tok

sft: the records of records.json's alpaca_en_demo, identity and sharegpt_multiturn (concatenated
in that order, as mix_strategy concat), converted by LF's converters and tokenized by
`datasets.Dataset.map(PackedSupervisedDatasetProcessor.preprocess_dataset, batched=True,
batch_size=preprocessing_batch_size)`, LF's own call (loader._get_preprocessed_dataset), with
neat_packing (DataArguments lowers cutoff_len by one). Each pack is stored without LF's padding
(attention_mask 0). pt: pt_generate.py's texts through PretrainDatasetProcessor the same way,
with a small preprocessing_batch_size, so each batch drops its own remainder.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETS = ["alpaca_en_demo", "identity", "sharegpt_multiturn"]
SFT_CASES = [dict(template="qwen", cutoff_len=64, neat_packing=True, preprocessing_batch_size=1000),
             dict(template="qwen", cutoff_len=64, neat_packing=True, preprocessing_batch_size=4),
             dict(template="qwen", cutoff_len=160, neat_packing=True, preprocessing_batch_size=5)]
PT_CASES = [dict(cutoff_len=8, preprocessing_batch_size=2), dict(cutoff_len=8, preprocessing_batch_size=1000)]


def _batches(rows: list[dict], size: int):
    """The column batches datasets.map(batched=True, batch_size=size) hands the processor (one
    process): `size` rows at a time, in order. (Called directly: Arrow cannot infer one schema for
    the packed processor's packing_params.)"""
    for k in range(0, len(rows), size):
        part = rows[k:k + size]
        yield {c: [r[c] for r in part] for c in part[0]}


def _aligned(args) -> list[dict]:
    from llamafactory.data.converter import AlpacaDatasetConverter, SharegptDatasetConverter
    from llamafactory.data.parser import DatasetAttr
    records = json.loads((HERE / "records.json").read_text())
    out = []
    for name in SETS:
        spec = records[name]["attr"]
        attr = DatasetAttr("file", dataset_name=name)
        attr.join(spec)
        convert = (SharegptDatasetConverter if spec.get("formatting") == "sharegpt" else AlpacaDatasetConverter)(
            attr, args)
        rows = records[name]["records"]
        keys = {k for r in rows for k in r}
        out += [convert({k: r.get(k) for k in keys}) for r in rows]
    return out


def sft_case(case: dict, tokenizer_dir: str) -> dict:
    from transformers import AutoTokenizer
    from llamafactory.data import template as lf_template
    from llamafactory.data.mm_plugin import get_mm_plugin
    from llamafactory.data.processor.supervised import PackedSupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments
    args = DataArguments(**case)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    saved = copy.deepcopy(lf_template.TEMPLATES)
    try:
        template = lf_template.get_template_and_fix_tokenizer(tokenizer, args)
        template.mm_plugin = get_mm_plugin(name="base")
        processor = PackedSupervisedDatasetProcessor(template=template, tokenizer=tokenizer, processor=None,
                                                     data_args=args)
        packs = []
        for batch in _batches(_aligned(args), args.preprocessing_batch_size):
            out = processor.preprocess_dataset(batch)
            for k, mask in enumerate(out["attention_mask"]):
                keep = [i for i, m in enumerate(mask) if m != 0]
                packs.append({c: [out[c][k][i] for i in keep] for c in ("input_ids", "labels", "position_ids")})
        return {**case, "lf_cutoff_len": args.cutoff_len, "packs": packs}
    finally:
        lf_template.TEMPLATES.clear()
        lf_template.TEMPLATES.update(saved)


def pt_case(case: dict, tokenizer_dir: str) -> dict:
    from transformers import AutoTokenizer
    from llamafactory.data import template as lf_template
    from llamafactory.data.processor.pretrain import PretrainDatasetProcessor
    from llamafactory.hparams import DataArguments
    from pt_generate import TEXTS
    args = DataArguments(**case)
    args.packing = True   # (the parser's default for stage pt)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template = lf_template.get_template_and_fix_tokenizer(tokenizer, args)
    processor = PretrainDatasetProcessor(template=template, tokenizer=tokenizer, processor=None, data_args=args)
    ids = []
    documents = [{"_prompt": [{"role": "user", "content": t}]} for t in TEXTS]
    for batch in _batches(documents, args.preprocessing_batch_size):
        ids += processor.preprocess_dataset(batch)["input_ids"]
    return {**case, "input_ids": ids}


def main(tokenizer_dir: str) -> None:
    sys.path.insert(0, str(HERE))
    reference = {"sets": SETS, "sft": [sft_case(c, tokenizer_dir) for c in SFT_CASES],
                 "pt": [pt_case(c, tokenizer_dir) for c in PT_CASES]}
    (HERE / "pack_reference.json").write_text(json.dumps(reference, separators=(",", ":")))
    print([len(c["packs"]) for c in reference["sft"]], [len(c["input_ids"]) for c in reference["pt"]])


if __name__ == "__main__":
    main(sys.argv[1])
