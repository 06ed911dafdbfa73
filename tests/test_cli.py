"""The `megatrain` command line's exit codes and error lines (docs/errors.md).

Every user error is exit 2 and ONE `megatrain: error: ...` line on stderr, never a traceback;
"cannot fit" is 3, a failed training run 4, an internal error 1 (traceback + one
`megatrain: internal error:` line), Ctrl-C 130. Most cases here are refused before any model is
built, so the file runs in seconds.
"""
from __future__ import annotations

import json
import os

import pytest
from conftest import tiny_config

import megacompile.inspect
import megacompile.meta_model
import megacompile.plan
from megacompile.cli import main
from megacompile.errors import CannotFitError, ConfigError, TrainingError


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    tiny_config("llama", layers=2, hidden=32).to_json_file(path)
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if inspect or plan starts building or tracing the model."""
    def boom(*args, **kwargs):
        raise AssertionError("the command did work before refusing its arguments")
    monkeypatch.setattr(megacompile.inspect, "inspect_model", boom)
    monkeypatch.setattr(megacompile.plan, "plan_model", boom)


def error_line(capsys, *expected: str) -> str:
    """The one `megatrain: error:` line of stderr (no traceback), containing each of `expected`."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("megatrain:")]
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: "), err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# -- argparse's own errors ---------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["inspect", "{cfg}", "--sq", "16"], ["unrecognized arguments: --sq 16", "did you mean --seq?",
                                          "megatrain inspect --help"]),
    (["inspect"], ["required: model"]),
    (["plan", "{cfg}", "--gpu"], ["--gpu: expected one argument", "megatrain plan --help"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'", "megatrain --help"]),
    (["train"], ["required: config"]),
    (["inspect", "{cfg}", "--dtype", "int8"], ["--dtype", "'int8'", "bfloat16"]),
    (["plan", "{cfg}", "--dtype", "float64"], ["--dtype", "float32"]),
    (["inspect", "{cfg}", "--format", "xml"], ["--format", "'xml'", "chrome-trace"]),
    (["plan", "{cfg}", "--format", "yaml"], ["--format", "json"]),
    (["inspect", "{cfg}", "--show", "scheduel"], ["--show", "schedule"]),
    (["inspect", "{cfg}", "--overlap-optimizer", "true"], ["--overlap-optimizer", "backward"]),
    (["plan", "{cfg}", "--vision", "yes"], ["--vision", "frozen"]),
])
def test_argparse_errors_are_one_line_exit_2(argv, expected, config_json, no_work, capsys):
    assert main([a.replace("{cfg}", str(config_json)) for a in argv]) == 2
    error_line(capsys, *expected)


def test_help_exits_0(capsys):
    assert main(["plan", "--help"]) == 0
    assert "--host-ram" in capsys.readouterr().out


# -- sizes: positive integers ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["plan", "inspect"])
@pytest.mark.parametrize("flag", ["--seq", "--batch", "--slots"])
@pytest.mark.parametrize("value", ["0", "-4", "abc", "2.5", "99999999999999999999"])
def test_sizes_must_be_positive_integers(command, flag, value, config_json, no_work, capsys):
    assert main([command, str(config_json), flag, value, "--gpu", "h100",
                 *(["--host-ram", "1T"] * (command == "plan"))]) == 2
    error_line(capsys, f"argument {flag}:", repr(value))


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_layers_must_be_a_positive_integer(value, config_json, no_work, capsys):
    assert main(["inspect", str(config_json), "--layers", value]) == 2
    error_line(capsys, "argument --layers:")


def test_more_layers_than_the_model_has_is_refused(config_json, capsys):
    """--layers N keeps the first N layers: more than the model has would silently build a deeper
    model, so it is refused with the depth."""
    assert main(["inspect", str(config_json), "--seq", "16", "--layers", "50"]) == 2
    error_line(capsys, "--layers 50", "has 2 decoder layers", "give 1 to 2")


