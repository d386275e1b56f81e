"""Least privilege, on a real-systemd host: the service runs as a dedicated unprivileged user (the
plan creates it when missing and says so) under the systemd hardening vLLM tolerates, and the
simulated vLLM starts and passes every readiness gate that way."""

from __future__ import annotations

import pytest

from orchestrator.host.connect import open_host
from orchestrator.ops.deploy import run_deploy
from orchestrator.ops.execute import Reporter
from orchestrator.ops.stop import stop_model
from orchestrator.plan.run import Options

from .deployhelp import on_port, tuned

pytestmark = pytest.mark.systemd


def test_the_service_runs_unprivileged_and_hardened(systemd_sim_host):
    entry, _, _ = systemd_sim_host
    assert entry.service_user == "vllm"                   # the default
    m = on_port("minimax-m25-ep")
    unit = f"vllm-{m.name}.service"
    opts = Options(budget_s=90, no_progress_s=60, poll_s=0.2, gpu_release_timeout_s=20)
    with open_host(entry) as host:
        if host.run(["id", "vllm"]).ok and not host.run(["pgrep", "-u", "vllm"]).ok:
            host.run(["userdel", "vllm"]).check(entry.name, "remove the user a previous test made")
        dry = run_deploy(entry, m, opts, Reporter(None, quiet=True), dry_run=True)
        user_step = [a for a in dry.plan.actions if a.step == "user"]
        if not host.run(["id", "vllm"]).ok:
            assert user_step and not user_step[0].noop and "create" in user_step[0].summary, dry.plan.text()
        try:
            res = run_deploy(entry, m, opts, Reporter(None, quiet=True), dry_run=False)
            assert res.ok, (res.error, res.error and res.error.details)
            pid = host.run(["systemctl", "show", "-p", "MainPID", "--value", unit]).stdout.strip()
            assert host.run(["ps", "-o", "user=", "-p", pid]).stdout.strip() == "vllm"
            workers = host.run(["pgrep", "-u", "vllm", "-f", "^VLLM::"]).stdout.split()
            assert workers, "the engine/worker processes run as vllm too"
            assert host.run(["pgrep", "-u", "root", "-f", "^VLLM::"]).stdout.split() == []
            props = dict(line.split("=", 1) for line in host.run(
                ["systemctl", "show", unit, "-p", "User,NoNewPrivileges,PrivateTmp,ProtectSystem,ProtectHome"]
            ).stdout.splitlines())
            assert props == {"User": "vllm", "NoNewPrivileges": "yes", "PrivateTmp": "yes", "ProtectSystem": "full",
                             "ProtectHome": "yes"}, props
            status = host.run(["cat", f"/proc/{pid}/status"]).stdout
            assert "NoNewPrivs:\t1" in status
            assert host.run(["stat", "-c", "%U %a", f"{entry.state_dir}/../home"]).stdout.split()[0] == "vllm"
        finally:
            stop_model(host, entry, m.name, m.serving.visible_devices)


def test_a_process_host_drops_to_the_service_user_too(systemd_sim_host):
    """The same container driven as a `process` host (no systemd units: a start script and a PID
    file): the start script reads the 0600 env file as root, then runs vLLM as `vllm`."""
    entry, _, _ = systemd_sim_host
    proc_entry = entry.model_copy(update={"service_manager": "process", "units_dir": "/var/lib/vo-proc/units",
                                          "env_dir": "/var/lib/vo-proc/units", "state_dir": "/var/lib/vo-proc/state",
                                          "log_dir": "/var/lib/vo-proc/logs"})
    m = on_port("minimax-m25-ep")
    opts = Options(budget_s=90, no_progress_s=60, poll_s=0.2, gpu_release_timeout_s=20)
    with open_host(proc_entry) as host:
        try:
            res = run_deploy(proc_entry, m, opts, Reporter(None, quiet=True), dry_run=False)
            assert res.ok, (res.error, res.error and res.error.details)
            pid = host.run(["cat", f"{proc_entry.state_dir}/run/vllm-{m.name}.pid"]).stdout.split()[0]  # PID first
            assert host.run(["ps", "-o", "user=", "-p", pid]).stdout.strip() == "vllm"
            assert "NoNewPrivs:\t1" in host.run(["cat", f"/proc/{pid}/status"]).stdout
            env_file = host.run(["stat", "-c", "%U %a", f"{proc_entry.env_dir}/vllm-{m.name}.env"]).stdout.split()
            assert env_file == ["root", "600"]          # the secret file stays root's: read before the drop
        finally:
            stop_model(host, proc_entry, m.name, m.serving.visible_devices)


