"""Write pt_reference.json: LLaMA-Factory 0.9.5's own `stage: pt` examples (input_ids) for a few
texts, packing and template cases (tests/test_lf_pt.py compares megatrain's examples with them).

Run with LLaMA-Factory's interpreter, on the SmolLM2 tokenizer saved as generate.py says:

    /work/lfenv/bin/python tests/data/lf_reference/pt_generate.py /tmp/smollm2_tok

Each case goes through LF's own code: DataArguments (whose __post_init__ lowers cutoff_len by one
for an explicit `packing: true`), the parser's default (packing = stage == "pt" when unset),
get_template_and_fix_tokenizer, then PretrainDatasetProcessor.preprocess_dataset over all the
texts at once (one batch, as datasets.map's default batch of 1000 is for these few texts).
`add_bos_token` cases set the tokenizer attribute LF reads (a SmolLM2 tokenizer has none).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Pre-training reads raw text: no chat template, no masks.",
         "A third document, a little longer than the others, so that the blocks cross document borders twice.",
         "Short.", "Numbers 1 2 3 and symbols <> {} are text too."]
CASES = [
    dict(cutoff_len=16),                                    # packing unset: LF packs pt, blocks of cutoff_len
    dict(cutoff_len=16, packing=True),                      # explicit: LF's blocks of cutoff_len - 1
    dict(cutoff_len=16, packing=False),                     # each document truncated
    dict(cutoff_len=12, template="llama3"),                 # the llama3 template's <|end_of_text|> separator
    dict(cutoff_len=12, template="qwen"),                   # a template that replaces EOS
    dict(cutoff_len=16, add_bos_token=True),                # each block starts with BOS
    dict(cutoff_len=16, packing=False, add_bos_token=True),  # BOS before each document
    dict(cutoff_len=4096),                                  # fewer tokens than one block: no example
]


def run_case(case: dict, tokenizer_dir: str) -> dict:
    from transformers import AutoTokenizer
    from llamafactory.data import template as lf_template
    from llamafactory.data.processor.pretrain import PretrainDatasetProcessor
    from llamafactory.hparams import DataArguments

    options = {k: v for k, v in case.items() if k not in ("add_bos_token",)}
    args = DataArguments(**options)
    if args.packing is None:   # hparams/parser.py: packing defaults to stage == "pt"
        args.packing = True
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if case.get("add_bos_token"):
        tokenizer.add_bos_token = True
    saved = copy.deepcopy(lf_template.TEMPLATES)
    try:
        template = lf_template.get_template_and_fix_tokenizer(tokenizer, args)
        processor = PretrainDatasetProcessor(template=template, tokenizer=tokenizer, processor=None, data_args=args)
        batch = {"_prompt": [[{"role": "user", "content": t}] for t in TEXTS]}
        out = processor.preprocess_dataset(batch)
        return {**case, "lf_cutoff_len": args.cutoff_len, "eos_token": tokenizer.eos_token,
                "bos_token_id": tokenizer.bos_token_id, "input_ids": out["input_ids"]}
    finally:
        lf_template.TEMPLATES.clear()
        lf_template.TEMPLATES.update(saved)


def main(tokenizer_dir: str) -> None:
    reference = {"texts": TEXTS, "cases": [run_case(c, tokenizer_dir) for c in CASES]}
    (HERE / "pt_reference.json").write_text(json.dumps(reference, ensure_ascii=False, indent=1))
    print(json.dumps([(c, len(r["input_ids"])) for c, r in zip(CASES, reference["cases"])]))


if __name__ == "__main__":
    main(sys.argv[1])
