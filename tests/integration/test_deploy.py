"""deploy on the default SIMULATED host: every shipped model, no-op redeploys, each safety refusal,
each fault the simulator injects, and convergence after a killed deploy."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.errors import RefusedError
from orchestrator.host.state import HostLock, lock_holder, read_active, read_history
from orchestrator.probe.readiness import NotReady
from orchestrator.sim import manager
from tests.plugins.sim_hosts import wait_until

from .deployhelp import DEPLOYABLE, cli_env, deploy, entry, kill_when, on_port, statuses, tuned, write_models

GOLDEN = Path(__file__).parents[1] / "golden" / "plans"


@pytest.mark.parametrize("model", DEPLOYABLE)
def test_deploy_each_shipped_model_then_nothing_to_do(sim_host, model):
    e, m = entry(sim_host), on_port(model)
    result = deploy(e, m)
    assert result.ok, result.error
    assert statuses(result)["ready"] == "done" and statuses(result)["download"] == "done"
    active = read_active(sim_host.host, e)
    assert active is not None and active.model == model and active.port == m.serving.port
    history = [h.shown() for h in read_history(sim_host.host, e)]
    assert history[-1]["ok"] and history[-1]["smoke"].startswith("answer '4'")
    assert history[-1]["tokens_per_s"] > 0            # measured and recorded (the figure: benchmarks/)
    again = deploy(e, m)
    assert again.ok and not again.plan.changes
    assert all(a.noop for a in again.plan.actions if a.step != "lock")
    assert read_history(sim_host.host, e)[-1].shown()["noop"] is True


def _normalise(text: str, sim_host, port: int) -> str:
    text = text.replace(str(sim_host.dir), "<SIM>").replace(sys.executable, "<PYTHON>")
    text = text.replace(f"port {port}", "port <PORT>")
    text = re.sub(r"@[0-9a-f]{12}", "@<COMMIT>", text)
    text = re.sub(r"download-[0-9a-f]{12}\.py", "download-<HASH>.py", text)
    text = re.sub(r"\(\d+\.\d+s\)", "(<T>)", text)
    text = re.sub(r"[\d.]+ [GT]B (available|free)", r"<N> \1", text)
    text = re.sub(r"PID \d+", "PID <PID>", text)
    text = re.sub(r"\d+(\.\d+)? GB free on \S+", "<FREE> on <DISK>", text)
    text = re.sub(r"(?m)^(\s+)\$ (\S*python\S*) ", r"\1$ <PYTHON> ", text)
    # The SIMULATED process host runs services as whoever runs the tests (root or not).
    text = re.sub(r"(?m)^(\s+\d+\. user\s+- nothing to do, because ).*$", r"\1<the simulator's user>", text)
    text = re.sub(r"(?m)^(\s+ok\s+service-user: ).*$", r"\1<the simulator's user can run <SIM>/bin/vllm>", text)
    return text


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"plan text changed: review and re-run with UPDATE_GOLDEN=1 ({path})"


def test_plan_text_of_a_fresh_and_of_a_deployed_host(sim_host):
    e, m = entry(sim_host), tuned("kimi-k25-int4", perf_tokens=None)       # the plan a user sees
    fresh = deploy(e, m, dry_run=True)
    assert fresh.ok and fresh.plan.changes
    assert not (sim_host.dir / "models" / m.name).exists(), "a dry run downloaded something"
    assert read_active(sim_host.host, e) is None
    _golden("deploy-fresh.txt", _normalise(fresh.plan.text(), sim_host, m.serving.port))
    assert deploy(e, m).ok
    done = deploy(e, m, dry_run=True)
    _golden("deploy-deployed.txt", _normalise(done.plan.text(), sim_host, m.serving.port))
    assert "Nothing to change." in done.plan.text()


@pytest.mark.parametrize("fault,kinds,signature", [
    ("crash-gpu-memory", ("fatal-log", "crash"), "Free memory on device"),
    ("crash-unrecognized-args", ("fatal-log", "crash"), "unrecognized arguments"),
    ("crash-trust-remote-code", ("fatal-log", "crash"), "contains custom code which must be executed"),
    ("garbage", ("smoke",), None),
])
def test_fault_fails_fast_with_the_root_cause(sim_host, fault, kinds, signature):
    e, m = entry(sim_host), on_port("minimax-m25")
    manager.add_fault("sim", fault, model=m.name, home=sim_host.home)
    t0 = time.monotonic()
    result = deploy(e, m)
    assert not result.ok and isinstance(result.error, NotReady)
    assert result.error.kind in kinds
    if signature:
        assert signature in result.error.root_cause
    # Fast: at the fatal line, the exit or the smoke test, not at the end of a window (900 s here).
    # A figure for how fast belongs in benchmarks/; a loaded machine is slow by design.
    elapsed = time.monotonic() - t0
    assert elapsed < m.startup.no_progress_seconds / 4, elapsed
    # the failed service was stopped: its GPUs are free again
    assert "VLLM::" not in sim_host.nvidia_smi("--query-compute-apps=pid,process_name", "--format=csv,noheader")
    assert read_history(sim_host.host, e)[-1].shown()["failure_kind"] == result.error.kind


def test_package_mismatch_is_refused_by_preflight_before_any_download(sim_host):
    e, m = entry(sim_host), on_port("kimi-k25-int4")
    manager.add_fault("sim", "crash-flashinfer", model=m.name, home=sim_host.home)   # cubin 0.6.13
    result = deploy(e, m)
    assert isinstance(result.error, RefusedError) and result.error.step == "preflight"
    assert "flashinfer" in str(result.error)
    assert [a.step for a in result.plan.actions] == ["lock", "preflight"]
    assert not (sim_host.dir / "models" / m.name).exists()


def test_a_service_user_that_cannot_reach_vllm_is_refused_by_preflight(sim_host):
    """The simulated host's vllm sits under pytest's 0700 temp folder, as a venv under /root does:
    the unprivileged `nobody` cannot run it, and deploy refuses before any download (the start
    would fail only after it). The simulator runs its services as whoever runs it."""
    m = on_port("minimax-m25")
    refused = deploy(entry(sim_host, service_user="nobody"), m, dry_run=True).plan.refusal
    assert refused is not None and refused.step == "preflight", refused
    assert f"the service user nobody cannot run {sim_host.entry['vllm']}" in str(refused)
    assert "does not let nobody in" in str(refused)
    plan = deploy(entry(sim_host), m, dry_run=True).plan
    assert plan.refusal is None
    assert any(d.startswith("ok      service-user: ") for a in plan.actions for d in a.details), plan.actions


def test_hang_fails_after_the_no_progress_window(sim_host):
    e, m = entry(sim_host), on_port("minimax-m25")
    manager.add_fault("sim", "hang", model=m.name, home=sim_host.home)
    result = deploy(e, m, no_progress_s=2)
    assert isinstance(result.error, NotReady) and result.error.kind == "hang"
    assert "no new log line" in str(result.error)


def test_a_hang_is_shown_counting_its_silence_even_without_a_terminal(sim_host, monkeypatch):
    # Without a terminal nothing was printed after "loading weights" (the log lines only fed a
    # spinner), and nowhere did a hang say how long it had been silent of its window.
    import io

    from rich.console import Console

    from orchestrator.ops import execute
    from orchestrator.ops.deploy import run_deploy

    from .deployhelp import opts

    monkeypatch.setattr(execute, "WAIT_LINE_S", 0.5)
    e, m = entry(sim_host), on_port("minimax-m25")
    manager.add_fault("sim", "hang", model=m.name, home=sim_host.home)
    out = io.StringIO()
    reporter = execute.Reporter(Console(file=out, force_terminal=False, width=200))
    result = run_deploy(e, m, opts(no_progress_s=4), reporter, False)
    assert isinstance(result.error, NotReady) and result.error.kind == "hang"
    said = [line for line in out.getvalue().splitlines() if "waiting:" in line]
    assert said and all("of the 4s no-progress window" in line and "start-up budget" in line for line in said), said
    silent = [int(re.search(r"silent for (\d+)s", line).group(1)) for line in said]
    assert silent[-1] == max(silent) >= 2, said          # the count grows toward the window
    assert "last line: " in said[-1], said


def test_die_after_ready_is_redeployed(sim_host):
    e, m = entry(sim_host), on_port("minimax-m25")
    manager.add_fault("sim", "die-after-ready", model=m.name, home=sim_host.home)
    assert deploy(e, m).ok
    deadline = time.monotonic() + 20
    from orchestrator.host.services import Service
    while Service.for_host(sim_host.host, e, m.name).state().active and time.monotonic() < deadline:
        time.sleep(0.2)
    again = deploy(e, m)
    assert again.ok and statuses(again)["start"] == "done"


def test_leftover_workers_of_a_killed_service_are_killed(sim_host):
    e, m = entry(sim_host), on_port("kimi-k25-int4")
    assert deploy(e, m).ok
    pid = int((sim_host.dir / "state" / "run" / f"vllm-{m.name}.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)                       # workers survive, holding GPU memory
    from orchestrator.host.services import Service

    wait_until(lambda: not Service.for_host(sim_host.host, e, m.name).state().active,
               what="the killed service seen as not running")
    assert "VLLM::Worker" in sim_host.nvidia_smi("--query-compute-apps=process_name", "--format=csv,noheader")
    result = deploy(e, m)
    assert result.ok, result.error
    gpus = [a for a in result.plan.actions if a.step == "gpus"][0]
    assert gpus.summary.startswith("kill 8 leftover processes")
    assert all("left behind by kimi-k25-int4" in d or "not a managed" in d for d in gpus.details)


def test_foreign_gpu_process_is_refused_unless_kill_foreign(sim_host):
    e, m = entry(sim_host), on_port("minimax-m25")
    proc = subprocess.Popen(["sleep", "300"])
    try:
        (sim_host.dir / "gpu-procs" / f"{proc.pid}-2.json").write_text(json.dumps(
            {"pid": proc.pid, "process_name": "python3 train.py", "gpu_index": 2, "used_mib": 40000,
             "start_time": manager.start_time(proc.pid)}))
        refused = deploy(e, m)
        assert isinstance(refused.error, RefusedError)
        assert "does not manage" in str(refused.error) and str(proc.pid) in str(refused.error)
        ok = deploy(e, m, kill_foreign=True)
        assert ok.ok, ok.error
        assert proc.wait(timeout=15) != 0
    finally:
        proc.kill()


def test_a_held_lock_refuses_naming_the_holder_and_a_killed_holder_frees_it(sim_host):
    e, m = entry(sim_host), on_port("minimax-m25")
    with HostLock(sim_host.host, e, "swap to somewhere"):
        with pytest.raises(RefusedError) as info:
            deploy(e, m)
    assert info.value.step == "lock" and "swap to somewhere by " in str(info.value)
    # A holder killed with SIGKILL releases the lock by itself.
    code = ("import sys, time; from orchestrator.host.local import LocalHost; "
            "from orchestrator.config.inventory import HostEntry; from orchestrator.host.state import HostLock; "
            f"e = HostEntry.model_validate({dict(sim_host.entry, name='sim')!r}); "
            "HostLock(LocalHost('sim'), e, 'doomed').acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    # its `flock ... cat` on the host reads EOF and exits: the lock is free without anyone's help
    wait_until(lambda: lock_holder(sim_host.host, e) is None, budget=20, what="the lock to be released")
    assert deploy(e, m).ok


def test_disk_budget_evicts_least_recently_used_then_refuses(sim_host):
    e = entry(sim_host)
    small, big = on_port("minimax-m25"), on_port("kimi-k25-int4")
    assert deploy(e, small).ok
    from orchestrator.ops.stop import stop_model
    stop_model(sim_host.host, e, small.name)
    # Budget fits Kimi only if minimax's folder goes: it is inactive, so it is deleted (LRU).
    fits_after_eviction = entry(sim_host, models_disk_budget_gib=0.07)
    result = deploy(fits_after_eviction, big, dry_run=True)
    disk = [a for a in result.plan.actions if a.step == "disk"][0]
    assert disk.summary.startswith("free ") and "minimax-m25" in disk.details[0]
    assert any(f"rm -rf {e.models_root}/minimax-m25 " in str(c) for c in disk.commands)
    assert disk.confirm and "minimax-m25" in disk.confirm       # a real run asks first (or --yes)
    too_small = entry(sim_host, models_disk_budget_gib=0.01)
    refused = deploy(too_small, big)
    assert isinstance(refused.error, RefusedError) and refused.error.step == "disk"
    assert "not enough disk" in str(refused.error) and "MB" in str(refused.error)
    assert (sim_host.dir / "models" / "minimax-m25").exists(), "a refused plan deleted something"


@pytest.mark.parametrize("fault", ["hub-drop", "hub-corrupt"])
def test_download_faults_are_recovered(sim_host, fault):
    e, m = entry(sim_host), on_port("minimax-m25")
    manager.add_fault("sim", fault, home=sim_host.home)
    result = deploy(e, m)
    assert result.ok, result.error
    files = result.outcome and [r for r in result.outcome.results if r.step == "download"][0]
    assert files.status == "done"
    record = json.loads((sim_host.dir / "models" / m.name / ".vllm-orch" / "verified.json").read_text())
    assert record["complete"] is True


def test_a_killed_deploy_converges_when_run_again(sim_host, tmp_path):
    m = on_port("kimi-k25-int4", budget_seconds=120)
    models = write_models(tmp_path / "models", [m])
    env = cli_env(sim_host, models)
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "deploy", m.name, "--host", "sim"]
    manager.add_fault("sim", "slow-start", model=m.name, home=sim_host.home)
    kill_when(cmd, env, "ready:")                      # killed while it waits for readiness
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already running" in second.stdout          # it did not start a second server
    assert read_active(sim_host.host, entry(sim_host)).model == m.name


def test_cli_exit_codes(sim_host, tmp_path):
    m = on_port("minimax-m25")
    models = write_models(tmp_path / "models", [m])
    env = cli_env(sim_host, models)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    assert run("deploy", "nope", "--host", "sim").returncode == 2
    assert run("deploy", m.name, "--host", "nohost").returncode == 2
    manager.add_fault("sim", "crash-flashinfer", home=sim_host.home)
    refused = run("deploy", m.name, "--host", "sim")
    assert refused.returncode == 3 and "Traceback" not in refused.stderr
    skipped = run("deploy", m.name, "--host", "sim", "--dry-run", "--skip-check", "package-pairs", "--json")
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert json.loads(skipped.stdout)["ok"] is True
    manager.clear_faults("sim", home=sim_host.home)
    ok = run("deploy", m.name, "--host", "sim", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True


def test_someone_elses_server_on_the_port_is_refused_not_killed(sim_host):
    e, m = entry(sim_host), on_port("minimax-m25")
    code = ("import socket, time; s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('127.0.0.1', {m.serving.port})); s.listen(); print('up', flush=True); time.sleep(120)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "up"
        result = deploy(e, m)
        assert isinstance(result.error, RefusedError) and result.error.step == "gpus"
        assert f"port {m.serving.port}" in str(result.error) and str(other.pid) in str(result.error)
        assert other.poll() is None, "vllm-orch killed a process it does not manage"
    finally:
        other.kill()


def _edit_sim(sim_host, **changes) -> None:
    path = sim_host.dir / "sim.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_old_driver_is_refused_by_preflight(sim_host):
    """torch built for CUDA 13.0 on a driver whose nvidia-smi says CUDA 12.8."""
    _edit_sim(sim_host, driver_version="570.86.10", cuda_version="12.8")
    e, m = entry(sim_host), on_port("minimax-m25")
    result = deploy(e, m, dry_run=True)
    assert result.plan.refusal is not None and result.plan.refusal.step == "preflight"
    assert "torch-cuda" in str(result.plan.refusal) and "12.8" in str(result.plan.refusal)
    skipped = deploy(e, m, dry_run=True, skip_checks=frozenset({"torch-cuda"}))
    assert skipped.plan.refusal is None
    assert any(d.startswith("skipped torch-cuda") for a in skipped.plan.actions for d in a.details)


def test_too_few_gpus_are_refused_by_preflight(sim_host):
    data = json.loads((sim_host.dir / "sim.json").read_text())
    _edit_sim(sim_host, gpus=data["gpus"][:4])
    e = entry(sim_host)
    refused = deploy(e, on_port("kimi-k25-int4"))
    assert isinstance(refused.error, RefusedError) and refused.error.step == "preflight"
    assert "4 GPUs available, 8 needed" in str(refused.error)
    assert deploy(e, on_port("minimax-m25")).ok          # TP4 on GPUs 0-3 still fits


def test_nothing_of_the_callers_environment_reaches_the_service(sim_host, monkeypatch):
    """A process host's service starts with a clean environment, as a systemd unit does: the
    operator's tokens and whatever else vllm-orch was started with never reach vLLM."""
    monkeypatch.setenv("HF_TOKEN", "hf_operators_own_token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-vllm")
    e, m = entry(sim_host), on_port("minimax-m25")
    assert deploy(e, m).ok
    pid = int((sim_host.dir / "state" / "run" / f"vllm-{m.name}.pid").read_text().split()[0])
    env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
    assert b"HF_TOKEN" not in env and b"AWS_SECRET_ACCESS_KEY" not in env, sorted(env)
    assert env[b"PATH"] == b"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env[b"HF_HUB_OFFLINE"] == b"1" and env[b"CUDA_VISIBLE_DEVICES"]      # the env file's, still


def test_render_of_a_local_host_shows_the_flags_deploy_installed(sim_host, tmp_path):
    # `render --host sim` said "hardware class: not known offline" and showed the manifest's own
    # flags, not the rtx-pro-6000 class's (attention backend, FP8 KV) that deploy installs there.
    from orchestrator.host.state import read_record

    from .deployhelp import SHIPPED

    m = SHIPPED["kimi-k25-int4"]
    e = entry(sim_host)
    assert deploy(e, m).ok
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "render", m.name, "--host", "sim"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    assert "not known" not in out.stdout and "rtx-pro-6000" in out.stdout, out.stdout[:1500]
    written = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "render", m.name, "--host", "sim",
                              "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    assert json.loads((tmp_path / "r" / "argv.json").read_text()) == read_record(sim_host.host, e, m.name).argv
