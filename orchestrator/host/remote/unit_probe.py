"""The systemd unit's own probe of its vLLM server, installed on the host (not sent on stdin like the
other host-side scripts: systemd runs it, with no vllm-orch around). Stdlib only, Python >= 3.9;
run by the host's Python (the vLLM venv's, which also has prometheus_client).

  ready   ExecStartPost= of vllm-NAME.service. Waits until /health is 200, /v1/models lists the
          served name and a one-token completion answers, then exits 0: only then does systemd
          call the unit `active`, so `systemctl is-active` means "serves" and TimeoutStartSec=
          bounds the whole load. It never gives up on its own (TimeoutStartSec= is the bound: systemd
          then stops the unit) and it exits 1 only once the service's main process is gone, because
          systemd keeps the unit in `activating` until this process ends even after vLLM died. So a
          slow or broken probe can only delay `active`; it can never be the reason vLLM is killed
          before the budget the manifest gave it.
  check   ExecStart= of vllm-NAME-health.service, run by vllm-NAME-health.timer. One probe of an
          `active` unit: /health and a one-token completion. A completion that times out while
          /metrics shows the engine stepping (PROGRESS: a long prefill fills the KV cache chunk by
          chunk while no token counter moves) is a busy server, not a hang: the first such check of
          a run exits BUSY_EXIT, for the root part to write a `health-busy` record. The count of
          failed checks in a row lives in <state_dir>/health/NAME.json (status shows it); at N it
          notes the restart there and exits RESTART_EXIT.
  watch-head  ExecStart= of vllm-NAME-headwatch.service on a headless node of a multi-node service
          (TP/PP across nodes). A headless vLLM outlives its head (seen with a real vLLM): its ranks
          stay in the dead head's process group and the head's next start waits for them in vain.
          This holds one idle TCP connection to the head's rendezvous store (--master-addr:
          --master-port, listened on by the head's rank-0 worker for as long as it lives; torch's
          store keeps a client that never speaks and does not count it as a rank). When the
          connection ends and the port refuses a connection within --window seconds (a process that
          exits closes its listening socket with it; a new head takes longer than that to listen
          again), the head is gone: it exits RESTART_EXIT, so that the unit is restarted and this
          node joins the head's next start (the unit starts a new watch). While vllm-orch holds the
          host's lock (a stop, deploy or swap, which act on every node), it waits, and asks for a
          restart only of a unit vllm-orch left as it was. A connection closed while the port still
          accepts is only reconnected. TCP keepalive notices a head host that vanished without
          closing anything. Only a refusal (a TCP reset from the head's host) means "gone": while
          the head does not answer at all (timeouts, no route: a partition) it probes on until it
          answers, and restarts nothing.
  restart ExecStopPost=+ of the health check and the head watch: the one part that runs as root
          (`python -I -S`, the standard library only). It acts only when the probe it follows
          exited RESTART_EXIT ($EXIT_STATUS): it appends a `health-restart` / `head-lost-restart`
          record (with the reason the check noted) to history.jsonl and restarts the unit (after
          `systemctl reset-failed`; under the host's deploy lock, taken without waiting: nothing
          when vllm-orch holds it; at most --limit-burst times within --limit-interval s); after
          BUSY_EXIT it appends a `health-busy` record (what moved) and restarts nothing.

Who runs what (docs/security.md): ready, check and watch-head run as the service user, with an
isolated Python (-I). check and watch-head run without the service's environment file; the
health check reads the API key (vLLM answers 401 on /v1/* without it) from its unit's credential
(LoadCredential= of the 0600 env file, $CREDENTIALS_DIRECTORY/service-env). ready is a command of
the service's own unit (ExecStartPost=): systemd gives it that unit's EnvironmentFile, the same
the service user's vLLM has, and it takes the key from there (systemd 252 does not show a
sandboxed unit's credentials to its ExecStartPost= processes). Each probe's HTTP is plain
http.client to the loopback: this runs where vllm-orch's own client (orchestrator/host/http.py)
is not installed.
"""