def test_python_api_checks_sizes_too():
    from megacompile.hardware import BUILTIN
    with pytest.raises(ConfigError, match="seq=0"):
        megacompile.inspect.inspect_model("llama-3-8b", seq=0, hardware=BUILTIN["h100"])
    with pytest.raises(ConfigError, match="batch=-1"):
        megacompile.plan.plan_model("llama-3-8b", batch=-1, hardware=BUILTIN["h100"], host_ram=2**40)


# -- inspect -o: refused before any work -----------------------------------------------------------

@pytest.mark.parametrize("output, expected", [
    ("{tmp}/no/such/folder/out.json", ["does not exist", "mkdir -p"]),
    ("{tmp}", ["is a directory"]),
    ("{tmp}/sub/", ["is a directory"]),
    ("{cfg}/out.json", ["is a file, not a folder"]),
])
def test_inspect_output_is_checked_before_any_work(output, expected, tmp_path, config_json, no_work, capsys):
    (tmp_path / "sub").mkdir()
    out = output.replace("{tmp}", str(tmp_path)).replace("{cfg}", str(config_json))
    assert main(["inspect", str(config_json), "--seq", "16", "-o", out]) == 2
    error_line(capsys, "-o ", *expected)
    assert not (tmp_path / "no").exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere")
def test_inspect_output_not_writable(tmp_path, config_json, no_work, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["inspect", str(config_json), "-o", str(locked / "out.json")]) == 2
        error_line(capsys, "permission denied")
    finally:
        locked.chmod(0o700)


# -- MODEL: presets, paths, config files, unsupported architectures --------------------------------

def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("command", ["plan", "inspect"])
def test_model_path_that_does_not_exist(command, tmp_path, capsys):
    for model in ["./no/such/dir", str(tmp_path / "nothere" / "config.json"), str(tmp_path / "x.json")]:
        assert main([command, model, "--gpu", "h100", *(["--host-ram", "1T"] * (command == "plan"))]) == 2
        line = error_line(capsys, "does not exist")
        assert "preset" not in line.split("does not exist")[0]   # not described as a bad preset name


def test_directory_without_config_json(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    error_line(capsys, "has no config.json")


@pytest.mark.parametrize("text, expected", [
    ("", "is empty"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"hidden_size": 32}', "has no 'model_type'"),
    ('{"model_type": "nosucharch"}', "'nosucharch' is not a model type transformers"),
    ('{"model_type": "lama"}', "did you mean 'llama'?"),
    ('{"model_type": "llama", "hidden_size": "big"}', "not a valid llama config"),
    ('{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 5}', "not a valid llama config"),
])
def test_bad_config_json(text, expected, tmp_path, capsys):
    assert main(["inspect", write(tmp_path / "config.json", text), "--seq", "16"]) == 2
    error_line(capsys, expected)


def test_binary_file_as_config(tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 4)
    assert main(["inspect", str(path)]) == 2
    error_line(capsys, "not a text file")


@pytest.mark.parametrize("typo, closest", [("llama3-8b", "llama-3-8b"), ("Llama-3-8B", "llama-3-8b"),
                                           ("qwen3_32b", "qwen3-32b"), ("mixtral-8x7", "mixtral-8x7b")])
def test_preset_typo_suggests_the_closest(typo, closest, capsys):
    assert main(["inspect", typo]) == 2
    error_line(capsys, f"Did you mean {closest!r}?", "is neither a preset")


def test_unknown_hub_id(capsys):
    assert main(["plan", "some-org/some-model-7b", "--gpu", "h100", "--host-ram", "1T"]) == 2
    error_line(capsys, "some-org/some-model-7b", "not the Hub id of a preset", "config.json")


def test_yaml_is_not_a_model_for_inspect(tmp_path, capsys):
    assert main(["inspect", write(tmp_path / "run.yaml", "model_name_or_path: llama-3-8b\n")]) == 2
    error_line(capsys, "is a YAML file")


def _config(model_type: str, **values):
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **values)


