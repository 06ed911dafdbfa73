"""The host as the process sees it (megacompile/host_probe.py): usable cores from the affinity
mask and the cgroup CPU quota, measured bandwidth and AdamW rate, and the plan's use of them."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megacompile import host_probe
from megacompile.cli import main
from megacompile.cost_model import optimizer_seconds
from megacompile.hardware import BUILTIN, measure_cpu
from megacompile.plan import BatchEstimate


def _cgroup(tmp_path, files: dict[str, str], self_cgroup: str) -> dict:
    for rel, text in files.items():
        path = tmp_path / "cg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "cgroup").write_text(self_cgroup)
    return dict(cgroup_root=tmp_path / "cg", proc_self_cgroup=tmp_path / "cgroup")


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


def test_usable_cores_without_a_quota_is_the_affinity_mask(tmp_path):
    cores, why = host_probe.usable_cores(**_cgroup(tmp_path, {"pod/cpu.max": "max 100000\n"}, "0::/pod\n"))
    assert cores == _affinity() and why.startswith("affinity")


@pytest.mark.parametrize("quota, want", [("50000 100000", 1), ("150000 100000", 1), ("100000 100000", 1)])
def test_a_cgroup_v2_quota_below_the_affinity_limits_the_cores(tmp_path, quota, want):
    """A pod's `cpu: 1.5` limit (cpu.max 150000 100000) runs one thread unthrottled: 1 core; a
    half-core quota still gets one thread."""
    if _affinity() <= want:
        pytest.skip("needs more usable cores than the quota")
    cores, why = host_probe.usable_cores(**_cgroup(tmp_path, {"pod/cpu.max": quota + "\n"}, "0::/pod\n"))
    assert cores == want and "cpu.max" in why


def test_the_tightest_quota_of_the_cgroup_and_its_ancestors_wins(tmp_path):
    if _affinity() < 2:
        pytest.skip("needs 2 usable cores")
    files = {"cpu.max": "100000 100000\n", "kube/cpu.max": "max 100000\n", "kube/pod/cpu.max": "800000 100000\n"}
    cores, why = host_probe.usable_cores(**_cgroup(tmp_path, files, "0::/kube/pod\n"))
    assert cores == 1 and "100000 100000" in why


def test_a_cgroup_v1_cfs_quota_limits_the_cores(tmp_path):
    if _affinity() < 2:
        pytest.skip("needs 2 usable cores")
    files = {"cpu,cpuacct/job/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}
    cores, why = host_probe.usable_cores(**_cgroup(tmp_path, files, "4:cpu,cpuacct:/job\n"))
    assert cores == 1 and "cfs_quota_us" in why
    files = {"cpu,cpuacct/job/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}
    assert host_probe.usable_cores(**_cgroup(tmp_path / "b", files, "4:cpu,cpuacct:/job\n"))[0] == _affinity()


def test_the_probe_measures_bandwidth_and_the_adamw_rate_on_the_given_cores():
    rates = host_probe.probe_host(elements=2**20, adamw_params=2**20, rounds=2, cores=1)
    assert rates.cores == 1 and rates.cores_why == "given"
    assert min(rates.copy_gbps, rates.triad_gbps, rates.update_gbps, rates.adamw_params_per_s) > 0
    assert rates.bandwidth_gbps == max(rates.copy_gbps, rates.triad_gbps, rates.update_gbps)
    assert rates.adamw_gbps == pytest.approx(rates.adamw_params_per_s * 30 / 1e9)
    assert "1 core(s)" in rates.describe() and "AdamW" in rates.describe()


def test_measured_host_figures_replace_the_profiles_and_set_the_optimizer_time():
    rates = host_probe.HostRates(cores=2, cores_why="x", copy_gbps=10, triad_gbps=12, update_gbps=15,
                                 adamw_params_per_s=5e8, adamw_kernel="fused", seconds=0.5)
    hw = host_probe.with_host(BUILTIN["h200"], rates)
    assert hw.host_memory_gbps == 15 and hw.compute_tflops == BUILTIN["h200"].compute_tflops
    assert optimizer_seconds(10**9, hw) == pytest.approx(2.0)   # 1e9 parameters at 5e8/s
    # without a measured rate: the profile's bytes/s at the cost model's 32 B/param
    assert optimizer_seconds(10**9, BUILTIN["h200"]) == pytest.approx(32e9 / 100e9)


def test_the_cpu_profile_takes_the_probes_figures():
    hw = measure_cpu()
    rates = host_probe.probed_host()
    assert hw.optimizer_gparams == pytest.approx(rates.adamw_params_per_s / 1e9)
    assert hw.host_memory_gbps == rates.bandwidth_gbps


def _estimate(forward, backward, optimizer) -> BatchEstimate:
    return BatchEstimate(batch=1, device_peak_bytes=0, forward_seconds=forward, backward_seconds=backward,
                         optimizer_seconds=optimizer)


def test_the_host_bounds_the_step_only_when_adamw_outlasts_what_it_can_overlap():
    assert host_probe.host_bound(_estimate(1.0, 2.0, 2.9)) is None
    note = host_probe.host_bound(_estimate(1.0, 2.0, 5.0))
    assert "the host bounds the step" in note and "2.00 s" in note


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_plan_probe_host_says_the_measured_host_and_warns_when_the_host_bounds_the_step(capsys, monkeypatch):
    """`megatrain plan --probe-host`: the plan uses this host's measured rates and says them; a
    host whose AdamW is slow against the device's step gets the warning (json: host_bound)."""
    slow = host_probe.HostRates(cores=1, cores_why="affinity 1 of 1", copy_gbps=6, triad_gbps=6, update_gbps=6,
                                adamw_params_per_s=1e6, adamw_kernel="fused", seconds=0.1)
    monkeypatch.setattr(host_probe, "probed_host", lambda: slow)
    rc, out, err = run_cli(capsys, "plan", "smollm2-135m", "--gpu", "h200", "--host-ram", "64G", "--seq", "256",
                           "--probe-host")
    assert rc == 0, err
    assert "host (measured, 1 core(s): affinity 1 of 1)" in out
    assert "WARNING: the host bounds the step" in out
    rc, out, err = run_cli(capsys, "plan", "smollm2-135m", "--gpu", "h200", "--host-ram", "64G", "--seq", "256",
                           "--probe-host", "--format", "json")
    data = json.loads(out)
    assert data["host_measured"].startswith("host (measured") and "the host bounds the step" in data["host_bound"]
    assert data["hardware"]["optimizer_gparams"] == pytest.approx(1e-3)


