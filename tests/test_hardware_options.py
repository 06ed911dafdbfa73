"""Hardware profiles (GPU name matching, measured GPUs, JSON profiles), the host RAM a process may
use (cgroups), and the type checks of every compile option. CPU only: the CUDA queries are
monkeypatched."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

import megacompile
from conftest import batch, tiny_model
from megacompile import hardware
from megacompile.errors import ConfigError
from megacompile.hardware import (BUILTIN, Hardware, gpu_profile, host_memory_bytes, host_memory_limit, load_hardware,
                                  measure_gpu, profile_for_gpu_name)
from megacompile.options import Options, pass_names

GiB = 2**30


# -- 1. which profile a GPU gets ------------------------------------------------------------------

@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H200 NVL", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H100 NVL", "h100"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA GH200 144G HBM3e", "gh200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA GeForce RTX 4090", None),
    ("NVIDIA L40S", None),
    ("NVIDIA B200", None),
    ("NVIDIA GB200", None),
    ("NVIDIA H20", None),
    ("Tesla V100-SXM2-16GB", None),
    ("", None),
])
def test_gpu_names_match_built_in_profiles_by_whole_word(name, expected):
    hw = profile_for_gpu_name(name)
    assert (hw.name if hw else None) == expected


def _fake_gpu(monkeypatch, name: str, total: int = 94 * GiB):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("Props", (), {"total_memory": total, "name": name})())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total // 2, total))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _no_measuring(*args, **kwargs):
    raise AssertionError("a GPU with a built-in profile is not measured")


def test_a_known_gpu_gets_its_built_in_profile_with_its_real_memory(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA GH200 480GB", total=95 * GiB)
    monkeypatch.setattr(hardware, "measure_gpu", _no_measuring)
    hw, why = gpu_profile(torch.device("cuda", 0), torch.bfloat16)
    assert hw == dataclasses.replace(BUILTIN["gh200"], device_memory_gib=95.0)
    assert hw.h2d_gbps == 400.0   # the C2C link, not an H200's PCIe
    assert why.startswith("NVIDIA GH200 480GB: built-in gh200 profile")
    hw, why = gpu_profile("cuda", torch.bfloat16)   # no index: the current device
    assert hw.name == "gh200"


def test_an_unknown_gpu_is_measured(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA L40S", total=44 * GiB)
    seen = []
    measured = Hardware("l40s-measured", 180.0, 25.0, 26.0, 44.0, 100.0, device_memory_gbps=800.0,
                        op_overhead_us=6.0, optimizer_gbps=20.0)

    def fake_measure(device, dtype=torch.bfloat16, **kw):
        seen.append((device, dtype))
        return measured

    monkeypatch.setattr(hardware, "measure_gpu", fake_measure)
    hw, why = gpu_profile(0, torch.float16)
    assert hw is measured and seen == [(torch.device("cuda", 0), torch.float16)]
    assert why.startswith("NVIDIA L40S: no built-in profile, rates measured on it: ")
    assert "180 TFLOP/s float16" in why and "H2D 25 GB/s" in why and "D2H 26 GB/s" in why


def test_a_gpu_whose_measurement_fails_is_assumed_an_h100(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA B200", total=179 * GiB)

    def broken(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB\nmore lines")

    monkeypatch.setattr(hardware, "measure_gpu", broken)
    hw, why = gpu_profile(torch.device("cuda", 0))
    assert hw == dataclasses.replace(BUILTIN["h100"], device_memory_gib=179.0)
    assert why.startswith("NVIDIA B200: no built-in profile and measuring its rates failed (OutOfMemoryError: CUDA "
                          "out of memory.") and why.endswith("assumed h100") and "\n" not in why


def test_options_hardware_profile_matches_exactly_and_measures_unknown_gpus(monkeypatch):
    opts = Options(device="cuda:0")   # built directly: validate() would want a real GPU
    _fake_gpu(monkeypatch, "NVIDIA GH200 480GB")
    monkeypatch.setattr(hardware, "measure_gpu", _no_measuring)
    assert opts.hardware_profile().name == "gh200"
    _fake_gpu(monkeypatch, "NVIDIA H200 NVL")
    assert opts.hardware_profile().name == "h200"
    _fake_gpu(monkeypatch, "NVIDIA RTX 6000 Ada Generation")
    measured = dataclasses.replace(BUILTIN["a100"], name="rtx-measured")
    monkeypatch.setattr(hardware, "measure_gpu", lambda device, dtype=torch.bfloat16, **kw: measured)
    assert opts.hardware_profile() is measured   # never None on CUDA
    # an explicit option wins over the GPU's name
    assert dataclasses.replace(opts, hardware="a100").hardware_profile() is BUILTIN["a100"]


def test_options_hardware_profile_on_the_cpu():
    assert Options.from_mapping({"device": "cpu"}).hardware_profile() is None
    assert Options.from_mapping({"device": "cpu", "hardware": "h100"}).hardware_profile() is BUILTIN["h100"]


def test_gpu_profile_of_the_cpu_is_the_measured_cpu_profile():
    hw, why = gpu_profile("cpu", torch.float32)
    assert hw is hardware.measure_cpu(torch.float32) and why.startswith("cpu: rates measured on this machine: ")


def test_measure_gpu_code_path_runs_on_a_cpu_device():
    """The CUDA measurement's arithmetic and calls, run with small sizes on the CPU device."""
    hw = measure_gpu(torch.device("cpu"), torch.float32, n=128, link_bytes=2**20, memory_bytes=2**20)
    assert hw.name == "cpu-measured" and not hw.overlap and not hw.measure_ops
    for key in ("compute_tflops", "h2d_gbps", "d2h_gbps", "device_memory_gib", "host_memory_gbps",
                "device_memory_gbps", "op_overhead_us", "optimizer_gparams"):
        value = getattr(hw, key)
        assert math.isfinite(value) and value > 0, key
    assert load_hardware(hw) is hw   # a measured profile passes the profile checks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_gpu_on_a_real_gpu():
    hw = measure_gpu(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    assert hw.overlap and hw.compute_tflops > 1 and hw.h2d_gbps > 1 and hw.device_memory_gbps > 50
    profile, why = gpu_profile("cuda", torch.bfloat16)
    assert torch.cuda.get_device_name() in why and profile.device_memory_gib > 1


# -- 2. host RAM: MemAvailable and cgroup limits -----------------------------------------------

def _meminfo(tmp_path, available_gib: float | None, total_gib: float = 64.0):
    lines = [f"MemTotal:       {int(total_gib * 2**20)} kB", "MemFree:         1024 kB",
             "Buffers:          2048 kB", "Cached:           4096 kB"]
    if available_gib is not None:
        lines.insert(2, f"MemAvailable:   {int(available_gib * 2**20)} kB")
    path = tmp_path / "meminfo"
    path.write_text("\n".join(lines) + "\n")
    return path


def _cgroup(tmp_path, lines: list[str]):
    path = tmp_path / "self_cgroup"
    path.write_text("\n".join(lines) + "\n")
    return path


def _files(root, rel: str, **files):
    d = root / rel if rel else root
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(str(text) + "\n")


def _limit(tmp_path, meminfo, self_cgroup):
    return host_memory_limit(proc_meminfo=meminfo, cgroup_root=tmp_path / "cg", proc_self_cgroup=self_cgroup)


def test_host_memory_without_cgroups_is_mem_available(tmp_path):
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 21.3, 23.4), tmp_path / "missing")
    assert nbytes == int(21.3 * 2**20) * 1024 and why == "MemAvailable 21.3 GiB of 23.4 GiB"


