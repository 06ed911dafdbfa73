"""MkDocs hook: the tables the documentation shows are made from the code, never copied by hand.

A page asks for one with a marker line, replaced when the site is built:

    <!-- megatrain:generate lf-keys -->      LLaMA-Factory's keys: mapped, noted, refused (train/lf_keys.py)
    <!-- megatrain:generate train-keys -->   `megatrain train`'s own keys by group (train/keys_help.py)
    <!-- megatrain:generate errors -->       the error classes and their exit codes (megacompile/errors.py)

`tests/test_docs.py` builds the site with `mkdocs build --strict` and checks that each table
holds every row of its source.
"""
from __future__ import annotations

import re

MARKER = re.compile(r"^<!-- megatrain:generate ([\w-]+) -->$", re.M)


def _yaml(value) -> str:
    """A value as a YAML config spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else "''"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _by_reason(items) -> dict[str, list[str]]:
    """Keys grouped by their reason, in the order the reasons first appear."""
    out: dict[str, list[str]] = {}
    for key, reason in items:
        out.setdefault(reason, []).append(key)
    return out


def lf_keys() -> str:
    from megacompile.train.hparams import lf_keys as lf
    lines = ["- **Mapped** into megatrain's keys (a contradiction with the key it maps to is refused):"]
    lines += [f"    - `{key}`: {what}." for key, what in lf.MAPPED.items()]
    lines.append("- **Accepted and ignored**, with one line at the start of the run saying what megatrain does "
                 "instead (keys with the same reason share the line):")
    for reason, keys in _by_reason(lf.NOTED.items()).items():
        lines.append(f"    - {', '.join(f'`{k}`' for k in keys)}: {reason}.")
    lines.append("- **Refused with the reason**, unless the value is the one in brackets (LLaMA-Factory's default, "
                 "which changes nothing):")
    for stage, reason in lf.STAGES_REFUSED.items():
        lines.append(f"    - `stage: {stage}`: {reason}.")
    refused = ((f"`{key}` ({', '.join(_yaml(v) for v in harmless)})", reason)
               for key, (harmless, reason) in lf.REFUSED.items())
    for reason, keys in _by_reason(refused).items():
        lines.append(f"    - {', '.join(keys)}: {reason}.")
    return "\n".join(lines)


def train_keys() -> str:
    from megacompile.train.hparams.keys_help import key_groups
    out = []
    for group, rows in key_groups():
        out += [f"**{group}**", "", "| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{name}` | `{_cell(default)}` | {_cell(text)} |" if default else f"| `{name}` | | {_cell(text)} |"
                for name, default, text in rows]
        out.append("")
    return "\n".join(out)


def errors() -> str:
    import megacompile.cli  # noqa: F401 (its UsageError is one of the classes)
    from megacompile import errors as err

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)
    classes = [err.MegatrainError, *dict.fromkeys(subclasses(err.MegatrainError))]
    out = ["| error class | exit code | raised when |", "|---|---|---|"]
    for cls in classes:
        doc = " ".join((cls.__doc__ or "").split())
        out.append(f"| `{cls.__module__.replace('megacompile.', '')}.{cls.__name__}` | {cls.exit_code} | "
                   f"{_cell(doc)} |")
    return "\n".join(out)


TABLES = {"lf-keys": lf_keys, "train-keys": train_keys, "errors": errors}


def render(markdown: str) -> str:
    """`markdown` with each marker replaced by its table (an unknown name is an error)."""
    def table(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise ValueError(f"docs: unknown generated table {name!r} (known: {', '.join(TABLES)})")
        return TABLES[name]()
    return MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, **_kwargs) -> str:
    return render(markdown)
