"""Training data: a LLaMA-Factory-style registry, file loading, chat formatting and masking.

`dataset_dir/dataset_info.json` names the data sets:

    {"alpaca_demo": {"file_name": "alpaca_demo.json"},                       # formatting: alpaca
     "chat_demo":   {"file_name": "sharegpt_demo.jsonl", "formatting": "sharegpt"},
     "openai_demo": {"file_name": "messages.parquet", "formatting": "sharegpt",
                     "columns": {"messages": "messages"},
                     "tags": {"role_tag": "role", "content_tag": "content",
                              "user_tag": "user", "assistant_tag": "assistant"}},
     "hub":         {"hf_hub_url": "tatsu-lab/alpaca", "split": "train", "num_samples": 1000}}

`file_name` is a file or a folder of json / jsonl / csv / parquet / arrow files (read with
`datasets`). Alpaca records (instruction, input, output, optional system and history) and
ShareGPT conversations (user/assistant turns, optional system) become chat messages, rendered
with the tokenizer's chat template (or a built-in one). Labels are -100 on everything but the
assistant replies (all of them, or the last with `mask_history`; everything with
`train_on_prompt`), found by rendering each conversation prefix, so any template that renders
prefixes as prefixes works. Pre-training text (`stage: pt`) is concatenated with EOS between
documents and cut into `cutoff_len` blocks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import MegatrainError

IGNORE = -100
FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
ATTR_KEYS = {"file_name", "hf_hub_url", "formatting", "columns", "tags", "split", "num_samples", "subset"}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                  "history": "history", "images": "images"}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "images": "images"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "system_tag": "system"}
PT_COLUMNS = {"prompt": "text"}

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
          " + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
TEMPLATES = {"chatml": CHATML, "qwen": CHATML, "llama3": LLAMA3}


class DataError(MegatrainError, ValueError):
    """A data set is missing, malformed or does not fit the chosen format."""


@dataclass
class DatasetAttr:
    name: str
    file_name: str | None = None
    hf_hub_url: str | None = None
    formatting: str = "alpaca"
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    split: str = "train"
    num_samples: int | None = None
    subset: str | None = None


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None   # packed examples: positions restart at each sample
    images: list[str] | None = None         # image files of a VLM example (see images.py)

    @property
    def trained_tokens(self) -> int:
        return sum(1 for t in self.labels[1:] if t != IGNORE)   # labels are shifted by the model


# registry ---------------------------------------------------------------------------
def load_registry(dataset_dir: str | Path) -> dict[str, DatasetAttr]:
    path = Path(dataset_dir) / "dataset_info.json"
    if not path.is_file():
        raise DataError(f"{path} does not exist: dataset_dir must hold a dataset_info.json registry "
                        "(see examples/data/dataset_info.json).")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path} holds a JSON {type(raw).__name__}: it must be one object of data set entries, "
                        '{"name": {"file_name": "data.json"}, ...}.')
    registry = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise DataError(f"{path}: entry {name!r} must be an object with file_name or hf_hub_url.")
        unknown = set(spec) - ATTR_KEYS
        if unknown:
            raise DataError(f"{path}: entry {name!r} has unknown keys {sorted(unknown)}; valid: {sorted(ATTR_KEYS)}.")
        if bool(spec.get("file_name")) == bool(spec.get("hf_hub_url")):
            raise DataError(f"{path}: entry {name!r} needs exactly one of file_name or hf_hub_url.")
        if spec.get("formatting", "alpaca") not in ("alpaca", "sharegpt"):
            raise DataError(f"{path}: entry {name!r} has formatting={spec['formatting']!r}; use alpaca or sharegpt.")
        for key, kind in _ATTR_TYPES.items():
            value = spec.get(key)
            if value is not None and not (isinstance(value, kind) and not isinstance(value, bool)):
                raise DataError(f"{path}: entry {name!r} has {key}={value!r} ({type(value).__name__}); expected "
                                f"{'an object' if kind is dict else kind.__name__}.")
        for key in ("columns", "tags"):
            bad = {k: v for k, v in (spec.get(key) or {}).items() if not isinstance(v, str)}
            if bad:
                raise DataError(f"{path}: entry {name!r}: {key} must map names to column/tag strings, not {bad!r}.")
        if spec.get("num_samples") is not None and spec["num_samples"] < 1:
            raise DataError(f"{path}: entry {name!r} has num_samples={spec['num_samples']}; it must be at least 1.")
        registry[name] = DatasetAttr(name, **spec)
    return registry


_ATTR_TYPES = {"file_name": str, "hf_hub_url": str, "formatting": str, "columns": dict, "tags": dict, "split": str,
               "num_samples": int, "subset": str}


def _data_files(path: Path) -> tuple[str, list[str]]:
    files = sorted(p for p in path.iterdir() if p.suffix in FILE_TYPES) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path} holds no {', '.join(FILE_TYPES)} files.")
    kinds = {FILE_TYPES.get(p.suffix) for p in files}
    if None in kinds:
        raise DataError(f"{path}: unsupported file type; use one of {', '.join(FILE_TYPES)}.")
    if len(kinds) > 1:
        raise DataError(f"{path} mixes file types {sorted(kinds)}; keep one type per data set.")
    return kinds.pop(), [str(p) for p in files]


def data_path(attr: DatasetAttr, dataset_dir: str | Path, allow_outside: bool = False) -> Path:
    """The resolved file or folder of a registered data set. A `file_name` that leads out of
    `dataset_dir` (`../x.json`, an absolute path, a link) is refused unless `allow_outside`: a
    registry copied from elsewhere must not make the trainer read (and print) any file."""
    base = Path(dataset_dir).resolve()
    path = (base / attr.file_name).resolve()
    if not allow_outside and not path.is_relative_to(base):
        raise DataError(f"data set {attr.name!r}: file_name {attr.file_name!r} resolves to {path}, outside dataset_dir "
                        f"{base}. Move the file into dataset_dir, or set allow_outside_dataset_dir: true to read it.")
    if not path.exists():
        raise DataError(f"data set {attr.name!r}: {path} does not exist (file_name {attr.file_name!r} in "
                        f"{base / 'dataset_info.json'}).")
    return path


def check_datasets(config) -> dict[str, str]:
    """Check the configured data sets before anything is loaded: registered, and their files
    present inside dataset_dir. Returns {name: resolved path or Hub id} for the log."""
    registry = load_registry(config.dataset_dir)
    sources = {}
    for name in config.datasets:
        if name not in registry:
            raise DataError(f"data set {name!r} is not in {config.dataset_dir}/dataset_info.json "
                            f"(registered: {', '.join(sorted(registry)) or 'none'}).")
        attr = registry[name]
        sources[name] = (str(data_path(attr, config.dataset_dir, config.allow_outside_dataset_dir)) if attr.file_name
                         else f"hf://{attr.hf_hub_url}")
    return sources


def load_records(attr: DatasetAttr, dataset_dir: str | Path, allow_outside: bool = False) -> list[dict]:
    """The raw records of a registered data set, as a list of dicts."""
    import datasets
    datasets.disable_progress_bars()
    if attr.file_name:
        path = data_path(attr, dataset_dir, allow_outside)
        kind, files = _data_files(path)
        if all(Path(f).stat().st_size == 0 for f in files):
            raise DataError(f"data set {attr.name!r}: {path} is empty. Put records in it ({kind}) or remove "
                            f"{attr.name!r} from dataset.")
        try:
            ds = datasets.load_dataset(kind, data_files=files, split="train")
        except Exception as e:  # datasets wraps parser errors in several exception types
            cause = e.__cause__ or e
            if isinstance(cause, StopIteration) or "corresponds to no data" in str(cause):
                raise DataError(f"data set {attr.name!r}: {path} holds no records. Put records in it or remove "
                                f"{attr.name!r} from dataset.") from None
            raise DataError(f"data set {attr.name!r}: could not read {path} as {kind} "
                            f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}). "
                            "Check that the file is complete and in that format.") from None
    else:
        if not _hub_reachable():
            raise DataError(f"data set {attr.name!r}: {attr.hf_hub_url!r} is on the Hugging Face Hub, which this "
                            "machine cannot reach (offline). Download it elsewhere and register it with file_name "
                            "instead, or set HF_HUB_OFFLINE=1 to read it from the local datasets cache.")
        try:
            ds = datasets.load_dataset(attr.hf_hub_url, attr.subset, split=attr.split)
        except Exception as e:
            raise DataError(f"data set {attr.name!r}: could not load {attr.hf_hub_url!r} from the Hugging Face Hub "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Offline, download "
                            "it elsewhere and register it with file_name instead.") from None
    records = ds.to_list()
    if not records:
        raise DataError(f"data set {attr.name!r} holds no records.")
    if attr.num_samples is not None:
        records = records[: attr.num_samples]
    return records


def _hub_reachable() -> bool:
    """False when the Hub's name does not resolve (offline): datasets would retry for ~25 s first."""
    import os
    import socket
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return True   # datasets reads its cache
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("//")[-1].split("/")[0]
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


