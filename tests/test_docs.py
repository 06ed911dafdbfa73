"""The documentation cannot rot: the site builds with no broken link, its generated tables hold
every row of their sources, and the commands and examples it marks as tested run.

A fenced ```bash block right after a `<!-- tested -->` line (in README.md or docs/*.md) is run
line by line: `megatrain ...` lines through the command line's `main` in this process (the
same parser, commands and exit codes as the installed script, without 6 s of imports per
line), other lines in bash from the repository root. A line's trailing comment may say
`# exits N: text`: the exit code must be N and, where text is given, the error output must hold
it (up to a `...`); otherwise it must exit 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
TESTED = re.compile(r"^<!-- tested -->\n```bash\n(.*?)^```", re.M | re.S)


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tested_lines() -> list[tuple[str, str]]:
    out = []
    for page in [ROOT / "README.md", *PAGES]:
        for block in TESTED.findall(page.read_text()):
            out += [(f"{page.relative_to(ROOT)}: {line.strip()}", line.strip()) for line in block.splitlines()
                    if line.strip() and not line.strip().startswith("#")]
    return out


def test_the_site_builds_with_no_broken_link(tmp_path):
    """`mkdocs build --strict`: a link to a missing page or anchor, a page left out of the nav,
    or an unknown generated table fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "site" / "llamafactory" / "index.html").is_file()
    assert not (tmp_path / "site" / "hooks.py").exists()


def test_each_generated_table_holds_every_row_of_its_source():
    from megacompile import errors
    from megacompile.options import Options
    from megacompile.train.hparams import lf_keys
    from megacompile.train.hparams.config import TrainConfig
    hooks = _hooks()
    lf = hooks.render((ROOT / "docs" / "llamafactory.md").read_text())
    missing = [k for k in [*lf_keys.NOTED, *lf_keys.REFUSED, *lf_keys.MAPPED] if f"`{k}`" not in lf]
    missing += [s for s in lf_keys.STAGES_REFUSED if f"`stage: {s}`" not in lf]
    assert not missing and "<!-- megatrain:generate" not in lf
    train = hooks.render((ROOT / "docs" / "train.md").read_text())
    fields = [f.name for f in dataclasses.fields(TrainConfig) if "group" in f.metadata]
    fields += [f.name for f in dataclasses.fields(Options)]
    assert [k for k in fields if f"| `{k}` |" not in train] == []
    page = hooks.render((ROOT / "docs" / "errors.md").read_text())
    for cls in (errors.MegatrainError, errors.ConfigError, errors.CannotFitError, errors.TrainingError,
                errors.InternalError):
        assert re.search(rf"\| `errors\.{cls.__name__}` \| {cls.exit_code} \|", page), cls.__name__
    # every exit code a class carries is explained in the page's exit-code table
    codes = {int(c) for c in re.findall(r"^\| (\d+) \|", page, re.M)}
    assert {c.exit_code for c in [errors.MegatrainError, *errors.MegatrainError.__subclasses__()]} <= codes


def test_an_unknown_generated_table_is_an_error():
    with pytest.raises(ValueError, match="unknown generated table 'lf-key'"):
        _hooks().render("text\n<!-- megatrain:generate lf-key -->\n")


TESTED_LINES = _tested_lines()


@pytest.mark.parametrize("where,line", TESTED_LINES, ids=[w for w, _ in TESTED_LINES])
def test_a_command_the_docs_mark_as_tested_runs(where, line, tmp_path, monkeypatch):
    from megacompile.cli import main
    command, _, comment = line.partition("#")
    expect = re.match(r"\s*exits (\d+)(?::\s*(.*))?", comment)
    code_wanted = int(expect.group(1)) if expect else 0
    says = (expect.group(2) or "").split("...")[0].strip() if expect else ""
    argv = shlex.split(command)
    if argv[0] == "megatrain":
        monkeypatch.chdir(tmp_path)   # (nothing a documented command writes lands in the repository)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv[1:])
            except SystemExit as e:   # (argparse's --version)
                code = e.code or 0
        output, errors = out.getvalue(), err.getvalue()
    else:
        run = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
        code, output, errors = run.returncode, run.stdout, run.stderr
    assert code == code_wanted, f"{where}: exit {code}\n{output[-2000:]}\n{errors[-2000:]}"
    assert says in errors, f"{where}: {errors[-2000:]}"


def _readme_block(lang: str, index: int = 0) -> str:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[index]


def test_the_readme_python_example_trains(tmp_path, capsys):
    """README's torch.compile example, as written, on a 2-layer Llama saved as a Hub folder is
    (the model's name and the device are the only words changed)."""
    from conftest import chatml_tokenizer, save_tiny_llama
    code = _readme_block("python")
    assert code.count('"HuggingFaceTB/SmolLM2-135M-Instruct"') == 1 and code.count('"cuda"') == 1
    folder = save_tiny_llama(tmp_path / "model", chatml_tokenizer())
    code = code.replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(folder))).replace('"cuda"', '"cpu"')
    assert len(code.splitlines()) <= 20
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[1]) for line in out if re.match(r"^\d+ \S+$", line)]
    assert len(losses) == 10 and losses[-1] < losses[0], out
    assert "distinct_layer_bodies" in out[-1]


def test_the_readme_config_example_is_a_config_megatrain_train_takes(tmp_path):
    """README's YAML example loads as a config (LLaMA-Factory's keys mapped: bf16 -> torch_dtype)."""
    from megacompile.train.hparams.config import load_config
    path = tmp_path / "my_run.yaml"
    path.write_text(_readme_block("yaml"))
    cfg = load_config(path)
    assert cfg.torch_dtype == "bfloat16" and cfg.gradient_accumulation_steps == 8 and cfg.stage == "sft"
