"""Running a model service on a host: systemd units, or a start script + PID file (`process`).

Both give the same operations, as printable commands where a plan shows them: start, stop,
state, log reading from a cursor (journal cursor or byte offset). `process` mirrors the units'
KillMode=mixed: SIGTERM to the main process, then SIGKILL to the whole process group (the TP
workers are in it).
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import CommandFailed
from orchestrator.host import cancel
from orchestrator.host.base import Command, Host, Script
from orchestrator.render.artifacts import dev_guard_table


@dataclass
class ServiceState:
    active: bool                  # the main process runs (or systemd says activating/active)
    main_pid: int | None
    failed: bool = False          # systemd "failed" / a PID file whose process is gone
    started_at: float | None = None
    restarts: int = 0
    raw: dict | None = None
    # systemd only (None on `process` hosts, which have no notion of it): the unit is `active`, which
    # our units' ExecStartPost= readiness probe makes mean "serves" (`activating` while it loads).
    ready: bool | None = None
    enabled: bool | None = None   # systemd: starts at boot (UnitFileState=enabled)

    @classmethod
    def from_facts(cls, raw: dict | None) -> ServiceState:
        raw = raw or {}
        pid = int(raw.get("MainPID") or 0) or None
        active_state = raw.get("ActiveState", "inactive")
        started = raw.get("StartedAt")
        systemd = "UnitFileState" in raw or "SubState" in raw
        return cls(active=active_state in ("active", "activating", "reloading") and pid is not None,
                   main_pid=pid, failed=active_state == "failed",
                   started_at=float(started) if started else None,
                   restarts=int(raw.get("NRestarts") or 0), raw=raw,
                   ready=(active_state == "active" and pid is not None) if systemd else None,
                   enabled=(raw.get("UnitFileState") == "enabled") if "UnitFileState" in raw else None)

    def describe(self) -> str:
        """systemd's words for the state, e.g. `activating (start-post)`, `failed (timeout)`."""
        raw = self.raw or {}
        state = raw.get("ActiveState") or ("active" if self.active else "failed" if self.failed else "inactive")
        sub = raw.get("Result") if state == "failed" else raw.get("SubState")
        return f"{state} ({sub})" if sub and sub != state else state


class Service:
    """One model's service on one host. Without a host (None) it only tells the commands it would
    issue, which is all a plan needs to print them."""

    def __init__(self, host: Host | None, entry: HostEntry, model: str):
        self._host, self.entry, self.model = host, entry, model

    @property
    def host(self) -> Host:
        if self._host is None:
            raise RuntimeError("a Service without a host can only list its commands")
        return self._host

    @staticmethod
    def for_host(host: Host | None, entry: HostEntry, model: str) -> Service:
        return SystemdService(host, entry, model) if entry.service_manager == "systemd" \
            else ProcessService(host, entry, model)

    # -- interface ------------------------------------------------------------------------------
    def describe(self) -> str:
        """What runs the service: the unit name, or the start script."""
        raise NotImplementedError

    def reload_commands(self) -> list[Command]:
        return []

    def start_commands(self) -> list[Command]:
        raise NotImplementedError

    # A service that never served has nothing to drain: a stop after a failed or interrupted start
    # (drain=False) gives vLLM this long to end, then kills it. Real vLLM's API server, SIGTERMed
    # while it handles its engine's start-up failure, hangs for good (vLLM 0.32 CPU build, seen by
    # the real tier): the whole drain window was added to every rollback's downtime.
    ABORT_WAIT_S = 10

    def stop_commands(self, drain: bool = True) -> list[Command]:
        raise NotImplementedError

    def enable_commands(self) -> list[Command]:
        return []

    def disable_commands(self) -> list[Command]:
        return []

    def state(self) -> ServiceState:
        raise NotImplementedError

    def wait_started(self, timeout: float = 60.0, poll: float = 0.2) -> ServiceState:
        """After the start commands: until the service has a main process (or has failed)."""
        return self.state()

    def log_cursor(self) -> str:
        raise NotImplementedError

    def read_log(self, cursor: str) -> tuple[list[str], str]:
        """New complete lines since cursor, and the cursor after them."""
        raise NotImplementedError

    def tail(self, lines: int = 40) -> list[str]:
        raise NotImplementedError

    def log_command(self, follow: bool = False, since: float | None = None, lines: int = 200) -> Command:
        raise NotImplementedError

    def run_all(self, commands: list[Command], what: str, timeout: float = 300) -> None:
        for cmd in commands:
            self.host.run(cmd, timeout=timeout).check(self.entry.name, what)