def test_the_probes_run_as_the_service_user_without_the_services_environment(systemd_sim_host, monkeypatch):
    """The health unit ran as root with the service's EnvironmentFile: `PYTHONPATH` pointing into
    the model folder (a manifest's env could say so then) plus a `sitecustomize.py` there (`*.py` is
    downloaded by default) ran code as root at every check. The deny-list now refuses such env at the
    door; here the env file is given that line by hand, as if it had got through, and a
    sitecustomize.py that writes who imported it sits in the model folder. The health check (as the
    service user, `python -I`, no EnvironmentFile, the key from its credential) and the readiness
    probe (`python -I`) import nothing from there; only the service itself (the service user) does.
    A key holding a quote and a `$` reaches vLLM (EnvironmentFile) and the probes (credential) intact."""
    entry, _, _ = systemd_sim_host
    monkeypatch.setenv("VLLM_API_KEY", "sk-it's-$HOME")
    m = tuned("minimax-m25-ep", serving={"secret_env": ["VLLM_API_KEY"]})
    unit, health = m.unit_name, f"vllm-{m.name}-health.service"
    opts = Options(budget_s=90, no_progress_s=60, poll_s=0.2, gpu_release_timeout_s=20)
    model_dir, env_file = f"{entry.models_root}/{m.name}", f"{entry.env_dir}/{m.name}.env"
    with open_host(entry) as host:
        try:
            res = run_deploy(entry, m, opts, Reporter(None, quiet=True), dry_run=False)
            assert res.ok, res.error
            props = dict(line.split("=", 1) for line in host.run(
                ["systemctl", "show", health, "-p", "User,EnvironmentFiles,LoadCredential"]).stdout.splitlines())
            assert props["User"] == "vllm" and not props.get("EnvironmentFiles"), props
            assert "LoadCredential" in props, props          # systemctl show prints its value as [unprintable]
            host.run(["sh", "-c", "rm -rf /srv/proof && mkdir -m 1777 -p /srv/proof"]).check(entry.name)
            host.put(f"{model_dir}/sitecustomize.py", b"import os, sys\nopen('/srv/proof/%d-%d' % (os.getuid(), "
                     b"os.getpid()), 'w').write(' '.join(sys.argv))\n", 0o644)
            host.run(["sh", "-c", f"echo PYTHONPATH={model_dir} >> {env_file}"]).check(entry.name)
            run = host.run(["systemctl", "start", health], timeout=120)      # one check (oneshot: waits)
            assert run.ok, run.stderr + host.run(["journalctl", "-u", health, "-o", "cat", "--no-pager"]).stdout
            state = host.run(["sh", "-c", f"stat -c %U {entry.state_dir}/health/{m.name}.json; "
                                          f"cat {entry.state_dir}/health/{m.name}.json"]).stdout.split("\n", 1)
            assert state[0] == "vllm" and '"ok": true' in state[1], state     # the key came as a credential
            assert host.run(["ls", "/srv/proof"]).stdout.split() == [], "the health check imported from the model folder"
            restarted = host.run(["systemctl", "restart", unit], timeout=300)   # the readiness probe, -I
            assert restarted.ok, restarted.stderr
            proofs = host.run(["sh", "-c", "cd /srv/proof && for f in *; do echo \"$f $(cat $f)\"; done"]).stdout
            uid = host.run(["id", "-u", "vllm"]).stdout.strip()
            lines = [line for line in proofs.splitlines() if line.strip() and line != "* "]
            assert lines and all(line.startswith(f"{uid}-") for line in lines), proofs    # the service's own
            assert "vllm-orch-probe" not in proofs, proofs
        finally:
            host.run(["sh", "-c", f"rm -rf /srv/proof {model_dir}/sitecustomize.py"])
            stop_model(host, entry, m.name, m.serving.visible_devices)
