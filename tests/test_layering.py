"""The compiler/runtime boundary (megacompile/ir.py): runtime/ imports only the IR layer, the
errors and itself; the compiler side (passes/, cost_model, simulate) never imports the runtime,
except the two modules that define the custom ops a pass inserts into graphs; ir.py imports
neither side. Checked on the source (every import statement, also inside functions)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the custom ops passes insert (torch.ops.megatrain.* and fetch_expert_rows): their definitions
#: are shared with the runtime that runs them; to move into the IR layer with their registries
OP_DEFINITIONS = {"megacompile.runtime.kernels.ops", "megacompile.runtime.expert_rows"}


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = {"passes": "megacompile.passes", "runtime": "megacompile.runtime"}.get(parts[0], parts[0])
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(p for part in parts for p in part.split("."))


def imports(path: Path) -> set[str]:
    """The megacompile modules `path` imports (relative imports resolved; `from X import name`
    counted as X.name when that is a module, else X)."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}")
    return {m for m in out if m.startswith("megacompile")}


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_runtime_imports_only_the_ir_layer_and_itself():
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in _files("runtime") for m in imports(p)
           if not any(_is(m, ok) for ok in ("megacompile.runtime", "megacompile.ir", "megacompile.errors"))}
    assert not bad, sorted(bad)


def test_the_compiler_never_imports_the_runtime_beyond_op_definitions():
    compiler = [*_files("passes"), ROOT / "megacompile" / "cost_model.py", ROOT / "megacompile" / "simulate.py"]
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in compiler for m in imports(p)
           if _is(m, "megacompile.runtime") and not any(_is(m, d) for d in OP_DEFINITIONS)}
    assert not bad, sorted(bad)


def test_the_ir_layer_depends_on_neither_side():
    assert not {m for m in imports(ROOT / "megacompile" / "ir.py")
                if not _is(m, "megacompile.ir")}


def test_the_checker_sees_imports():
    """The rule is live: an import of the passes from runtime/ would be found."""
    found = imports(ROOT / "runtime" / "executor.py")
    assert "megacompile.ir.SCHEDULE" in found and "megacompile.errors.ResidencyError" in found
    assert any(_is(m, "megacompile.runtime.expert_rows") for m in imports(ROOT / "passes" / "routed_experts.py"))