# formatting -------------------------------------------------------------------------
def _text(value) -> str:
    return "" if value is None else str(value)


def alpaca_messages(record: dict, columns: dict, name: str) -> list[dict]:
    cols = {**ALPACA_COLUMNS, **columns}
    for key in ("prompt", "response"):
        if cols[key] not in record:
            raise DataError(f"data set {name!r} (alpaca): records have no {cols[key]!r} column (has {sorted(record)}); "
                            f"set columns.{key} in dataset_info.json.")
    messages = []
    if record.get(cols["system"]):
        messages.append({"role": "system", "content": _text(record[cols["system"]])})
    for turn in record.get(cols["history"]) or []:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise DataError(f"data set {name!r}: history entries must be [user, assistant] pairs, got {turn!r}.")
        messages += [{"role": "user", "content": _text(turn[0])}, {"role": "assistant", "content": _text(turn[1])}]
    query = _text(record.get(cols["query"]))
    prompt = _text(record[cols["prompt"]]) + ("\n" + query if query else "")
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(record[cols["response"]])}]
    return messages


def sharegpt_messages(record: dict, columns: dict, tags: dict, name: str) -> list[dict]:
    cols, tg = {**SHAREGPT_COLUMNS, **columns}, {**SHAREGPT_TAGS, **tags}
    if cols["messages"] not in record:
        raise DataError(f"data set {name!r} (sharegpt): records have no {cols['messages']!r} column "
                        f"(has {sorted(record)}); set columns.messages (and tags for role/content) in dataset_info.json.")
    roles = {tg["user_tag"]: "user", tg["assistant_tag"]: "assistant", tg["system_tag"]: "system"}
    messages = []
    if record.get(cols["system"]):
        messages.append({"role": "system", "content": _text(record[cols["system"]])})
    for turn in record[cols["messages"]] or []:
        role = roles.get(turn.get(tg["role_tag"])) if isinstance(turn, dict) else None
        if role is None:
            raise DataError(f"data set {name!r}: turn {turn!r} has no role among {sorted(roles)} under "
                            f"{tg['role_tag']!r}; set tags.role_tag / user_tag / assistant_tag in dataset_info.json.")
        messages.append({"role": role, "content": _text(turn.get(tg["content_tag"]))})
    return messages


