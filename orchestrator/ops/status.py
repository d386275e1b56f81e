"""`vllm-orch status`: what each host serves now, read in as few round trips as possible. A host
that runs several services (disjoint GPUs and ports) has one ServiceStatus per service, each
decided and probed on its own; the host's own fields are those of its first service.

Per host: ONE round trip, the facts script asked for status's subset (orchestrator/host/facts.py
gather_for_status: the facts, the history tail, the host's uptime clock, the lock holder, the health
checks), and up to three HTTP probes through the host when a service runs: /health, then /v1/models
and /metrics side by side (each probe is a round trip of its own over SSH), carrying the service's
API key when its manifest names one (VLLM_API_KEY in serving.secret_env, taken from the environment).
/metrics is aggregated across vLLM's DP engines by probe/metrics.py: KV usage is the per-engine mean
(and max), requests are sums.
Hosts are asked in parallel, one thread and one connection each; a host that cannot be reached is a
row with its error, never a crash of the whole command.

The state of a host is decided by a pure function (`decide_state`) from the service state and the
probe answers, so the rules are unit-tested without a host:
  ready    the service runs, /health is 200 and /v1/models lists the served name (and, on systemd
           hosts, the unit is `active`: its ExecStartPost= readiness probe passed)
  loading  the service runs but the port does not answer yet (vLLM binds early, listens late),
           or /health is 200 and the name is not listed yet, or the unit is still `activating`
  failed   the service died (systemd failed, a PID file without a process), or /health says 503,
           or systemd is waiting to restart it after a crash
  stopped  nothing runs
A failed unit costs one more round trip: its journal tail, for the root-cause line. The health
timer's last check (state_dir/health/NAME.json), its restarts (history) and a swap left half done
(state_dir/swap.json, with the command that finishes it) are shown too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from orchestrator.config.inventory import HostEntry
from orchestrator.host.base import Host
from orchestrator.host.facts import StatusExtras
from orchestrator.host.records import ServiceRecord
from orchestrator.host.state import parse_history
from orchestrator.plan.interrupted import half_done
from orchestrator.probe import api as probes
from orchestrator.probe import keyed, logsig
from orchestrator.secret import Secret

DEPLOY_OPS = ("deploy", "swap", "rollback")
HISTORY_TAIL = 500          # lines of history.jsonl read for the last deploy / bench
PROBE_TIMEOUT_S = 3.0
JOURNAL_TAIL = 300          # log lines of a failed unit searched for its root cause
# systemd's Result= of a failed unit, in words
RESULT_WORDS = {"timeout": "not ready within its start-up budget (TimeoutStartSec)",
                "exit-code": "vLLM exited with an error", "signal": "vLLM was killed by a signal",
                "core-dump": "vLLM crashed (core dump)", "start-limit-hit": "too many starts in a row",
                "oom-kill": "the kernel's OOM killer stopped it", "resources": "systemd could not set it up"}


@dataclass
class ServiceStatus:
    """One service on a host (a host runs several on disjoint GPUs and ports): its own row."""

    name: str
    model: str | None = None
    folder: str | None = None            # its weights folder under models_root (shared per checkpoint)
    served_name: str | None = None
    port: int | None = None
    gpus: list[int] = field(default_factory=list)
    state: str = "unknown"
    state_reason: str = ""
    uptime_s: float | None = None
    main_pid: int | None = None
    kv_cache_usage: float | None = None
    kv_cache_usage_max: float | None = None
    engines: int | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    unit_state: str | None = None
    enabled: bool | None = None
    restarts: int | None = None
    root_cause: str | None = None
    health: dict | None = None
    last_health_restart: dict | None = None
    # A multi-node service: its rank on this host (0: the head) and its nodes, head first (from its
    # records); the head's row lists every node with its state (fold_nodes).
    rank: int | None = None
    vllm_version: str | None = None      # what it runs: its record's (its engine venv's), else the host's vllm
    engine: str | None = None            # its engine venv (engines_root/NAME), None: the inventory's vllm
    node_names: list[str] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)      # head only: {host, rank, state, unit_state, reason}
    # sleep mode: {level, where ("level 1: 547 GB in host RAM"), since, gpu_mib, allowance_mib,
    # cycles, growth_mib}; None while it serves
    asleep: dict | None = None


# The fields a host's row copies from its first service (the one a single-service host has).
PRIMARY_FIELDS = ("served_name", "port", "state", "state_reason", "uptime_s", "main_pid", "kv_cache_usage",
                  "kv_cache_usage_max", "engines", "requests_running", "requests_waiting", "unit_state",
                  "enabled", "restarts", "root_cause", "health", "last_health_restart")


@dataclass
class HostStatus:
    host: str
    reachable: bool = True
    error: str | None = None
    label: str | None = None         # the host's inventory label, e.g. SIMULATED
    active_model: str | None = None
    served_name: str | None = None
    port: int | None = None
    state: str = "unknown"           # ready / loading / failed / stopped / unreachable
    state_reason: str = ""
    uptime_s: float | None = None
    main_pid: int | None = None
    running_models: list[str] = field(default_factory=list)
    gpus: list[dict] = field(default_factory=list)
    gpu_error: str | None = None
    gpu_processes: list[dict] = field(default_factory=list)
    kv_cache_usage: float | None = None          # mean over the service's engines (0..1)
    kv_cache_usage_max: float | None = None      # the fullest engine
    engines: int | None = None                   # engines reporting metrics (DP size)
    requests_running: float | None = None
    requests_waiting: float | None = None
    disk: dict = field(default_factory=dict)
    models: list[dict] = field(default_factory=list)
    last_deploy: dict | None = None
    last_bench: dict | None = None
    unit_state: str | None = None                # systemd's words, e.g. "activating (start-post)"
    enabled: bool | None = None                  # the unit starts at boot (systemd)
    restarts: int | None = None                  # systemd's automatic restarts since the last start
    root_cause: str | None = None                # a failed service: the root-cause line of its log
    health: dict | None = None                   # the health timer's last check (health/NAME.json)
    last_health_restart: dict | None = None      # the health timer's last restart (history)
    interrupted_swap: dict | None = None         # swap.json: from, to, since, by, text, hint
    gateway: dict | None = None                  # the gateway it runs (ops/gateway.summary), None: none installed
    bad_records: list[str] = field(default_factory=list)   # record files that did not parse (left out)
    lock: dict | None = None
    vllm_version: str | None = None
    services: list[ServiceStatus] = field(default_factory=list)   # one per service; the host's fields: the first's
    # multi-node services this host is a worker node of (shown with their head): {service, head, rank, state}
    node_of: list[dict] = field(default_factory=list)
    round_trips: int = 0
    seconds: float = 0.0
    # the history lines read (the last `history_tail`), for `status --prometheus`; not in --json
    history: list[dict] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("history")
        return out

    def attention(self) -> list[str]:
        """What on this host needs the operator (each one line), for `status`'s exit code: a
        recorded service that failed or does not run (nothing serves it), a swap left half done.
        A service asleep or loading is fine."""
        if not self.reachable:
            return []                                  # said as the host's error
        out = [f"{self.host}: {s.name} is {s.state}" + (f" ({s.state_reason})" if s.state_reason else "")
               for s in self.services if s.state in ("failed", "stopped")]
        if self.gateway and self.gateway["state"] != "serving":
            out.append(f"{self.host}: its gateway is {self.gateway['state']} (every model behind it is unreachable "
                       f"through it)")
        if self.interrupted_swap:
            out.append(f"{self.host}: a swap is half done ({self.interrupted_swap.get('from')} -> "
                       f"{self.interrupted_swap.get('to')})")
        return out


def decide_state(service_active: bool, service_failed: bool, health: int | None,
                 listed: bool | None, unit_ready: bool | None = None, restarting: bool = False) -> tuple[str, str]:
    """(state, reason) from the service state and the probe answers (None = no HTTP answer).
    `unit_ready`: systemd's `active` (None where there is no unit); `restarting`: systemd waits to
    restart the service after a failure (activating, auto-restart)."""
    if not service_active:
        if restarting:
            return "failed", "the service failed; systemd restarts it after RestartSec"
        if service_failed:
            return "failed", "the service's process is gone (crashed or killed)"
        return "stopped", "no managed service runs"
    if health is None:
        return "loading", "the process runs, the port does not answer yet"
    if health == 503:
        return "failed", "/health answers 503: the engine is dead"
    if health != 200:
        return "loading", f"/health answers {health}"
    if listed is False:
        return "loading", "/health is 200 but /v1/models does not list the served name yet"
    if unit_ready is False:
        return "loading", "/health 200 and the name is listed, but the unit is still activating (its readiness " \
                          "probe has not passed yet)"
    return "ready", "/health 200 and the served name is listed" + (", unit active" if unit_ready else "")


START_LIMIT_LINE = "Start request repeated too quickly"     # systemd's journal line at StartLimitBurst


def failure_words(raw: dict, limit_hit: bool = False) -> str:
    """Why systemd calls a unit failed, and whether its restarts ran out. (NRestarts counts the
    restart that the start limit refused too.)"""
    result = raw.get("Result") or ""
    words = RESULT_WORDS.get(result, result or "failed")
    restarts = int(raw.get("NRestarts") or 0)
    if limit_hit:       # the first start, the restarts that ran, and the one the limit refused
        starts = max(restarts, 1)
        words += f"; {starts} start{'s' if starts != 1 else ''} failed in a row, then the start limit " \
                 f"(StartLimitBurst) stopped the restarts"
    elif restarts:
        words += f"; systemd restarted it {restarts} time{'s' if restarts != 1 else ''}"
    return words


def last_record(history: list[dict], operations: tuple[str, ...]) -> dict | None:
    for rec in reversed(history):
        if rec.get("operation") in operations:
            return rec
    return None


def last_deploy(history: list[dict]) -> dict | None:
    """The last deploy, swap or rollback that changed the host (it ran, or failed part-way): a
    later run that changed nothing (nothing to do, refused) was named as the host's last deploy
    (`deploy` again after a deploy: "ok (nothing to do)", took 0.4 s). Those later runs are counted
    in `later`, the newest named."""
    runs = [r for r in history if r.get("operation") in DEPLOY_OPS]
    changed = next((i for i in range(len(runs) - 1, -1, -1)
                    if not runs[i].get("noop") and not runs[i].get("refused")), None)
    if changed is None:
        return deploy_summary(runs[-1]) if runs else None
    out = deploy_summary(runs[changed])
    after = runs[changed + 1:]
    if out is not None and after:
        newest = deploy_summary(after[-1]) or {}
        out["later"] = {"runs": len(after), "operation": newest.get("operation"), "model": newest.get("model"),
                        "result": newest.get("result"), "at": newest.get("at")}
    return out


def deploy_summary(rec: dict | None) -> dict | None:
    """The fields of a deploy/swap/rollback record that status shows."""
    if rec is None:
        return None
    out = {k: rec.get(k) for k in ("operation", "model", "ok", "at", "seconds", "noop") if k in rec}
    if rec.get("refused"):
        out["result"] = "refused"
        out["error"] = rec["refused"]
    elif rec.get("ok"):
        out["result"] = "ok (nothing to do)" if rec.get("noop") else "ok"
    else:
        out["result"] = "failed"
        out["error"] = rec.get("root_cause") or rec.get("error")
    for key in ("downtime_s", "tokens_per_s", "rolled_back_to"):
        if key in rec:
            out[key] = rec[key]
    return out


def bench_summary(rec: dict | None) -> dict | None:
    """A bench record's headline figures, whatever subset of them the record carries."""
    if rec is None:
        return None
    out = {k: rec[k] for k in ("model", "at", "single_stream_tok_s", "peak_output_tok_s", "peak_concurrency")
           if k in rec}
    return out