# What vllm-orch reads of a unit (the facts script reads the same list).
SYSTEMD_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "Result", "NRestarts",
                      "ExecMainStartTimestampMonotonic", "UnitFileState", "Job")


class SystemdService(Service):
    @property
    def unit(self) -> str:
        return f"vllm-{self.model}.service"

    def describe(self) -> str:
        return self.unit

    def reload_commands(self) -> list[Command]:
        return [["systemctl", "daemon-reload"]]

    def start_commands(self) -> list[Command]:
        # reset-failed: a unit that hit its StartLimit refuses to start until reset (and the reset
        # gives it its full number of attempts again). --no-block: the start job lasts as long as the
        # load (ExecStartPost= waits until it serves); the readiness gates watch it instead.
        return [Script(f"systemctl reset-failed {self.unit} 2>/dev/null; systemctl start --no-block {self.unit}")]

    def stop_commands(self, drain: bool = True) -> list[Command]:
        if drain:
            return [["systemctl", "stop", self.unit]]
        # The stop job outlives a timed-out client; SIGKILL to the unit's processes ends it, and the
        # second `systemctl stop` waits for it to finish. systemd counts a main process ended by our
        # SIGKILL as the unit's failure (Result=signal, "failed"): reset-failed, since nothing failed
        # but the load we abandoned (the readiness wait has already said why), and a `failed` unit
        # would read as a crash in status and in the crash-loop bound.
        u = shlex.quote(self.unit)
        return [Script(f"timeout {self.ABORT_WAIT_S} systemctl stop {u} || "
                       f"{{ systemctl kill --signal=SIGKILL {u}; systemctl stop {u}; systemctl reset-failed {u}; }}",
                       display=f"systemctl stop {u}  (SIGKILL after {self.ABORT_WAIT_S} s: it never served, "
                               f"nothing to drain)")]

    def enable_commands(self) -> list[Command]:
        return [["systemctl", "enable", self.unit]]

    def disable_commands(self) -> list[Command]:
        return [["systemctl", "disable", self.unit]]

    def state(self) -> ServiceState:
        r = self.host.run(["systemctl", "show", self.unit, "-p", ",".join(SYSTEMD_PROPERTIES)])
        raw = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        if not r.ok or "ActiveState" not in raw:
            # systemctl shows even an unknown unit (inactive, not-found): no answer is not "stopped".
            r.check(self.entry.name, f"systemctl show {self.unit}")
            raise CommandFailed(f"systemctl show {self.unit} printed no ActiveState", host=self.entry.name)
        return ServiceState.from_facts(raw)

    def wait_started(self, timeout: float = 60.0, poll: float = 0.2) -> ServiceState:
        """The start job is queued (--no-block): wait until it runs the main process, or failed."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            raw = st.raw or {}
            if st.main_pid or st.failed or (raw.get("ActiveState") == "inactive" and not raw.get("Job")) \
                    or time.monotonic() > deadline:
                return st
            cancel.sleep(poll)

    def log_cursor(self) -> str:
        r = self.host.run(["journalctl", "-u", self.unit, "-n", "1", "--show-cursor", "-o", "cat", "--no-pager"])
        for line in reversed(r.stdout.splitlines()):
            if line.startswith("-- cursor: "):
                return "c:" + line[len("-- cursor: "):]
        return f"t:{time.time() - 1:.3f}"

    def read_log(self, cursor: str) -> tuple[list[str], str]:
        argv = ["journalctl", "-u", self.unit, "--show-cursor", "-o", "cat", "--no-pager"]
        argv += [f"--after-cursor={cursor[2:]}"] if cursor.startswith("c:") else [f"--since=@{cursor[2:]}"]
        r = self.host.run(argv)
        lines, new = [], cursor
        for line in r.stdout.splitlines():
            if line.startswith("-- cursor: "):
                new = "c:" + line[len("-- cursor: "):]
            elif line != "-- No entries --":
                lines.append(line)
        return lines, new

    def tail(self, lines: int = 40) -> list[str]:
        r = self.host.run(["journalctl", "-u", self.unit, "-n", str(lines), "-o", "cat", "--no-pager"])
        return [l for l in r.stdout.splitlines() if l != "-- No entries --"]

    def log_command(self, follow: bool = False, since: float | None = None, lines: int = 200) -> Command:
        argv = ["journalctl", "-u", self.unit, "--no-pager", "-o", "short-iso-precise"]
        if since is not None:
            argv.append(f"--since=@{int(since)}")
        else:
            argv += ["-n", str(lines)]
        if follow:
            argv.append("-f")
        return argv


# /proc/PID/stat's starttime (clock ticks after boot): the fields after "PID (comm) " start at field 3,
# so starttime (field 22) is the 20th; sed strips up to the LAST ") " since comm may contain one.
_START_TIME = "sed 's/^.*) //' /proc/$P/stat 2>/dev/null | cut -d' ' -f20"
_BOOT_ID = "cat /proc/sys/kernel/random/boot_id 2>/dev/null"


def _verified_record(pidfile: str, on_stale: str) -> str:
    """Shell that reads a process service's record (`PGID BOOT_ID START_TIME`) into P and runs
    `on_stale` (with $WHY set) unless it provably names our process group: written in this boot,
    and its leader, when alive, is the very process we started (same start time). The group of a
    dead leader cannot have been reused while a member lives (Linux keeps a PGID in use), so its
    members are ours. orchestrator/host/remote/facts_script.py applies the same rule in Python."""
    q = shlex.quote(pidfile)
    # Only a PID above 1 written as digits (no sign, no leading zero, at most 9 digits: Linux's
    # pid_max is 2^22) names a group: `kill 0` / `pkill -g 0` is the caller's own group, `kill -1`
    # every process, `kill 1` init. `set -f`: a `*` in the record is not a file name.
    return (f"R=$(cat {q} 2>/dev/null) || R=; set -f; set -- $R; set +f; P=${{1:-}}; B=${{2:-}}; T=${{3:-}}; "
            f"WHY=; N=; case \"$P\" in ''|0*|*[!0-9]*) ;; *) [ ${{#P}} -le 9 ] && [ \"$P\" -gt 1 ] && N=1;; esac; "
            f"if [ -z \"$P\" ]; then WHY=none; "
            f"elif [ -z \"$N\" ]; then WHY=\"the record names no process group vllm-orch started\"; "
            f"elif [ \"$B\" != \"$({_BOOT_ID})\" ]; then WHY=\"recorded in another boot (or by an older vllm-orch)\"; "
            f"elif [ -r /proc/$P/stat ] && [ \"$({_START_TIME})\" != \"$T\" ]; then "
            f"WHY=\"PID $P is another process now\"; fi; "
            f"if [ -n \"$WHY\" ]; then {on_stale}; fi; ")


class ProcessService(Service):
    """Hosts without systemd: `setsid` start script, a record of the process group it started (its
    PGID, the boot id and the leader's start time), group kill only when the record is proven
    current, a log file."""

    STOP_WAIT_S = 120      # vLLM's drain (--shutdown-timeout, 30 s by default) and its teardown

    @property
    def script(self) -> str:
        return f"{self.entry.units_dir}/vllm-{self.model}.sh"

    def describe(self) -> str:
        return self.script

    @property
    def pidfile(self) -> str:
        return f"{self.entry.state_dir}/run/vllm-{self.model}.pid"

    @property
    def logfile(self) -> str:
        return f"{self.entry.log_dir}/vllm-{self.model}.log"

    def start_commands(self) -> list[Command]:
        q = shlex.quote
        run_dir = f"{self.entry.state_dir}/run"
        return [Script(
            f"mkdir -p {q(run_dir)} {q(self.entry.log_dir)} || exit 1\n"
            f"printf '%s\\n' \"--- vllm-orch start $(date -u +%FT%TZ)\" >> {q(self.logfile)}\n"
            f"setsid {q(self.script)} >> {q(self.logfile)} 2>&1 < /dev/null &\n"
            f"P=$!; T=$({_START_TIME}); "
            f"echo \"$P $({_BOOT_ID}) ${{T:-gone}}\" > {q(self.pidfile)}",
            display=f"setsid {q(self.script)} >> {q(self.logfile)} 2>&1 < /dev/null &  (its process group, "
                    f"the boot id and its start time into {q(self.pidfile)})")]

    def stop_commands(self, drain: bool = True) -> list[Command]:
        """Like the units' KillMode=mixed: SIGTERM to vLLM's main process only (it drains and stops
        its workers itself; workers signalled directly die at once and fail the requests in flight),
        the whole process group after STOP_WAIT_S (ABORT_WAIT_S without a drain). A main process
        already gone leaves orphans: the group gets SIGTERM at once."""
        q = shlex.quote
        wait_s = self.STOP_WAIT_S if drain else self.ABORT_WAIT_S
        # The group is "alive" while a member is not a zombie (kill -0 succeeds on zombies).
        group_alive = "ps -eo pgid=,stat= | awk -v g=$P '$1==g && $2 !~ /^Z/ {f=1} END {exit !f}'"
        main_alive = "S=$(ps -o stat= -p $P 2>/dev/null) && [ -n \"$S\" ] && [ \"${S#Z}\" = \"$S\" ]"
        # A sleep-capable service's dev-mode guard (its own nftables table, installed by its start
        # script: render/artifacts.py dev_guard_rules) goes once nothing of it runs; none: nothing done.
        t = f"inet {dev_guard_table(self.model)}"
        unguard = (f"if command -v nft >/dev/null 2>&1 && nft list table {t} >/dev/null 2>&1; then "
                   f"nft delete table {t}; fi")
        stale = (f"[ \"$WHY\" = none ] || echo \"not stopping process group $P: $WHY\" >&2; "
                 f"rm -f {q(self.pidfile)}; {unguard}; exit 0")
        return [Script(
            _verified_record(self.pidfile, stale) +
            f"if {main_alive}; then kill -TERM $P; else pkill -TERM -g $P; fi; i=0; "
            f"while {group_alive} && [ $i -lt {wait_s * 10} ]; do sleep 0.1; i=$((i+1)); done; "
            f"pkill -KILL -g $P; i=0; while {group_alive} && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done; "
            f"if {group_alive}; then echo \"process group $P survived SIGKILL\" >&2; exit 1; fi; "
            f"rm -f {q(self.pidfile)}; {unguard}",
            display=f"kill -TERM the main process recorded in {self.pidfile} (once the record is proven "
                    f"current: same boot, same leader start time; it stops its workers); wait up to "
                    f"{self.STOP_WAIT_S}s; kill -KILL what is left of its process group; delete its nftables "
                    f"table {t} if there is one")]

    def state(self) -> ServiceState:
        q = shlex.quote
        r = self.host.run(Script(
            _verified_record(self.pidfile, "echo none; exit 0") +
            f"S=$(ps -o stat= -p $P 2>/dev/null); "
            f"if [ -n \"$S\" ] && [ \"${{S#Z}}\" = \"$S\" ]; then echo running $P $(stat -c %Y {q(self.pidfile)}); "
            f"else echo dead $P; fi"))
        words = r.stdout.split()
        if not words or words[0] == "none":
            return ServiceState(False, None)
        if words[0] == "running":
            return ServiceState(True, int(words[1]), started_at=float(words[2]) if len(words) > 2 else None)
        return ServiceState(False, None, failed=True)

    def log_cursor(self) -> str:
        r = self.host.run(Script(f"stat -c %s {shlex.quote(self.logfile)} 2>/dev/null || echo 0"))
        return f"o:{int((r.stdout.strip() or '0').split()[0])}"

    def read_log(self, cursor: str) -> tuple[list[str], str]:
        offset = int(cursor[2:])
        r = self.host.run(Script(f"tail -c +{offset + 1} {shlex.quote(self.logfile)} 2>/dev/null"))
        data = r.stdout
        if "\n" not in data:
            return [], cursor
        complete = data[: data.rindex("\n") + 1]
        return complete.splitlines(), f"o:{offset + len(complete.encode())}"

    def tail(self, lines: int = 40) -> list[str]:
        r = self.host.run(["tail", "-n", str(lines), self.logfile])
        return r.stdout.splitlines()

    def log_command(self, follow: bool = False, since: float | None = None, lines: int = 200) -> Command:
        if since is not None:
            # The start script writes a marker line per start; print from the last one.
            q = shlex.quote(self.logfile)
            return Script(f"awk '/^--- vllm-orch start /{{buf=\"\"}} {{buf=buf $0 \"\\n\"}} END{{printf \"%s\", buf}}' {q}"
                          + (f"; tail -n 0 -f {q}" if follow else ""))
        return ["tail", "-n", str(lines)] + (["-f"] if follow else []) + [self.logfile]