ENCODER_DECODER = {
    "t5": dict(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=128),
    "bart": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128),
    "whisper": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128),
}


@pytest.mark.parametrize("command", ["plan", "inspect"])
@pytest.mark.parametrize("model_type", sorted(ENCODER_DECODER))
def test_encoder_decoder_models_are_refused_before_tracing(command, model_type, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(megacompile.meta_model, "capture_program", lambda *a, **k: pytest.fail("traced"))
    path = tmp_path / "config.json"
    _config(model_type, **ENCODER_DECODER[model_type]).to_json_file(path)
    assert main([command, str(path), "--seq", "16", "--gpu", "h100",
                 *(["--host-ram", "1T"] * (command == "plan"))]) == 2
    line = error_line(capsys, f"model_type={model_type!r}", "is an encoder-decoder model", "decoder-only")
    assert len(line) < 400   # not transformers' list of every causal-LM class


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_encoder_only_models_are_refused_before_tracing(model_type, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(megacompile.meta_model, "capture_program", lambda *a, **k: pytest.fail("traced"))
    path = tmp_path / "config.json"
    _config(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            vocab_size=128).to_json_file(path)
    assert main(["plan", str(path), "--seq", "16", "--gpu", "h100", "--host-ram", "1T"]) == 2
    error_line(capsys, "is an encoder-only model")
    assert main(["inspect", str(path), "--seq", "16"]) == 2
    error_line(capsys, "is an encoder-only model")


def test_model_without_a_causal_lm_class(tmp_path, capsys):
    path = tmp_path / "config.json"
    _config("vit", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2).to_json_file(path)
    assert main(["inspect", str(path), "--seq", "16"]) == 2
    line = error_line(capsys, "model_type='vit'", "has no causal-LM")
    assert len(line) < 400


def test_embedded_quickstart_model_resolves_to_its_preset():
    from megacompile.presets import load_config
    config = load_config("embedded:smollm2")
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) \
        == ("llama", 30, 576, 49152)


# -- plan: host RAM, hardware, train configs -------------------------------------------------------

@pytest.mark.parametrize("value", ["lots", "0", "-5G", "1.5 T", "12XB", "512"])
def test_host_ram_must_be_a_size(value, config_json, no_work, capsys):
    assert main(["plan", str(config_json), "--gpu", "h100", "--host-ram", *value.split()]) == 2
    error_line(capsys, "--host-ram" if value != "1.5 T" else "unrecognized arguments: T")


def test_vision_train_on_a_text_model_is_refused(config_json, capsys):
    assert main(["plan", str(config_json), "--gpu", "h100", "--host-ram", "1T", "--vision", "train"]) == 2
    error_line(capsys, "--vision train", "text-only model")


def test_host_ram_is_required_with_a_gpu_profile(config_json, no_work, capsys):
    assert main(["plan", str(config_json), "--gpu", "h200"]) == 2
    error_line(capsys, "--host-ram is required")


def test_unknown_gpu_lists_the_profiles(config_json, no_work, capsys):
    assert main(["plan", str(config_json), "--gpu", "tpu-v9", "--host-ram", "1T"]) == 2
    error_line(capsys, "unknown hardware 'tpu-v9'", "h200", "h100")
    assert main(["inspect", str(config_json), "--gpu", "H200"]) == 2
    error_line(capsys, "unknown hardware 'H200'")


@pytest.mark.parametrize("text", ["{not json", "[]", json.dumps({"name": "x", "compute_tflops": 1}),
                                  json.dumps({"name": "x", "compute_tflops": -1, "h2d_gbps": 1, "d2h_gbps": 1,
                                              "device_memory_gib": 1, "host_memory_gbps": 1})])
def test_bad_gpu_profile_file(text, tmp_path, config_json, no_work, capsys):
    assert main(["plan", str(config_json), "--gpu", write(tmp_path / "gpu.json", text), "--host-ram", "1T"]) == 2
    error_line(capsys, "gpu.json")


def _train_yaml(tmp_path, model, **extra) -> str:
    keys = {"model_name_or_path": str(model), "dataset": "alpaca_demo", "output_dir": str(tmp_path / "run"),
            "cutoff_len": 16, **extra}
    return write(tmp_path / "train.yaml", "".join(f"{k}: {v}\n" for k, v in keys.items()))


def test_plan_train_yaml_that_cannot_fit_exits_3(tmp_path, config_json, capsys):
    gpu = write(tmp_path / "tiny_gpu.json", json.dumps({
        "name": "tiny", "compute_tflops": 1, "h2d_gbps": 1, "d2h_gbps": 1, "device_memory_gib": 0.00001,
        "host_memory_gbps": 1}))
    assert main(["plan", _train_yaml(tmp_path, config_json), "--gpu", gpu, "--host-ram", "64G"]) == 3
    captured = capsys.readouterr()
    assert "CANNOT FIT" in captured.out and "Traceback" not in captured.err   # the report, then one line
    lines = [line for line in captured.err.splitlines() if line.startswith("megatrain:")]
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: device memory")


@pytest.mark.parametrize("text, expected", [
    ("model_name_or_path: [unclosed\n", "is not valid YAML"),
    ("- a\n- b\n", "must hold a mapping"),
    ("model_name_or_path: llama-3-8b\nlerning_rate: 1\n", "'learning_rate'"),
])
def test_plan_train_yaml_with_errors_exits_2(text, expected, tmp_path, no_work, capsys):
    assert main(["plan", write(tmp_path / "bad.yaml", text), "--gpu", "h100", "--host-ram", "1T"]) == 2
    error_line(capsys, expected)


def test_plan_train_yaml_that_does_not_exist(tmp_path, no_work, capsys):
    assert main(["plan", str(tmp_path / "nope.yaml"), "--gpu", "h100", "--host-ram", "1T"]) == 2
    error_line(capsys, "does not exist")


def test_plan_train_yaml_with_a_missing_model(tmp_path, capsys):
    assert main(["plan", _train_yaml(tmp_path, tmp_path / "gone"), "--gpu", "h100", "--host-ram", "1T"]) == 2
    error_line(capsys, "does not exist")


def test_train_config_that_does_not_exist(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    error_line(capsys, "does not exist")


# -- main(): exit codes from exceptions --------------------------------------------------------

def _fail_with(monkeypatch, exc):
    def fail(*args, **kwargs):
        raise exc
    monkeypatch.setattr(megacompile.inspect, "inspect_model", fail)


@pytest.mark.parametrize("exc, code", [(ConfigError("bad option x"), 2), (CannotFitError("does not fit"), 3),
                                       (TrainingError("diverged at step 3"), 4)])
def test_exit_code_is_the_errors(exc, code, config_json, monkeypatch, capsys):
    _fail_with(monkeypatch, exc)
    assert main(["inspect", str(config_json)]) == code
    error_line(capsys, str(exc))


def test_wrapped_errors_are_found(config_json, monkeypatch, capsys):
    """Dynamo's BackendCompilerFailed (inner_exception) and chained causes."""
    class BackendCompilerFailed(RuntimeError):
        def __init__(self, inner):
            super().__init__(f"backend failed: {inner}")
            self.inner_exception = inner

    _fail_with(monkeypatch, BackendCompilerFailed(CannotFitError("needs 3 TiB")))
    assert main(["inspect", str(config_json)]) == 3
    error_line(capsys, "needs 3 TiB")

    def chained(*args, **kwargs):
        try:
            raise TrainingError("loss is nan at step 7")
        except TrainingError as e:
            raise RuntimeError("while training") from e
    monkeypatch.setattr(megacompile.inspect, "inspect_model", chained)
    assert main(["inspect", str(config_json)]) == 4
    error_line(capsys, "loss is nan at step 7")

    def context(*args, **kwargs):
        try:
            raise ConfigError("slots=0: use at least 1")
        except ConfigError:
            raise KeyError("x")   # raised while handling it: __context__
    monkeypatch.setattr(megacompile.inspect, "inspect_model", context)
    assert main(["inspect", str(config_json)]) == 2
    error_line(capsys, "slots=0")


def test_multi_line_error_message_is_one_line(config_json, monkeypatch, capsys):
    _fail_with(monkeypatch, ConfigError("first line\n  second line\n"))
    assert main(["inspect", str(config_json)]) == 2
    error_line(capsys, "first line second line")


def test_train_errors_are_not_special_cased(monkeypatch, tmp_path, capsys):
    """train's cannot-fit preflight (a CannotFitError) exits 3, a diverged run (TrainingError) 4."""
    import megacompile.train.hparams.config
    import megacompile.train.trainer
    monkeypatch.setattr(megacompile.train.hparams.config, "load_config", lambda path, overrides=(): None)
    for exc, code in [(CannotFitError("host RAM: needs 2 TiB"), 3), (TrainingError("diverged"), 4),
                      (ConfigError("bad key"), 2)]:
        def fail(config, progress=True, exc=exc):
            raise exc
        monkeypatch.setattr(megacompile.train.trainer, "train", fail)
        assert main(["train", "x.yaml", "max_steps=1"]) == code
        error_line(capsys, str(exc))


def test_internal_error_prints_the_traceback_and_asks_for_a_report(config_json, monkeypatch, capsys):
    _fail_with(monkeypatch, ZeroDivisionError("division by zero"))
    assert main(["inspect", str(config_json)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    lines = [line for line in err.splitlines() if line.startswith("megatrain:")]
    assert len(lines) == 1 and lines[0].startswith("megatrain: internal error: ZeroDivisionError: division by zero")
    assert "report" in lines[0]


def test_keyboard_interrupt_exits_130(config_json, monkeypatch, capsys):
    _fail_with(monkeypatch, KeyboardInterrupt())
    assert main(["inspect", str(config_json)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip() == "megatrain: interrupted"


def test_os_errors_on_user_files_are_user_errors(config_json, monkeypatch, capsys):
    _fail_with(monkeypatch, PermissionError(13, "Permission denied", "/data/out.json"))
    assert main(["inspect", str(config_json)]) == 2
    error_line(capsys, "/data/out.json: Permission denied")


# -- end to end, tiny ---------------------------------------------------------------------------

def test_inspect_writes_the_checked_output(config_json, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["inspect", str(config_json), "--seq", "16", "--dtype", "bf16", "--format", "json",
                 "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"]["dtype"] == "bfloat16" and report["model"]["layers"] == 2
    assert "wrote" in capsys.readouterr().err


def test_plan_says_host_ram_in_the_users_unit_and_refuses_an_impossible_seq_at_once(config_json, capsys,
                                                                                    monkeypatch, own_compile_cache):
    """--host-ram 1T is said back as "1T (931.32 GiB)"; a sequence whose layer boundary alone
    exceeds the device is refused (exit 3) before the compile, which at 100M tokens would unroll
    thousands of MLP tiles and take minutes."""
    import time
    import megacompile.cli as cli
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True, raising=False)   # (a person at a terminal)
    assert main(["plan", str(config_json), "--gpu", "h100", "--host-ram", "1T", "--seq", "64"]) == 0
    captured = capsys.readouterr()
    assert "of 1T (931.32 GiB)" in captured.out
    assert "[megatrain] plan: compiling the first 2 layer(s) at batch 2 x seq 64" in captured.err   # progress
    monkeypatch.undo()
    start = time.perf_counter()
    assert main(["plan", "llama-3-8b", "--gpu", "h200", "--host-ram", "1T", "--seq", "100000000"]) == 3
    assert time.perf_counter() - start < 30   # (no compile: the meta model and one comparison)
    line = error_line(capsys, "two hidden states at a layer boundary alone need")
    assert "1.49 TiB" in line and "shorter --seq" in line