def read_extras(extras: StatusExtras) -> tuple[list[dict], float | None, dict | None, dict[str, dict]]:
    """The history tail, the host's uptime clock (systemd start times are monotonic), who holds
    the deploy lock (flock, so a stale holder file is not reported) and the health timer's last
    check of each model, from the facts script's status extras (facts_script.status_extras, read
    leniently by host/facts.StatusExtras: what is not of its shape is left out)."""
    history = [h.shown() for h in parse_history([line for line in extras.history if isinstance(line, str)])]
    return (history, extras.uptime, extras.lock,
            {k: v for k, v in extras.health.items() if isinstance(v, dict)})


def _uptime(svc_raw: dict, host_time: float, host_uptime: float | None) -> float | None:
    """Seconds since the service's main process started, in the host's clocks."""
    if svc_raw.get("StartedAt"):                     # process services: PID file mtime (epoch)
        return max(0.0, host_time - float(svc_raw["StartedAt"]))
    mono = svc_raw.get("ExecMainStartTimestampMonotonic")
    if mono and mono.isdigit() and int(mono) and host_uptime is not None:
        return max(0.0, host_uptime - int(mono) / 1e6)
    return None


def pick_model(recorded: str | None, running: list[str]) -> str | None:
    """The service status is about: the recorded one while it runs (or when nothing else runs);
    else a running managed one (a first deploy or a swap loading before it is recorded)."""
    if recorded and (recorded in running or not running):
        return recorded
    return running[0] if running else recorded


