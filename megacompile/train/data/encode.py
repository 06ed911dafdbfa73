"""Per-turn encoding of conversations, as LLaMA-Factory 0.9.5 does it (template.py's
encode_multiturn and the supervised processor).

A conversation is a list of messages: an optional ``system`` message first, then turns that
alternate (``user`` | ``observation``) and (``assistant`` | ``function``). Each turn's slots are
tokenized separately and concatenated, so the prompt of turn k is exactly the tokens between
reply k-1 and reply k: no rendering of prefixes, and templates whose generation prompt ends in
whitespace or that rewrite earlier turns (Qwen3's thought blocks) encode like any other.

    >>> ids, labels = encode_example(get_template("qwen"), tok, messages, cutoff_len=1024)
    # ids:    <|im_start|>system\\nYou are Qwen...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n...Hello<|im_end|>\\n
    # labels: -100 ...                                                                      ...Hello<|im_end|>\\n

`cutoff_len` is shared out turn by turn with LLaMA-Factory's `infer_seqlen` (each turn's prompt
and reply truncated in proportion), `mask_history` keeps only the last reply trained (and, with a
budget too small for the whole conversation, keeps the last turns rather than the first),
`train_on_prompt` trains on everything; templates with `efficient_eos` end the sequence with one
EOS that is trained.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .examples import IGNORE
from .registry import DataError
from .templates import BOS, CONTENT, EOS, Template
from .tool_formats import describe_tools, format_calls

PROMPT_ROLES = ("user", "observation")
REPLY_ROLES = ("assistant", "function")


def prepare_tokenizer(template: Template, tokenizer) -> list[str]:
    """Fix the tokenizer for `template` as LLaMA-Factory does (its fix_special_tokens): with
    `replace_eos` the first stop word becomes EOS, a missing EOS becomes <|endoftext|>, a
    missing pad token becomes EOS, and the other stop words are added as special tokens.
    Returns the tokens that were new to the vocabulary (their ids follow the old ones)."""
    before = len(tokenizer)
    stop_words = list(template.stop_words)
    if template.replace_eos:
        if tokenizer.eos_token != stop_words[0]:
            tokenizer.add_special_tokens({"eos_token": stop_words[0]})
        stop_words = stop_words[1:]
    if tokenizer.eos_token_id is None:
        tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if stop_words:
        try:
            tokenizer.add_special_tokens({"additional_special_tokens": stop_words},
                                         replace_additional_special_tokens=False)
        except TypeError:   # tokenizers without the keyword keep the old ones anyway
            tokenizer.add_special_tokens({"additional_special_tokens": stop_words})
    return tokenizer.convert_ids_to_tokens(list(range(before, len(tokenizer))))   # added tokens come last


def _ids(tokenizer, elements: list) -> list[int]:
    """Token ids of rendered slots: each string tokenized on its own, without special tokens."""
    ids: list[int] = []
    for e in elements:
        if isinstance(e, str):
            if e:
                ids += tokenizer.encode(e, add_special_tokens=False)
        elif e == BOS and tokenizer.bos_token_id is not None:
            ids.append(tokenizer.bos_token_id)
        elif e == EOS and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return ids


def _fill(slots: tuple, content: str, idx: str | None = None) -> list:
    """The slots with the first {{content}} (then {{idx}}) in each string replaced."""
    out = []
    for s in slots:
        if isinstance(s, str):
            s = s.replace(CONTENT, content, 1)
            if idx is not None:
                s = s.replace("{{idx}}", idx, 1)
        out.append(s)
    return out


def _system_text(template: Template, system: str, tools) -> str:
    """System prompt plus the tool list's text (tools rendered in the template's tool format)."""
    if not tools:
        return system
    if template.tools_slot is not None:   # phi4_mini: the raw tools text in <|tool|> markers
        return system + _fill(template.tools_slot, tools if isinstance(tools, str) else json.dumps(tools))[0]
    return system + describe_tools(tools, template.tool_format)


def _remove_thought(template: Template, content: str) -> str:
    start, end = template.thought_words
    return re.sub(f"{re.escape(start)}(.*?){re.escape(end)}", "", content, flags=re.DOTALL).lstrip("\n")


def _encode_messages(template: Template, tokenizer, turns: list[dict], system: str, tools) -> list[list[int]]:
    """One token list per turn; the first also carries the prefix and the system prompt."""
    system = system or template.default_system
    encoded = []
    for i, m in enumerate(turns):
        elements: list = []
        system_text = ""
        if i == 0:
            elements += list(template.prefix)
            if system or tools:
                system_text = _fill(template.system, _system_text(template, system, tools))
                if not template.system_in_user:
                    elements += system_text
        content = m["content"]
        if m["role"] == "user" and template.system_in_user and system_text:
            content = system_text[0] + content   # the system slot's first piece, glued to the message
        if m["role"] == "user":
            elements += _fill(template.user, content, None if template.system_in_user else str(i // 2))
        elif m["role"] == "assistant":
            elements += _fill(template.assistant, content)
        elif m["role"] == "observation":
            elements += _fill(template.observation, content)
        else:   # function
            words = (None, None) if template.system_in_user else (template.thought_words, template.tool_call_words)
            elements += _fill(template.function, format_calls(content, template.tool_format, *words))
        encoded.append(_ids(tokenizer, elements))
    return encoded


def encode_turns(template: Template, tokenizer, turns: list[dict], system: str = "", tools=None,
                 mask_history: bool = False) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) per turn. Reasoning templates: without a thought block in a reply,
    an empty one is added, to the prompt (not trained) when enable_thinking is false or to the
    reply otherwise; enable_thinking false also removes the replies' thoughts, and mask_history
    removes them from every turn but the last (only the last is encoded with a thought), unless
    the template has preserve_thinking (LLaMA-Factory's "discarding_history_cot" is exactly
    mask_history and not preserve_thinking)."""
    mask_history = mask_history and not template.preserve_thinking
    if template.reasoning:
        turns = [dict(m) for m in turns]
        replies = range(1, len(turns), 2)
        if not template.enable_thinking:
            for i in replies:
                turns[i]["content"] = _remove_thought(template, turns[i]["content"])
        if mask_history:
            for i in replies[:-1]:
                turns[i]["content"] = _remove_thought(template, turns[i]["content"])
    encoded = _encode_messages(template, tokenizer, turns, system, tools)
    if template.reasoning:
        empty = tokenizer.encode(template.thought_words[0] + template.thought_words[1], add_special_tokens=False)
        start, end = (w.strip() for w in template.thought_words)
        for i in [len(turns) - 2] if mask_history else range(0, len(turns), 2):
            reply = turns[i + 1]["content"]
            if start not in reply and end not in reply:
                if template.enable_thinking:
                    encoded[i + 1] = empty + encoded[i + 1]
                else:
                    encoded[i] = encoded[i] + empty
    return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """How much of a turn's prompt and reply fit in `cutoff_len` tokens (LLaMA-Factory's rule):
    a short reply (under half the budget) is kept whole and the prompt cut; else a short prompt
    is kept and the reply cut; else both are cut in proportion to their lengths."""
    if target_len * 2 < cutoff_len:
        target_room = cutoff_len
    elif source_len * 2 < cutoff_len:
        target_room = cutoff_len - source_len
    else:
        target_room = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target = min(target_room, target_len)
    new_source = min(max(cutoff_len - new_target, 0), source_len)
    return new_source, new_target


