"""`streaming: true` (megacompile/train/data/stream.py): the streamed examples are the tokenized path's
examples (same chunks as LLaMA-Factory's map batches), a checkpoint's stream position resumes
exactly (across epochs and through the shuffle buffer), and a streamed `megatrain train` run that
stops and resumes logs the uninterrupted run's losses. Tiny Llama from test_train's fixture."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megacompile.errors import ConfigError
from megacompile.train.data import stream
from megacompile.train import trainer
from megacompile.train.data import build_examples, data_template
from test_train import config, log_rows, tiny_dir  # noqa: F401 (tiny_dir: a fixture)


pytestmark = pytest.mark.usefixtures("own_cache")


def _rows(examples) -> list[tuple]:
    return [(e.input_ids, e.labels, e.position_ids) for e in examples]


def _streamed(cfg, tok) -> list[tuple]:
    return _rows(stream._example(r) for r in stream.examples_stream(cfg, tok, data_template(cfg, tok)))


@pytest.mark.parametrize("keys", [
    dict(stage="pt", dataset="pretrain_demo", cutoff_len=32),                    # blocks within each chunk
    dict(stage="pt", dataset="pretrain_demo", cutoff_len=24, packing=False),     # documents truncated
    dict(dataset="alpaca_demo"),
    dict(dataset="alpaca_demo,sharegpt_demo", packing=True, cutoff_len=128),     # LF's knapsack per chunk
    dict(dataset="alpaca_demo,sharegpt_demo", mix_strategy="interleave_under", interleave_probs="0.5,0.5"),
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_streamed_examples_are_the_tokenized_ones(tiny_dir, tmp_path, keys):  # noqa: F811
    """The same examples in the same order: a stream's chunk is one preprocessing_batch_size map
    batch, as the tokenized path packs (and LF packs) within one."""
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = config(tiny_dir, tmp_path, preprocessing_batch_size=5, **keys)
    examples, _ = build_examples(cfg, tok, say=lambda *_: None)
    streamed = _streamed(dataclasses.replace(cfg, streaming=True), tok)
    assert len(examples) > 3 and streamed == _rows(examples)


def test_the_stream_position_resumes_exactly_across_epochs(tiny_dir, tmp_path):  # noqa: F811
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = config(tiny_dir, tmp_path, stage="pt", dataset="pretrain_demo", cutoff_len=16, streaming=True,
                 buffer_size=4, val_size=2, per_device_train_batch_size=2)

    def batches(order, n):
        return [_rows(order.next_examples()) for _ in range(n)]
    whole = stream.open_stream(cfg, tok, data_template(cfg, tok))
    n_train = sum(1 for _ in stream.examples_stream(cfg, tok, data_template(cfg, tok))) - 2
    per_epoch = n_train // 2
    run = batches(whole.order, 2 * per_epoch + 3)   # into the third epoch
    assert whole.order.epoch == 2
    epochs = [run[k * per_epoch:(k + 1) * per_epoch] for k in range(2)]
    flat = [sorted(x for b in e for x in b) for e in epochs]
    assert epochs[0] != epochs[1] and flat[0] == flat[1]   # reshuffled each epoch, the same examples
    held = _rows(whole.held_out)
    assert len(held) == 2 and not any(x in held for b in run for x in b)   # held-out examples never train
    for stop in (1, per_epoch, per_epoch + 1):   # within, at the end of, and past an epoch
        first = stream.open_stream(cfg, tok, data_template(cfg, tok))
        head = batches(first.order, stop)
        state = first.order.state_dict()
        again = stream.open_stream(cfg, tok, data_template(cfg, tok))
        again.order.load_state_dict(state)
        assert head + batches(again.order, len(run) - stop) == run
    # a checkpoint of another stream setting, or of the tokenized path, is refused
    other = stream.open_stream(dataclasses.replace(cfg, per_device_train_batch_size=1), tok,
                               data_template(cfg, tok))
    with pytest.raises(stream.DataError, match="per_device_train_batch_size"):
        other.order.load_state_dict(state)
    with pytest.raises(stream.DataError, match="resume with streaming: false"):
        other.order.load_state_dict({"epoch": 0, "index": 1, "n": 8, "batch": 1, "seed": 0, "shuffle": True})


@pytest.mark.parametrize("keys, message", [
    (dict(max_steps=-1, num_train_epochs=1), "streaming: true needs max_steps"),
    (dict(tokenized_path="tok"), "tokenized_path with streaming"),
    (dict(val_size=2, eval_strategy="epoch"), "eval_strategy: epoch with streaming"),
    (dict(buffer_size=0), "buffer_size=0"),
])
def test_streaming_options_that_cannot_work_are_refused(tiny_dir, tmp_path, keys, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        config(tiny_dir, tmp_path, streaming=True, **keys)


def test_a_streamed_run_stops_and_resumes_to_the_same_losses(tiny_dir, tmp_path):  # noqa: F811
    keys = dict(stage="pt", dataset="pretrain_demo", cutoff_len=16, streaming=True, buffer_size=8, max_steps=6,
                save_steps=3, val_size=2, eval_strategy="steps", eval_steps=3)
    whole = config(tiny_dir, tmp_path / "whole", **keys)
    trainer.train(whole, progress=False)
    part = config(tiny_dir, tmp_path / "part", **keys)
    trainer.train(part, stop_at_step=3, progress=False)
    trainer.train(config(tiny_dir, tmp_path / "part", resume_from_checkpoint=True, **keys), progress=False)
    a, b = log_rows(Path(whole.output_dir)), log_rows(Path(part.output_dir))
    losses = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in a]
    assert [r["step"] for r in a if "loss" in r] == list(range(1, 7)) and any(r.get("eval_loss") for r in a)
    assert [(r["step"], r.get("loss"), r.get("eval_loss")) for r in b] == losses
    # resumed under other data (a changed corpus file) the position is refused
    data = tmp_path / "data"
    data.mkdir()
    for f in Path(whole.dataset_dir).iterdir():
        if f.is_file():
            (data / f.name).write_bytes(f.read_bytes())
    more = config(tiny_dir, tmp_path / "more", dataset_dir=str(data), **{**keys, "max_steps": 2, "save_steps": 1})
    trainer.train(more, stop_at_step=1, progress=False)
    with open(data / "pretrain_demo.jsonl", "a") as f:
        f.write('{"text": "one more document"}\n')
    with pytest.raises(ConfigError, match="other training examples"):
        trainer.train(config(tiny_dir, tmp_path / "more", dataset_dir=str(data), resume_from_checkpoint=True,
                             **{**keys, "max_steps": 2, "save_steps": 1}), progress=False)
