"""SshHost against a real OpenSSH sshd on loopback (fixture sshd_local)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import paramiko
import pytest

from orchestrator.errors import ConnectError, RefusedError
from orchestrator.host.base import Script
from orchestrator.host.ssh import SshHost
from orchestrator.host.ssh_connect import fingerprint
from orchestrator.secret import Secret
from orchestrator.sim import sshd as sshd_mod

pytestmark = pytest.mark.ssh


def make_host(info, **kw) -> SshHost:
    name = kw.pop("name", "testhost")
    args = dict(port=info.port, user=info.user, identity_file=info.identity_file,
                known_hosts_file=info.known_hosts_file, connect_timeout=5, ssh_config=None)
    args.update(kw)
    return SshHost(name, info.address, **args)


# -- commands ----------------------------------------------------------------------------------------
def test_run_exit_code_stdout_stderr(ssh_host):
    r = ssh_host.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert not r.ok
    assert ssh_host.run(Script("printf '%s' a | tr a b")).stdout == "b"


def test_env_from_host_and_call(sshd_local):
    with make_host(sshd_local, env={"A": "from host", "B": "b"}) as h:
        r = h.run(Script('echo "$A|$B"'), env={"B": "from call"})
    assert r.stdout == "from host|from call\n"


def test_secret_is_revealed_on_the_host_but_masked_in_result(ssh_host):
    r = ssh_host.run(["echo", "token", Secret("hf_s3cr3t")])
    assert r.stdout == "token hf_s3cr3t\n"
    assert r.cmd == "echo token ***"
    assert "hf_s3cr3t" not in repr(r.cmd)


def test_input_is_sent_to_stdin(ssh_host):
    assert ssh_host.run(["cat"], input=b"line1\nline2").stdout == "line1\nline2"
    # without input, stdin is at EOF at once (a command reading it does not hang)
    assert ssh_host.run(["cat"], timeout=5).exit_code == 0


def test_stream_calls_back_per_line_as_lines_arrive(ssh_host):
    seen: list[tuple[float, str]] = []
    started = time.monotonic()
    r = ssh_host.stream(Script("for i in 1 2 3; do echo line$i; sleep 0.6; done; "
                               "echo oops >&2; printf tail"),
                        on_line=lambda line: seen.append((time.monotonic() - started, line)))
    assert [line for _, line in seen] == ["line1", "line2", "line3", "tail"]
    # line1 reached us long before the command ended (1.8 s of sleeps after it; room for a busy machine)
    assert seen[0][0] < r.duration - 0.9
    assert r.stdout == "line1\nline2\nline3\ntail"
    assert r.stderr == "oops\n"


def test_timeout_kills_the_command_and_its_children(ssh_host):
    started = time.monotonic()
    r = ssh_host.run(Script("sleep 31.41 & sleep 31.42"), timeout=0.5)
    assert r.exit_code == 124 and "timed out after 0.5 s" in r.stderr
    assert time.monotonic() - started < 3
    deadline = time.monotonic() + 3
    while ssh_host.run(["pgrep", "-f", "^sleep 31.4"]).exit_code == 0:
        assert time.monotonic() < deadline, "timed-out command still running on the host"
        time.sleep(0.05)


# -- files -------------------------------------------------------------------------------------------
def test_put_get_with_mode_and_missing_parents(ssh_host, tmp_path):
    target = tmp_path / "a" / "b" / "unit.service"
    data = bytes(range(256)) * 10
    ssh_host.put(str(target), data, mode=0o640)
    assert target.read_bytes() == data
    assert target.stat().st_mode & 0o777 == 0o640
    assert ssh_host.get(str(target)) == data
    ssh_host.put(str(target), b"v2", mode=0o600)           # overwrite replaces, atomically
    assert target.read_bytes() == b"v2" and target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["unit.service"]   # no temp left


def test_get_missing_file_is_none(ssh_host, tmp_path):
    assert ssh_host.get(str(tmp_path / "nope")) is None


@pytest.mark.skipif(not shutil.which("sudo"), reason="sudo not installed (apt-get install sudo)")
@pytest.mark.skipif(os.geteuid() != 0, reason="sudo -n only works without a password as root")
def test_sudo_wraps_commands_and_installs_files(sshd_local, tmp_path):
    with make_host(sshd_local, sudo=True) as h:
        r = h.run(["id", "-u"])
        assert r.stdout.strip() == "0"
        assert h.wrap(["id", "-u"], None, None).startswith("sudo -n ")
        target = tmp_path / "etc" / "thing.env"
        h.put(str(target), b"A=1\n", mode=0o600)
        assert target.read_bytes() == b"A=1\n" and target.stat().st_mode & 0o777 == 0o600
        assert h.get(str(target)) == b"A=1\n"
        assert h.get(str(tmp_path / "missing")) is None
        staged = [p for p in Path("/tmp").glob(".vllm-orch-put-*")]
        assert staged == []


# -- tunnels -----------------------------------------------------------------------------------------
def test_connect_tcp_reaches_a_loopback_server_on_the_host(ssh_host):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"echo:" + conn.recv(100))

    threading.Thread(target=echo, daemon=True).start()
    chan = ssh_host.connect_tcp(server.getsockname()[1])
    try:
        chan.sendall(b"ping")
        assert chan.recv(100) == b"echo:ping"
    finally:
        chan.close()
        server.close()


def test_connect_tcp_to_a_closed_port_is_refused(ssh_host):
    port = sshd_mod.free_port()
    with pytest.raises(ConnectionRefusedError):
        ssh_host.connect_tcp(port)


# -- host keys ---------------------------------------------------------------------------------------
def _expected_fingerprint(info) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", f"{info.folder}/host_ed25519.pub"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()[1]


def test_unknown_host_key_is_refused_with_its_fingerprint(sshd_local, tmp_path):
    kh = tmp_path / "known_hosts"
    with make_host(sshd_local, known_hosts_file=str(kh)) as h:
        with pytest.raises(RefusedError) as err:
            h.run(["true"])
    msg = str(err.value)
    assert "unknown host key" in msg and "ssh-ed25519" in msg
    assert _expected_fingerprint(sshd_local) in msg          # same text as OpenSSH prints
    assert "--accept-new-host-key" in err.value.hint
    assert err.value.exit_code == 3 and "\n" not in msg
    assert not kh.exists()


def test_a_failed_connect_reports_its_own_error_when_closing_what_it_made_fails(sshd_local, tmp_path,
                                                                             monkeypatch):
    """A failed connect closes the client it made; on a connection that is already dead, paramiko's
    close raises (EOFError, as in the swap of test_a_channel_close_that_fails_...). The refusal, not
    the close's error, is what the operator must see."""
    def dead(self):
        raise EOFError()

    monkeypatch.setattr(paramiko.SSHClient, "close", dead)
    with make_host(sshd_local, known_hosts_file=str(tmp_path / "known_hosts")) as h:
        with pytest.raises(RefusedError, match="unknown host key"):
            h.run(["true"])


