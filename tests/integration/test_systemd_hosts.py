"""Real systemd (PID 1 in a systemd-nspawn container), reached only over real SSH, as the
orchestrator reaches a GPU host. Fixture: systemd_hosts (tests/plugins/remote_hosts.py)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.host.base import Script
from orchestrator.host.ssh import SshHost
from orchestrator.sim import nspawn
from tests.plugins.remote_hosts import systemd_skip_reason

pytestmark = pytest.mark.systemd

IP_FORWARD_BEFORE = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()  # test hosts never change it


def connect(info: dict) -> SshHost:
    return SshHost(info["_name"], info["address"], port=info["port"], user=info["user"],
                   identity_file=info["identity_file"], known_hosts_file=info["known_hosts_file"],
                   env=info["env"], connect_timeout=10, ssh_config=None)


@pytest.fixture(scope="module")
def sd(systemd_hosts):
    info = systemd_hosts(1)[0]
    host = connect(info)
    yield info, host
    host.close()


def wait_for(predicate, budget: float = 5.0, every: float = 0.05):
    deadline = time.monotonic() + budget
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(every)


def install_unit(host: SshHost, name: str, text: str) -> None:
    host.put(f"/etc/systemd/system/{name}", text.encode())
    host.run(["systemctl", "daemon-reload"]).check(host.name)


def test_a_booted_host_runs_systemd_and_answers_over_one_connection(sd):
    info, host = sd
    started = time.monotonic()
    r = host.run(["systemctl", "is-system-running"])
    assert r.stdout.strip() in ("running", "degraded"), info.get("_degraded")
    assert host.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert host.run(["hostname"]).stdout.strip() == info["_name"]
    assert host.connects == 1
    # Figures, not assertions (a parallel run on a busy machine is slow by design): benchmarks/.
    print(f"boot {info['_timings']}; three commands over one connection {time.monotonic() - started:.2f} s")


def test_inventory_entry_has_the_contract_fields(sd):
    info, _ = sd
    for key in ("address", "port", "user", "identity_file", "known_hosts_file", "service_manager",
                "models_root", "units_dir", "state_dir", "vllm", "python", "nvidia_smi", "env"):
        assert key in info
    assert info["service_manager"] == "systemd" and "simulated" not in info
    assert info["address"].startswith("10.200.") and info["address"].endswith(".2")


def test_unit_lifecycle_journal_and_stop_kills_forked_children(sd):
    _, host = sd
    install_unit(host, "vo-forks.service", """[Unit]
Description=forks children

[Service]
Type=exec
ExecStart=/bin/sh -c 'echo started-$$; sleep 1001 & sleep 1002 & wait'
""")
    host.run(["systemctl", "start", "vo-forks.service"]).check(host.name)
    assert host.run(["systemctl", "is-active", "vo-forks.service"]).stdout.strip() == "active"
    wait_for(lambda: host.run(["pgrep", "-c", "-f", "^sleep 100[12]"]).stdout.strip() == "2")
    journal = wait_for(lambda: (r := host.run(["journalctl", "-u", "vo-forks.service",
                                               "--no-pager"])).stdout.count("started-") and r)
    assert "Started vo-forks.service" in journal.stdout or "forks children" in journal.stdout
    host.run(["systemctl", "stop", "vo-forks.service"]).check(host.name)
    assert host.run(["pgrep", "-f", "^sleep 100[12]"]).exit_code == 1     # cgroup: none left
    assert host.run(["systemctl", "is-active", "vo-forks.service"]).stdout.strip() == "inactive"


def test_an_abort_stop_of_a_unit_that_ignores_sigterm_kills_it_and_leaves_it_inactive(sd, monkeypatch):
    """The stop of a service that never served (a rollback's, an abandoned start's): a vLLM that
    hangs on SIGTERM is SIGKILLed after Service.ABORT_WAIT_S. systemd then calls the unit failed
    (Result=signal); nothing failed but the load we gave up on, so the unit must end inactive."""
    from orchestrator.host.services import SystemdService

    info, host = sd
    install_unit(host, "vllm-vo-abort.service", """[Service]
Type=exec
ExecStart=/bin/sh -c 'trap "" TERM; echo up; while :; do sleep 1; done'
TimeoutStopSec=600
""")
    host.run(["systemctl", "start", "vllm-vo-abort.service"]).check(host.name)
    wait_for(lambda: host.run(["journalctl", "-u", "vllm-vo-abort.service", "--no-pager", "-o", "cat"]).stdout
             .count("up"), budget=30)
    monkeypatch.setattr(SystemdService, "ABORT_WAIT_S", 2)
    svc = SystemdService(host, SimpleNamespace(name=host.name), "vo-abort")   # type: ignore[arg-type]
    svc.run_all(svc.stop_commands(drain=False), "stop")
    show = host.run(["systemctl", "show", "-p", "ActiveState,Result", "--value", "vllm-vo-abort.service"]).stdout
    assert sorted(show.split()) == ["inactive", "success"], show
    assert host.run(["pgrep", "-f", "^/bin/sh -c trap"]).exit_code == 1        # the cgroup is empty


def test_restart_on_failure_after_kill_9(sd):
    _, host = sd
    install_unit(host, "vo-restart.service", """[Service]
