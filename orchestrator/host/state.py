"""vllm-orch's records on each host (under the inventory's state_dir), and the host lock.

The records are versioned pydantic models (host/records.py: read old, write new); this module
reads and writes them:
  services/NAME.json   ServiceRecord, one per service that vllm-orch started and proved serving
                       (NAME: the service, its model's name unless --name). A host from before
                       several services per host has one `active.json` instead: it is read as its
                       model's record, and the first locked operation moves it to
                       services/MODEL.json (upgrade_records)
  installed/NAME.json  InstalledRecord, each service whose unit vllm-orch installed (regen re-renders these)
  usage.json           last time each model was started (least-recently-used disk eviction)
  history.jsonl        HistoryEntry, one line per deploy / swap / rollback / stop / gc / bench, with
                       timings, and per health-restart / health-busy (written by the units' health
                       timer on the host) and head-lost-restart (a headless node's head watch)
  swap.json            SwapMarker: a swap under way: written when it stops the old model, removed
                       when it ends (the new model recorded, or the old one back); left behind by a
                       swap that was killed or lost its connection, so the next command can say what to run
  health/NAME.json     the health timer's last check of NAME and its count of failures in a row
  lock/deploy.lock     flock(1) file, 0600 in a root-only folder (0711: others may stat the file, to
                       see it held in /proc/locks, but neither list the folder nor open the file; a
                       0644 file could be flocked by any local user through a read-only descriptor);
                       deploy.lock.json, readable, names the holder (and its token). The previous
                       place, deploy.lock, becomes a link to it (older vllm-orch runs lock the same file)
The lock is held by a `flock ...` process on the host whose stdin is our connection: when the
orchestrator dies or the SSH connection drops it sees EOF (or no heartbeat for a minute), exits and
the lock is free. A run checks before each step that its lock process is still there (HostLock.ensure).
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import shlex
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import DeployFailed, OrchestratorError, RefusedError
from orchestrator.host.base import Host, Script, Spawned
from orchestrator.host.records import HistoryEntry, InstalledRecord, ServiceRecord, SwapMarker

LOCK_BUSY_EXIT = 75
LOCKED = "VLLM_ORCH_LOCKED"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _path(entry: HostEntry, *parts: str) -> str:
    return "/".join([entry.state_dir, *parts])


LOCK_FILE = "lock/deploy.lock"          # the unit probe (host/remote/unit_probe.py) names it too
LEGACY_LOCK = "deploy.lock"             # where vllm-orch before issue 42 took it: now a link to LOCK_FILE


def lock_path(entry: HostEntry) -> str:
    return _path(entry, LOCK_FILE)


def holder_path(entry: HostEntry) -> str:
    return _path(entry, "deploy.lock.json")


def read_json(host: Host, path: str):
    data = host.get(path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def write_json(host: Host, path: str, value, mode: int = 0o644) -> None:
    host.put(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode(), mode)


LEGACY_ACTIVE = "active.json"      # the one record of a host before several services per host


def record_path(entry: HostEntry, name: str) -> str:
    return _path(entry, "services", f"{name}.json")


def write_record(host: Host, entry: HostEntry, name: str, record: ServiceRecord | None) -> None:
    """The record of the service NAME (None: it no longer serves, the record goes)."""
    if record is None:
        host.run(["rm", "-f", record_path(entry, name)]).check(entry.name, f"clear {name}'s record")
    else:
        write_json(host, record_path(entry, name), record.dump())


_REC_MARK = "@@vllm-orch-record "


def read_records(host: Host, entry: HostEntry) -> dict[str, ServiceRecord]:
    """Every service's record, by name, in one round trip (a legacy active.json reads as its
    model's record unless services/ has one): for commands that do not read the host's facts. A
    file that is no record is left out."""
    d = shlex.quote(entry.state_dir)
    r = host.run(Script(f"for f in {d}/services/*.json {d}/{LEGACY_ACTIVE}; do [ -f \"$f\" ] && "
                        f"printf '{_REC_MARK}%s ' \"$(basename \"$f\" .json)\" && tr -d '\\n' < \"$f\" && echo; "
                        f"done 2>/dev/null; true"), timeout=30)
    out: dict[str, ServiceRecord] = {}
    legacy = None
    for line in r.stdout.splitlines():
        if not line.startswith(_REC_MARK):
            continue
        name, _, text = line[len(_REC_MARK):].partition(" ")
        try:
            value = ServiceRecord.read(json.loads(text))
        except ValueError:
            continue
        if value is None:
            continue
        if name == LEGACY_ACTIVE[:-5]:
            legacy = value
        else:
            out[name] = value
    if legacy is not None and legacy.model not in out:
        out[legacy.model] = legacy
    return out


def read_active(host: Host, entry: HostEntry) -> ServiceRecord | None:
    """The record of the host's service when it runs one (None: none); on a host with several, the
    one deployed last. For callers that think of a host as serving one model (bench, fleet views)."""
    records = read_records(host, entry)
    if not records:
        return None
    return max(records.values(), key=lambda r: r.deployed_at or "")


def read_record(host: Host, entry: HostEntry, name: str) -> ServiceRecord | None:
    return ServiceRecord.read(read_json(host, record_path(entry, name)))


def update_record(host: Host, entry: HostEntry, name: str, **fields) -> bool:
    """Change some fields of NAME's record (False: NAME has none)."""
    record = read_record(host, entry, name)
    if record is None:
        return False
    write_record(host, entry, name, record.model_copy(update=fields))
    return True