def test_host_memory_cgroup_v2_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cg"
    _files(root, "", **{"cgroup_controllers": "cpu memory"})           # the real root: no memory.max
    _files(root, "slurm", memory_max=32 * GiB, memory_current=20 * GiB)    # 12 GiB left
    _files(root, "slurm/job_7", memory_max=16 * GiB, memory_current=int(3.1 * GiB))   # 12.9 GiB left
    _files(root, "slurm/job_7/step_0", memory_max="max", memory_current=GiB)
    cg = _cgroup(tmp_path, ["0::/slurm/job_7/step_0"])
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 60.0), cg)
    assert nbytes == 12 * GiB and why == "cgroup memory.max 32.0 GiB (20.0 GiB in use)"
    _files(root, "slurm", memory_max="max", memory_current=20 * GiB)
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 60.0), cg)
    assert nbytes == 16 * GiB - int(3.1 * GiB) and why == "cgroup memory.max 16.0 GiB (3.1 GiB in use)"


def test_host_memory_cgroup_v2_max_is_no_limit(tmp_path):
    root = tmp_path / "cg"
    _files(root, "user.slice/session.scope", memory_max="max", memory_current=5 * GiB)
    _files(root, "user.slice", memory_max="max", memory_current=9 * GiB)
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 40.0), _cgroup(tmp_path, ["0::/user.slice/session.scope"]))
    assert nbytes == 40 * GiB and why.startswith("MemAvailable 40.0 GiB")