ExecStart=/bin/sleep 1003
Restart=on-failure
RestartSec=100ms
""")
    host.run(["systemctl", "start", "vo-restart.service"]).check(host.name)
    show = ["systemctl", "show", "-p", "MainPID,NRestarts", "--value", "vo-restart.service"]
    first_pid = host.run(show).stdout.split()[0]
    host.run(["kill", "-9", first_pid]).check(host.name)
    pid, restarts = wait_for(lambda: (v := host.run(show).stdout.split()) and v[1] == "1"
                             and v[0] != "0" and v)
    assert pid != first_pid and restarts == "1"
    host.run(["systemctl", "stop", "vo-restart.service"])


def test_failing_execstart_ends_failed(sd):
    _, host = sd
    install_unit(host, "vo-fails.service", "[Service]\nType=exec\nExecStart=/bin/false\n")
    host.run(["systemctl", "start", "vo-fails.service"])
    wait_for(lambda: host.run(["systemctl", "is-failed", "vo-fails.service"]).stdout.strip()
             == "failed")
    host.run(["systemctl", "reset-failed", "vo-fails.service"])


def test_systemd_analyze_verify_inside_the_host(sd):
    _, host = sd
    host.put("/etc/systemd/system/vo-good.service",
             b"[Service]\nType=exec\nExecStart=/bin/sleep 1\n")
    host.put("/etc/systemd/system/vo-bad.service",
             b"[Service]\nExecStart=/bin/sleep 1\nBogusKey=1\n")
    good = host.run(["systemd-analyze", "verify", "/etc/systemd/system/vo-good.service"])
    assert good.exit_code == 0 and good.stderr.strip() == ""
    bad = host.run(["systemd-analyze", "verify", "/etc/systemd/system/vo-bad.service"])
    assert "Unknown key 'BogusKey'" in bad.stderr     # a warning only: exit code stays 0


def test_sim_programs_find_their_host_folder_and_venv_has_huggingface_hub(sd):
    info, host = sd
    host_dir = Path(info["_console_log"]).parent.parent
    script = host_dir / "bin" / "vllm"
    script.write_text("#!/usr/bin/env python3\nfrom pathlib import Path\n"
                      "print(Path(__file__).resolve().parent.parent)\n")
    script.chmod(0o755)
    assert host.run([info["vllm"]]).stdout.strip() == nspawn.SIM_MOUNT
    r = host.run([info["python"], "-c", "import huggingface_hub; print(huggingface_hub.__name__)"])
    assert r.stdout.strip() == "huggingface_hub", r.stderr


def test_the_host_reaches_a_server_on_the_gateway_address(sd):
    """Where the per-host hub mirror listens: the veth's root side (10.200.N.1)."""
    info, host = sd

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer((info["_gateway"], 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://{info['_gateway']}:{server.server_address[1]}/api/models"
        r = host.run([info["python"], "-c",
                      f"import urllib.request; print(urllib.request.urlopen({url!r}).read())"])
        assert "/api/models" in r.stdout, r.stderr
    finally:
        server.shutdown()


def test_connect_tcp_reaches_a_port_bound_to_the_hosts_loopback(sd):
    info, host = sd
    host.run(Script("nohup /opt/vllm/bin/python -m http.server 18080 --bind 127.0.0.1 "
                    ">/dev/null 2>&1 &")).check(host.name)
    try:
        def answer():
            try:
                chan = host.connect_tcp(18080)
            except ConnectionRefusedError:
                return None
            with chan:
                chan.sendall(b"GET / HTTP/1.0\r\n\r\n")
                return chan.recv(12)
        assert wait_for(answer) == b"HTTP/1.0 200"
    finally:
        host.run(["pkill", "-f", "http.server 18080"])


def test_two_hosts_at_once_each_in_its_own_cgroup_and_network(systemd_hosts):
    a, b = systemd_hosts(2)
    assert a["address"] != b["address"]
    names = set()
    for info in (a, b):
        with connect(info) as h:
            names.add(h.run(["hostname"]).stdout.strip())
            assert h.run(["ip", "-4", "-br", "addr", "show", "eth0"]).stdout.split()[2] == \
                info["address"] + "/24"
        assert all(Path(cg).is_dir() for cg in info["_cgroups"])
    assert names == {a["_name"], b["_name"]}


_LISTENER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
open("/run/listener.ready", "w").close()
conn, peer = srv.accept()
conn.sendall(("%s %s\\n" % (socket.gethostname(), peer[0])).encode())
conn.close()
"""


def test_two_hosts_reach_each_other_on_their_own_addresses(systemd_hosts):
    """What a multi-node service needs: a rank on host B connects to the head's port on host A's
    address, through this side's forwarding, and A sees B's own address (no NAT). Only the test
    hosts' veths forward: the namespace-wide switch is left as it was."""
    a, b = systemd_hosts(2)
    for info in (a, b):
        assert Path(f"/proc/sys/net/ipv4/conf/{info['_veth']}/forwarding").read_text().strip() == "1"
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == IP_FORWARD_BEFORE
    with connect(a) as ha, connect(b) as hb:
        for h, info in ((ha, a), (hb, b)):
            route = h.run(["ip", "-4", "route", "show", nspawn.HOSTS_NET]).stdout
            assert f"via {info['_gateway']} dev eth0" in route, route
        ha.put("/run/listener.py", _LISTENER.encode())
        ha.run(Script(f"rm -f /run/listener.ready; nohup python3 /run/listener.py {a['address']} 29555 "
                      ">/run/listener.log 2>&1 &")).check(ha.name)
        wait_for(lambda: ha.run(["test", "-e", "/run/listener.ready"]).ok, budget=30)
        r = hb.run(["python3", "-c", "import socket; c = socket.create_connection("
                    f"({a['address']!r}, 29555), timeout=10); print(c.makefile().readline().strip())"],
                   timeout=30)
        assert r.stdout.split() == [a["_name"], b["address"]], (r.stdout, r.stderr,
                                                                ha.run(["cat", "/run/listener.log"]).stdout)


def test_shutdown_leaves_nothing_behind_and_boot_recovers_a_stale_network(tmp_path):
    if systemd_skip_reason():
        pytest.skip(systemd_skip_reason())
    tree = nspawn.ensure_tree()
    nspawn.prepare_network("vo-stale", 240)             # left over by a killed run
    info = nspawn.boot("vo-stale", 240, tmp_path, tree)
    with connect(info) as h:
        assert h.run(["true"]).ok
    nspawn.shutdown(info)
    nspawn.shutdown(info)                                # twice is fine
    assert not Path("/run/netns/vllm-orch-vo-stale").exists()
    assert not nspawn.link_exists("vorch240")
    assert not any(Path(cg).exists() for cg in info["_cgroups"])
    assert nspawn.find_running("vo-stale") is None


def test_prepare_network_keeps_a_complete_network_so_a_bound_mirror_survives_boot(tmp_path):
    if systemd_skip_reason():
        pytest.skip(systemd_skip_reason())
    import socket
    net = nspawn.prepare_network("vo-keep", 241)
    mirror = socket.socket()
    mirror.bind((net["gateway"], 0))            # the hub mirror, started before the container
    mirror.listen(1)
    info = nspawn.boot("vo-keep", 241, tmp_path, nspawn.ensure_tree(),
                       hub_port=mirror.getsockname()[1])
    try:
        assert info["env"]["HF_ENDPOINT"] == f"http://{net['gateway']}:{mirror.getsockname()[1]}"
        with connect(info) as h:
            r = h.run([info["python"], "-c", "import socket; socket.create_connection("
                       f"({net['gateway']!r}, {mirror.getsockname()[1]}), timeout=3); print('ok')"])
        assert r.stdout.strip() == "ok", r.stderr
    finally:
        mirror.close()
        nspawn.shutdown(info)


def test_what_a_killed_run_left_is_reaped_by_the_next_and_a_live_runs_is_not(tmp_path, monkeypatch):
    """A test run killed with SIGKILL leaves its containers (a root sshd), named namespaces and
    cgroups: the next run (and `vllm-orch sim down`) reaps what a dead owner registered; a live
    owner's hosts are left alone."""
    import subprocess

    from orchestrator.sim.nvidia_smi import proc_start_time

    if systemd_skip_reason():
        pytest.skip(systemd_skip_reason())
    tree = nspawn.ensure_tree()
    owner = subprocess.Popen(["sleep", "600"])          # stands in for a pytest run that gets killed
    monkeypatch.setenv(nspawn.OWNER_ENV, f"{owner.pid}:{proc_start_time(owner.pid)}")
    info = nspawn.boot("vo-reap", 242, tmp_path, tree)
    monkeypatch.delenv(nspawn.OWNER_ENV)
    try:
        assert (nspawn.REGISTRY / "vo-reap.json").exists()
        assert not [r for r in nspawn.reap_stale() if "vo-reap" in r]       # its owner lives: kept
        assert nspawn.find_running("vo-reap") == info["_pid"]
        owner.kill()
        owner.wait()
        reaped = nspawn.reap_stale()
        assert any(r.startswith("vo-reap ") for r in reaped), reaped
        assert nspawn.find_running("vo-reap") is None
        assert not Path(f"/run/netns/{info['_netns']}").exists()
        assert not nspawn.link_exists(info["_veth"])
        assert not any(Path(cg).exists() for cg in info["_cgroups"])
        assert not (nspawn.REGISTRY / "vo-reap.json").exists()
    finally:
        owner.kill()
        nspawn.shutdown(info)