def split_system(messages: list[dict]) -> tuple[str, list[dict]]:
    """(system prompt, turns) of a message list that may start with a system message."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return "", messages


def malformed(messages: list[dict]) -> str | None:
    """Why LLaMA-Factory would skip this conversation (None if it is fine): the turns must
    alternate user/observation and assistant/function and end with a reply."""
    _, turns = split_system(messages)
    if not turns:
        return "no turns"
    for i, m in enumerate(turns):
        if m["role"] not in (PROMPT_ROLES if i % 2 == 0 else REPLY_ROLES):
            return f"turn {i + 1} is {m['role']!r} where {' or '.join(PROMPT_ROLES if i % 2 == 0 else REPLY_ROLES)} " \
                   "belongs"
    if len(turns) % 2:
        return "it ends on a prompt, not a reply"
    return None


def encode_example(template: Template, tokenizer, messages: list[dict], cutoff_len: int, tools=None,
                   train_on_prompt: bool = False, mask_history: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one well-formed conversation (see :func:`malformed`), truncated to
    `cutoff_len` turn by turn. Labels are IGNORE on prompts (unless `train_on_prompt`) and on
    every reply but the last with `mask_history`. With `efficient_eos` the sequence ends in EOS,
    and each later prompt's first label is EOS: the previous reply has no end marker of its own."""
    if train_on_prompt and template.efficient_eos:
        raise DataError(f"template {template.name} has efficient_eos and cannot train on the prompt "
                        "(LLaMA-Factory refuses it too): set train_on_prompt: false.")
    system, turns = split_system(messages)
    pairs = encode_turns(template, tokenizer, turns, system, tools, mask_history)
    eos = tokenizer.eos_token_id
    total = 1 if template.efficient_eos else 0
    if mask_history:
        pairs = pairs[::-1]   # the last turns get the budget first
    input_ids: list[int] = []
    labels: list[int] = []
    for k, (source, target) in enumerate(pairs):
        if total >= cutoff_len:
            break
        n_source, n_target = infer_seqlen(len(source), len(target), cutoff_len - total)
        source, target = source[:n_source], target[:n_target]
        total += n_source + n_target
        if train_on_prompt:
            source_labels = list(source)
        elif template.efficient_eos and k != 0 and n_source:
            source_labels = [eos] + [IGNORE] * (n_source - 1)
        else:
            source_labels = [IGNORE] * n_source
        target_labels = [IGNORE] * n_target if mask_history and k != 0 else list(target)
        if mask_history:
            input_ids = source + target + input_ids
            labels = source_labels + target_labels + labels
        else:
            input_ids += source + target
            labels += source_labels + target_labels
    if template.efficient_eos:
        input_ids.append(eos)
        labels.append(eos)
    return input_ids, labels