def test_host_memory_cgroup_v2_in_a_container(tmp_path):
    """With a cgroup namespace the process sees "0::/" and its own cgroup at the mount's root;
    without one, a path that the mount does not show still finds the root's limit."""
    root = tmp_path / "cg"
    _files(root, "", memory_max=8 * GiB, memory_current=GiB)
    for line in ("0::/", "0::/docker/0123abcd"):
        nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 100.0), _cgroup(tmp_path, [line]))
        assert nbytes == 7 * GiB and why == "cgroup memory.max 8.0 GiB (1.0 GiB in use)"


def test_host_memory_cgroup_page_cache_is_not_in_use(tmp_path):
    root = tmp_path / "cg"
    _files(root, "job", memory_max=16 * GiB, memory_current=10 * GiB,
           memory_stat=f"anon {2 * GiB}\nfile {8 * GiB}\nactive_file {GiB}\ninactive_file {7 * GiB}")
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 100.0), _cgroup(tmp_path, ["0::/job"]))
    assert nbytes == 13 * GiB and why == "cgroup memory.max 16.0 GiB (3.0 GiB in use)"


def test_host_memory_cgroup_v1(tmp_path):
    root = tmp_path / "cg"
    _files(root, "memory", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=50 * GiB)  # no limit
    _files(root, "memory/slurm/uid_1000/job_42", memory_limit_in_bytes=16 * GiB,
           memory_usage_in_bytes=int(3.1 * GiB))
    cg = _cgroup(tmp_path, ["12:pids:/slurm/uid_1000/job_42", "4:memory:/slurm/uid_1000/job_42",
                            "1:name=systemd:/slurm/uid_1000/job_42", "0::/"])
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 200.0), cg)
    assert nbytes == 16 * GiB - int(3.1 * GiB) and why == "cgroup memory.limit_in_bytes 16.0 GiB (3.1 GiB in use)"


def test_host_memory_mem_available_below_the_cgroup_limit(tmp_path):
    root = tmp_path / "cg"
    _files(root, "job", memory_max=64 * GiB, memory_current=GiB)
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, 10.0, 32.0), _cgroup(tmp_path, ["0::/job"]))
    assert nbytes == 10 * GiB and why == "MemAvailable 10.0 GiB of 32.0 GiB"


def test_host_memory_over_its_limit_is_zero_and_old_kernels_add_free_and_cache(tmp_path):
    root = tmp_path / "cg"
    _files(root, "job", memory_max=GiB, memory_current=2 * GiB)
    assert _limit(tmp_path, _meminfo(tmp_path, 10.0), _cgroup(tmp_path, ["0::/job"]))[0] == 0
    nbytes, why = _limit(tmp_path, _meminfo(tmp_path, None), tmp_path / "missing")
    assert nbytes == (1024 + 2048 + 4096) * 1024 and why.startswith("MemFree+Buffers+Cached")


def test_host_memory_off_linux_is_the_physical_memory(tmp_path):
    nbytes, why = _limit(tmp_path, tmp_path / "no_meminfo", tmp_path / "no_cgroup")
    assert nbytes > 0 and why.endswith("(sysconf)")


