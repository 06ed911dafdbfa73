"""One data-set record to one example: LLaMA-Factory's converters (alpaca and sharegpt records to
chat messages) and the encoding of a record for stage sft (its template, turn by turn:
encode.py) or pt (raw text, EOS appended).

    encode_record({"instruction": "Hi", "input": "", "output": "Hello"}, attr, config, tok, template)
      -> (ids, labels, why_skipped)

tokenize_cache.py maps this over a data set (datasets.map, cached on disk) and loader.py builds
the examples of a run from it; it imports neither.
"""
from __future__ import annotations

from .examples import IGNORE, Example
from .registry import DataError, DatasetAttr

# LLaMA-Factory's DatasetAttr defaults: the system, history and tools columns are read only when
# dataset_info.json maps them (a record's unmapped "history" is not trained on, there as here:
# tokenize_cache says so in the log). An unmapped "images" column is read (a deliberate
# difference: LF would leave the <image> markers without images and refuse the record).
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": None,
                  "history": None, "images": "images", "tools": None}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "images": "images", "tools": None}
#: the optional columns LLaMA-Factory reads only when they are mapped
UNMAPPED_IGNORED = ("system", "history", "tools")
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
PT_COLUMNS = {"prompt": "text"}

# a plain ChatML Jinja template (tests and tiny tokenizers); named templates are in templates.py
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# formatting -------------------------------------------------------------------------
def _shown(value, width: int = 40) -> str:
    """A record's value as a message quotes it: its repr, cut to `width` characters."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _text(value) -> str:
    return "" if value is None else str(value)


def alpaca_messages(record: dict, columns: dict, name: str) -> list[dict]:
    """An alpaca record as messages: [system], history pairs, "instruction\ninput", output."""
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
    # LLaMA-Factory joins the non-empty ones: "instruction\ninput"
    prompt = "\n".join(_text(record.get(cols[k])) for k in ("prompt", "query") if record.get(cols[k]))
    messages.append({"role": "user", "content": prompt})
    if isinstance(record[cols["response"]], str):   # else no reply: check_conversation skips the record
        messages.append({"role": "assistant", "content": record[cols["response"]]})
    return messages


def sharegpt_messages(record: dict, columns: dict, tags: dict, name: str) -> list[dict]:
    """A sharegpt record as messages with roles system, user, assistant, observation and function
    (function_call turns). The system prompt is a first system turn, else the system column."""
    cols, tg = {**SHAREGPT_COLUMNS, **columns}, {**SHAREGPT_TAGS, **tags}
    if cols["messages"] not in record:
        raise DataError(f"data set {name!r} (sharegpt): records have no {cols['messages']!r} column "
                        f"(has {sorted(record)}); set columns.messages (and tags for role/content) in "
                        "dataset_info.json.")
    roles = {tg["user_tag"]: "user", tg["assistant_tag"]: "assistant", tg["system_tag"]: "system",
             tg["observation_tag"]: "observation", tg["function_tag"]: "function"}
    turns = record[cols["messages"]] or []
    if not isinstance(turns, (list, tuple)):
        raise DataError(f"data set {name!r} (sharegpt): a record's {cols['messages']!r} is "
                        f"{type(turns).__name__} {_shown(turns)}, not a list of turns; fix the record (or "
                        "columns.messages in dataset_info.json).")
    turns = list(turns)
    messages = []
    first = turns[0] if turns and isinstance(turns[0], dict) else {}
    if first.get(tg["role_tag"]) == tg["system_tag"]:   # as LLaMA-Factory: a first system turn wins
        messages.append({"role": "system", "content": _text(first.get(tg["content_tag"]))})
        turns = turns[1:]
    elif record.get(cols["system"]):
        messages.append({"role": "system", "content": _text(record[cols["system"]])})
    for turn in turns:
        tag = turn.get(tg["role_tag"]) if isinstance(turn, dict) else None
        role = roles.get(tag) if isinstance(tag, str) else None   # (a list or a dict is no role: a data error)
        if role is None:
            raise DataError(f"data set {name!r}: turn {turn!r} has no role among {sorted(roles)} under "
                            f"{tg['role_tag']!r}; set tags.role_tag / user_tag / assistant_tag in dataset_info.json.")
        messages.append({"role": role, "content": _text(turn.get(tg["content_tag"]))})
    return messages


def check_conversation(messages: list[dict], name: str) -> str | None:
    """Why LLaMA-Factory would skip this conversation, or None: turns must alternate user (or
    observation) and assistant (or function_call) and end with a reply. Not fatal: the record is
    skipped and counted, as LLaMA-Factory does."""
    from .encode import malformed
    return malformed(messages)


def record_tools(record: dict, columns: dict, formatting: str):
    """The record's tool schemas (the tools column: a JSON string or a list), or None."""
    cols = {**(ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS), **columns}
    return record.get(cols["tools"]) or None


# tokenization -----------------------------------------------------------------------
def chat_template(tokenizer, template: str | None, config=None):
    """The run's conversation encoder (encode.ChatEncoder): LLaMA-Factory's template `template`,
    or, unset, the tokenizer's own chat_template cut into turns. `config` gives the other
    LLaMA-Factory options (default_system, tool_format, enable_thinking, train_on_prompt). Fixes
    the tokenizer's EOS / pad / stop words for the template, as LLaMA-Factory does."""
    from .encode import make_encoder
    opts = {} if config is None else dict(default_system=config.default_system, tool_format=config.tool_format,
                                          enable_thinking=config.enable_thinking,
                                          train_on_prompt=config.train_on_prompt, mask_history=config.mask_history,
                                          preserve_thinking=config.preserve_thinking)
    return make_encoder(tokenizer, template, **opts)