import argparse
import errno
import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from datetime import datetime, timezone

PROMPT = "Hello"
CREDENTIAL = "service-env"      # render/artifacts.py: CREDENTIAL, RESTART_EXIT
RESTART_EXIT = 75
BUSY_EXIT = 76                  # render/artifacts.py: BUSY_EXIT (the health unit's SuccessExitStatus=)


def now_iso():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def say(text):
    print("vllm-orch probe: " + text, flush=True)


def env_values(text):
    """The assignments of an env file vllm-orch wrote (render/artifacts.py env_value: plain, in
    single quotes, or in double quotes with \\ " ` $ escaped)."""
    out = {}
    for line in text.splitlines():
        name, eq, raw = line.partition("=")
        if not eq or not name or not (name[0].isalpha() or name[0] == "_") or \
                not name.replace("_", "").isalnum():
            continue
        if len(raw) >= 2 and raw[0] == raw[-1] == "'":
            raw = raw[1:-1]
        elif len(raw) >= 2 and raw[0] == raw[-1] == '"':
            value, i, inner = [], 0, raw[1:-1]
            while i < len(inner):
                if inner[i] == "\\" and i + 1 < len(inner) and inner[i + 1] in '"\\`$':
                    i += 1
                value.append(inner[i])
                i += 1
            raw = "".join(value)
        out[name] = raw
    return out


def api_key():
    """VLLM_API_KEY: from the unit's credential when it has one (the health check, which runs
    without the service's environment), else from the environment of the service's own unit
    (the readiness probe, ExecStartPost=); None without a key."""
    folder = os.environ.get("CREDENTIALS_DIRECTORY")
    if folder:
        try:
            with open(os.path.join(folder, CREDENTIAL)) as f:
                return env_values(f.read()).get("VLLM_API_KEY") or None
        except OSError:
            return None
    return os.environ.get("VLLM_API_KEY") or None


class NotTheService(OSError):
    """The peer of a connection to the service's port is no process of the service's unit."""


UNIT_CGROUP = []  # type: list  # the unit's ControlGroup, asked once (--unit)


def _socket_row(port, peer_port):
    """The inode of the server side of our connection (the established socket whose local port is
    the service's and whose remote port is ours) from /proc/net/tcp{,6}: "0" until the server
    accepted it, None when it is not there."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    local, remote = parts[1].rsplit(":", 1)[1], parts[2].rsplit(":", 1)[1]
                    if int(local, 16) == port and int(remote, 16) == peer_port and parts[3] == "01":
                        return parts[9]
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return None


def _in_cgroup(pid, cgroup):
    """Whether the process is in `cgroup` or below it: the unified hierarchy (`0::/...`) or the v1
    `name=systemd` one (hybrid hosts), as host/ownership.py's cgroup_paths reads them."""
    paths = []
    try:
        with open("/proc/%s/cgroup" % pid) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and (parts[0] == "0" or parts[1] == "name=systemd"):
                    paths.append(parts[2])
    except OSError:
        return False
    return any(p == cgroup or p.startswith(cgroup + "/") for p in paths)


def peer_is_unit(sock, port, unit, wait=3.0):
    """Whether the process that holds the server side of `sock` (a connection to the service's
    port) is in the unit's control group. Only then is the API key sent: while vLLM loads (its
    socket bound, not listening) or restarts, another local user can listen on the loopback
    address of the same port. Read from /proc: the server socket's inode (0 until the server
    accepted: waited for up to `wait` s), then which process holds it: one of the service user's
    (this probe's user) or nobody it may see."""
    if not UNIT_CGROUP:
        UNIT_CGROUP.append(unit_show(unit, "ControlGroup"))
    cgroup = UNIT_CGROUP[0]
    if not cgroup:
        return False
    mine = sock.getsockname()[1]
    deadline = time.monotonic() + wait
    inode = _socket_row(port, mine)
    while inode in (None, "0") and time.monotonic() < deadline:
        time.sleep(0.05)
        inode = _socket_row(port, mine)
    if inode in (None, "0"):
        return False
    target = "socket:[%s]" % inode
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue                          # another user's process: not the service's
        for fd in fds:
            try:
                if os.readlink("/proc/%s/fd/%s" % (pid, fd)) == target:
                    return _in_cgroup(pid, cgroup)
            except OSError:
                continue
    return False