def test_host_memory_bytes_is_the_usable_figure(monkeypatch):
    monkeypatch.setattr(hardware, "host_memory_limit", lambda *a, **k: (12345 * GiB, "cgroup memory.max"))
    assert host_memory_bytes() == 12345 * GiB
    nbytes, why = host_memory_limit()   # this machine: a real answer
    assert 0 < nbytes and why


# -- 3. JSON hardware profiles ------------------------------------------------------------------

_OK = {"name": "my_gpu", "compute_tflops": 100, "h2d_gbps": 20, "d2h_gbps": 20, "device_memory_gib": 24,
       "host_memory_gbps": 50}


def _profile(tmp_path, data, name="gpu.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_a_good_profile_loads_with_float_rates(tmp_path):
    hw = load_hardware(_profile(tmp_path, {**_OK, "optimizer_gbps": 0, "op_overhead_us": 0, "overlap": False}))
    assert hw == Hardware("my_gpu", 100.0, 20.0, 20.0, 24.0, 50.0, op_overhead_us=0.0, optimizer_gbps=0.0,
                          overlap=False)
    assert isinstance(hw.compute_tflops, float)


@pytest.mark.parametrize("data,kind", [("[1, 2]", "list"), ("42", "int"), ('"h200"', "str"), ("null", "NoneType")])
def test_a_profile_that_is_not_a_json_object(tmp_path, data, kind):
    with pytest.raises(ConfigError, match=f"holds a JSON {kind}, not an object"):
        load_hardware(_profile(tmp_path, data))


def test_every_bad_value_is_named_in_one_message(tmp_path):
    bad = {**_OK, "compute_tflops": 0, "h2d_gbps": -1, "d2h_gbps": True, "device_memory_gib": "80",
           "device_memory_gbps": float("inf"), "op_overhead_us": -0.5, "optimizer_gbps": None, "overlap": "yes",
           "measure_ops": 1, "name": ""}
    with pytest.raises(ConfigError) as e:
        load_hardware(_profile(tmp_path, json.dumps(bad)))   # json writes inf as Infinity, and reads it back
    msg = str(e.value)
    for part in ("compute_tflops=0 (int) must be a finite number > 0", "h2d_gbps=-1 (int) must be a finite number > 0",
                 "d2h_gbps=True (bool) must be a finite number > 0",
                 "device_memory_gib='80' (str) must be a finite number > 0",
                 "device_memory_gbps=inf (float) must be a finite number > 0",
                 "op_overhead_us=-0.5 (float) must be a finite number >= 0",
                 "optimizer_gbps=None (NoneType) must be a finite number >= 0 (0: the default)",
                 "overlap='yes' (str) must be true or false", "measure_ops=1 (int) must be true or false",
                 "name='' (str) must be a non-empty string", "Required keys"):
        assert part in msg, part
    assert "host_memory_gbps" not in msg.split("Required keys")[0]   # a good value is not listed


def test_nan_and_unknown_and_missing_keys_in_one_message(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_hardware(_profile(tmp_path, '{"name": "x", "compute_tflop": 1, "h2d_gbps": NaN}'))
    msg = str(e.value)
    assert "unknown key 'compute_tflop' (did you mean 'compute_tflops'?)" in msg
    assert "missing keys ['compute_tflops', 'd2h_gbps', 'device_memory_gib', 'host_memory_gbps']" in msg
    assert "h2d_gbps=nan (float) must be a finite number > 0" in msg


def test_a_directory_or_unreadable_profile_is_a_config_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="is a directory"):
        load_hardware(str(tmp_path))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_hardware(str(binary))
    path = _profile(tmp_path, _OK)

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(tmp_path), "read_text", denied)
    with pytest.raises(ConfigError, match=r"cannot be read \(Permission denied\)"):
        load_hardware(path)


@pytest.mark.parametrize("spec", [5, None, b"h200", ""])
def test_a_hardware_spec_of_the_wrong_type(spec):
    with pytest.raises(ConfigError, match=r"hardware=.*\): expected one of h200, h100, gh200, a100, cpu"):
        load_hardware(spec)


