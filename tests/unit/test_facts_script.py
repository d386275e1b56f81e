"""The host-side facts script reads process facts with psutil when the host's Python has it and
from /proc when it has not (`python -S` hides the venv's site-packages, as on a bare python3):
both ways give the same facts, and a zombie counts as dead in both."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.paths import package_file

SCRIPT = package_file("host", "remote", "facts_script.py").read_text()


def run_facts(tmp_path, python: list[str], models: list[str], ports: list[int]) -> dict:
    args = {"ports": ports, "models_root": str(tmp_path / "models"), "state_dir": str(tmp_path / "state"),
            "nvidia_smi": "nvidia-smi-absent", "vllm": "/nonexistent/vllm", "manager": "process",
            "models": models, "gpu_query": ["nvidia-smi-absent"], "apps_query": ["nvidia-smi-absent"]}
    out = subprocess.run([*python, "-c", SCRIPT, json.dumps(args)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


BOOT_ID = open("/proc/sys/kernel/random/boot_id").read().strip()


def start_ticks(pid: int) -> str:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2:].split()[19]


def record(pid: int, boot: str = BOOT_ID, start: str | None = None) -> str:
    """A process service's record as the start command writes it: PGID, boot id, start time."""
    return f"{pid} {boot} {start if start is not None else start_ticks(pid)}\n"