def host_status(entry: HostEntry, port_of: Callable[[str], int | None] | None = None,
                served_name_of: Callable[[str], str | None] | None = None,
                accept_new_host_key: bool = False,
                api_key_of: Callable[[str], Secret | None] | None = None,
                history_tail: int = HISTORY_TAIL) -> HostStatus:
    """Status of one host. Never raises: errors become HostStatus(reachable=False, error=...).
    The callbacks map a model name to its manifest's port, served name and API key."""
    from orchestrator.host.connect import open_host

    t0 = time.monotonic()
    st = HostStatus(host=entry.name, label=entry.label)
    host = None
    try:
        host = open_host(entry, accept_new_host_key)
        _fill(st, host, entry, port_of or (lambda _m: None), served_name_of or (lambda _m: None),
              api_key_of or (lambda _m: None), history_tail)
    except Exception as exc:   # one host's failure is that host's row, not the command's crash
        st.reachable, st.state = False, "unreachable"
        st.error = str(exc) or type(exc).__name__
    finally:
        if host is not None:
            st.round_trips = host.stats.round_trips
            try:
                host.close()
            except Exception:
                pass
    st.seconds = round(time.monotonic() - t0, 3)
    return st


def service_list(records: Mapping[str, ServiceRecord], running: list[str]) -> list[str]:
    """The services status shows, every recorded and every running one; the first is the one a
    single-service host's row is about (pick_model), the others follow by name."""
    names = sorted(set(records) | set(running))
    first = pick_model(next(iter(records)) if len(records) == 1 else None, running) \
        if len(records) <= 1 else None
    return ([first] if first else []) + [n for n in names if n != first]