def test_a_hardware_object_is_checked_too(tmp_path):
    assert load_hardware(BUILTIN["h200"]) is BUILTIN["h200"]
    with pytest.raises(ConfigError, match="h2d_gbps=0.0 .* must be a finite number > 0"):
        load_hardware(dataclasses.replace(BUILTIN["h200"], h2d_gbps=0.0))
    _profile(tmp_path, _OK)
    assert load_hardware(tmp_path / "gpu.json").name == "my_gpu"   # a pathlib.Path works as a str


# -- 4. compile options: every value type-checked -------------------------------------------------

_FORMAT = re.compile(r"^option (\w+)=(.+) \((\w+)\): expected .+")


def _error(mapping) -> str:
    with pytest.raises(ConfigError) as e:
        Options.from_mapping(mapping)
    return str(e.value)


def _option_error(name, value) -> str:
    msg = _error({"device": "cpu", name: value})
    m = _FORMAT.match(msg)
    assert m and m.group(1) == name and m.group(3) == type(value).__name__, msg
    return msg


@pytest.mark.parametrize("options", ["cpu", 5, ["device", "cpu"], ("slots", 2), True])
def test_options_must_be_a_mapping(options):
    msg = _error(options)
    assert msg.startswith(f"options={options!r} ({type(options).__name__}): expected a dict of option names")
    assert "options={'device': 'cpu', 'slots': 2}" in msg


def test_options_none_or_a_mapping_proxy():
    import types
    assert Options.from_mapping(None) == Options.from_mapping({})
    assert Options.from_mapping(types.MappingProxyType({"device": "cpu", "slots": 3})).slots == 3


def test_option_names_must_be_strings():
    assert "option names are strings" in _error({5: True})


@pytest.mark.parametrize("name", ["debug_residency", "recompute_head", "routed_experts", "overlap_grads",
                                  "host_arena", "debug_passes"])
def test_bool_options_accept_only_true_or_false(name):
    for bad in ("no", "false", 0, 1, None, [True]):
        assert _option_error(name, bad).endswith("expected True or False.")
    for good in (True, False):
        assert getattr(Options.from_mapping({"device": "cpu", name: good}), name) is good


def test_slots_is_an_int_of_at_least_one():
    for bad in (True, False, 0, -1, 2.0, "2", None):
        assert "expected an integer >= 1" in _option_error("slots", bad)
    assert Options.from_mapping({"device": "cpu", "slots": 3}).slots == 3


def test_device_is_a_string_or_a_torch_device():
    for bad in (42, None, 0.5, "tpu", "cuda:x", ["cpu"]):
        assert "expected 'cuda', 'cuda:N' or 'cpu'" in _error({"device": bad})
    opts = Options.from_mapping({"device": torch.device("cpu")})
    assert opts.device == "cpu" and opts.torch_device == torch.device("cpu")


def test_hardware_is_none_a_name_a_json_file_or_a_hardware(tmp_path):
    for bad in (5, True, ["h100"], "tpu-v9"):
        assert "expected None, one of 'h200', 'h100', 'gh200', 'a100', 'cpu', the path of a JSON" in \
            _option_error("hardware", bad)
    assert "is a directory" in _option_error("hardware", str(tmp_path))
    for good in (None, "h100", "cpu", BUILTIN["a100"], _profile(tmp_path, _OK)):
        assert Options.from_mapping({"device": "cpu", "hardware": good}).hardware is good
    # a profile's content is checked when the options are, not at the first step
    with pytest.raises(ConfigError, match=r"option hardware=.*compute_tflops=0 \(int\) must be a finite number > 0"):
        Options.from_mapping({"device": "cpu", "hardware": _profile(tmp_path, {**_OK, "compute_tflops": 0}, "z.json")})


def test_device_budget_is_none_a_positive_int_or_a_byte_size():
    for bad in (True, 0, -5, 1.5e9, ["1G"], "lots", "0.0000001B"):
        assert "expected None, a positive int of bytes or a size string" in _option_error("device_budget", bad)
    assert "not a byte size" in _option_error("device_budget", "12 parsecs")
    for good, nbytes in ((None, None), (1024, 1024), ("1GiB", GiB)):
        assert Options.from_mapping({"device": "cpu", "device_budget": good}).device_budget_bytes == nbytes