@pytest.fixture
def processes(tmp_path):
    """A running process, a zombie (exited, not reaped) and a dead PID, each as a process
    service's PID file; and a listening socket of this process."""
    run = tmp_path / "state" / "run"
    run.mkdir(parents=True)
    live = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["true"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    deadline = time.monotonic() + 10
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for name, proc in (("live", live), ("zomb", zombie), ("dead", gone)):
        (run / f"vllm-{name}.pid").write_text(record(proc.pid))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        yield {"live": live.pid, "port": server.getsockname()[1]}
    finally:
        server.close()
        live.kill()
        live.wait()
        zombie.wait()


def test_psutil_and_proc_give_the_same_facts(tmp_path, processes):
    assert subprocess.run([sys.executable, "-S", "-c", "import psutil"], capture_output=True).returncode != 0
    models, ports = ["live", "zomb", "dead"], [processes["port"]]
    with_psutil = run_facts(tmp_path, [sys.executable], models, ports)
    by_hand = run_facts(tmp_path, [sys.executable, "-S"], models, ports)
    assert with_psutil["psutil"] and by_hand["psutil"] is None
    for facts in (with_psutil, by_hand):
        states = {name: s["ActiveState"] for name, s in facts["services"].items()}
        assert states == {"live": "active", "zomb": "failed", "dead": "failed"}
        assert facts["ports"] == {str(processes["port"]): [os.getpid()]}
        info = facts["procs"][str(processes["live"])]
        assert info["alive"] and info["comm"] == "sleep" and info["cmdline"] == ["sleep", "60"]
        assert info["ppid"] == os.getpid() and info["pgid"] == os.getpgid(processes["live"])
        assert info["cgroup"]
    assert with_psutil["procs"] == by_hand["procs"]
    assert with_psutil["services"] == by_hand["services"]


def test_a_stale_record_names_no_process_group(tmp_path):
    """After a reboot (another boot id), or when the PID now belongs to a process started later,
    the record is stale: the service is inactive and no process group is attributed to it."""
    run = tmp_path / "state" / "run"
    run.mkdir(parents=True)
    other = subprocess.Popen(["sleep", "60"])
    try:
        (run / "vllm-reboot.pid").write_text(record(other.pid, boot="0" * 8 + "-old-boot"))
        (run / "vllm-reused.pid").write_text(record(other.pid, start=str(int(start_ticks(other.pid)) - 5)))
        (run / "vllm-legacy.pid").write_text(f"{other.pid}\n")          # an older vllm-orch's PID file
        (run / "vllm-ours.pid").write_text(record(other.pid))
        facts = run_facts(tmp_path, [sys.executable], ["reboot", "reused", "legacy", "ours"], [])
        svc = facts["services"]
        for name in ("reboot", "reused", "legacy"):
            assert svc[name]["ActiveState"] == "inactive" and "PGID" not in svc[name], name
            assert svc[name]["StaleRecord"]
        assert "another boot" in svc["reboot"]["StaleRecord"] and "another process" in svc["reused"]["StaleRecord"]
        assert svc["ours"]["ActiveState"] == "active" and svc["ours"]["PGID"] == str(other.pid)
    finally:
        other.kill()
        other.wait()


def test_a_record_naming_init_the_callers_group_or_garbage_names_no_process_group(tmp_path):
    """PID 1 (init, with its own start time so the leader check would pass), 0, -1 and non-canonical
    numbers are no group vllm-orch started: the status never attributes them to the service (the
    stop command's shell rule is tests/integration/test_process_stop_pid.py)."""
    run = tmp_path / "state" / "run"
    run.mkdir(parents=True)
    names = {"init": record(1), "zero": record(0, start="1"), "minus": record(-1, start="1"),
             "plus": f"+{os.getpid()} {BOOT_ID} {start_ticks(os.getpid())}\n",
             "zeros": f"00{os.getpid()} {BOOT_ID} {start_ticks(os.getpid())}\n"}
    for name, text in names.items():
        (run / f"vllm-{name}.pid").write_text(text)
    svc = run_facts(tmp_path, [sys.executable], list(names), [])["services"]
    for name in names:
        assert svc[name]["ActiveState"] == "inactive" and "PGID" not in svc[name], (name, svc[name])
        assert "no process group vllm-orch started" in svc[name]["StaleRecord"], (name, svc[name])


# -- service_reach: can the service user run vllm (preflight check service-user) -----------------------
@pytest.fixture
def open_dir():
    """A world-enterable folder in /tmp (pytest's own tmp_path sits under a 0700 folder)."""
    import shutil
    import tempfile
    path = tempfile.mkdtemp(prefix="vllm-orch-reach-", dir="/tmp")
    os.chmod(path, 0o755)
    yield Path(path)
    shutil.rmtree(path)


def _venv(base, folder_mode: int, script_mode: int = 0o755):
    """base/private/venv/bin/vllm: a #! script naming the venv's python (a link to /bin/sh here:
    only its path and permissions are read)."""
    bin_dir = base / "private" / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to("/bin/sh")
    vllm = bin_dir / "vllm"
    vllm.write_text(f"#!{bin_dir / 'python'}\nimport sys\n")
    vllm.chmod(script_mode)
    os.chmod(base / "private", folder_mode)
    return vllm


def test_service_reach_walks_every_folder_and_the_interpreter(tmp_path, open_dir):
    def service_reach(vllm: str, user: str) -> dict:
        args = {"ports": [], "models_root": str(tmp_path / "models"), "state_dir": str(tmp_path / "state"),
                "nvidia_smi": "nvidia-smi-absent", "vllm": vllm, "manager": "process", "models": [],
                "users": [user], "gpu_query": ["nvidia-smi-absent"], "apps_query": ["nvidia-smi-absent"]}
        out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["service_reach"]

    vllm = _venv(open_dir, 0o700)          # like a venv under /root: only its owner gets in
    ghost = "vllm-orch-no-such-user"       # deploy would create it: judged by the 'other' bits
    reach = service_reach(str(vllm), ghost)
    assert reach["exists"] is False and reach["problems"], reach
    assert reach["problems"][0].startswith(f"{open_dir / 'private'} (drwx------ ") and \
        reach["problems"][0].endswith(f"does not let {ghost} in"), reach
    assert service_reach(str(vllm), "root")["problems"] == []
    (open_dir / "private").chmod(0o755)
    assert service_reach(str(vllm), ghost)["problems"] == []
    vllm.chmod(0o711)                      # a script must be readable too, not only executable
    assert service_reach(str(vllm), ghost)["problems"] == [
        f"{vllm} (-rwx--x--x {vllm.owner()}) is not readable and executable by {ghost}"]


def root_trust(tmp_path, programs: list[str], folders: list[str], python: str = sys.executable) -> dict:
    args = {"ports": [], "models_root": str(tmp_path / "models"), "state_dir": str(tmp_path / "state"),
            "nvidia_smi": "nvidia-smi-absent", "vllm": "/nonexistent/vllm", "manager": "process", "models": [],
            "users": ["root"], "gpu_query": ["nvidia-smi-absent"], "apps_query": ["nvidia-smi-absent"],
            "trust": {"programs": programs, "folders": folders}}
    out = subprocess.run([python, "-c", SCRIPT, json.dumps(args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {r["path"]: r["problem"] for kind in ("programs", "folders")
            for r in json.loads(out.stdout)["root_trust"][kind]}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files owned by another user")
def test_root_trust_names_every_path_another_user_could_change(tmp_path, open_dir):
    """What vllm-orch runs and writes as root must be changeable by root only: a venv's python in a
    folder another user owns, `models_root: /tmp/models` that anyone could have made first,
    `state_dir: /tmp` itself, a folder under a group-writable one."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    theirs = open_dir / "theirs"
    (theirs / "bin").mkdir(parents=True)
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    python = theirs / "bin" / "python3"
    python.symlink_to(sys.executable)
    mine = open_dir / "mine"
    (mine / "bin").mkdir(parents=True)
    linked = mine / "bin" / "python3"
    linked.symlink_to(python)                    # root's link into a folder another user owns
    group_w = open_dir / "shared"
    group_w.mkdir()
    os.chown(group_w, 0, nobody.pw_gid)
    group_w.chmod(0o775)
    squat = "/tmp/vllm-orch-test-" + os.urandom(4).hex()
    made = open_dir / "made-by-root"
    made.mkdir()
    got = root_trust(tmp_path, [str(python), str(linked), sys.executable],
                     ["/tmp", squat + "/models", str(made), str(made / "later" / "state"), str(group_w / "x")])
    assert "owned by nobody" in got[str(python)] and "owned by nobody" in got[str(linked)]
    assert got[sys.executable] is None                       # this venv's python: root's all the way
    assert got["/tmp"] == "/tmp is writable by everyone"
    assert "does not exist yet" in got[squat + "/models"] and "make it as root" in got[squat + "/models"]
    assert got[str(made)] is None and got[str(made / "later" / "state")] is None   # open_dir: a root folder in /tmp
    assert "writable by group" in got[str(group_w / "x")]
    os.chown(made, nobody.pw_uid, nobody.pw_gid)             # someone else's folder in /tmp: not trusted
    assert "owned by nobody" in root_trust(tmp_path, [], [str(made / "state")])[str(made / "state")]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files owned by another user")
def test_root_trust_reads_the_pythons_sys_path_and_the_top_of_its_site_packages(tmp_path):
    """A `.pth` file at the top of site-packages runs at every start of that Python, as root for the
    helpers: one another user owns is named."""
    import pwd

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    python = tmp_path / "venv" / "bin" / "python"
    packages = Path(subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    got = root_trust(tmp_path, [str(python)], [], python=str(python))
    assert got[str(packages)] is None and got[str(python)] is None, got
    planted = packages / "zz-planted.pth"
    planted.write_text("")
    os.chown(planted, pwd.getpwnam("nobody").pw_uid, 0)
    got = root_trust(tmp_path, [str(python)], [], python=str(python))
    assert got[str(planted)] == f"{planted} is owned by nobody", got


def test_a_recorded_multinode_services_ports_are_read_as_listeners(tmp_path):
    """The facts name who listens on every port an installed multi-node service takes besides its API
    port: the port its nodes meet at (cluster_ports) and its Ray ports (node_ports, a worker port range
    as each of its ports), so another service's plan checks them (issue 26, finding 5)."""
    meet, in_range = socket.socket(), socket.socket()
    for s in (meet, in_range):
        s.bind(("127.0.0.1", 0))
        s.listen(1)
    low = in_range.getsockname()[1] - 1                   # the listener is inside the recorded worker range
    installed = tmp_path / "state" / "installed"
    installed.mkdir(parents=True)
    (installed / "svc.json").write_text(json.dumps({
        "version": 1, "model": "m", "port": 1, "gpus": [0], "nodes": ["a", "b"], "rank": 0, "head": "a",
        "head_address": "10.0.0.1", "cluster_ports": {"ray_port": meet.getsockname()[1]},
        "node_ports": {"node_manager_port": 2, "min_worker_port": low, "max_worker_port": low + 2}}))
    try:
        for python in ([sys.executable], [sys.executable, "-S"]):
            ports = run_facts(tmp_path, python, [], [])["ports"]
            assert {str(p) for p in (1, 2, meet.getsockname()[1], low, low + 1, low + 2)} <= set(ports), ports
            assert ports[str(meet.getsockname()[1])] == ports[str(low + 1)] == [os.getpid()], ports
    finally:
        meet.close()
        in_range.close()


def test_the_vllm_version_of_a_venv_the_facts_python_is_not_is_read_from_its_dist_info(tmp_path):
    """A manifest's engine venv (its bin/vllm) when the facts' Python has no vLLM: the version is read
    from that venv's dist-info, not by running `vllm --version` (which imports vLLM: tens of seconds of
    CPU on a real one, on every deploy); a vllm outside a venv still answers --version."""
    venv = tmp_path / "engines" / "vllm-0.33.0-0123456789abcdef"
    dist = venv / "lib" / "python3.11" / "site-packages" / "vllm-0.33.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n\nvLLM\n")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    ran = tmp_path / "ran"
    for exe in (venv / "bin" / "vllm", tmp_path / "bare" / "vllm"):
        exe.parent.mkdir(parents=True)
        exe.write_text(f"#!/bin/sh\necho \"$0\" >> {ran}\necho 0.24.0\n")
        exe.chmod(0o755)

    def version(exe: Path) -> str:
        args = {"ports": [], "models_root": str(tmp_path / "models"), "state_dir": str(tmp_path / "state"),
                "nvidia_smi": "nvidia-smi-absent", "vllm": str(exe), "manager": "process", "models": [],
                "gpu_query": ["nvidia-smi-absent"], "apps_query": ["nvidia-smi-absent"]}
        out = subprocess.run([sys.executable, "-S", "-c", SCRIPT, json.dumps(args)], capture_output=True, text=True,
                             timeout=120)     # -S: this Python's own site-packages (and any vLLM there) hidden
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["vllm"]["version"]

    assert version(venv / "bin" / "vllm") == "0.33.0" and not ran.exists()
    assert version(tmp_path / "bare" / "vllm") == "0.24.0" and ran.read_text().split() == [str(tmp_path / "bare" / "vllm")]