def check_conversation(messages: list[dict], name: str) -> None:
    turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not turns or turns[-1]["role"] != "assistant":
        raise DataError(f"data set {name!r}: a conversation must end with an assistant reply: {messages!r:.200}")
    for i, m in enumerate(turns):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise DataError(f"data set {name!r}: turns must alternate user/assistant: {messages!r:.200}")


# tokenization -----------------------------------------------------------------------
def chat_template(tokenizer, template: str | None) -> str:
    if template is None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("the tokenizer has no chat_template: set template to one of "
                            f"{', '.join(TEMPLATES)}.")
        return tokenizer.chat_template
    if template not in TEMPLATES:
        raise DataError(f"template={template!r}: use one of {', '.join(TEMPLATES)} or leave it unset for the "
                        "tokenizer's own chat_template.")
    return TEMPLATES[template]


def _render(tokenizer, template: str, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                        add_generation_prompt=generation_prompt, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def encode_chat(tokenizer, template: str, messages: list[dict], cutoff_len: int, train_on_prompt: bool = False,
                mask_history: bool = False) -> Example:
    ids: list[int] = []
    labels: list[int] = []
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in replies:
        prompt = _render(tokenizer, template, messages[:i], generation_prompt=True)
        full = _render(tokenizer, template, messages[: i + 1], generation_prompt=False)
        if prompt[: len(ids)] != ids or full[: len(prompt)] != prompt:
            raise DataError("the chat template does not render a conversation's prefixes as prefixes, so prompt "
                            "and reply tokens cannot be told apart; choose another template.")
        ids += prompt[len(ids):]
        labels += prompt[len(labels):] if train_on_prompt else [IGNORE] * (len(prompt) - len(labels))
        reply = full[len(prompt):]
        ids += reply
        labels += [IGNORE] * len(reply) if mask_history and i != replies[-1] else reply
    return Example(ids[:cutoff_len], labels[:cutoff_len])


def encode_pretrain(tokenizer, texts: list[str], cutoff_len: int) -> list[Example]:
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
    blocks = [stream[k: k + cutoff_len] for k in range(0, len(stream) - cutoff_len + 1, cutoff_len)]
    return [Example(b, list(b)) for b in blocks]


def build_examples(config, tokenizer, images=None) -> tuple[list[Example], dict[str, int]]:
    """Every example of the configured data sets, and counts (samples, dropped) for the log.
    `images` (images.ImageInputs) handles the records' images for a vision-language model."""
    check_datasets(config)
    registry = load_registry(config.dataset_dir)
    examples: list[Example] = []
    counts = {"samples": 0, "dropped": 0, "records": {}}
    template = chat_template(tokenizer, config.template) if config.stage == "sft" else None
    for name in config.datasets:
        attr = registry[name]
        records = load_records(attr, config.dataset_dir, config.allow_outside_dataset_dir)
        if config.max_samples is not None:
            records = records[: config.max_samples]
        counts["samples"] += len(records)
        counts["records"][name] = len(records)
        if config.stage == "pt":
            column = {**PT_COLUMNS, **attr.columns}["prompt"]
            if records and column not in records[0]:
                raise DataError(f"data set {name!r} (pt): records have no {column!r} column; set columns.prompt.")
            examples += encode_pretrain(tokenizer, [_text(r[column]) for r in records], config.cutoff_len)
            continue
        image_column = {**(ALPACA_COLUMNS if attr.formatting == "alpaca" else SHAREGPT_COLUMNS),
                        **attr.columns}["images"]
        for record in records:
            messages = (alpaca_messages(record, attr.columns, name) if attr.formatting == "alpaca"
                        else sharegpt_messages(record, attr.columns, attr.tags, name))
            check_conversation(messages, name)
            paths = record.get(image_column) or None
            if paths and images is None:
                raise DataError(f"data set {name!r} has images (column {image_column!r}) but "
                                f"{config.model_name_or_path} is a text-only model: train a vision-language model "
                                "or drop the column.")
            if paths:
                messages, image_tokens = images.expand(messages, list(paths), name)
            ex = encode_chat(tokenizer, template, messages, config.cutoff_len, config.train_on_prompt,
                             config.mask_history)
            if paths:
                ex.images = list(paths)
                ex.labels = [IGNORE if t == images.image_token_id else y for t, y in zip(ex.input_ids, ex.labels)]
                if images.count(ex.input_ids) != image_tokens:   # cutoff_len cut into an image
                    counts["dropped_images"] = counts.get("dropped_images", 0) + 1
                    continue
            if ex.trained_tokens == 0:   # the reply was cut off entirely by cutoff_len
                counts["dropped"] += 1
            else:
                examples.append(ex)
    if not examples:
        raise DataError(f"no training examples: {counts['samples']} samples, {counts['dropped']} dropped because "
                        f"cutoff_len={config.cutoff_len} left no reply tokens"
                        + (f", {counts['dropped_images']} because it cut into an image" if "dropped_images" in counts
                           else "") + ".")
    if config.packing and config.stage == "sft":   # (pt text is already concatenated into blocks)
        if any(ex.images for ex in examples):
            raise DataError("packing: true with image data: packed samples would share image positions. "
                            "Set packing: false.")
        counts["packed_from"] = len(examples)
        examples = pack(examples, config.cutoff_len, config.seed)
    return examples, counts


def fingerprint(examples: list[Example]) -> str:
    """A digest of the examples' tokens, labels, positions and image paths, in order: a resumed
    run must read the same examples (the data position in a checkpoint is an index into them)."""
    import hashlib
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.input_ids, ex.labels, ex.position_ids, ex.images], separators=(",", ":")).encode())
    return h.hexdigest()[:32]


