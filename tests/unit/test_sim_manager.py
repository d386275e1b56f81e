"""`vllm-orch sim up/status/fault/down` on a tmp sim home (the hub mirror is started only when
orchestrator.sim.hub is present)."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml
from click.testing import CliRunner

from orchestrator.config.inventory import load_inventory
from orchestrator.sim import manager
from orchestrator.sim.cli import sim


def test_up_is_idempotent_and_writes_the_inventory(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(2, speed=500, home=home)
    inv_file = tmp_path / "state" / "hosts.d" / "sim.yaml"
    inv1 = inv_file.read_text()
    manager.up(2, home=home)
    assert inv_file.read_text() == inv1
    hosts = yaml.safe_load(inv1)["hosts"]
    assert list(hosts) == ["sim", "sim-2"]
    e = hosts["sim"]
    hdir = home / "hosts" / "sim"
    # ordinary host settings describe it: a label, the reserve scaled like the files, no flag check
    # without a real vLLM
    assert e["label"] == "SIMULATED" and e["address"] == "local"
    assert e["disk_reserve_gib"] == 20 / manager.DEFAULT_SCALE and e["skip_checks"] == ["flags", "env"]
    assert {h.name: h.label for h in load_inventory().hosts.values()} == {"sim": "SIMULATED", "sim-2": "SIMULATED"}
    assert e["service_manager"] == "process"
    assert e["time_scale"] == 500 and hosts["sim-2"]["time_scale"] == 500   # --speed: expected times scale
    # process hosts share this machine's network: the second serves on its own port (vLLM's
    # SO_REUSEPORT would let both bind 8000 and mix their requests), the first keeps the manifests'
    assert "overrides" not in e and hosts["sim-2"]["overrides"] == {"*": {"serving": {"port": 8100}}}
    sim2 = load_inventory().hosts["sim-2"]
    assert [o.serving.port for o in sim2.overrides.values()] == [8100]
    assert e["vllm"] == str(hdir / "bin" / "vllm") and e["models_root"] == str(hdir / "models")
    assert e["engines_root"] == str(hdir / "engines")     # never this machine's /var/lib/vllm-orch/engines
    assert e["env"]["PYTHONPATH"] == str(hdir / "site-packages")
    info = json.loads((hdir / "sim.json").read_text())
    assert info["simulated"] and info["speed"] == 500 and len(info["gpus"]) == 8
    assert info["gpus"][0]["memory_total_mib"] == 97887 and info["vllm_version"] == "0.33.0"
    # the host's Python sees the fake packages through the entry's PYTHONPATH
    code = "import importlib.metadata as m; print(m.version('flashinfer-cubin'), m.version('torch'))"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": e["env"]["PYTHONPATH"]},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0.7.2.post1", "2.14.0+cu130"]
    out = subprocess.run([str(hdir / "bin" / "vllm"), "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "0.33.0"
    manager.down(home)
    assert not (home / "hosts").exists() and not inv_file.exists()
    assert load_inventory().hosts == {}


def test_vllm_python_is_recorded_and_the_flag_check_kept(tmp_path):
    home = tmp_path / "state" / "sim"
    manager.up(1, home=home, vllm_python=sys.executable)
    e = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]["sim"]
    assert e["python"] == sys.executable and "skip_checks" not in e
    manager.down(home)


def test_faults_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path))
    r = CliRunner()
    out = r.invoke(sim, ["up", "--speed", "2000"])
    assert out.exit_code == 0 and "SIMULATED" in out.output
    listed = r.invoke(sim, ["fault", "--list"]).output.splitlines()
    assert {ln.split()[0] for ln in listed} >= {
        "crash-flashinfer", "crash-gpu-memory", "crash-unrecognized-args",
        "crash-trust-remote-code", "hang", "die-after-ready", "garbage", "slow-start"}
    assert r.invoke(sim, ["fault", "sim", "crash-flashinfer", "--model", "m1"]).exit_code == 0
    hdir = tmp_path / "sim" / "hosts" / "sim"      # the sim home is <state home>/sim
    assert json.loads((hdir / "faults.json").read_text()) == [
        {"fault": "crash-flashinfer", "model": "m1"}]
    assert (hdir / "site-packages" / "flashinfer_cubin-0.7.2.dist-info").is_dir()
    st = json.loads(r.invoke(sim, ["status", "--json"]).output)
    assert st["simulated"] and st["hosts"]["sim"]["faults"][0]["fault"] == "crash-flashinfer"
    assert r.invoke(sim, ["fault", "sim", "--clear"]).exit_code == 0
    assert json.loads((hdir / "faults.json").read_text()) == []
    assert (hdir / "site-packages" / "flashinfer_cubin-0.7.2.post1.dist-info").is_dir()
    bad = r.invoke(sim, ["fault", "sim", "no-such-fault"])
    assert bad.exit_code != 0
    assert r.invoke(sim, ["fault", "nohost", "hang"]).exit_code != 0
    down = r.invoke(sim, ["down"])
    assert down.exit_code == 0 and "SIMULATED" in down.output
    assert "none" in r.invoke(sim, ["status"]).output


def test_ram_is_configurable_kept_across_up_and_scaled_like_the_files(tmp_path, monkeypatch):
    import pytest

    from orchestrator.errors import ConfigError

    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(1, ram_gib=2048, home=home)
    hdir = home / "hosts" / "sim"
    e = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]["sim"]
    assert e["meminfo"] == str(hdir / "meminfo")
    assert e["cpu_memory_per_gpu_gib"] == 12 / manager.DEFAULT_SCALE
    gib, scale = 2 ** 30, manager.DEFAULT_SCALE
    text = (hdir / "meminfo").read_text()
    assert f"MemTotal:       {2048 * gib // scale // 1024:>8} kB" in text
    assert f"MemAvailable:   {1984 * gib // scale // 1024:>8} kB" in text       # RAM - 64 GiB
    manager.up(1, home=home)                                                       # kept
    assert (hdir / "meminfo").read_text() == text
    result = CliRunner().invoke(sim, ["memory", "sim", "--available-gib", "600"])
    assert result.exit_code == 0 and "600 GiB available" in result.output
    assert f"MemAvailable:   {600 * gib // scale // 1024:>8} kB" in (hdir / "meminfo").read_text()
    with pytest.raises(ConfigError):
        manager.set_memory("sim", available_gib=4096, home=home)
    manager.down(home)


def test_a_systemd_host_folder_is_roots_and_its_shared_folders_are_sticky():
    """The service user in the container writes GPU bookkeeping, run records and logs (sticky, like
    /tmp: nobody removes another's file); the folder holding bin/nvidia-smi and bin/vllm, which root
    runs, is writable by its owner only. The service user refreshes meminfo in place."""
    import os
    import shutil
    import stat
    import tempfile
    from pathlib import Path

    from orchestrator.sim import nvidia_smi

    base = Path(tempfile.mkdtemp(prefix="vo-modes-"))     # pytest's tmp folders are 0700: not for `nobody`
    try:
        base.chmod(0o755)
        hdir = base / "sim"
        manager.prepare_host("sim", hdir, speed=2000, scale=10000, flavour="systemd", python="/usr/bin/env python3")
        assert stat.S_IMODE(hdir.stat().st_mode) == 0o755
        for sub in ("gpu-procs", "run", "logs"):
            assert stat.S_IMODE((hdir / sub).stat().st_mode) == 0o1777, sub
        for sub in ("bin", "site-packages", "models"):
            assert not (hdir / sub).stat().st_mode & 0o022, sub
        assert stat.S_IMODE((hdir / "meminfo").stat().st_mode) == 0o666
        if os.geteuid() == 0:           # as an unprivileged user: no rename in the folder, in place instead
            (hdir / "meminfo").write_text("")
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    nvidia_smi.write_meminfo(hdir)
                    code = 0 if "MemTotal" in (hdir / "meminfo").read_text() else 2
                finally:
                    os._exit(code)
            assert os.waitpid(pid, 0)[1] == 0
            assert not list(hdir.glob(".meminfo.*"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _cli(argv, capsys) -> tuple[int, str]:
    from orchestrator.cli.main import main
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0), capsys.readouterr().err
    raise AssertionError("main() did not exit")


def test_sim_up_systemd_as_non_root_is_refused_with_exit_3_before_anything_is_built(tmp_path, monkeypatch,
                                                                                     capsys):
    # As a non-root user the container tree's debootstrap failed and `sim up --systemd` printed
    # "internal error: TreeBuildError" (exit 1) after minutes; it is a refusal, at once, naming root.
    from orchestrator.sim import nspawn, nspawn_tree

    def build(*a, **k):
        raise nspawn_tree.TreeBuildError("debootstrap exited 1: E: debootstrap can only run as root")
    monkeypatch.setattr(nspawn, "ensure_tree", build)
    monkeypatch.setattr(nspawn_tree, "ensure_tree", build)
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    code, err = _cli(["sim", "up", "--systemd"], capsys)
    assert code == 3, err
    assert "needs root" in err and "internal error" not in err
    assert not (tmp_path / "state" / "hosts.d" / "sim.yaml").exists()


def test_a_failed_container_tree_build_is_one_error_line_not_an_internal_error(tmp_path, monkeypatch, capsys):
    from orchestrator.sim import nspawn, nspawn_tree

    def build(*a, **k):
        raise nspawn_tree.TreeBuildError("debootstrap exited 1: E: Failed getting release file")
    monkeypatch.setattr(nspawn, "ensure_tree", build)
    monkeypatch.setattr(nspawn_tree, "ensure_tree", build)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda p, *a, **k: f"/usr/bin/{p}")
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    code, err = _cli(["sim", "up", "--systemd"], capsys)
    assert code == 1, err
    assert "container tree failed: debootstrap exited 1" in err and "internal error" not in err