def upgrade_records(host: Host, entry: HostEntry) -> str | None:
    """Move a host's legacy active.json to services/MODEL.json (written as this version's record),
    once, under the host lock. A record already under services/ for that model wins (the legacy file
    is then stale) and the legacy file goes either way. Says what it did (None: nothing to do)."""
    raw = read_json(host, _path(entry, LEGACY_ACTIVE))
    if raw is None and host.get(_path(entry, LEGACY_ACTIVE)) is None:
        return None
    legacy = ServiceRecord.read(raw)
    moved = None
    if legacy is not None and legacy.model and host.get(record_path(entry, legacy.model)) is None:
        write_record(host, entry, legacy.model, legacy)
        moved = f"moved {entry.state_dir}/{LEGACY_ACTIVE} to services/{legacy.model}.json"
    host.run(["rm", "-f", _path(entry, LEGACY_ACTIVE)]).check(entry.name, "remove the legacy active record")
    return moved or f"removed a stale {entry.state_dir}/{LEGACY_ACTIVE}"


def write_swap(host: Host, entry: HostEntry, old: str, new: str, old_enabled: bool, *, from_sleeps: bool = False,
               to_wakes: bool = False) -> None:
    """Mark a swap as half done (its old model is about to stop, or to sleep: `from_sleeps`; the new
    one is woken: `to_wakes`)."""
    marker = SwapMarker(from_=old, to=new, since=now_iso(), by=whoami(), from_enabled=old_enabled,
                        from_sleeps=from_sleeps, to_wakes=to_wakes)
    write_json(host, _path(entry, "swap.json"), marker.dump())


def clear_swap(host: Host, entry: HostEntry) -> None:
    host.run(["rm", "-f", _path(entry, "swap.json")]).check(entry.name, "clear the swap record")


def installed_path(entry: HostEntry, name: str) -> str:
    return _path(entry, "installed", f"{name}.json")


def write_installed(host: Host, entry: HostEntry, name: str, record: InstalledRecord) -> None:
    write_json(host, installed_path(entry, name), record.dump())


def read_installed(host: Host, entry: HostEntry, name: str) -> InstalledRecord | None:
    return InstalledRecord.read(read_json(host, installed_path(entry, name)))


def append_history(host: Host, entry: HostEntry, record: HistoryEntry) -> None:
    """One line per operation, stamped now; it names its service (`history SERVICE` filters on it),
    which is the model's name unless the record says otherwise."""
    line = json.dumps({**record.dump(), "at": now_iso(), "service": record.subject}, sort_keys=True)
    path = _path(entry, "history.jsonl")
    host.run(Script(f"mkdir -p {shlex.quote(entry.state_dir)} && "
                    f"printf '%s\\n' {shlex.quote(line)} >> {shlex.quote(path)}")).check(entry.name, "append history")


def read_history(host: Host, entry: HostEntry) -> list[HistoryEntry]:
    """history.jsonl's lines, oldest first (a line that is no history entry is left out)."""
    data = host.get(_path(entry, "history.jsonl"))
    return parse_history((data or b"").decode(errors="replace").splitlines())


def history_tail(host: Host, entry: HostEntry, size: int = 1 << 20) -> list[HistoryEntry]:
    """The last `size` bytes of history.jsonl (its last lines, oldest first; the first, cut, left out):
    what a plan reads of it (this host's last measured start)."""
    r = host.run(["tail", "-c", str(size), _path(entry, "history.jsonl")], timeout=30)
    if not r.ok:
        return []
    lines = r.stdout.splitlines()
    return parse_history(lines[1:] if len(r.stdout.encode()) >= size else lines)


