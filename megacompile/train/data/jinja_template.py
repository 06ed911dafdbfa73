"""`template` unset: the tokenizer's own Jinja chat_template, encoded per turn.

Why per turn, like a named template: LLaMA-Factory (get_template_and_fix_tokenizer without a
template) does not render conversation prefixes; its parse_template renders four probe
conversations with ``{{content}}`` as the message text and cuts the output into slots (prefix,
system, user + generation prompt, assistant), finds a default system prompt that the template
inserts by itself, and from then on encodes turn by turn exactly like a named template. We do
the same (:func:`parse_chat_template`), so a model's own template gives LLaMA-Factory's tokens
and labels, and templates that rewrite earlier turns (Qwen3 drops old thought blocks) or whose
generation prompt ends in whitespace still encode: the slots are cut once, not per prefix.

The exception: a template with ``{% generation %}`` blocks says itself which tokens are the
assistant's. Then the whole conversation is rendered once with
``apply_chat_template(return_assistant_tokens_mask=True)`` and those tokens are the trained ones
(:func:`encode_marked`); cutoff_len cuts the end. LLaMA-Factory ignores the blocks.
"""
from __future__ import annotations

import re

from .examples import IGNORE
from .registry import DataError
from .templates import CONTENT, Template

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_marks(chat_template: str) -> bool:
    """True when the Jinja template marks the assistant's tokens with {% generation %}."""
    return bool(_GENERATION.search(chat_template))


def _render(tokenizer, chat_template: str, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:   # jinja2 errors (raise_exception in the template, undefined names)
        raise DataError(f"the tokenizer's chat_template cannot render a {'/'.join(m['role'] for m in messages)} "
                        f"conversation ({type(e).__name__}: {e}); set template to a LLaMA-Factory template name "
                        "instead.") from None


def _inserted(short: str, long: str) -> str:
    """The characters of `long` skipped while matching `short` against it in order: what a
    template inserted (its default system prompt) when the system message is left out."""
    out, i = [], 0
    for ch in long:
        if i >= len(short):
            break
        if ch == short[i]:
            i += 1
        else:
            out.append(ch)
    return "".join(out)


def parse_chat_template(tokenizer, chat_template: str) -> Template:
    """A per-turn Template cut from a Jinja chat template (see the module docstring)."""
    prefix = tokenizer.decode(tokenizer.encode(""))   # what the tokenizer puts first (a BOS), as text
    n = len(prefix)
    user = {"role": "user", "content": CONTENT}
    system = _render(tokenizer, chat_template, [{"role": "system", "content": CONTENT}], False)[n:]
    user_empty_system = _render(tokenizer, chat_template, [{"role": "system", "content": ""}, user], True)[n:]
    user_slot = _render(tokenizer, chat_template, [user], True)[n:]
    assistant = _render(tokenizer, chat_template, [user, {"role": "assistant", "content": CONTENT}], False)
    assistant = assistant[n + len(user_slot):]
    reasoning = "<think>" in assistant
    assistant = assistant.replace("<think>", "").replace("</think>", "").lstrip("\n")
    default_system = ""
    if len(user_slot) > len(user_empty_system):   # the template adds a system prompt of its own
        default_system = _inserted(user_empty_system, user_slot)
        user_slot = user_slot[len(system.replace(CONTENT, default_system, 1)):]
    if CONTENT not in user_slot or CONTENT not in assistant:
        raise DataError("the tokenizer's chat_template does not render messages as plain text (a user or assistant "
                        "message is rewritten), so it cannot be cut into turns; set template to a LLaMA-Factory "
                        "template name.")
    return Template(name="chat_template", user=(user_slot,), assistant=(assistant,), system=(system,),
                    function=(assistant,), observation=(user_slot,), prefix=(prefix,) if prefix else (),
                    default_system=default_system, reasoning=reasoning)


def encode_marked(tokenizer, chat_template: str, messages: list[dict], cutoff_len: int,
                  train_on_prompt: bool = False, mask_history: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, labels) from the template's {% generation %} marks: the whole conversation
    rendered once; the marked tokens trained (only the last marked run with `mask_history`,
    everything with `train_on_prompt`); cut at `cutoff_len`."""
    try:
        out = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as e:
        raise DataError(f"the tokenizer's chat_template cannot render this conversation ({type(e).__name__}: {e}); "
                        "set template to a LLaMA-Factory template name instead.") from None
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if mask_history:
        starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
        mask = [m if starts and i >= starts[-1] else 0 for i, m in enumerate(mask)]
    labels = list(ids) if train_on_prompt else [t if m else IGNORE for t, m in zip(ids, mask)]
    return ids[:cutoff_len], labels[:cutoff_len]


def _jinja_text(text: str) -> str:
    """`text` as a single-quoted Jinja string literal (LLaMA-Factory escapes only the quote)."""
    return "'" + text.replace("'", "\\'") + "'"


def _jinja_slots(slots: tuple, tokenizer, placeholder: str = "content") -> str:
    """A Jinja expression concatenating the slots, the message as `placeholder`."""
    from .templates import BOS, EOS
    parts = []
    for slot in slots:
        if isinstance(slot, str):
            before, *after = slot.split(CONTENT)
            parts += [_jinja_text(before)] if before else []
            if after:
                parts.append(placeholder)
                parts += [_jinja_text(after[0])] if after[0] else []
        elif slot == BOS and tokenizer.bos_token_id is not None:   # the token itself: {{ eos_token }} may differ
            parts.append("'" + tokenizer.bos_token + "'")
        elif slot == EOS and tokenizer.eos_token_id is not None:
            parts.append("'" + tokenizer.eos_token + "'")
    return " + ".join(parts)


def template_as_jinja(template: Template, tokenizer) -> str:
    """The chat_template LLaMA-Factory writes into the tokenizer for a named template (its
    fix_jinja_template): system, user and assistant turns only, the default system prompt set
    first."""
    prefix, system, user, assistant = (
        _jinja_slots(template.prefix, tokenizer), _jinja_slots(template.system, tokenizer, "system_message"),
        _jinja_slots(template.user, tokenizer), _jinja_slots(template.assistant, tokenizer))
    out = "{{ " + prefix + " }}" if prefix else ""
    if template.default_system:
        out += "{% set system_message = " + _jinja_text(template.default_system) + " %}"
    out += ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
            "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% endif %}")
    if template.system_in_user:   # the system text glued to the first user message
        out += ("{% for message in loop_messages %}{% if loop.index0 == 0 and system_message is defined %}"
                "{% set content = " + system + " + message['content'] %}"
                "{% else %}{% set content = message['content'] %}{% endif %}")
    else:
        out += ("{% if system_message is defined %}{{ " + system + " }}{% endif %}"
                "{% for message in loop_messages %}{% set content = message['content'] %}")
    return out + ("{% if message['role'] == 'user' %}{{ " + user + " }}"
                  "{% elif message['role'] == 'assistant' %}{{ " + assistant + " }}{% endif %}{% endfor %}")