def _fill(st: HostStatus, host: Host, entry: HostEntry, port_of, served_name_of, api_key_of,
          history_tail: int = HISTORY_TAIL) -> None:
    from orchestrator.host.facts import gather_for_status

    facts, extras = gather_for_status(host, entry, history_tail)
    history, host_uptime, lock_holder, checks = read_extras(extras)
    st.history = history
    running = facts.running()
    names = service_list(facts.records, running)
    st.active_model, st.running_models = (names[0] if names else None), running
    st.vllm_version, st.lock = facts.vllm_version, lock_holder
    st.services = [_service(ServiceStatus(name), host, entry, facts, history, checks, host_uptime,
                            port_of, served_name_of, api_key_of) for name in names]
    if st.services:
        for name in PRIMARY_FIELDS:
            setattr(st, name, getattr(st.services[0], name))
    else:
        st.state, st.state_reason = decide_state(False, False, None, None, None, False)
    st.bad_records = list(facts.bad_records)
    half = half_done(facts, entry.name)
    if half:
        st.interrupted_swap = {**(facts.half_swap.shown() if facts.half_swap else {}), "text": half[0],
                               "hint": half[1]}

    st.gpus = [{"index": g.index, "name": g.name, "memory_used_mib": g.memory_used_mib,
                "memory_total_mib": g.memory_total_mib, "utilization_pct": g.utilization_pct}
               for g in facts.gpus]
    st.gpu_error = facts.gpu_error
    st.gpu_processes = [{**p.as_dict(), "owner": p.owner, "left_by": p.left_by}
                        for p in facts.procs]
    st.disk = {"path": facts.disk_path, "total": facts.disk_total, "free": facts.disk_free}
    recorded = {facts.model_of(n) for n in facts.records}
    st.models = [{"name": d.name, "bytes": d.bytes, "last_used": d.last_used,
                  "verified": d.complete, "ours": d.ours, "active": d.name in recorded,
                  "running": d.name in running}
                 for d in sorted(facts.models.values(), key=lambda d: d.name)]
    st.last_deploy = last_deploy(history)
    st.last_bench = bench_summary(last_record(history, ("bench",)))
    if extras.gateway is not None:          # a gateway is installed: its line (a few more round trips)
        st.gateway = gateway_line(host, entry, extras.gateway)