def parse_history(lines: list[str]) -> list[HistoryEntry]:
    out = []
    for line in lines:
        try:
            rec = HistoryEntry.read(json.loads(line))
        except ValueError:
            continue
        if rec is not None:
            out.append(rec)
    return out


def touch_usage(host: Host, entry: HostEntry, model: str) -> None:
    """Record that MODEL was started now (least-recently-used disk eviction reads this)."""
    usage = read_json(host, _path(entry, "usage.json"))
    write_json(host, _path(entry, "usage.json"), {**(usage if isinstance(usage, dict) else {}), model: time.time()})


def whoami() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


class LockLost(DeployFailed):
    """The connection that held the host lock dropped and the lock could not be proved ours again:
    the run stops here, and runs no recovery either (another vllm-orch may be at work)."""


def _roots_alone(folder: str, what: str) -> str:
    """Shell: as root, `folder` (quoted) must be root's, writable by no other user or group."""
    return (f"{{ [ \"$(id -u)\" != 0 ] || [ -z \"$(find {folder} -maxdepth 0 \\( ! -user 0 -o -perm -0002 -o "
            f"\\( -perm -0020 ! -group 0 \\) \\) -print)\" ] || {{ echo \"{what} {folder} is not root's alone "
            f"(owner or write permission): another user could plant links in it\"; exit 1; }}; }}")


