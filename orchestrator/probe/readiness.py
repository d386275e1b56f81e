"""Waiting until a started service really serves, while following its log.

Gates, each timed from the start: process alive -> port accepting -> /health 200 -> /v1/models
lists the served name -> smoke completion passes -> (systemd) the unit is `active`: our units'
ExecStartPost= probe holds them in `activating` until vLLM serves, so the last gate makes vllm-orch
and `systemctl is-active` agree on when the model is ready. The gates on /v1/* carry the service's
API key (`api_key`): without it vLLM answers 401, and a 401 fails the wait at once (kind "auth")
instead of burning the start-up budget. The key is sent only once the process bound to the port
is provably the service's (its unit's cgroup, its recorded process group: the host facts, by the
ownership rule), checked again whenever the service's main process changes: while vLLM loads
(its socket bound, not listening) or restarts, another local user can listen on the loopback
address of the same port (kind "port": the key was not sent). /health and the port gate carry no key.
The log is read every poll: a fatal line (see
logsig.FATAL) or the process exiting fails the wait at once with the root-cause line and the last
log lines; no new log line for the manifest's no-progress window (before /health answers) fails
it too - that is what an NCCL hang looks like. Time is a parameter: tests pass small budgets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from orchestrator.config.manifest import Manifest
from orchestrator.errors import ConnectError, DeployFailed
from orchestrator.fmt import fmt_duration
from orchestrator.host import cancel
from orchestrator.host.base import Host
from orchestrator.host.services import Service
from orchestrator.probe import api as probes
from orchestrator.probe import keyed, logsig
from orchestrator.secret import Secret

GATES = ("process alive", "port accepting", "/health 200", "model listed", "smoke test")
UNIT_GATE = "unit active"      # systemd hosts only (ServiceState.ready is None elsewhere)


@dataclass
class Ready:
    gates: list[tuple[str, float]]          # (gate, seconds since start when it passed)
    smoke: probes.SmokeResult
    seconds: float
    log_lines: int
    phases: list[tuple[str, float]] = field(default_factory=list)
    ledger: dict[str, float] = field(default_factory=dict)     # the start's phases (start_ledger)


def start_ledger(lines: list[str], phases: list[tuple[str, float]], passed: list[tuple[str, float]],
                 smoke: probes.SmokeResult) -> dict[str, float]:
    """A start's phases: vLLM's own figures from its log (logsig.LEDGER: weight loading, compile, CUDA
    graph capture, the engine's init), and when the wait saw the API come up and the first token of
    the smoke completion (seconds since the wait began, i.e. since the start)."""
    out = logsig.ledger(lines)
    at = dict(reversed(phases))
    if "API server up" in at:
        out["api_up_s"] = round(at["API server up"], 2)
    smoke_at = dict(passed).get(GATES[4])
    if smoke_at is not None and smoke.ttft_s is not None:
        out["first_token_s"] = round(smoke_at - smoke.seconds + smoke.ttft_s, 2)
    return out


class NotReady(DeployFailed):
    """The service failed a readiness gate. `kind`: crash, fatal-log, hang, timeout, smoke, auth, port,
    join (a node of a multi-node service did not join within vllm-orch's join wait)."""

    def __init__(self, message: str, *, kind: str, root_cause: str | None, last_lines: list[str],
                 gates: list[tuple[str, float]], host: str | None = None, hint: str | None = None):
        details = ([f"root cause: {root_cause}"] if root_cause else []) + \
                  (["last log lines:"] + [f"  {l}" for l in last_lines] if last_lines else [])
        super().__init__(message, host=host, step="ready", details=details, hint=hint)
        self.kind, self.root_cause, self.last_lines, self.gates = kind, root_cause, last_lines, gates


def failure_fields(err: Exception | None) -> dict:
    """What a history record says about a failure: the error, and for readiness failures its kind
    (crash, fatal-log, hang, timeout, smoke, auth) and root-cause line."""
    if err is None:
        return {}
    fields: dict[str, str | None] = {"error": str(err)}
    if isinstance(err, NotReady):
        fields.update(failure_kind=err.kind, root_cause=err.root_cause)
    elif kind := getattr(err, "kind", None):    # e.g. a performance floor (plan/perf.py): kind "perf"
        fields["failure_kind"] = kind
    return fields


# A line (or an exit) that says ANOTHER node died: the head's "Connection closed by peer" when a
# rank went away, a rank's "Failed to recv" when the head did. Not a root cause: the wait gives the
# other nodes CONSEQUENCE_GRACE_S to show theirs before it fails on such a line.
CONSEQUENCES = frozenset({"peer-closed", "head-gone"})
CONSEQUENCE_GRACE_S = 2.0


@dataclass
class _Failure:
    node: str | None            # None: the head (the host the wait is at)
    kind: str                   # fatal-log | crash
    message: str
    root: str | None
    hint: str | None
    consequence: bool           # the line says another node died (CONSEQUENCES)

    def rank(self) -> tuple[bool, bool, bool]:
        """Which of several failures seen together to report: a root cause before a consequence,
        a fatal line before an exit, another node before the head (whose death follows a rank's)."""
        return self.consequence, self.kind != "fatal-log", self.node is None


def _fatal(lines: list[str]) -> tuple[logsig.Signature, str] | None:
    for line in lines:
        sig = logsig.fatal_in(line)
        if sig and sig.key != "engine-core-failed":
            return sig, line
    return None


def _exited(seen: list[str]) -> tuple[str | None, str | None, bool]:
    """(root-cause line, hint, is it a consequence) of a process that exited, from its log."""
    cause, root = logsig.root_cause(seen)
    return root, cause.fix if cause else None, bool(cause and cause.key in CONSEQUENCES)


@dataclass
class _Node:
    """Another node of a multi-node service, followed during the wait: its log and its unit."""

    name: str
    service: Service
    cursor: str
    seen: list[str] = field(default_factory=list)
    fresh: int = 0                      # lines read in the last poll
    joined: bool = False                # its ranks said they joined the world (logsig.JOINED)

    def failure(self, elapsed: float) -> _Failure | None:
        """A fatal line among the node's new log lines, or its unit stopped; None while it runs.
        The unit's state is read BEFORE the log (see wait_ready)."""
        active = self.service.state().active
        lines, self.cursor = self.service.read_log(self.cursor)
        self.seen.extend(lines)
        self.fresh = len(lines)
        self.joined = self.joined or any(logsig.JOINED.search(line) for line in lines)
        if found := _fatal(lines):
            sig, line = found
            return _Failure(self.name, "fatal-log", f"fatal log line on node {self.name} after {elapsed:.1f}s: "
                                                    f"{sig.meaning}", logsig.clean(line), sig.fix, sig.key in CONSEQUENCES)
        if not active:
            root, hint, consequence = _exited(self.seen)
            return _Failure(self.name, "crash", f"vLLM on node {self.name} exited after {elapsed:.1f}s (a rank of the "
                                                f"service is gone: it cannot serve)", root, hint, consequence)
        return None


def wait_ready(host: Host, service: Service, m: Manifest, cursor: str, *,
               on_event: Callable[[str, str], None] = lambda kind, text: None,
               budget_s: float | None = None, no_progress_s: float | None = None,
               poll_s: float = 0.5, api_key: Secret | str | None = None,
               nodes: Sequence[tuple[str, Service]] = (), node_cursors: Mapping[str, str] | None = None) -> Ready:
    """`nodes`: a multi-node service's other nodes (name, their Service), whose logs (from
    node_cursors, else from now) and units are read every poll too: a fatal line or a stopped unit
    on one fails the wait naming it. Of several failures seen together, a root cause beats a line
    saying another node died (CONSEQUENCES: reported only when no cause shows within
    CONSEQUENCE_GRACE_S), a fatal line beats an exit, and another node beats the head (the head dies
    of a lost rank: the rank is the cause)."""
    budget = float(budget_s if budget_s is not None else m.startup.budget_seconds)
    quiet_limit = float(no_progress_s if no_progress_s is not None else m.startup.no_progress_seconds)
    start = time.monotonic()
    last_line_at = start
    passed: list[tuple[str, float]] = []
    phases: list[tuple[str, float]] = []
    seen: list[str] = []
    port = m.serving.port
    key = Secret(api_key) if isinstance(api_key, str) else api_key
    open_ep = probes.Endpoint(host, port)           # /health and the port: no key
    ep = open_ep                                    # with the key once its listener is proven (keyed.endpoint)
    verified_for: list[int | None] = []              # the main PID the listener was proved for

    def fail(kind: str, message: str, root: str | None = None, hint: str | None = None) -> NoReturn:
        more, _ = service.read_log(cursor_box[0])
        seen.extend(more)
        sig, line = logsig.root_cause(seen)
        raise NotReady(message, kind=kind, root_cause=root or line, host=service.entry.name,
                       last_lines=[logsig.clean(l) for l in seen[-12:]], gates=list(passed),
                       hint=hint or (sig.fix if sig else None))

    # a node whose log is read from its start (its recorded cursor) says when its ranks joined; one read
    # from now may have said it already: not judged by the join wait
    others = [_Node(name, svc, (node_cursors or {}).get(name) or svc.log_cursor(),
                    joined=not (node_cursors or {}).get(name)) for name, svc in nodes]
    # vllm-orch's own join wait (tensor/pipeline parallel across nodes on vLLM's runtime): every node's
    # ranks say they joined (a line each prints once the whole group, the head's ranks too, formed)
    # within multinode.join_timeout_seconds, else the wait fails naming the nodes that did not.
    # vLLM's --distributed-timeout-seconds is the collectives' timeout, far longer.
    mn = m.multinode
    join_s = float(mn.join_timeout_seconds) if others and mn is not None and mn.backend == "mp" and \
        m.vllm.data_parallel_size == 1 else None

    by_name = {n.name: n for n in others}
    held: tuple[float, _Failure] | None = None      # a consequence seen first, while the cause may follow

    def report(f: _Failure) -> NoReturn:
        if f.node is None:
            fail(f.kind, f.message, root=f.root, hint=f.hint)
        node = by_name[f.node]
        raise NotReady(f.message, kind=f.kind, root_cause=f.root, host=node.name,
                       last_lines=[logsig.clean(l) for l in node.seen[-12:]], gates=list(passed), hint=f.hint)

    cursor_box = [cursor]
    smoke_result: probes.SmokeResult | None = None
    connects = [h.connects for h in [host, *(n.service.host for n in others)]]
    while True:
        if [h.connects for h in [host, *(n.service.host for n in others)]] != connects:
            # A command that was cut raises ConnectError itself; one that ran after a cut between
            # polls reconnected without a word. Either way the deploy lock's connection is gone:
            # end the wait the same way, so the run re-proves its lock and rolls back.
            raise ConnectError(f"lost the connection to {host.name} during the readiness wait "
                               "(it reconnected, but the deploy lock went with the old connection)",
                               host=service.entry.name, step="ready")
        now = time.monotonic()
        elapsed = now - start
        # The state BEFORE the log: a process seen exited has written its last line by then, so the
        # exit is judged with it. Read the other way round, a head that printed "Connection closed by
        # peer" (the consequence of a rank's death) and exited between the two reads was judged
        # without that line, and the deploy named the head instead of the rank with the root cause.
        state = service.state()
        lines, cursor_box[0] = service.read_log(cursor_box[0])
        if lines:
            last_line_at = now
            seen.extend(lines)
            for line in lines:
                phase = logsig.phase_of(line)
                if phase and (not phases or phases[-1][0] != phase):
                    phases.append((phase, elapsed))
                    on_event("phase", f"{phase} (at {elapsed:.1f}s)")
                on_event("log", logsig.clean(line))
        failures = [f for node in others if (f := node.failure(elapsed)) is not None]
        if any(node.fresh for node in others):
            last_line_at = now                  # a node's progress (joining, loading) is progress too
        if found := _fatal(lines):
            sig, line = found
            failures.append(_Failure(None, "fatal-log", f"fatal log line after {elapsed:.1f}s: {sig.meaning}",
                                     logsig.clean(line), sig.fix, sig.key in CONSEQUENCES))
        if not state.active:
            root, hint, consequence = _exited(seen)
            failures.append(_Failure(None, "crash", f"the service exited after {elapsed:.1f}s" +
                                     (" (before it served)" if len(passed) < 3 else ""), None, None,
                                     consequence and bool(others)))
        if failures:
            worst = min(failures, key=_Failure.rank)
            # one host, or a root cause: fail now; a node that says another died: let that one speak
            if not others or not worst.consequence:
                report(worst)
            held = held or (now, worst)
        if held is not None:                    # waiting for the cause of what a node said
            if now - held[0] >= CONSEQUENCE_GRACE_S:
                report(held[1])
            cancel.sleep(poll_s)          # Ctrl-C ends the wait here (host/cancel.py)
            continue
        missing = [n for n in others if not n.joined]
        if join_s is not None and elapsed > join_s and missing:
            late = missing[0]
            message = (f"{'node' if len(missing) == 1 else 'nodes'} {', '.join(n.name for n in missing)} did not "
                       f"join the head within {join_s:.0f}s (vllm-orch's join wait, multinode.join_timeout_seconds): "
                       f"{'its' if len(missing) == 1 else 'their'} ranks never said they joined")
            hint = ("check that every node is started, reaches the head's cluster address and master port "
                    "(firewall, route, NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME), and holds the same files")
            _cause, root = logsig.root_cause(late.seen)
            raise NotReady(message, kind="join", root_cause=root, host=late.name,
                           last_lines=[logsig.clean(l) for l in late.seen[-12:]], gates=list(passed), hint=hint)
        stage = len(passed)
        if stage in (3, 4) and key is not None and verified_for != [state.main_pid]:
            try:
                ep = keyed.endpoint(host, service.entry, m.name, port, key)
            except keyed.ForeignListener as exc:
                fail("port", f"{exc}: the API key was not sent (after {elapsed:.1f}s)", hint=keyed.HINT)
            verified_for[:] = [state.main_pid]
        if stage == 0:
            passed.append((GATES[0], elapsed))
            on_event("gate", GATES[0])
            continue
        if stage == 1 and probes.port_open(open_ep):
            passed.append((GATES[1], time.monotonic() - start))
            on_event("gate", GATES[1])
            continue
        if stage == 2 and probes.health(open_ep, m.probes.health_path) == 200:
            passed.append((GATES[2], time.monotonic() - start))
            on_event("gate", GATES[2])
            continue
        if stage == 3:
            try:
                ids = probes.served_models(ep)
            except probes.Unauthorized as exc:
                fail("auth", f"{exc} (after {elapsed:.1f}s)",
                     hint="export the key vLLM was started with (VLLM_API_KEY, listed in the "
                          "manifest's serving.secret_env) in vllm-orch's environment")
            except probes.HttpError:
                ids = []
            if m.served_name in ids:
                passed.append((GATES[3], time.monotonic() - start))
                on_event("gate", GATES[3])
                continue
        if stage == 4:
            smoke = probes.smoke_test(ep, m.served_name, m.probes.smoke_prompt, m.probes.smoke_expect,
                                      m.probes.smoke_max_tokens, m.probes.smoke_timeout_seconds)
            if smoke.ok:
                passed.append((GATES[4], time.monotonic() - start))
                on_event("gate", GATES[4])
                smoke_result = smoke
                if state.ready is None:
                    return Ready(passed, smoke, time.monotonic() - start, len(seen), phases,
                                 start_ledger(seen, phases, passed, smoke))
                continue
            if smoke.answer or "garbage" in (smoke.problem or "") or "does not match" in (smoke.problem or ""):
                fail("smoke", f"smoke test failed: {smoke.problem}",
                     hint="the server answers but the model's output is wrong: check the checkpoint, "
                          "quantisation and MoE/attention backends")
        if stage == 5 and state.ready and smoke_result is not None:
            passed.append((UNIT_GATE, time.monotonic() - start))
            on_event("gate", UNIT_GATE)
            return Ready(passed, smoke_result, time.monotonic() - start, len(seen), phases,
                         start_ledger(seen, phases, passed, smoke_result))
        if stage < 3:               # loading: how long it has been silent, against the window
            on_event("wait", f"silent for {now - last_line_at:.0f}s of the {quiet_limit:.0f}s no-progress "
                             f"window; {fmt_duration(elapsed)} of the {fmt_duration(budget)} start-up budget")
        if stage < 3 and now - last_line_at > quiet_limit:
            fail("hang", f"no new log line for {now - last_line_at:.0f}s (no-progress window "
                         f"{quiet_limit:.0f}s) - an NCCL hang looks like this",
                 hint="check NCCL_P2P_LEVEL / NCCL_P2P_DISABLE / iommu (facts: NCCL hang on PCIe)")
        if elapsed > budget:
            fail("timeout", f"not ready within the start-up budget of {budget:.0f}s "
                            f"(passed: {', '.join(g for g, _ in passed) or 'nothing'})")
        cancel.sleep(poll_s)