def gateway_line(host: Host, entry: HostEntry, raw: dict) -> dict:
    from orchestrator.errors import OrchestratorError
    from orchestrator.host.records import GatewayRecord
    from orchestrator.ops import gateway

    rec, why = GatewayRecord.parse(raw)
    if rec is None:
        return {"state": "unreadable", "error": f"its record gateway/gateway.json: {why}"}
    try:
        return gateway.summary(gateway.status_of(host, entry, rec))
    except OrchestratorError as exc:
        return {"state": "unknown", "error": str(exc)}


def _service(row: ServiceStatus, host: Host, entry: HostEntry, facts, history: list[dict], checks: dict[str, dict],
             host_uptime: float | None, port_of, served_name_of, api_key_of) -> ServiceStatus:
    """One service's row: its state (decide_state), probes at its port, unit, health timer."""
    name = row.name
    rec: ServiceRecord | None = facts.record(name)
    installed = facts.installed.get(name)
    nodes = rec if rec is not None and rec.nodes else installed
    if nodes is not None and nodes.nodes and nodes.rank is not None:
        row.node_names, row.rank = list(nodes.nodes), nodes.rank
    row.model = facts.model_of(name)
    row.folder = facts.folder_of(name)
    row.engine = rec.engine if rec is not None else None
    row.vllm_version = (rec.vllm_version if rec is not None else None) or facts.vllm_version
    placement = facts.placement(name, entry.name)      # its record's, else where it was installed
    row.port = (placement.port if placement is not None else 0) or port_of(name)
    row.served_name = (rec.served_name if rec is not None else None) or served_name_of(name)
    row.gpus = list(placement.gpus) if placement is not None else []
    svc = facts.services.get(name)
    health = listed = auth_problem = None
    if row.rank:                                    # a worker node: no HTTP to ask, its unit says it all
        row.state = "running" if svc is not None and svc.active else \
            "failed" if svc is not None and svc.failed else "stopped"
        row.state_reason = f"rank {row.rank} of {name} (headless), whose head is {row.node_names[0]}"
        if svc is not None and svc.ready is not None:
            row.unit_state, row.enabled, row.restarts = svc.describe(), svc.enabled, svc.restarts
        if svc is not None and svc.active:
            row.main_pid = svc.main_pid
            row.uptime_s = _uptime(svc.raw or {}, facts.time or time.time(), host_uptime)
        return row
    if svc is not None and svc.active:
        row.main_pid = svc.main_pid
        row.uptime_s = _uptime(svc.raw or {}, facts.time or time.time(), host_uptime)
        if port := row.port:
            health, listed, auth_problem = _probe(row, probes.Endpoint(host, port),
                                                  lambda: keyed.endpoint(host, entry, name, port, api_key_of(name)))
    raw = (svc.raw or {}) if svc is not None else {}
    restarting = raw.get("SubState") == "auto-restart"
    row.state, row.state_reason = decide_state(bool(svc and svc.active), bool(svc and svc.failed),
                                               health, listed, svc.ready if svc else None, restarting)
    if svc is not None and svc.ready is not None:
        row.unit_state, row.enabled = svc.describe(), svc.enabled
        row.restarts = svc.restarts
    if svc is not None and (svc.failed or restarting):
        from orchestrator.host.services import Service

        tail = Service.for_host(host, entry, name).tail(JOURNAL_TAIL)
        _sig, row.root_cause = logsig.root_cause(tail)
        if svc.ready is not None and raw.get("Result"):
            limit_hit = svc.failed and any(START_LIMIT_LINE in line for line in tail[-20:])
            row.state_reason = f"{'restarting' if restarting else 'failed'}: {failure_words(raw, limit_hit)}"
            if limit_hit:       # systemd refuses a plain start until the window passes or reset-failed
                row.state_reason += (f"; `vllm-orch logs {name} --host {entry.name}` shows why, `vllm-orch deploy` "
                                     f"starts it afresh")
    row.health = checks.get(name)
    row.last_health_restart = next((r for r in reversed(history) if r.get("operation") == "health-restart"
                                    and (r.get("service") or r.get("model")) == name), None)
    if auth_problem:
        row.state_reason += f"; {auth_problem}"
    if (asleep := facts.asleep(name)) is not None and row.state == "ready" and \
            probes.is_sleeping(probes.Endpoint(host, row.port)) is not False:    # the server's word wins
        most = max(asleep.gpu_mib.values(), default=0)
        row.asleep = {**asleep.model_dump(mode="json", exclude_none=True), "where": asleep.where()}
        row.state = "asleep"
        row.state_reason = (f"{asleep.where()}; it keeps {most} MiB per GPU (allowance {asleep.allowance_mib})"
                            + (f", {asleep.growth_mib} MiB more than after its first sleep over {asleep.cycles} "
                               f"cycles" if asleep.growth_mib else "")
                            + f"; `vllm-orch swap {name} --host {entry.name}` wakes it")
    if row.state == "loading" and not row.port:
        row.state_reason += " (port unknown: no manifest and no active record)"
    return row