def pack(examples: list[Example], cutoff_len: int, seed: int) -> list[Example]:
    """Greedy first-fit packing of shuffled examples into sequences of at most `cutoff_len`.

    Samples do not see each other: positions restart at every sample, which makes transformers
    build a block-diagonal causal mask (no 2-D attention mask is passed), and the first token of
    each sample is not a target (it would be predicted from the previous sample's last token).
    """
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    bins: list[list[Example]] = []
    room: list[int] = []
    for i in order:
        ex = examples[i]
        k = next((b for b, r in enumerate(room) if r >= len(ex.input_ids)), None)
        if k is None:
            bins.append([]), room.append(cutoff_len)
            k = len(bins) - 1
        bins[k].append(ex)
        room[k] -= len(ex.input_ids)
    packed = []
    for members in bins:
        ids, labels, positions = [], [], []
        for ex in members:
            ids += ex.input_ids
            labels += [IGNORE] + ex.labels[1:]
            positions += list(range(len(ex.input_ids)))
        packed.append(Example(ids, labels, positions))
    return packed


def show_example(tokenizer, ex: Example) -> str:
    """The example decoded, with the tokens that are not trained on in [[...]]."""
    out, masked, run = [], None, []
    for tok, lab in zip(ex.input_ids, ex.labels):
        m = lab == IGNORE
        if m != masked and run:
            text = tokenizer.decode(run)
            out.append(f"[[{text}]]" if masked else text)
            run = []
        masked = m
        run.append(tok)
    if run:
        text = tokenizer.decode(run)
        out.append(f"[[{text}]]" if masked else text)
    return "".join(out)