def test_plan_compare_with_probe_host_is_refused(capsys):
    rc, out, err = run_cli(capsys, "plan", "smollm2-135m", "--compare", "--probe-host")
    assert rc == 2 and err.startswith("megatrain: error: --compare with --probe-host")


def test_a_profile_file_may_give_the_measured_optimizer_rate(tmp_path):
    from megacompile.hardware import load_hardware
    data = {**dataclasses.asdict(BUILTIN["h100"]), "name": "mine", "optimizer_gparams": 1.5}
    (tmp_path / "hw.json").write_text(json.dumps(data))
    hw = load_hardware(tmp_path / "hw.json")
    assert optimizer_seconds(3 * 10**9, hw) == pytest.approx(2.0)


def test_the_training_preflight_on_a_gpu_plans_with_this_hosts_measured_figures(monkeypatch):
    """`megatrain train` on CUDA: the GPU's profile, its free memory, and this host's measured
    bandwidth and AdamW rate (a pod's quota, not the profile's table figure)."""
    import types

    import torch

    from megacompile import hardware
    from megacompile.train.preflight import hardware_for
    slow = host_probe.HostRates(cores=3, cores_why="cgroup cpu.max 300000 100000 = 3 cores (affinity 16)",
                                copy_gbps=6, triad_gbps=6, update_gbps=7, adamw_params_per_s=2e8,
                                adamw_kernel="fused", seconds=0.4)
    monkeypatch.setattr(host_probe, "probed_host", lambda: slow)
    monkeypatch.setattr(hardware, "gpu_profile", lambda device, dtype: (BUILTIN["h100"], "h100: built-in profile"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * 2**30, 80 * 2**30))
    hw, why = hardware_for(types.SimpleNamespace(megatrain={}), torch.device("cuda", 0), torch.bfloat16)
    assert hw.compute_tflops == BUILTIN["h100"].compute_tflops and hw.device_memory_gib == 40
    assert hw.host_memory_gbps == 7 and hw.optimizer_gparams == pytest.approx(0.2)
    assert why.startswith("h100: built-in profile; host (measured, 3 core(s): cgroup cpu.max")