def _probe(st: ServiceStatus, ep: probes.Endpoint,
           with_key: Callable[[], probes.Endpoint]) -> tuple[int | None, bool | None, str | None]:
    """(/health status, served name listed?, why /v1/models could not be read), and the /metrics
    figures into `st`. /health and /metrics are asked at `ep` (no key: vLLM leaves them open);
    /v1/models at `with_key()`, which proves the listener the service's before it carries the key
    (probe/keyed.py): a port held by another is said, and sent no key."""
    health = probes.health(ep, timeout=PROBE_TIMEOUT_S)
    if health != 200:
        return health, None, None
    listed, auth_problem = None, None
    with ThreadPoolExecutor(max_workers=1) as pool:     # /metrics while /v1/models is asked here
        metrics = pool.submit(probes.fetch_metrics, ep, timeout=PROBE_TIMEOUT_S)
        try:
            names = probes.served_models(with_key(), timeout=PROBE_TIMEOUT_S)
            listed = st.served_name in names if st.served_name else bool(names)
        except probes.Unauthorized as exc:
            auth_problem = f"{exc} (export VLLM_API_KEY; the manifest lists it in serving.secret_env)"
        except keyed.ForeignListener as exc:
            auth_problem = f"{exc}: the API key was not sent"
        except probes.HttpError:
            listed = False
        try:
            snap = metrics.result()
        except (probes.HttpError, ValueError):          # MetricsError is a ValueError
            return health, listed, auth_problem
    st.kv_cache_usage, st.kv_cache_usage_max = snap["kv_cache_usage_perc"], snap["kv_cache_usage_perc_max"]
    st.requests_running, st.requests_waiting = snap["running"], snap["waiting"]
    st.engines = int(snap["engines"]) if snap["engines"] else None
    return health, listed, auth_problem


def gather_status(entries: list[HostEntry], port_of=None, served_name_of=None,
                  accept_new_host_key: bool = False, max_workers: int = 32,
                  api_key_of: Callable[[str], Secret | None] | None = None,
                  node_entry: Callable[[str], HostEntry | None] | None = None,
                  history_tail: int = HISTORY_TAIL) -> list[HostStatus]:
    """Every host at once (one thread and one connection per host), in the order given.
    host_status is safe to call from several threads: each call opens its own connection. A
    multi-node service is shown once, on its head's row, with every node's state (fold_nodes);
    `node_entry` (a name -> inventory entry lookup) lets the nodes not selected be asked too."""
    if not entries:
        return []

    def ask(hosts: list[HostEntry]) -> list[HostStatus]:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(hosts))) as pool:
            futures = [pool.submit(host_status, e, port_of, served_name_of, accept_new_host_key, api_key_of,
                                   history_tail) for e in hosts]
            return [f.result() for f in futures]

    results = ask(entries)
    asked = {r.host for r in results}
    missing = sorted({n for r in results for v in r.services if v.rank == 0 for n in v.node_names} - asked)
    extra = [e for n in missing if node_entry is not None and (e := node_entry(n)) is not None]
    fold_nodes(results, ask(extra) if extra else [])
    return results