def test_accept_new_adds_the_key_then_plain_connects_work(sshd_local, tmp_path):
    kh = tmp_path / "ssh" / "known_hosts"
    with make_host(sshd_local, known_hosts_file=str(kh), accept_new_host_key=True) as h:
        assert h.run(["true"]).ok
    entry = f"[{sshd_local.address}]:{sshd_local.port}"
    assert kh.read_text() == f"{entry} {sshd_local.host_key_pub}\n"
    # OpenSSH reads what we wrote
    found = subprocess.run(["ssh-keygen", "-F", entry, "-f", str(kh)], capture_output=True)
    assert found.returncode == 0
    with make_host(sshd_local, known_hosts_file=str(kh)) as h:
        assert h.run(["true"]).ok
    assert kh.read_text().count("\n") == 1


def test_changed_host_key_is_refused_even_with_accept_new(sshd_local, tmp_path):
    sshd_mod.keygen(tmp_path / "other")
    other = (tmp_path / "other.pub").read_text().split()
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[{sshd_local.address}]:{sshd_local.port} {other[0]} {other[1]}\n")
    before = kh.read_text()
    with make_host(sshd_local, known_hosts_file=str(kh), accept_new_host_key=True) as h:
        with pytest.raises(RefusedError) as err:
            h.run(["true"])
    assert "HOST KEY CHANGED" in str(err.value)
    assert _expected_fingerprint(sshd_local) in str(err.value)
    assert kh.read_text() == before


