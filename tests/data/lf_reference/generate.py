"""Write reference.json: LLaMA-Factory 0.9.5's own input_ids and labels for records.json.

Run with LLaMA-Factory's interpreter (not a test dependency; the tests read reference.json):

    # 1. the SmolLM2 tokenizer, saved from megatrain's venv (embedded:smollm2)
    .venv/bin/python -c "from transformers import AutoTokenizer; from megacompile import embedded as e; \\
        p = e.find_gguf(); \\
        AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained('/tmp/smollm2_tok')"
    # 2. LLaMA-Factory's encoding of every case below
    /work/lfenv/bin/python tests/data/lf_reference/generate.py /tmp/smollm2_tok

Every case uses the SmolLM2 tokenizer, whatever the template: LLaMA-Factory's
get_template_and_fix_tokenizer adds the template's stop words it lacks as new special tokens
(and may replace EOS), and megatrain's encode.prepare_tokenizer must do the same for the ids to
match. The chat_template LLaMA-Factory writes into the tokenizer (for
chatml, default, alpaca, vicuna) is stored as "chat_template_after". Each record goes through
LLaMA-Factory's own code path: its data set converter
(Alpaca/SharegptDatasetConverter: the role checks that skip malformed conversations) and
SupervisedDatasetProcessor.preprocess_dataset (template.encode_multiturn and the per-turn
truncation with infer_seqlen). A record LLaMA-Factory skips is stored as "skipped", one it
raises on as "error". Tool data is left out of templates whose tool format is llama3: that
format prints today's date.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

TEMPLATES = ["default", "empty", "alpaca", "vicuna", "llava", "chatml", "qwen", "qwen2_vl", "qwen3", "qwen3_nothink",
             "yi", "smollm", "smollm2", "cpm4", "llama2", "llama3", "llama4", "mistral", "ministral", "mistral_small",
             "gemma", "gemma2", "gemma3", "phi", "phi4", "phi4_mini", "deepseek", "deepseek3", "deepseekr1", "glm4",
             "gpt_oss", "zephyr", "olmo", "granite3", "falcon", "qwen3_5", "qwen3_5_nothink", "glm4_moe"]
LLAMA3_TOOLS = {"llama3", "llama4"}
DATASETS = ["alpaca_en_demo", "identity", "sharegpt_multiturn", "glaive_toolcall_en_demo"]
# a chat_template shaped like Qwen3's: old thoughts dropped from the history, an empty thought block
# before the last reply, a generation prompt ending in "\n" (LLaMA-Factory parses it as a reasoning
# template)
QWEN3_LIKE = (
    "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' %}"
    "{% if '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.last %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + c + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def cases() -> list[dict]:
    """(template, options, data sets): every template plainly, and the options on a few."""
    out = [dict(template=t, datasets=[d for d in DATASETS if not (t in LLAMA3_TOOLS and d.startswith("glaive"))])
           for t in TEMPLATES]
    out.append(dict(template=None, datasets=DATASETS))   # the tokenizer's own chat_template (parse_template)
    out.append(dict(template=None, datasets=["alpaca_en_demo"], default_system="Custom system prompt.",
                    cutoff_len=30))
    out.append(dict(template=None, chat_template=QWEN3_LIKE, datasets=["sharegpt_multiturn", "alpaca_en_demo"]))
    out.append(dict(template=None, chat_template=QWEN3_LIKE, datasets=["sharegpt_multiturn"], enable_thinking=False,
                    mask_history=True))
    for t in ["qwen", "qwen3", "llama3", "gemma2", "glm4", "mistral", "gpt_oss", "default"]:
        data = ["sharegpt_multiturn", "alpaca_en_demo"]
        if t not in ("gemma2", "glm4", "gpt_oss"):   # efficient_eos: train_on_prompt is refused
            out.append(dict(template=t, datasets=data, train_on_prompt=True))
        out.append(dict(template=t, datasets=data, mask_history=True))
        out.append(dict(template=t, datasets=data, cutoff_len=24))
        out.append(dict(template=t, datasets=data, cutoff_len=40, mask_history=True))
        out.append(dict(template=t, datasets=["alpaca_en_demo"], default_system="Custom system prompt."))
    for t in ["qwen3", "gpt_oss", "deepseekr1"]:
        out.append(dict(template=t, datasets=["sharegpt_multiturn", "glaive_toolcall_en_demo"], enable_thinking=False))
        out.append(dict(template=t, datasets=["sharegpt_multiturn"], enable_thinking=False, mask_history=True))
    for t, fmt in [("qwen", "default"), ("default", "qwen"), ("default", "glm4"), ("mistral", "mistral"),
                   ("qwen3", "mistral"), ("llama3", "qwen"), ("glm4", "default"), ("qwen", "qwen3_5"),
                   ("default", "glm4_moe")]:
        out.append(dict(template=t, datasets=["glaive_toolcall_en_demo"], tool_format=fmt))
    out.append(dict(template="qwen", datasets=["glaive_toolcall_en_demo"], cutoff_len=50, mask_history=True))
    # preserve_thinking: mask_history keeps the earlier replies' thoughts
    for t in ["qwen3", "deepseekr1"]:
        out.append(dict(template=t, datasets=["sharegpt_multiturn"], mask_history=True, preserve_thinking=True))
    out.append(dict(template=None, chat_template=QWEN3_LIKE, datasets=["sharegpt_multiturn"], mask_history=True,
                    preserve_thinking=True))
    return out


def run_case(case: dict, records: dict, tokenizer_dir: str) -> dict:
    from transformers import AutoTokenizer
    from llamafactory.data import template as lf_template
    from llamafactory.data.mm_plugin import get_mm_plugin
    from llamafactory.data.converter import AlpacaDatasetConverter, SharegptDatasetConverter
    from llamafactory.data.parser import DatasetAttr
    from llamafactory.data.processor.supervised import SupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments

    options = {k: v for k, v in case.items() if k not in ("template", "datasets", "chat_template")}
    args = DataArguments(template=case["template"], **options)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if case.get("chat_template"):
        tokenizer.chat_template = case["chat_template"]
    own_template = tokenizer.chat_template
    saved = copy.deepcopy(lf_template.TEMPLATES)   # get_template_and_fix_tokenizer edits the template in place
    try:
        template = lf_template.get_template_and_fix_tokenizer(tokenizer, args)
        # a vision template refuses text without an image processor; its plugin only rewrites image
        # placeholders, and these records have none, so the text-only plugin encodes them the same
        template.mm_plugin = get_mm_plugin(name="base")
        processor = SupervisedDatasetProcessor(template=template, tokenizer=tokenizer, processor=None, data_args=args)
        results = {}
        for name in case["datasets"]:
            spec = records[name]["attr"]
            attr = DatasetAttr("file", dataset_name=name)
            attr.join(spec)
            convert = (SharegptDatasetConverter if spec.get("formatting") == "sharegpt" else AlpacaDatasetConverter)(
                attr, args)
            rows = records[name]["records"]
            keys = {k for r in rows for k in r}
            out = []
            for row in rows:
                row = {k: row.get(k) for k in keys}   # `datasets` fills a record's missing columns with None
                try:
                    aligned = convert(row)
                    batch = {k: [v] for k, v in aligned.items()}
                    enc = processor.preprocess_dataset(batch)
                except Exception as e:   # LLaMA-Factory raises on it: megatrain must refuse it too
                    out.append({"error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                if not enc["input_ids"]:
                    out.append({"skipped": True})
                else:
                    out.append({"input_ids": enc["input_ids"][0], "labels": enc["labels"][0]})
            results[name] = out
        fixed = {} if tokenizer.chat_template == own_template else {"chat_template_after": tokenizer.chat_template}
        return {**case, "eos_token": tokenizer.eos_token, "vocab_size": len(tokenizer), **fixed, "results": results}
    finally:
        lf_template.TEMPLATES.clear()
        lf_template.TEMPLATES.update(saved)


def main(tokenizer_dir: str) -> None:
    records = json.loads((HERE / "records.json").read_text())
    reference = [run_case(c, records, tokenizer_dir) for c in cases()]
    (HERE / "reference.json").write_text(json.dumps(reference, ensure_ascii=False, separators=(",", ":")))
    print(f"{len(reference)} cases, {(HERE / 'reference.json').stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