@pytest.mark.parametrize("name,good,expected", [
    ("recompute", "selective", "'layer' (least memory) or 'selective'"),
    ("kernels", "none", "'auto' (Triton kernels on CUDA), 'triton' or 'none'"),
    ("logits", "drop", "'keep' (return the logits) or 'drop'"),
    ("lowering", "eager", "'auto' (measured per body on CUDA), 'eager' or 'inductor'"),
])
def test_string_choices(name, good, expected):
    for bad in ("full", "", 1, None, True, [good]):
        assert expected in _option_error(name, bad)
    assert getattr(Options.from_mapping({"device": "cpu", name: good}), name) == good


def test_disable_passes_names_real_passes():
    assert set(pass_names()) >= {"fused_kernels", "fused_lm_loss", "retarget_device", "tag_weights", "layer_regions",
                                 "unshare_weight_views", "recompute_boundaries", "selective_recompute",
                                 "routed_experts", "split_segments", "dedupe_bodies", "schedule", "memory_plan",
                                 "tile_mlp", "offload_checkpoints"}
    from megacompile.passes import pipelines
    lists = (pipelines.DYNAMO_PASSES, pipelines.JOINT_PASSES, pipelines.DIRECTION_PASSES)
    assert set(pass_names()) == {p.name for passes in lists for p in passes} \
        and len(set(pass_names())) == len(pass_names())
    assert Options.from_mapping({"device": "cpu", "disable_passes": "dedupe_bodies"}).disable_passes \
        == ("dedupe_bodies",)
    assert Options.from_mapping({"device": "cpu", "disable_passes": ["dedupe_bodies", "memory_plan"]}).disable_passes \
        == ("dedupe_bodies", "memory_plan")
    # a pass that a later pass or the runtime reads is refused with the option, before any work
    msg = _error({"device": "cpu", "disable_passes": ["schedule"]})
    assert msg.startswith("option disable_passes=['schedule']: pass 'offload_checkpoints' reads graph key "
                          "'mt_schedule'") and "which pass 'schedule' writes, and it is disabled" in msg
    assert Options.from_mapping({"device": "cpu", "disable_passes": ()}).disable_passes == ()
    msg = _option_error("disable_passes", ["schedule", "dedupe_body"])
    assert "'dedupe_body' is not one: did you mean 'dedupe_bodies'?" in msg and "memory_plan" in msg
    for bad in (3, None, ["schedule", 3], {"schedule"}):
        assert "expected a pass name or a list of pass names" in _option_error("disable_passes", bad)


def test_validate_checks_options_built_directly():
    with pytest.raises(ConfigError, match=r"option routed_experts='no' \(str\): expected True or False"):
        Options(device="cpu", routed_experts="no").validate()


def test_a_training_config_gets_the_same_checks():
    from megacompile.train.hparams.config import from_mapping
    ok = dict(model_name_or_path="m", dataset="d", output_dir="o")
    with pytest.raises(ConfigError, match=r"option routed_experts='no' \(str\): expected True or False"):
        from_mapping({**ok, "routed_experts": "no"})
    with pytest.raises(ConfigError, match=r"option slots=True \(bool\)"):
        from_mapping({**ok, "slots": True})


@pytest.mark.parametrize("options,pattern", [
    ("cpu", r"^options='cpu' \(str\): expected a dict"),
    ({"device": "cpu", "routed_experts": "no"}, r"^option routed_experts='no' \(str\): expected True or False"),
    ({"device": "cpu", "disable_passes": ["dedupe_body"]}, r"did you mean 'dedupe_bodies'"),
])
def test_bad_options_through_torch_compile(options, pattern):
    """torch.compile passes a truthy `options` of any type to the backend unchanged (at the first
    call, when Dynamo compiles); the backend's ConfigError is the inner exception."""
    model = tiny_model("llama", layers=2)
    cmodel = torch.compile(model, backend="megatrain", options=options)
    ids, _, labels = batch()
    with pytest.raises(Exception) as e:
        cmodel(input_ids=ids, labels=labels, use_cache=False)
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, megacompile.ConfigError), repr(e.value)
    assert re.search(pattern, str(inner)), str(inner)
