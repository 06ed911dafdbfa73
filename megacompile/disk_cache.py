"""JSON entries kept on disk between processes: compile-side results that cost seconds to make
and bytes to keep (the planner's prefix captures, plan_capture.py).

    text = disk_cache.key_text([config_dict, layers, batch, ...])   # None: a value with no plain form
    entry = disk_cache.read("plan", text)        # None: absent, unreadable, or another key's
    disk_cache.write("plan", text, payload)      # atomic; a failure is logged, never raised

An entry lives at `<folder>/<kind>/<sha256(code version, key)>.json` and holds its key's text, so a
digest collision or a file cut short by a crash reads as a miss, never as another entry. The code
version digests megatrain's own sources and the torch, transformers and Triton versions: a
change to a pass, the runtime or the modeling code makes every older entry a miss. Entries are
small (a plan capture: about 5 kB) and never evicted: delete the folder to reclaim the space.

The folder is $MEGATRAIN_COMPILE_CACHE, else `<cache root>/compile` (`cache_root`:
$MEGATRAIN_CACHE, else ~/.cache/megatrain). MEGATRAIN_COMPILE_CACHE=off turns it off.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

_log = logging.getLogger("megatrain.compile")

FORMAT = "megatrain-compile-cache-v1"
OFF = ("off", "0", "false", "no")
#: the packages whose sources a cached result depends on (pyproject's package-dir: passes/ and
#: runtime/ live beside megacompile/ in a checkout)
_PACKAGES = ("megacompile", "megacompile.passes", "megacompile.runtime")


def cache_root() -> Path:
    """$MEGATRAIN_CACHE or ~/.cache/megatrain: tokenized data, the embedded model, compile entries."""
    return Path(os.environ.get("MEGATRAIN_CACHE") or Path.home() / ".cache" / "megatrain").expanduser()


def folder() -> Path | None:
    """Where compile entries live (None: turned off)."""
    given = os.environ.get("MEGATRAIN_COMPILE_CACHE")
    if given is not None and given.strip().lower() in OFF:
        return None
    return Path(given).expanduser() if given else cache_root() / "compile"


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of megatrain's sources and the torch / transformers / Triton versions (read once
    per process: the sources cannot change under a running compile)."""
    import torch
    import transformers
    try:   # (whether and which Triton is installed decides the kernels a GPU profile's graphs hold)
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    h = hashlib.sha256(f"{FORMAT} torch {torch.__version__} transformers {transformers.__version__} "
                       f"triton {triton}".encode())
    for name in _PACKAGES:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def key_text(parts: Any) -> str | None:
    """`parts` as canonical JSON; None where a value has no plain JSON form (its repr could name
    an object's address, which another process may reuse for another object)."""
    try:
        return json.dumps(parts, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _path(kind: str, key: str) -> Path | None:
    where = folder()
    if where is None:
        return None
    digest = hashlib.sha256(f"{code_version()}\n{key}".encode()).hexdigest()
    return where / kind / f"{digest}.json"


def read(kind: str, key: str) -> Any | None:
    """The payload stored under `key`, or None."""
    path = _path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        _log.debug("compile cache: %s unreadable (%s); compiling instead", path, e)
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
        return None
    return entry.get("payload")


def write(kind: str, key: str, payload: Any) -> None:
    """Store `payload` under `key` (replacing the file whole, so readers never see a part). A
    cache that cannot be written costs a later compile, not this run: logged, not raised."""
    path = _path(kind, key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "key": key, "payload": payload}, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        _log.warning("compile cache: cannot write %s (%s); the next run compiles this again", path, e)