class HostLock:
    """Exclusive deploy/swap/regen lock of one host; use as a context manager.

    Held by `flock LOCK sh -c 'echo LOCKED; <wait for heartbeats>'` on the host, whose stdin is our
    connection: it exits (and frees the lock) when the connection drops, or when no heartbeat
    (a newline every PING_S) came for IDLE_S, so a lost controller frees the host within a minute
    even when no TCP reset ever arrives. The holder record (deploy.lock.json) carries a random
    token: `ensure()`, called before every step, checks the lock process is still ours, and after a
    drop re-takes the lock only when the record still holds our token (nobody held it meanwhile:
    whoever takes it writes its own token first)."""

    PING_S = 10.0
    IDLE_S = 60
    # A watcher's root part (the health check's or head watch's restart) holds the lock for the
    # second its `systemctl restart --no-block` and history record take: wait that out rather than
    # refuse, naming as holder the last run's record, which is not who holds it then.
    BUSY_WAIT_S = 5

    def __init__(self, host: Host, entry: HostEntry, operation: str, timeout: float = 15.0):
        self.host, self.entry, self.operation, self.timeout = host, entry, operation, timeout
        self.token = secrets.token_hex(8)
        self._proc: Spawned | None = None
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def path(self) -> str:
        return lock_path(self.entry)

    def command(self) -> Script:
        """The lock comes before the facts (and their preflight of the folders root writes), so it
        checks its own folders: as root, state_dir and its lock/ must be root's and writable by
        nobody else, or another user could have made them first and planted `deploy.lock` as a link
        (flock creates and opens it, following links). The file is made 0600 (umask 077) in lock/
        (0711): another user can neither open it nor, so, flock it. Under the lock, before it says
        LOCKED, `migrate` turns the previous lock file into a link to this one."""
        d, ld, p = (shlex.quote(x) for x in (self.entry.state_dir, _path(self.entry, "lock"), self.path))
        wait = shlex.quote(f"{self._migrate()} echo {LOCKED}; "
                           f"while timeout {self.IDLE_S} sh -c 'IFS= read -r x'; do :; done")
        flock = f"flock -w {self.BUSY_WAIT_S} -E {LOCK_BUSY_EXIT}"
        return Script(f"mkdir -p {d} && {_roots_alone(d, 'state_dir')} && umask 077 && mkdir -p {ld} && "
                      f"[ ! -L {ld} ] && chmod 0711 {ld} && {_roots_alone(ld, 'the lock folder')} && "
                      f"exec {flock} {p} sh -c {wait}")

    def _migrate(self) -> str:
        """Shell run under the new lock: the previous lock file (state_dir/deploy.lock, a regular 0644
        file), or its place when there is none, becomes a link to the new one, so an older vllm-orch
        (which flocks that path, following links, as root) and this one exclude each other. While
        that file is held by a process of state_dir's owner (an older vllm-orch at work: root) the
        lock is busy; a holder of another user (anyone could flock the old 0644 file) is ignored:
        the link replaces the file."""
        old = shlex.quote(_path(self.entry, LEGACY_LOCK))
        d = shlex.quote(self.entry.state_dir)
        holders = ("awk -v i=\"$(stat -c %i " + old + ")\" '$2 == \"FLOCK\" { n = split($6, a, \":\"); "
                   "if (a[n] == i) print $5 }' /proc/locks")
        return (f"if [ ! -L {old} ]; then "
                f"if [ -f {old} ] && ! flock -n {old} true; then u=$(stat -c %u {d}); for k in $({holders}); do "
                f"[ \"$(stat -c %u /proc/$k 2>/dev/null)\" != \"$u\" ] || {{ echo \"an older vllm-orch holds "
                f"the previous lock file {old}\"; exit {LOCK_BUSY_EXIT}; }}; done; fi; "
                f"ln -sfn {shlex.quote(LOCK_FILE)} {old}.new && mv -fT {old}.new {old} || exit 1; fi;")

    def _take(self, timeout: float) -> tuple[Spawned | None, list[str]]:
        proc = self.host.spawn(self.command())
        deadline = time.monotonic() + timeout
        output: list[str] = []
        while time.monotonic() < deadline:
            line = proc.readline(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            if line == LOCKED:
                return proc, output
            output.append(line)
        proc.close()
        return None, output

    def _holder(self) -> dict:
        return read_json(self.host, holder_path(self.entry)) or {}

    def acquire(self) -> None:
        proc, output = self._take(self.timeout)
        if proc is not None:
            self._hold(proc)
            write_json(self.host, holder_path(self.entry), {"holder": whoami(), "operation": self.operation,
                                                        "since": now_iso(), "token": self.token})
            return
        holder = self._holder()
        if output and not holder:
            raise RefusedError(f"cannot take the deploy lock {self.path}: {' '.join(output)[-300:]}",
                               host=self.entry.name, step="lock")
        raise RefusedError(
            f"another operation holds the deploy lock: {holder.get('operation', '?')} by "
            f"{holder.get('holder', 'an unknown process')} since {holder.get('since', '?')}",
            host=self.entry.name, step="lock",
            hint="wait for it to finish; a killed vllm-orch releases the lock by itself")

    def _hold(self, proc: Spawned) -> None:
        self._proc = proc
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, args=(proc,), daemon=True)
        self._beat.start()

    def _heartbeat(self, proc: Spawned) -> None:
        while not self._stop.wait(self.PING_S):
            try:
                proc.ping()
            except OSError:
                return                          # ensure() sees the process gone

    def ensure(self) -> str | None:
        """None while the lock is ours; after a dropped connection, re-take it and say so, or raise
        LockLost when another operation held it meanwhile (or holds it now)."""
        if self._proc is not None and self._proc.alive():
            return None
        self._let_go()
        where: dict[str, Any] = dict(
            host=self.entry.name, step="lock",
            hint="another vllm-orch may have changed the host meanwhile: look at `vllm-orch status` and "
                 "`history`, then run again")
        try:
            proc, _ = self._take(min(self.timeout, 10.0))
        except OrchestratorError as exc:
            raise LockLost(f"the connection holding the deploy lock dropped and the host cannot be reached "
                           f"again to re-take it: {exc.message}", **where) from None
        holder = self._holder()
        if proc is None:
            raise LockLost(f"the connection holding the deploy lock dropped and {holder.get('operation', '?')} "
                           f"by {holder.get('holder', 'another process')} holds it now: stopped here", **where)
        if holder.get("token") != self.token:
            proc.close()
            raise LockLost(f"the connection holding the deploy lock dropped and {holder.get('operation', '?')} "
                           f"by {holder.get('holder', 'another process')} held it meanwhile: stopped here", **where)
        self._hold(proc)
        return "the connection dropped; re-took the deploy lock (nobody held it meanwhile)"

    def _let_go(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.close()
            self._proc = None

    def release(self) -> None:
        self._let_go()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def lock_holder(host: Host, entry: HostEntry) -> dict | None:
    """Who holds the lock now (None when free) - for dry runs, which never take it."""
    p, old = shlex.quote(lock_path(entry)), shlex.quote(_path(entry, LEGACY_LOCK))
    # An older vllm-orch at work holds the previous lock file (until a run of this one makes it a link)
    r = host.run(Script(f"for f in {p} {old}; do [ ! -e \"$f\" ] || flock -n \"$f\" true || exit {LOCK_BUSY_EXIT}; done"))
    if r.exit_code != LOCK_BUSY_EXIT:
        return None
    return read_json(host, holder_path(entry)) or {"holder": "unknown"}