def node_health(v: ServiceStatus) -> None:
    """A multi-node service's state from all its nodes (v.nodes), not its head's alone. vLLM does not
    notice a lost node while idle: the head answers /health 200 and fails the next request that
    needs the lost ranks; a headless node outlives its head, holding its GPUs (both seen with a real
    vLLM, docs/multi-node.md). So a head that looks ready with a node down, or a node left running
    without its head, is `failed`, with what to run."""
    def named(nodes: list[dict]) -> str:
        return f"node{'s' if len(nodes) > 1 else ''} {', '.join(n['host'] for n in nodes)}"

    workers = v.nodes[1:]
    down = [n for n in workers if n["state"] in ("stopped", "failed")]
    unsure = [n for n in workers if n["state"] not in ("running", "stopped", "failed")]
    running = [n for n in workers if n["state"] == "running"]
    redeploy = (f"`vllm-orch deploy {v.model} --host {','.join(v.node_names)}"
                f"{'' if v.name == v.model else ' --name ' + v.name}` restarts every node")
    if down and v.state in ("ready", "loading"):
        v.state = "failed"
        v.state_reason = (f"{named(down)} not running: the head still answers /health, but vLLM notices a "
                          f"lost node only when a request needs its ranks, then fails it and exits; {redeploy}")
    elif running and v.state in ("stopped", "failed"):
        v.state_reason += (f"; {named(running)} still running without the head, holding {'their' if len(running) > 1 else 'its'} "
                           f"GPUs (a headless vLLM outlives its head): `vllm-orch stop {v.name}` stops every "
                           f"node, {redeploy}")
        v.state = "failed"
    if unsure:
        v.state_reason += f"; {named(unsure)} not known to run ({', '.join(sorted({n['state'] for n in unsure}))})"


def fold_nodes(results: list[HostStatus], others: Sequence[HostStatus] = ()) -> None:
    """A multi-node service once: its head's service row gets every node's state (`nodes`), and
    the workers' rows carry it in `node_of` instead of a service of their own. `others`: nodes
    asked only for this (not selected). Pure: the statuses in, changed in place."""
    by_host = {r.host: r for r in [*results, *others]}
    for r in results:
        for v in r.services:
            if v.rank != 0 or not v.node_names:
                continue
            v.nodes = [{"host": v.node_names[0], "rank": 0, "state": v.state, "unit_state": v.unit_state,
                        "reason": v.state_reason}]
            for rank, node in enumerate(v.node_names[1:], 1):
                hs = by_host.get(node)
                w = next((x for x in hs.services if x.name == v.name), None) if hs is not None else None
                if hs is None:
                    state, reason = "unknown", "not asked (not in the inventory)"
                elif not hs.reachable:
                    state, reason = "unreachable", hs.error or ""
                elif w is None:
                    state, reason = "stopped", f"{v.name} does not run there"
                else:
                    state, reason = w.state, w.state_reason
                v.nodes.append({"host": node, "rank": rank, "state": state,
                                "unit_state": w.unit_state if w is not None else None, "reason": reason})
            node_health(v)
    for r in results:
        workers = [v for v in r.services if v.rank]
        if not workers:
            continue
        r.node_of = [{"service": v.name, "head": v.node_names[0] if v.node_names else None, "rank": v.rank,
                      "state": v.state, "reason": v.state_reason} for v in workers]
        r.services = [v for v in r.services if not v.rank]
        if r.services:
            for name in PRIMARY_FIELDS:
                setattr(r, name, getattr(r.services[0], name))
            r.active_model = r.services[0].name
        else:
            first = workers[0]
            r.active_model = None
            for name in PRIMARY_FIELDS:
                setattr(r, name, getattr(first, name))
            r.port = r.served_name = None


def serving(entries: list[HostEntry] | Sequence[HostEntry], port_of=None, served_name_of=None,
            api_key_of: Callable[[str], Secret | None] | None = None,
            accept_new_host_key: bool = False) -> dict[str, str]:
    """host -> what it serves now, e.g. `kimi-k25-int4 (ready)`, from each host's status."""
    out = {}
    for st in gather_status(list(entries), port_of, served_name_of, accept_new_host_key, api_key_of=api_key_of):
        if not st.reachable:
            out[st.host] = "unreachable"
        else:
            out[st.host] = f"{st.active_model} ({st.state})" if st.active_model else "nothing"
    return out