# batching ---------------------------------------------------------------------------
def collate(examples: list[Example], pad_id: int, multiple: int = 8, images=None) -> dict[str, torch.Tensor]:
    """Right-padded tensors; padding is masked by position (pad may equal eos). Packed examples
    get `position_ids` instead of an attention mask (the padding is one more packed sample).
    With `images` (images.ImageInputs), a VLM batch also gets its processed images."""
    length = max(len(e.input_ids) for e in examples)
    length = -(-length // multiple) * multiple
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    positions = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
        if e.position_ids is not None:
            positions[row, :n] = torch.tensor(e.position_ids)
            positions[row, n:] = torch.arange(length - n)
    if examples[0].position_ids is not None:
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if images is not None:
        batch.update(images.batch([p for e in examples for p in e.images or ()], ids))
    return batch


class Order:
    """The sample order: one seeded permutation per epoch (or the examples as they are, with
    shuffle=False: LLaMA-Factory's disable_shuffling), read micro-batch by micro-batch.
    Its position (epoch, micro-batch) is part of a checkpoint, so a resumed run reads on."""

    def __init__(self, n: int, batch: int, seed: int, shuffle: bool = True):
        self.n, self.batch, self.seed, self.shuffle = n, batch, seed, shuffle
        self.epoch, self.index = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch

    def next(self) -> list[int]:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._permutation()
        k = self.index * self.batch
        self.index += 1
        return self._perm[k: k + self.batch]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "n": self.n, "batch": self.batch, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["n"], state["batch"]) != (self.n, self.batch):
            raise DataError(f"the checkpoint was written for {state['n']} examples in batches of {state['batch']}, "
                            f"this run has {self.n} in batches of {self.batch}: resume with the same data and "
                            "per_device_train_batch_size.")
        if state.get("shuffle", True) != self.shuffle:   # (checkpoints before disable_shuffling: shuffled)
            raise DataError(f"the checkpoint read the examples {'shuffled' if state.get('shuffle', True) else 'in order'}"
                            f", this run would read them {'shuffled' if self.shuffle else 'in order'}: resume with "
                            f"disable_shuffling: {str(not state.get('shuffle', True)).lower()}.")
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._perm = self._permutation()