def test_fingerprint_format_matches_openssh(sshd_local):
    import paramiko
    key = paramiko.Ed25519Key.from_path(f"{sshd_local.folder}/host_ed25519")
    assert fingerprint(key) == _expected_fingerprint(sshd_local)


# -- connect failures: one line, within the timeout -------------------------------------------------
def _one_line_error(host: SshHost, budget: float) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(ConnectError) as err:
        host.run(["true"])
    elapsed = time.monotonic() - started
    # within the timeout, give or take what a busy machine adds (no retries, no default 10 s wait)
    assert elapsed < budget + 1.5, f"took {elapsed:.2f} s for a {budget} s connect timeout"
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{host.name}: ")
    return text, elapsed


def test_bad_auth_is_one_line(sshd_local, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    sshd_mod.keygen(tmp_path / "stranger")
    with make_host(sshd_local, identity_file=str(tmp_path / "stranger"), connect_timeout=5) as h:
        text, _ = _one_line_error(h, 5)
    assert "authentication failed" in text and str(tmp_path / "stranger") in text


def test_closed_port_is_one_line(sshd_local):
    port = sshd_mod.free_port()
    with make_host(sshd_local, port=port, connect_timeout=3) as h:
        text, elapsed = _one_line_error(h, 3)
    assert "connection refused" in text and f"127.0.0.1:{port}" in text
    assert elapsed < 2                                   # refused is final: no retries until the 3 s timeout


def test_unresolvable_name_is_one_line(sshd_local):
    h = SshHost("ghost", "no-such-host.invalid", port=22, user="root", connect_timeout=3,
                ssh_config=None)
    text, _ = _one_line_error(h, 3)
    assert "does not resolve" in text and "no-such-host.invalid" in text


def test_silent_server_times_out_within_the_connect_timeout(sshd_local):
    """A port that accepts but never speaks SSH (a hung daemon): fail after connect_timeout."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        with make_host(sshd_local, port=silent.getsockname()[1], connect_timeout=1) as h:
            text, elapsed = _one_line_error(h, 1)
        assert "timed out after 1 s" in text and elapsed >= 0.9
    finally:
        silent.close()


# -- one connection, shared by threads ---------------------------------------------------------------
def test_one_connection_serves_many_commands_from_many_threads(ssh_host, tmp_path):
    results: dict[int, str] = {}

    def work(i: int) -> None:
        for j in range(5):
            results[i * 10 + j] = ssh_host.run(["echo", str(i * 10 + j)]).stdout.strip()
        ssh_host.put(str(tmp_path / f"f{i}"), str(i).encode())
        assert ssh_host.get(str(tmp_path / f"f{i}")) == str(i).encode()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: str(k) for k in results} and len(results) == 20
    assert ssh_host.connects == 1
    assert ssh_host.stats.round_trips == 28


def test_reconnects_once_when_the_connection_died(ssh_host):
    assert ssh_host.run(["true"]).ok
    ssh_host.transport().close()
    assert ssh_host.run(["echo", "again"]).stdout == "again\n"
    assert ssh_host.connects == 2


def test_a_connection_cut_under_a_running_command_is_a_lost_connection_not_an_exit_code(ssh_host):
    """paramiko closes the channels of a dead transport and then reports their exit status as ready
    (-1): the command must not look as if it ended (readiness read that as "the service exited")."""
    for _ in range(3):
        assert ssh_host.run(["true"]).ok
        sock = ssh_host.transport().sock
        threading.Timer(0.3, sock.shutdown, args=(socket.SHUT_RDWR,)).start()
        with pytest.raises(ConnectError, match="lost the connection"):
            ssh_host.run(["sleep", "5"], timeout=20)
    assert ssh_host.run(["echo", "again"]).stdout == "again\n"


def test_a_file_read_on_a_dropped_connection_is_a_lost_connection_and_the_next_read_reopens(ssh_host, tmp_path):
    """get() reads through SFTP: on a connection cut under its open session paramiko raises
    SSHException("Server connection dropped"), which escaped a swap's rollback (the lock guard reads
    the lock's record with get; seen on real systemd under load). It is a ConnectError, like run()'s."""
    f = tmp_path / "record.json"
    f.write_text("{}")
    assert ssh_host.get(str(f)) == b"{}"                 # the SFTP session is open
    sftp = ssh_host.sftp()

    def dropped(*args, **kwargs):                     # what paramiko raised in the swap, whose cut
        raise paramiko.SSHException("Server connection dropped: ")   # the transport had not seen yet

    sftp.open = dropped                                # type: ignore[method-assign]
    with pytest.raises(ConnectError, match="lost the connection.*Server connection dropped"):
        ssh_host.get(str(f))
    assert ssh_host.sftp() is not sftp                 # the next read opens a new session
    assert ssh_host.get(str(f)) == b"{}" and ssh_host.get(str(tmp_path / "none")) is None


def test_closing_a_connection_that_died_does_not_raise_and_the_next_use_reconnects(ssh_host, tmp_path):
    """On a connection that has died, paramiko's close of the SFTP channel raises EOFError: it left
    a swap cut off from its host through its session's close (seen on real systemd under load), in
    place of the half-done swap and its hint. close() forgets what it cannot close."""
    f = tmp_path / "record.json"
    f.write_text("{}")
    assert ssh_host.get(str(f)) == b"{}"                 # the SFTP session is open
    sftp = ssh_host.sftp()

    def dead(*args, **kwargs):                        # what paramiko raised in the swap
        raise EOFError()

    sftp.close = dead                                  # type: ignore[method-assign]
    ssh_host.close()
    assert ssh_host.get(str(f)) == b"{}" and ssh_host.sftp() is not sftp


def test_a_channel_close_that_fails_on_the_dead_connection_leaves_the_lost_connection(ssh_host, monkeypatch):
    """When the connection dies under a command before paramiko has noticed, closing the command's
    channel writes on the dead socket and paramiko raises EOFError. It replaced the lost connection
    in a swap cut off from its real-systemd host under load (a full run of issue 24), and with it the
    half-done swap and its hint. The caller gets the lost connection; a command that ended keeps its
    answer even when its channel cannot be closed."""
    def dead(self):                                     # what paramiko's close raised in that swap
        raise EOFError()

    assert ssh_host.run(["true"]).ok
    monkeypatch.setattr(paramiko.Channel, "close", dead)
    sock = ssh_host.transport().sock
    threading.Timer(0.3, sock.shutdown, args=(socket.SHUT_RDWR,)).start()
    with pytest.raises(ConnectError, match="lost the connection"):
        ssh_host.run(["sleep", "5"], timeout=20)
    assert ssh_host.run(["echo", "again"]).stdout == "again\n"
    monkeypatch.undo()
    assert ssh_host.run(["echo", "closed"]).stdout == "closed\n"


# -- ~/.ssh/config -----------------------------------------------------------------------------------
def _ssh_config(tmp_path: Path, info, extra: str = "") -> Path:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"""
Host gpu-box
    HostName {info.address}
    Port {info.port}
    User {info.user}
    IdentityFile {info.identity_file}
    UserKnownHostsFile {info.known_hosts_file}
{extra}""")
    return cfg


def test_ssh_config_alias_supplies_address_port_user_key(sshd_local, tmp_path):
    cfg = _ssh_config(tmp_path, sshd_local)
    with SshHost("gpu", "gpu-box", ssh_config=str(cfg), connect_timeout=5) as h:
        assert h.target.hostname == sshd_local.address and h.target.port == sshd_local.port
        assert h.run(["echo", "via alias"]).stdout == "via alias\n"


def test_proxy_jump_reaches_the_host_through_another(sshd_local, tmp_path):
    cfg = _ssh_config(tmp_path, sshd_local, f"""
Host behind
    HostName {sshd_local.address}
    Port {sshd_local.port}
    User {sshd_local.user}
    IdentityFile {sshd_local.identity_file}
    ProxyJump gpu-box
""")
    with SshHost("behind", "behind", ssh_config=str(cfg), connect_timeout=5,
                 known_hosts_file=sshd_local.known_hosts_file) as h:
        assert h.target.jump is not None and h.target.jump.hostname == sshd_local.address
        assert h.run(["echo", "jumped"]).stdout == "jumped\n"


# -- keys from the SSH agent; hashed known_hosts -----------------------------------------------------
@pytest.mark.skipif(not shutil.which("ssh-agent"), reason="ssh-agent not found (openssh-client)")
def test_key_from_the_ssh_agent(sshd_local, tmp_path, monkeypatch):
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while not sock.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        monkeypatch.setenv("HOME", str(tmp_path))            # no ~/.ssh/id_* to fall back on
        subprocess.run(["ssh-add", "-q", sshd_local.identity_file], check=True,
                       capture_output=True)
        with make_host(sshd_local, identity_file=None) as h:
            assert h.target.identity_files == ()
            assert h.run(["echo", "agent"]).stdout == "agent\n"
    finally:
        agent.terminate()
        agent.wait(5)


def test_hashed_known_hosts_entries_are_honoured(sshd_local, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(Path(sshd_local.known_hosts_file).read_text())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert str(sshd_local.port) not in kh.read_text()                 # really hashed
    with make_host(sshd_local, known_hosts_file=str(kh)) as h:
        assert h.run(["true"]).ok


@pytest.mark.skipif(not shutil.which("sudo"), reason="sudo not installed (apt-get install sudo)")
@pytest.mark.skipif(os.geteuid() != 0, reason="sudo -n only works without a password as root")
def test_sudo_command_timeout_kills_it_too(sshd_local):
    with make_host(sshd_local, sudo=True) as h:
        assert h.run(["sleep", "33.61"], timeout=0.5).exit_code == 124
        deadline = time.monotonic() + 3
        while h.run(["pgrep", "-f", "^sleep 33.61"]).exit_code == 0:
            assert time.monotonic() < deadline, "sudo'd command survived its timeout"
            time.sleep(0.05)


def test_a_dropped_handshake_is_retried(sshd_local):
    """The first connection is closed before the banner (a daemon at MaxStartups); the retry
    goes through. A forwarder in front of the real sshd plays the flaky network."""
    front = socket.socket()
    front.bind(("127.0.0.1", 0))
    front.listen(4)
    seen = []

    def pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            b.close()

    def serve():
        while True:
            try:
                conn, _ = front.accept()
            except OSError:
                return
            seen.append(conn)
            if len(seen) == 1:
                conn.close()                                    # drop the first attempt
                continue
            back = socket.create_connection((sshd_local.address, sshd_local.port))
            threading.Thread(target=pipe, args=(conn, back), daemon=True).start()
            threading.Thread(target=pipe, args=(back, conn), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    kh = Path(sshd_local.folder) / "known_hosts"
    entry = f"[127.0.0.1]:{front.getsockname()[1]} {sshd_local.host_key_pub}\n"
    front_kh = Path(sshd_local.folder) / f"known_hosts.front{front.getsockname()[1]}"
    front_kh.write_text(kh.read_text() + entry)
    try:
        with make_host(sshd_local, port=front.getsockname()[1], known_hosts_file=str(front_kh)) as h:
            assert h.run(["echo", "retried"]).stdout == "retried\n"
            assert h.connects == 1 and len(seen) == 2
    finally:
        front.close()


def test_from_inventory_entry(sshd_local):
    entry = {**sshd_local.inventory(), "service_manager": "process", "env": {"X": "1"}}
    with SshHost.from_inventory("inv", entry) as h:
        assert h.run(Script("echo $X")).stdout == "1\n"


def test_a_channel_that_cannot_open_on_a_silent_link_is_a_lost_connection(ssh_host, monkeypatch):
    """On a link that died without a reset paramiko's open_session times out with its own
    SSHException("Timeout opening channel"); the lock's spawn must raise ConnectError like run() does
    (HostLock.ensure handles ours and let paramiko's escape the run's recovery)."""
    transport = ssh_host.transport()

    def silent(*args, **kwargs):
        raise paramiko.SSHException("Timeout opening channel.")

    monkeypatch.setattr(transport, "open_session", silent)
    with pytest.raises(ConnectError, match="lost the connection.*Timeout opening channel"):
        ssh_host.spawn(["cat"])
    with pytest.raises(ConnectError, match="lost the connection"):
        ssh_host.run(["true"])


RELAY = """
import os, socket, sys, threading
link = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
with open(sys.argv[2], "a") as f:
    f.write("relayed to port %s\\n" % sys.argv[1])
def up():
    while True:
        data = os.read(0, 65536)
        if not data:
            link.shutdown(socket.SHUT_WR)
            return
        link.sendall(data)
threading.Thread(target=up, daemon=True).start()
while True:
    data = link.recv(65536)
    if not data:
        break
    os.write(1, data)
"""


def test_proxy_command_is_how_the_host_is_reached(sshd_local, tmp_path):
    """ssh_config's ProxyCommand was silently ignored: the connection went straight to HostName.
    Now it is the link, run as ssh runs it (by the shell: the redirection works), with %p expanded."""
    relay, used = tmp_path / "relay.py", tmp_path / "relay.log"
    relay.write_text(RELAY)
    cfg = _ssh_config(tmp_path, sshd_local, f"""
Host proxied
    HostName {sshd_local.address}
    Port {sshd_local.port}
    User {sshd_local.user}
    IdentityFile {sshd_local.identity_file}
    UserKnownHostsFile {sshd_local.known_hosts_file}
    ProxyCommand {sys.executable} {relay} %p {used} 2>>{tmp_path / "relay.err"}
""")
    with SshHost("proxied", "proxied", ssh_config=str(cfg), connect_timeout=10) as h:
        assert h.target.proxy_command is not None and str(sshd_local.port) in h.target.proxy_command
        assert h.run(["echo", "proxied"]).stdout == "proxied\n"
    assert used.read_text() == f"relayed to port {sshd_local.port}\n"


def test_a_failing_proxy_command_is_one_line(sshd_local, tmp_path):
    cfg = _ssh_config(tmp_path, sshd_local, "    ProxyCommand false\n")
    host = SshHost("gpu", "gpu-box", ssh_config=str(cfg), connect_timeout=5)
    with pytest.raises(ConnectError) as err:
        host.run(["true"])
    # The proxy's own end is the cause named, not a banner timeout (what a busy CI machine saw).
    assert "cannot connect to" in str(err.value) and "ProxyCommand exited with status 1 (false)" in str(err.value), \
        str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("extra, says", [
    ("    ProxyJump a,b\n", "ProxyJump a,b for gpu-box: vllm-orch takes one hop"),
    ("    ProxyJump ssh://a:22\n", "ProxyJump ssh://a:22 for gpu-box"),
    ("    ProxyJump a\n    ProxyCommand nc %h %p\n", "sets both ProxyJump and ProxyCommand for gpu-box"),
])
def test_proxy_settings_vllm_orch_cannot_follow_are_refused_naming_host_and_option(sshd_local, tmp_path,
                                                                                    extra, says):
    from orchestrator.errors import ConfigError

    cfg = _ssh_config(tmp_path, sshd_local, extra)
    with pytest.raises(ConfigError) as err:
        SshHost("gpu", "gpu-box", ssh_config=str(cfg), connect_timeout=5)
    assert err.value.exit_code == 2 and says in str(err.value) and "gpu" in str(err.value)