def encode_chat(tokenizer, template, messages: list[dict], cutoff_len: int, train_on_prompt: bool = False,
                mask_history: bool = False, tools=None) -> Example:
    """One conversation's Example, encoded turn by turn (encode.py). `template`: a ChatEncoder
    (chat_template's), or a Jinja chat template string, cut into turns as the tokenizer's own."""
    from .encode import ChatEncoder
    from .jinja_template import parse_chat_template
    if isinstance(template, str):
        template = ChatEncoder(parse_chat_template(tokenizer, template))
    ids, labels = template.encode(tokenizer, messages, cutoff_len, train_on_prompt, mask_history, tools)
    return Example(ids, labels)


def pretrain_tokens(tokenizer, text, separator: str | None) -> list[int]:
    """One pre-training document's tokens: its text with `separator` (pt_separator's) appended,
    tokenized as one string without special tokens, as LLaMA-Factory's pretrain processor does.
    Documents are then cut into blocks or truncated (processor/pretrain.py)."""
    return tokenizer(_text(text) + (separator or ""), add_special_tokens=False)["input_ids"]


def pt_separator(tokenizer, template: str | None) -> str:
    """The text LLaMA-Factory appends to every pre-training document: "<|end_of_text|>" with the
    llama3 template, else the tokenizer's EOS after the template fixed it (a template with
    replace_eos makes its first stop word EOS: encode.prepare_tokenizer does as LF)."""
    from .encode import prepare_tokenizer
    from .templates import get_template
    if template is not None:
        prepare_tokenizer(get_template(template), tokenizer)
    if template == "llama3":
        return "<|end_of_text|>"
    if tokenizer.eos_token is None:   # (LF would add a new <|endoftext|> token the model has no embedding for)
        raise DataError("stage pt: the tokenizer has no EOS token to separate the documents with: set template to "
                        "one that names it (e.g. llama3, qwen) or use a tokenizer with an eos_token.")
    return tokenizer.eos_token


def packs(config) -> bool:
    """Whether the examples are packed: `packing`, or when unset LLaMA-Factory's default, true
    for stage pt (its parser) and false for sft."""
    return config.packing if config.packing is not None else config.stage == "pt"


def data_cutoff_len(config) -> int:
    """The cutoff_len the data is encoded with. LLaMA-Factory's DataArguments lowers cutoff_len by
    one when packing (or neat_packing) is set to true in the config (its __post_init__, "avoid
    pad_to_multiple_of"), but not when stage pt turns packing on by default: the same here, so the
    tokens match LF's in both cases."""
    return config.cutoff_len - 1 if config.packing is True else config.cutoff_len


def encode_record(record: dict, attr: DatasetAttr, config, tokenizer, template, images=None) \
        -> tuple[Example | None, str | None]:
    """One sft record's example, or None and the reason it gives none (the key of its count in
    build_examples' counts: dropped = cutoff_len left no reply, dropped_images = it cut into an
    image). Called once per record, in datasets.map's worker processes (tokenize_cache.py)."""
    name = attr.name
    image_column = {**(ALPACA_COLUMNS if attr.formatting == "alpaca" else SHAREGPT_COLUMNS),
                    **attr.columns}["images"]
    messages = (alpaca_messages(record, attr.columns, name) if attr.formatting == "alpaca"
                else sharegpt_messages(record, attr.columns, attr.tags, name))
    if why := check_conversation(messages, name):   # LLaMA-Factory skips it too
        return None, f"malformed|{_not_text(record, attr) or why}"
    paths = record.get(image_column) or None
    if paths and images is None:
        raise DataError(f"data set {name!r} has images (column {image_column!r}) but "
                        f"{config.model_name_or_path} is a text-only model: train a vision-language model "
                        "or drop the column.")
    if paths:
        messages, image_tokens = images.expand(messages, list(paths), name)
    ex = encode_chat(tokenizer, template, messages, data_cutoff_len(config), config.train_on_prompt,
                     config.mask_history, record_tools(record, attr.columns, attr.formatting))
    if paths:
        ex.images = list(paths)
        ex.labels = [IGNORE if t == images.image_token_id else y for t, y in zip(ex.input_ids, ex.labels)]
        if images.count(ex.input_ids) != image_tokens:   # cutoff_len cut into an image
            return None, "dropped_images"
    if ex.trained_tokens == 0:   # the reply was cut off entirely by cutoff_len
        return None, "dropped"
    return ex, None


def _not_text(record: dict, attr: DatasetAttr) -> str | None:
    """The real cause of an alpaca record without a reply: its response column holds no text (a
    number, a list, null), which LLaMA-Factory's converter also turns into no reply."""
    if attr.formatting != "alpaca":
        return None
    column = {**ALPACA_COLUMNS, **attr.columns}["response"]
    value = record.get(column)
    if isinstance(value, str):
        return None
    return f"its {column!r} is {'null' if value is None else type(value).__name__ + ' ' + _shown(value)}, not text"
