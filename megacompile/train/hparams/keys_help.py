"""The config keys as `megatrain train --help` lists them: by group, with defaults and one line each.

    print(keys_help())
      model:
        model_name_or_path      ''        a Hugging Face id or folder, or embedded:smollm2 ...
      ...
      megatrain options (compile):
        slots                   2         Number of decoder-layer weight slots on the device ...

The descriptions are the fields' own: TrainConfig's `help` metadata (config.py) and the first
sentence of each Options field's `#:` comment (options.py); nothing is written twice.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap

from ...options import Options
from .config import GROUPS, TrainConfig


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" else value
    return str(value) if not isinstance(value, tuple) else str(list(value))


def option_help() -> dict[str, str]:
    """Each compile option's first sentence of its `#:` comment in options.py."""
    out, comment = {}, []
    for line in inspect.getsource(Options).splitlines():
        line = line.strip()
        if line.startswith("#:"):
            comment.append(line[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", line)
        if m and comment:
            text = " ".join(comment)
            out[m.group(1)] = re.split(r"(?<=[.)])\s+(?=[A-Z\"(])", text)[0]
        comment = []
    return out


def _rows(rows: list[tuple[str, str, str]], width: int) -> list[str]:
    lines = []
    for name, default, text in rows:
        head = f"  {name:<30} {default:<10} "
        if len(head) > 44:   # a long default goes on its own line
            lines.append(f"  {name:<30} {default}")
            head = " " * 44
        wrapped = textwrap.wrap(text, max(width - 44, 30)) or [""]
        lines.append(head.ljust(44) + wrapped[0])
        lines += [" " * 44 + more for more in wrapped[1:]]
    return lines


#: compile options whose default under `megatrain train` is not Options' own (trainer.py)
_TRAIN_DEFAULTS = {"device": "cuda if available, else cpu", "logits": "drop"}


def key_groups() -> list[tuple[str, list[tuple[str, str, str]]]]:
    """All config keys by group, each as (name, default, one line of help): what `keys_help`
    prints and the documentation's key table shows (docs/hooks.py)."""
    fields = [f for f in dataclasses.fields(TrainConfig) if "group" in f.metadata]
    groups = [(group, [(f.name, _default(f), f.metadata["help"]) for f in fields if f.metadata["group"] == group])
              for group in GROUPS]
    helps = option_help()
    groups.append(("megatrain options (the backend's compile options, as top-level keys)",
                   [(f.name, _TRAIN_DEFAULTS.get(f.name, _default(f)), helps.get(f.name, ""))
                    for f in dataclasses.fields(Options)]))
    return groups


def keys_help(width: int = 118) -> str:
    """All config keys by group: name, default, one line of help."""
    lines = ["config keys (YAML, or key=value after the config file):"]
    for group, rows in key_groups():
        lines.append(f"\n{group}:")
        lines += _rows(rows, width)
    lines.append("\nLLaMA-Factory keys megatrain has no field for are mapped (bf16 -> torch_dtype), accepted with a "
                 "note (deepspeed), or refused with the reason: docs/llamafactory.md.")
    return "\n".join(lines)