def request(port, method, path, body=None, timeout=10.0, address="127.0.0.1", unit=None):
    """(status, body bytes); raises OSError / http.client.HTTPException when there is no answer,
    NotTheService when the key would go to a process that is not `unit`'s."""
    headers = {}
    key = api_key() if path.startswith("/v1") else None
    if key:
        headers["Authorization"] = "Bearer " + key
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        if key:
            conn.connect()
            if unit is None or not peer_is_unit(conn.sock, port, unit):
                raise NotTheService("the process listening on port %d is not %s's: the API key was not "
                                    "sent" % (port, unit))
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def asleep(port):
    """Whether the server sleeps (vLLM's GET /is_sleeping, a development endpoint: only with sleep
    mode, which renders VLLM_SERVER_DEV_MODE=1; no key). False when it does not say."""
    try:
        status, body = request(port, "GET", "/is_sleeping", timeout=5.0)
        return status == 200 and bool(json.loads(body).get("is_sleeping"))
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return False


def probe(port, served, health_path, timeout, listed=True, unit=None):
    """(ok, why not): /health 200, the name listed (optional), a one-token completion answered;
    the requests with the key go only to a process of `unit` (NotTheService: not ok, say why)."""
    try:
        status, _ = request(port, "GET", health_path, timeout=min(timeout, 10.0))
    except (OSError, http.client.HTTPException) as exc:
        return False, "%s gave no answer (%s)" % (health_path, exc.__class__.__name__)
    if status != 200:
        return False, "%s answered %d%s" % (health_path, status, " (the engine is dead)" if status == 503 else "")
    if listed:
        try:
            status, body = request(port, "GET", "/v1/models", timeout=min(timeout, 10.0), unit=unit)
            names = [card.get("id") for card in json.loads(body).get("data") or []] if status == 200 else []
        except NotTheService as exc:
            return False, str(exc)
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            return False, "/v1/models gave no usable answer"
        if status != 200:
            return False, "/v1/models answered %d" % status
        if served not in names:
            return False, "/v1/models does not list %s yet" % served
    body = {"model": served, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    try:
        status, text = request(port, "POST", "/v1/completions", body, timeout=timeout, unit=unit)
    except NotTheService as exc:
        return False, str(exc)
    except socket.timeout:
        return False, "a one-token completion did not answer within %.0fs" % timeout
    except (OSError, http.client.HTTPException) as exc:
        return False, "a one-token completion failed (%s)" % exc.__class__.__name__
    if status != 200:
        return False, "a one-token completion answered %d: %s" % (status, text[:120].decode("utf-8", "replace"))
    return True, ""


# The engine's progress, per engine (label `engine`), from the series vLLM 0.33 publishes
# (vllm/v1/metrics/loggers.py; tests/unit/test_unit_probe_progress.py pins them to vLLM's own
# metrics code). The scheduler publishes running / waiting / KV-cache usage after EVERY step, even
# one that produced no token (vllm/v1/core/sched/scheduler.py: "We must return the stats even if
# there are no request outputs this step"): a chunked prefill allocates KV blocks chunk by chunk,
# so vllm:kv_cache_usage_perc moves while a 200K-token prompt is prefilled, when the token counters
# do not (vllm:prompt_tokens counts a prompt when its first token comes out, and a step without
# new tokens publishes no IterationStats: vllm/v1/engine/async_llm.py). A hung engine (a collective
# that never returns) publishes nothing: every series of its stays as it was.
PROGRESS = (
    ("generation_tokens", ("vllm:generation_tokens_total", "vllm:generation_tokens")),
    ("prompt_tokens", ("vllm:prompt_tokens_total", "vllm:prompt_tokens")),
    ("kv_cache_usage", ("vllm:kv_cache_usage_perc",)),
    ("running", ("vllm:num_requests_running",)),
    ("waiting", ("vllm:num_requests_waiting",)),
)


def progress_from_text(text):
    """{engine: {signal: value}} from a /metrics text (vLLM serves it with prometheus_client, the
    parser used here; the probe runs with the vLLM venv's Python, which has it)."""
    from prometheus_client.parser import text_string_to_metric_families
    wanted = {name: key for key, names in PROGRESS for name in names}
    out = {}  # type: dict
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is None:
                continue
            engine = sample.labels.get("engine", "0")
            signals = out.setdefault(engine, {})
            signals[key] = signals.get(key, 0.0) + sample.value
    return out


def engine_progress(port):
    """progress_from_text of the service's /metrics, or None when it cannot be read."""
    try:
        status, body = request(port, "GET", "/metrics", timeout=5.0)
        if status != 200:
            return None
        return progress_from_text(body.decode("utf-8", "replace"))
    except Exception:   # no prometheus_client, no answer, odd text: no progress signal
        return None


def progress_note(before, after):
    """Why a completion that timed out is a busy engine and not a hung one, or None: some engine
    published a step (a series of it changed) and no engine with work (requests running or
    waiting) stayed as it was. An idle engine may stay unchanged."""
    if not before or not after:
        return None
    moved, stalled = [], []
    for engine in sorted(set(before) | set(after)):
        b, a = before.get(engine, {}), after.get(engine, {})
        changed = [key for key, _ in PROGRESS if key in b and key in a and a[key] != b[key]]
        if changed:
            moved.append((engine, b, a, changed))
        elif a.get("running", 0) + a.get("waiting", 0) > 0:
            stalled.append(engine)
    if not moved or stalled:
        return None
    parts = []
    for engine, b, a, changed in moved:
        what = []
        for key in changed:
            if key in ("generation_tokens", "prompt_tokens"):
                what.append("vllm:%s +%d" % (key, a[key] - b[key]))
            elif key == "kv_cache_usage":
                what.append("vllm:kv_cache_usage_perc %.4f -> %.4f" % (b[key], a[key]))
            else:
                what.append("vllm:num_requests_%s %d -> %d" % (key, b[key], a[key]))
        parts.append("engine %s: %s" % (engine, ", ".join(what)))
    return "busy, not hung: the one-token completion waited in the queue while the engine stepped (%s)" \
        % "; ".join(parts)


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def unit_show(unit, prop):
    r = subprocess.run(["systemctl", "show", "-p", prop, "--value", unit], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, timeout=30)
    return r.stdout.decode().strip()


def cmd_ready(a):
    # systemd signals this process too when the unit is stopped while it loads (or its start
    # times out): that ends the wait, it is no failure of ours (exit 0: a stopped unit ends
    # `inactive`, not `failed`; a timeout keeps systemd's own Result=timeout)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    main_pid = int(os.environ.get("MAINPID") or 0) or int(unit_show(a.unit, "MainPID") or 0)
    t0 = time.monotonic()
    say("waiting until port %d answers: %s 200, %s listed, a one-token completion (TimeoutStartSec= "
        "bounds this wait)" % (a.port, a.health_path, a.served_name))
    said = [""]
    while True:
        if main_pid and not alive(main_pid):
            say("the service's main process (PID %d) exited before it was ready" % main_pid)
            return 1
        ok, why = probe(a.port, a.served_name, a.health_path, a.timeout, unit=a.unit)
        if "was not sent" in why and why != said[0]:       # once per change: someone else holds the port
            said[0] = why
            say(why)
        if ok:
            say("ready after %.0fs: %s 200, %s listed, a one-token completion answered"
                % (time.monotonic() - t0, a.health_path, a.served_name))
            return 0
        time.sleep(a.poll)


def read_state(path):
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def write_state(path, value):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(value, f, sort_keys=True)
    os.replace(tmp, path)


def append_history(state_dir, record):
    os.makedirs(state_dir, exist_ok=True)
    # version: orchestrator/host/records.py RECORDS_VERSION (a test checks they agree)
    line = json.dumps(dict({"at": now_iso(), "version": 1}, **record), sort_keys=True) + "\n"
    fd = os.open(os.path.join(state_dir, "history.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def cmd_check(a):
    path = os.path.join(a.state_dir, "health", a.model + ".json")
    state = read_state(path)
    unit_state = unit_show(a.unit, "ActiveState")
    stamp = {"at": now_iso(), "ts": time.time()}
    if unit_state != "active":
        state.update(failures=0, last=dict(stamp, ok=None, note="%s is %s: not probed" % (a.unit, unit_state)))
        write_state(path, state)
        return 0
    if asleep(a.port):
        # sleep mode: the engine is paused on purpose, and a completion would wait until a wake
        state.update(failures=0, last=dict(stamp, ok=None, note="asleep (sleep mode): not probed"))
        write_state(path, state)
        return 0
    before = engine_progress(a.port)
    ok, why = probe(a.port, a.served_name, a.health_path, a.timeout, listed=False, unit=a.unit)
    if not ok and "did not answer within" in why:
        note = progress_note(before, engine_progress(a.port))
        if note:
            ok = True
            stamp["note"] = note
    if ok:
        busy_since = state.get("busy_since") if stamp.get("note") else None
        state.update(failures=0, last=dict(stamp, ok=True), last_ok=stamp["at"])
        if stamp.get("note"):
            state["busy_since"] = busy_since or stamp["at"]
            state["busy_checks"] = int(state.get("busy_checks") or 0) + 1
        else:
            state.pop("busy_since", None)
            state["busy_checks"] = 0
        write_state(path, state)
        # the first busy check of a run of them: the root part writes it to history
        return BUSY_EXIT if stamp.get("note") and not busy_since else 0
    state.pop("busy_since", None)
    state["busy_checks"] = 0
    failures = int(state.get("failures") or 0) + 1
    state.update(failures=failures, last=dict(stamp, ok=False, reason=why))
    say("health check failed (%d of %d in a row): %s" % (failures, a.failures, why))
    if failures < a.failures:
        write_state(path, state)
        return 1
    reason = "%d health checks failed in a row, the last: %s" % (failures, why)
    # the restart itself (and its history record) is the root part's: ExecStopPost=+ ... restart
    state.update(failures=0, restarted_at=stamp["at"], restart_reason=reason, restart_failures=failures,
                 restarts=int(state.get("restarts") or 0) + 1)
    write_state(path, state)
    say("%d failures in a row: %s is to be restarted" % (failures, a.unit))
    return RESTART_EXIT


def connect(address, port, timeout):
    """A connected socket, or None when the port does not accept within `timeout`."""
    sock, _why = reach(address, port, timeout)
    return sock


def reach(address, port, timeout):
    """(connected socket, None), or (None, "refused") when the head's host answered that nothing
    listens there (a TCP reset: its process is gone), or (None, why) when it did not answer at all
    (a timeout, no route, the network down: a partition, a switch reload, a bond failover), which
    says nothing about the head."""
    try:
        return socket.create_connection((address, port), timeout=timeout), None
    except ConnectionRefusedError:
        return None, "refused"
    except socket.timeout:
        return None, "no answer within %.0fs" % timeout
    except OSError as exc:
        return None, os.strerror(exc.errno) if exc.errno else exc.__class__.__name__


def keepalive(sock, idle=10, interval=5, count=3):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def until_closed(sock):
    """Block until the peer closes the connection (or it breaks)."""
    sock.settimeout(None)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    finally:
        sock.close()


def still_listening(address, port, window, poll=1.0):
    """After the head's store closed our connection: whether its port kept accepting for `window`
    seconds (the store only dropped this connection, or the network did) rather than refusing (its
    process exited: the listening socket closes with it, and a restarted head listens again only
    later). Immediately after the close first: a head restarted at once cannot be listening yet.
    Only a refusal from the head's host counts: while it cannot be reached (timeouts, no route),
    this keeps probing, every `poll` s, for as long as that lasts."""
    deadline = time.monotonic() + window
    unreachable_since = None
    while True:
        sock, why = reach(address, port, 2.0)
        if why == "refused":
            return False
        if sock is None:
            if unreachable_since is None:
                unreachable_since = time.monotonic()
                say("the head at %s:%d cannot be reached (%s): not a sign that it is gone, probing until it "
                    "answers" % (address, port, why))
            time.sleep(poll)
            deadline = time.monotonic() + window        # the window starts again once it answers
            continue
        sock.close()
        if unreachable_since is not None:
            say("the head at %s:%d answers again after %.0fs" % (address, port, time.monotonic() - unreachable_since))
            unreachable_since = None
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)


# host/state.py LOCK_FILE: vllm-orch's lock, 0600 in a folder (0711) only root can list: the service
# user cannot open it, so the head watch sees it held in /proc/locks (a flock on its inode) instead.
LOCK_FILE = ("lock", "deploy.lock")


def lock_held(state_dir):
    """Whether vllm-orch holds this host's lock (state_dir/lock/deploy.lock, flock): it is then
    stopping, deploying or swapping, on every node of the service, itself. Read without opening the
    file (the service user may not): held when /proc/locks has a FLOCK on its inode."""
    # Cannot tell (no file, a folder it cannot search, no /proc/locks): not held, as before; the
    # root part, which restarts, takes the lock itself without waiting and refuses when it is held.
    try:
        inode = os.stat(os.path.join(state_dir, *LOCK_FILE)).st_ino
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return False
    return any(len(r) > 5 and r[1] == "FLOCK" and r[5].rsplit(":", 1)[-1] == str(inode) for r in rows)


def cmd_watch_head(a):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    where = "%s:%d" % (a.address, a.port)
    say("waiting for the head's rendezvous store at %s" % where)
    while True:
        sock = connect(a.address, a.port, 5.0)
        if sock is None:
            time.sleep(a.poll)
            continue
        keepalive(sock)
        say("holding a connection to the head's store at %s: %s restarts when it closes" % (where, a.unit))
        until_closed(sock)
        if still_listening(a.address, a.port, a.window, a.poll):
            say("the head's store at %s closed this connection but still accepts: reconnecting" % where)
            continue
        break
    unit_state, pid = unit_show(a.unit, "ActiveState"), unit_show(a.unit, "MainPID")
    if unit_state not in ("active", "activating", "reloading"):
        say("the head at %s is gone and %s is %s: nothing to restart" % (where, a.unit, unit_state))
        return 0
    if lock_held(a.state_dir):
        say("the head at %s is gone while vllm-orch holds this host's lock: waiting for it" % where)
        while lock_held(a.state_dir):
            time.sleep(a.poll)
        if unit_show(a.unit, "MainPID") != pid:
            say("vllm-orch stopped or restarted %s itself" % a.unit)
            return 0
    say("the head at %s is gone: %s is to be restarted" % (where, a.unit))
    return RESTART_EXIT          # the root part restarts the unit; the restarted unit starts a new watch


def read_data(path, limit):
    """At most `limit` bytes of a file another user writes (the service user's health state), as
    root reads it: never through a link (O_NOFOLLOW), never waiting (O_NONBLOCK: a FIFO planted
    there would have hung root's open), and only a regular file (fstat of what was opened: a FIFO
    or a device is refused). OSError otherwise. facts_script.py's read_json(nofollow=True) is the
    same rule for the status facts (each host script is one self-contained file)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def health_state(state_dir, model):
    """health/MODEL.json, the check's notes (a file of the service user's: read_data, and only as
    data)."""
    try:
        state = json.loads(read_data(os.path.join(state_dir, "health", model + ".json"), 65536)
                           .decode("utf-8", "replace"))
    except (OSError, ValueError):
        state = {}
    return state if isinstance(state, dict) else {}


def health_reason(state_dir, model):
    """(reason, failures) the check noted for its restart."""
    state = health_state(state_dir, model)
    reason, failures = state.get("restart_reason"), state.get("restart_failures")
    return (str(reason)[:1000] if reason else "the health check asked for a restart",
            failures if isinstance(failures, int) else None)


def busy_note(state_dir, model):
    """The note of the check that found the engine busy (its last result)."""
    last = health_state(state_dir, model).get("last")
    note = last.get("note") if isinstance(last, dict) else None
    return str(note)[:1000] if note else "the health check found the engine busy"


WATCHER_RESTARTS = ("health-restart", "head-lost-restart")


def history_tail(state_dir, limit=1 << 20):
    """The records of the last `limit` bytes of history.jsonl (root's file), as dicts."""
    path = os.path.join(state_dir, "history.jsonl")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _of(rec, model):
    return (rec.get("service") or rec.get("model")) == model


def watcher_restarts(state_dir, model, within):
    """How many times the watchers (health check, head watch) restarted `model` in the last `within`
    seconds and since vllm-orch last acted on it (a deploy, swap or regen starts it afresh, and
    gives systemd's counter its starts back too), from the history records."""
    since = time.time() - within
    count = 0
    for rec in history_tail(state_dir):
        if not _of(rec, model) or rec.get("operation") == "health-busy":
            continue
        if rec.get("operation") not in WATCHER_RESTARTS:
            count = 0
            continue
        try:
            at = datetime.fromisoformat(str(rec.get("at"))).timestamp()
        except ValueError:
            continue
        count += rec.get("ok") is True and at >= since
    return count


def limit_noted(state_dir, model):
    """Whether the last record of `model` already says its watchers' limit was reached (one such
    record, not one per failed check)."""
    for rec in reversed(history_tail(state_dir)):
        if _of(rec, model) and rec.get("operation") != "health-busy":
            return bool(rec.get("limit"))
    return False


def cmd_restart(a):
    """As root, after the check or the watch: a restart only when it exited RESTART_EXIT; after the
    first check of a run that found the engine busy but stepping (BUSY_EXIT), a `health-busy`
    record, so history shows why a slow answer was not a failure."""
    status = os.environ.get("EXIT_STATUS")
    if a.operation == "health-restart" and status == str(BUSY_EXIT):
        append_history(a.state_dir, {"operation": "health-busy", "model": a.model, "by": a.by, "ok": True,
                                     "reason": busy_note(a.state_dir, a.model)})
        return 0
    if status != str(RESTART_EXIT):
        return 0
    if a.operation == "health-restart":
        reason, failures = health_reason(a.state_dir, a.model)
        record = {"operation": a.operation, "model": a.model, "reason": reason, "by": a.by}
        if failures is not None:
            record["failures"] = failures
    else:
        record = {"operation": a.operation, "model": a.model, "by": a.by,
                  "reason": "the head's rendezvous store at %s:%s closed (its vLLM exited): this node's ranks "
                            "belong to the dead head's process group" % (a.address, a.port)}
    done = watcher_restarts(a.state_dir, a.model, a.limit_interval) if a.limit_burst else 0
    if a.limit_burst and done >= a.limit_burst:
        # the watchers' own bound: as many restarts as the unit's StartLimitBurst within its window
        if not limit_noted(a.state_dir, a.model):
            record["ok"] = False
            record["refused"] = (
                "not restarted: its watchers restarted it %d times within %d s (the unit's StartLimitBurst, "
                "counted apart from systemd's crash-loop limit) and it failed again; it is left as it is. "
                "`vllm-orch logs %s` shows why; `vllm-orch deploy` (or regen --restart) starts it afresh"
                % (done, a.limit_interval, a.model))
            record["limit"] = True
            append_history(a.state_dir, record)
        say("not restarting %s: %d restarts by its watchers within %d s" % (a.unit, done, a.limit_interval))
        return 1
    # the restart stops the head watch too (PartOf=): finish the record first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # vllm-orch's lock, held from this check to the restart's job being queued: a stop, deploy or
    # swap that took it meanwhile acts on the unit (on every node) itself, and one that comes
    # later waits for no half-done restart of ours
    lock = lock_nb(a.state_dir)
    if lock is False:
        say("vllm-orch holds this host's lock (it acts on %s itself): not restarting it" % a.unit)
        return 0
    try:
        unit_state = unit_show(a.unit, "ActiveState")
        if unit_state not in ("active", "activating", "reloading"):
            say("%s is %s: nothing to restart" % (a.unit, unit_state))
            return 0
        return _restart(a, record)
    finally:
        if lock is not None:
            os.close(lock)


def lock_nb(state_dir):
    """This host's deploy lock (state_dir/lock/deploy.lock, flock), taken without waiting: its fd,
    False when another process (vllm-orch) holds it, None when there is no lock file (nothing to
    hold). Root's part only: the file is root's, 0600."""
    import fcntl
    try:
        fd = os.open(os.path.join(state_dir, *LOCK_FILE),
                     os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd


def _restart(a, record):
    """reset-failed, restart --no-block and the history record (cmd_restart, under the lock)."""
    # A deliberate restart is no crash: systemd counts every start, `systemctl restart` too, against
    # StartLimitBurst= (systemd.unit(5)), so a deploy and two restarts inside the window would have the
    # next one refused (start-limit-hit) and the service down. reset-failed flushes the unit's start
    # rate counter (systemctl(1): "the start rate limit counter of all unit types is reset to zero"):
    # from this restart on, systemd's limit bounds a crash loop as after a deploy; the watchers' own
    # restarts are bounded above, by their records.
    subprocess.run(["systemctl", "reset-failed", a.unit], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=60)
    r = subprocess.run(["systemctl", "restart", "--no-block", a.unit], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=60)
    record["ok"] = r.returncode == 0
    if r.returncode != 0:
        record["error"] = r.stdout.decode(errors="replace").strip()[-300:]
    append_history(a.state_dir, record)
    say("restarting %s: %s" % (a.unit, record["reason"]) if r.returncode == 0 else
        "could not restart %s: %s" % (a.unit, record["error"]))
    return 0 if r.returncode == 0 else 1


def main(argv=None):
    p = argparse.ArgumentParser(prog="vllm-orch-probe")
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("ready", "check"):
        s = sub.add_parser(name)
        s.add_argument("--unit", required=True)
        s.add_argument("--port", type=int, required=True)
        s.add_argument("--served-name", required=True)
        s.add_argument("--health-path", default="/health")
        s.add_argument("--timeout", type=float, default=30.0)
    sub.choices["ready"].add_argument("--poll", type=float, default=1.0)
    check = sub.choices["check"]
    check.add_argument("--model", required=True)
    check.add_argument("--failures", type=int, default=3)
    check.add_argument("--state-dir", required=True)
    watch = sub.add_parser("watch-head")
    watch.add_argument("--unit", required=True)
    watch.add_argument("--model", required=True)
    watch.add_argument("--address", required=True)
    watch.add_argument("--port", type=int, required=True)
    watch.add_argument("--window", type=float, default=1.0)
    watch.add_argument("--poll", type=float, default=1.0)
    watch.add_argument("--state-dir", required=True)
    restart = sub.add_parser("restart")
    restart.add_argument("--unit", required=True)
    restart.add_argument("--model", required=True)
    restart.add_argument("--state-dir", required=True)
    restart.add_argument("--operation", required=True, choices=["health-restart", "head-lost-restart"])
    restart.add_argument("--by", required=True)
    restart.add_argument("--address", default="?")
    restart.add_argument("--port", default="?")
    restart.add_argument("--limit-burst", type=int, default=0)        # 0: no bound of its own
    restart.add_argument("--limit-interval", type=int, default=0)
    a = p.parse_args(argv)
    return {"ready": cmd_ready, "check": cmd_check, "watch-head": cmd_watch_head, "restart": cmd_restart}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