@dataclass
class ChatEncoder:
    """How a run encodes its conversations: a per-turn `template` (a LLaMA-Factory template, or
    one cut from the tokenizer's chat_template), or `marked`, a Jinja chat_template with
    {% generation %} marks that is rendered whole (jinja_template.py). Picklable: it travels to
    datasets.map's worker processes with the tokenizer. `new_from`: ids from there on are
    tokens the template added to the tokenizer (the model has no trained embedding for them)."""
    template: Template
    marked: str | None = None
    new_from: int | None = None
    new_tokens: tuple[str, ...] = ()

    def encode(self, tokenizer, messages: list[dict], cutoff_len: int, train_on_prompt: bool = False,
               mask_history: bool = False, tools=None) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of a well-formed conversation (see :func:`malformed`)."""
        if self.marked is not None:
            from .jinja_template import encode_marked
            if tools or any(m["role"] in ("function", "observation") for m in messages):
                raise DataError("tool-calling data (tools, function_call or observation turns) with the tokenizer's "
                                "{% generation %} chat_template: set template to a LLaMA-Factory template name, whose "
                                "tool_format renders them.")
            ids, labels = encode_marked(tokenizer, self.marked, messages, cutoff_len, train_on_prompt, mask_history)
        else:
            ids, labels = encode_example(self.template, tokenizer, messages, cutoff_len, tools, train_on_prompt,
                                         mask_history)
        if self.new_from is not None and any(t >= self.new_from for t in ids):
            raise DataError(f"template {self.template.name} puts {', '.join(self.new_tokens)} into the examples, "
                            "which the tokenizer does not have (LLaMA-Factory adds them as new tokens, which needs "
                            "resize_vocab; megatrain does not resize the model): use the template of the model's "
                            "family, or leave template unset for the tokenizer's own chat_template.")
        return ids, labels


def check_options(config) -> None:
    """The template options a config can get wrong, checked before any model or tokenizer loads:
    the template name, the tool format, train_on_prompt with mask_history or with an
    efficient_eos template. (make_encoder checks them again, with the tokenizer.)"""
    from .templates import get_template
    from .tool_formats import check_format
    if config.template is not None:
        t = get_template(config.template)
        if config.train_on_prompt and t.efficient_eos:
            raise DataError(f"template {t.name} has efficient_eos and cannot train on the prompt (LLaMA-Factory "
                            "refuses it too): set train_on_prompt: false.")
    if config.tool_format is not None:
        check_format(config.tool_format)
    if config.train_on_prompt and config.mask_history:
        raise DataError("train_on_prompt and mask_history together: one trains on every prompt, the other on the "
                        "last reply only (LLaMA-Factory refuses the pair too); set one of them to false.")


def make_encoder(tokenizer, template: str | None, default_system: str | None = None, tool_format: str | None = None,
                 enable_thinking: bool = True, train_on_prompt: bool = False,
                 mask_history: bool = False, preserve_thinking: bool = False) -> ChatEncoder:
    """The run's ChatEncoder for `template` (a LLaMA-Factory name, or None: the tokenizer's
    chat_template) with LLaMA-Factory's options; fixes the tokenizer for it (prepare_tokenizer).
    Everything is checked here, before the model loads: the template name, the tool format,
    train_on_prompt with an efficient_eos template, a chat_template that cannot be cut into turns."""
    from .jinja_template import has_generation_marks, parse_chat_template
    from .templates import get_template
    from .tool_formats import check_format
    if tool_format is not None:
        check_format(tool_format)
    if train_on_prompt and mask_history:
        raise DataError("train_on_prompt and mask_history together: one trains on every prompt, the other on the "
                        "last reply only (LLaMA-Factory refuses the pair too); set one of them to false.")
    marked = None
    if template is not None:
        t = get_template(template)
    else:
        jinja = getattr(tokenizer, "chat_template", None)
        if not isinstance(jinja, str) or not jinja:
            raise DataError("the tokenizer has no chat_template: set template to a LLaMA-Factory template name "
                            "(chatml, qwen, llama3, ...).")
        if has_generation_marks(jinja):
            marked, t = jinja, Template("chat_template", (CONTENT,), (CONTENT,), (CONTENT,), (CONTENT,), (CONTENT,))
        else:
            t = parse_chat_template(tokenizer, jinja)
    t = t.configured(default_system, tool_format, enable_thinking, preserve_thinking)
    if train_on_prompt and t.efficient_eos:
        raise DataError(f"template {t.name} has efficient_eos and cannot train on the prompt (LLaMA-Factory "
                        "refuses it too): set train_on_prompt: false.")
    # the vocabulary before any template touched this tokenizer: a second encoder (the eval set's)
    # must still know which tokens the model lacks
    base = getattr(tokenizer, "megatrain_base_vocab", None) or len(tokenizer)
    tokenizer.megatrain_base_vocab = base
    prepare_tokenizer(t, tokenizer)
    if template is not None and (getattr(tokenizer, "chat_template", None) is None or t.replace_jinja):
        # as LLaMA-Factory: the exported tokenizer renders like the template it was trained with
        from .jinja_template import template_as_jinja
        tokenizer.chat_template = template_as_jinja(t, tokenizer)
    added = tuple(tokenizer.convert_ids_to_tokens(list(range(base, len(tokenizer)))))
    return ChatEncoder(t, marked, base if added else None, added)
