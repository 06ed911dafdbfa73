"""The compiler/runtime boundary (the IR layer: megacompile/ir.py, the compile artifacts and the
schedule ops, and megacompile/ir_ops.py, the custom ops passes insert): runtime/ imports only
the IR layer, the errors, the process topology (megacompile/distributed.py, which imports only
the errors) and itself; the compiler side (passes/, cost_model, simulate) never
imports the runtime; the IR layer imports neither side. Across the whole package: no import
cycle between modules, and no module imports another's private (`_name`) names. Checked on the
source (every import statement, also inside functions: an import deferred into a function is
still a dependency)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IR_LAYER = ("megacompile.ir", "megacompile.ir_ops")


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
           if not any(_is(m, ok) for ok in ("megacompile.runtime", *IR_LAYER, "megacompile.errors",
                                            "megacompile.distributed"))}
    assert not bad, sorted(bad)
    assert imports(ROOT / "megacompile" / "distributed.py") <= {"megacompile.errors.ConfigError",
                                                                 "megacompile.errors.MegatrainError"}


def test_the_compiler_never_imports_the_runtime():
    compiler = [*_files("passes"), ROOT / "megacompile" / "cost_model.py", ROOT / "megacompile" / "simulate.py"]
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in compiler for m in imports(p) if _is(m, "megacompile.runtime")}
    assert not bad, sorted(bad)


def test_the_ir_layer_depends_on_neither_side():
    for name in ("ir.py", "ir_ops.py"):
        assert not {m for m in imports(ROOT / "megacompile" / name) if not any(_is(m, ok) for ok in IR_LAYER)}


def test_the_checker_sees_imports():
    """The rule is live: an import of the passes from runtime/ would be found."""
    found = imports(ROOT / "runtime" / "executor.py")
    assert "megacompile.ir.STEP" in found and "megacompile.errors.ResidencyError" in found
    assert "megacompile.ir_ops.fetch_expert_rows" in imports(ROOT / "passes" / "routed_experts.py")
    assert "megacompile.ir_ops.triton_runs" in imports(ROOT / "runtime" / "kernels" / "ops.py")


def test_the_options_and_the_passes_do_not_import_the_backend():
    """The pipelines are registered beside the passes (passes/pipelines.py): options.py lists and
    checks them without importing backend.py, which imports options.py (the cycle this ended)."""
    for path in (ROOT / "megacompile" / "options.py", *_files("passes")):
        assert not any(_is(m, "megacompile.backend") for m in imports(path)), path


def test_each_pass_has_a_stable_identity_that_its_options_values_extend():
    from megacompile.passes import PassContext
    from megacompile.passes.pipelines import all_passes, identities, pass_names
    ids = identities()
    assert list(ids) == list(pass_names()) and len(set(ids.values())) == len(ids)
    assert identities() == ids   # stable within a process (and across: a hash of the source)
    schedule = next(p for p in all_passes() if p.name == "schedule")
    two, one = (PassContext("forward", 4, {}, slots=s).view("schedule", schedule.uses) for s in (2, 1))
    assert schedule.identity_with(two) == schedule.identity_with(two) != schedule.identity_with(one)


def _package_modules() -> dict[str, Path]:
    return {_module_of(p): p for folder in ("megacompile", "passes", "runtime") for p in _files(folder)}


def import_graph():
    """(module -> the modules it imports, [(importer, module, private name)]) over the package:
    `from X import name` is an edge to X (to X.name where that is a module); the private names
    are `_name`s imported from another module."""
    import networkx as nx
    modules = _package_modules()

    def owner(name: str) -> tuple[str | None, str]:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in modules:
                return ".".join(parts[:i]), ".".join(parts[i:])
        return None, ""
    graph, private = nx.DiGraph(), []
    for module, path in modules.items():
        graph.add_node(module)
        for name in imports(path):
            target, rest = owner(name)
            if target is None or target == module:
                continue
            graph.add_edge(module, target)
            if rest.startswith("_") and not rest.startswith("__"):
                private.append((module, target, rest))
    return graph, private


def test_no_import_cycle_in_the_package():
    """Imports run one way (a cycle means two modules are one concern, or a third is missing)."""
    import networkx as nx
    graph, _ = import_graph()
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    assert not cycles, cycles


def test_no_module_imports_another_s_private_names():
    _, private = import_graph()
    assert not private, sorted(private)


def test_the_graph_checks_are_live(tmp_path, monkeypatch):
    """A cycle and a private import written into a copy of two modules are found."""
    import networkx as nx
    graph, _ = import_graph()
    assert graph.has_edge("megacompile.train.checkpoint.format", "megacompile.train.checkpoint.files")
    graph.add_edge("megacompile.train.checkpoint.files", "megacompile.train.checkpoint.format")
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))
    fake = tmp_path / "megacompile" / "train" / "lora.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from .checkpoint import _damaged\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "megacompile" / "train" / "checkpoint.py").write_text("")
    _, private = import_graph()
    assert private == [("megacompile.train.lora", "megacompile.train.checkpoint", "_damaged")]


def test_the_tokenized_data_cache_key_covers_the_code_that_makes_the_examples():
    """tokenize_cache.py keys its cache on the source of the modules that turn records into
    tokens (`_CODE`): each module it imports in the training package is one of them, and each
    named file exists (a module moved without its name updated would leave stale examples)."""
    import networkx as nx

    from megacompile.train.data import tokenize_cache
    graph, _ = import_graph()
    reached = {m for m in nx.descendants(graph, "megacompile.train.data.tokenize_cache")
               if m.startswith("megacompile.train.")}
    named = {f"megacompile.train.data.{name[:-3].replace('/__init__', '').replace('/', '.')}"
             for name in tokenize_cache._CODE}
    assert reached <= named, sorted(reached - named)
    here = Path(tokenize_cache.__file__).parent
    assert [name for name in tokenize_cache._CODE if not (here / name).is_file()] == []


#: the training package's layers, in the order imports may run (a layer imports only itself and those before)
TRAIN_LAYERS = ("hparams", "data", "model", "checkpoint")


def _train_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["megacompile", "train"] or len(parts) < 3:
        return None
    return TRAIN_LAYERS.index(parts[2]) if parts[2] in TRAIN_LAYERS else len(TRAIN_LAYERS)   # (the loop)


def test_the_training_package_imports_run_one_way():
    """hparams -> data -> model -> checkpoint -> the loop (trainer.py and its parts): a stage
    workflow or the loop may read any layer; the config never reads the data, the data never the
    model, the model never the checkpoints."""
    graph, _ = import_graph()
    back = [(a, b) for a, b in graph.edges
            if _train_layer(a) is not None and _train_layer(b) is not None and _train_layer(a) < _train_layer(b)]
    assert not back, sorted(back)
    assert _train_layer("megacompile.train.hparams.config") == 0 and _train_layer("megacompile.train.trainer") == 4


def test_every_package_folder_is_installed():
    """pyproject.toml lists every package of the tree (a subpackage left out would be missing
    from a wheel, while the editable install used here still finds it)."""
    import pytest
    tomllib = pytest.importorskip("tomllib")   # (Python 3.11+)
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_of(p) for folder in ("megacompile", "passes", "runtime") for p in _files(folder)
             if p.name == "__init__.py"}
    assert found == listed, (sorted(found - listed), sorted(listed - found))
