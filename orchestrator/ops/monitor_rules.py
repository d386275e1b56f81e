"""What `vllm-orch monitor` writes for a Prometheus and a Grafana, as pure functions of the fleet's
services (`Target`) and the timing (`Timing`): file_sd target groups, the scrape configuration,
recording and alert rules, `promtool test rules` cases for every alert (firing and not), and a
Grafana dashboard whose every expression is a series these rules record (or `up`).

vLLM's series are read under the names probe/metrics.py keeps (vLLM 0.33, vllm/v1/metrics/loggers.py),
with its aggregation over data-parallel engines (each engine has its own series, label `engine`):
requests and tokens are SUMMED, KV-cache usage is the engine MEAN and MAX (never a sum), latency
quantiles come from the engines' histogram buckets summed per `le`. Every rule groups by the
target labels `host` and `service` that the file_sd files put on each service's series.
vllm-orch's own series (`vllm_orch_*`) come from `vllm-orch status --prometheus` (ops/monitor.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.probe import metrics as m

VLLM_JOBS = ("vllm", "vllm-keyed")          # services scraped without, and (opted in) with a scrape credential
UP = f'up{{job=~"{"|".join(VLLM_JOBS)}"}}'
BY = "host, service"
KV_FULL = 0.95                                # KV-cache usage that counts as full
SLEEP_GROWTH_MIB = 256                        # GPU memory a sleeping service may gain in SLEEP_WINDOW
SLEEP_WINDOW = "10m"
CRASH_LOOP_RESTARTS = 3                       # systemd restarts within CRASH_WINDOW
CRASH_WINDOW = "15m"


def q(value: str) -> str:
    """A PromQL string literal: a service name comes from a host's records, so it is escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@dataclass(frozen=True)
class Target:
    """One service's /metrics as Prometheus scrapes it, with the labels its series get."""

    host: str
    service: str
    model: str
    served_name: str
    gpus: tuple[int, ...]
    node_role: str                  # "single", or "head" of a multi-node service (workers have no HTTP)
    vllm_version: str
    address: str                    # host:port Prometheus scrapes
    keyed: bool                     # the manifest lists VLLM_API_KEY: scraped with a scrape credential if one is given
    slo_ttft_p95_s: float | None = None
    on_host: bool = False           # listens on loopback of a host scraped over the network: its agent's target

    def labels(self) -> dict[str, str]:
        return {"host": self.host, "service": self.service, "model": self.model,
                "served_name": self.served_name, "gpus": ",".join(str(g) for g in self.gpus),
                "node_role": self.node_role, "vllm_version": self.vllm_version}


@dataclass(frozen=True)
class Exporter:
    host: str
    kind: str                       # "node" or "dcgm"
    address: str                    # host:port


@dataclass(frozen=True)
class Timing:
    """Scrape and rule-evaluation interval, and every alert's `for:` when given (drills and tests:
    the rules' own durations are minutes). Rate windows are four intervals (Prometheus needs at
    least two samples in a window; four ride out a missed scrape)."""

    interval_s: int = 15
    for_s: int | None = None

    @property
    def interval(self) -> str:
        return f"{self.interval_s}s"

    @property
    def window(self) -> str:
        return f"{4 * self.interval_s}s"

    def hold(self, default: str) -> str:
        return f"{self.for_s}s" if self.for_s is not None else default


def file_sd(targets: list[Target]) -> list[dict]:
    """file_sd target groups of the services: one group per service."""
    return [{"targets": [t.address], "labels": t.labels()} for t in targets]


def exporter_sd(exporters: list[Exporter], kind: str) -> list[dict]:
    return [{"targets": [e.address], "labels": {"host": e.host}} for e in exporters if e.kind == kind]


def gateway_job() -> dict:
    """The gateways' own metrics (HAProxy's Prometheus exporter, `gateway.metrics_port`): a backend
    svc_NAME is service NAME's traffic through the gateway, relabelled `service` as vLLM's series are."""
    return _job("gateway", metric_relabel_configs=[
        {"source_labels": ["proxy"], "regex": "svc_(.+)", "target_label": "service", "replacement": "$1"}])


def _job(name: str, **extra) -> dict:
    return {"job_name": name, "file_sd_configs": [{"files": [f"targets/{name}.json"]}], **extra}


def _vllm_jobs(key_file: str | None, scheme: str) -> list[dict]:
    """The vLLM scrape jobs: unkeyed, and keyed with the operator's credential file when given."""
    tls = {"scheme": scheme} if scheme != "http" else {}
    jobs = [_job("vllm", **tls)]
    if key_file is not None:
        jobs.append(_job("vllm-keyed", **tls, authorization={"type": "Bearer", "credentials_file": key_file}))
    return jobs


def scrape_config(timing: Timing, key_file: str | None, scheme: str = "http") -> dict:
    """prometheus.yml: every path relative to its own folder (Prometheus resolves them so). No
    scrape carries a key by default (vLLM 0.33 leaves /metrics outside --api-key's guarded
    prefixes); the keyed job is there only when the operator gives a scrape credential `key_file`,
    referenced as a file (authorization.credentials_file), never written here. `scheme` https: the
    vLLM jobs scrape over TLS (a server started with --ssl-* or a TLS proxy at the target)."""
    jobs = _vllm_jobs(key_file, scheme)
    # vllm-orch's own series (status --prometheus through a node exporter's textfile collector)
    # carry their own host and service labels: honor_labels keeps them
    jobs += [_job("node"), _job("dcgm"), _job("vllm-orch", honor_labels=True), gateway_job()]
    return {"global": {"scrape_interval": timing.interval, "evaluation_interval": timing.interval},
            "rule_files": ["rules/vllm-orch.rules.yml"], "scrape_configs": jobs}


def agent_config(timing: Timing, key_file: str | None, scheme: str, remote_write: str | None) -> dict:
    """agent/HOST/prometheus.yml: a Prometheus in agent mode on HOST (`prometheus
    --enable-feature=agent`) scraping the services that listen on its loopback, with the labels the
    fleet's targets carry, and remote-writing every series (up included) to the fleet's Prometheus
    (started with --web.enable-remote-write-receiver), so its rules and alerts see them as any other."""
    out: dict = {"global": {"scrape_interval": timing.interval}, "scrape_configs": _vllm_jobs(key_file, scheme)}
    if remote_write:
        out["remote_write"] = [{"url": remote_write}]
    return out


# -- recording rules ----------------------------------------------------------------------------

def recorded(timing: Timing) -> dict[str, str]:
    """record name -> expression: what the alerts and the dashboard read."""
    w = timing.window

    def quantile(phi: float, hist: str) -> str:
        return f"histogram_quantile({phi}, sum by ({BY}, le) (rate({hist}_bucket[{w}])))"

    return {
        "vllm_orch:generation_tokens:rate": f"sum by ({BY}) (rate({m.GENERATION_TOKENS}[{w}]))",
        "vllm_orch:prompt_tokens:rate": f"sum by ({BY}) (rate({m.PROMPT_TOKENS}[{w}]))",
        "vllm_orch:ttft_seconds:p50": quantile(0.5, m.TTFT),
        "vllm_orch:ttft_seconds:p95": quantile(0.95, m.TTFT),
        "vllm_orch:tpot_seconds:p50": quantile(0.5, m.TPOT),
        "vllm_orch:tpot_seconds:p95": quantile(0.95, m.TPOT),
        "vllm_orch:kv_cache_usage:mean": f"avg by ({BY}) ({m.KV_CACHE})",
        "vllm_orch:kv_cache_usage:max": f"max by ({BY}) ({m.KV_CACHE})",
        "vllm_orch:requests_waiting": f"sum by ({BY}) ({m.WAITING})",
        "vllm_orch:requests_running": f"sum by ({BY}) ({m.RUNNING})",
    }


# -- alert rules --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    hold: str                       # the rule's own `for:` ("0s": fires at once)
    severity: str
    summary: str
    answer: str                     # the vllm-orch command that answers it (docs/monitoring.md)


def alerts(targets: list[Target]) -> list[Alert]:
    out = [
        Alert("VllmServiceDown", f"{UP} == 0", "2m", "critical",
              "{{ $labels.service }} on {{ $labels.host }}: /metrics does not answer",
              "vllm-orch status --host {{ $labels.host }}; vllm-orch logs {{ $labels.service }} "
              "--host {{ $labels.host }}"),
        Alert("VllmServiceHung",
              "(vllm_orch:requests_running + vllm_orch:requests_waiting) > 0 and on (host, service) "
              "(vllm_orch:generation_tokens:rate + vllm_orch:prompt_tokens:rate) == 0", "5m", "critical",
              "{{ $labels.service }} on {{ $labels.host }}: requests in flight, no token produced",
              "vllm-orch status --host {{ $labels.host }} (the health timer restarts a hung engine; "
              "vllm-orch history {{ $labels.service }} --host {{ $labels.host }} shows it)"),
        Alert("VllmKvCacheFull",
              f"max by ({BY}) (({m.KV_CACHE} > {KV_FULL}) and on (host, service, engine) ({m.WAITING} > 0))",
              "5m", "warning",
              "{{ $labels.service }} on {{ $labels.host }}: an engine's KV cache is full and requests wait",
              "vllm-orch bench {{ $labels.service }} --host {{ $labels.host }} (the concurrency it "
              "sustains); more GPUs or a shorter max_model_len in its manifest, then vllm-orch swap"),
    ]
    out += [Alert("VllmTtftSlo",
                  f"vllm_orch:ttft_seconds:p95{{host={q(t.host)}, service={q(t.service)}}} > {t.slo_ttft_p95_s:g}",
                  "10m", "warning",
                  f"{{{{ $labels.service }}}} on {{{{ $labels.host }}}}: TTFT p95 above its objective "
                  f"({t.slo_ttft_p95_s:g} s)",
                  "vllm-orch status --host {{ $labels.host }} (waiting requests, KV usage); "
                  "vllm-orch bench {{ $labels.service }} --host {{ $labels.host }}")
            for t in targets if t.slo_ttft_p95_s is not None]
    out += [
        Alert("VllmHealthRestart",
              'increase(vllm_orch_operations_total{operation=~"health-restart|head-lost-restart"}[1h]) > 0',
              "0s", "warning",
              "{{ $labels.service }} on {{ $labels.host }}: restarted by its health check",
              "vllm-orch history {{ $labels.service }} --host {{ $labels.host }}; vllm-orch logs "
              "{{ $labels.service }} --host {{ $labels.host }}"),
        Alert("VllmCrashLoop",
              f"increase(vllm_orch_systemd_restarts_total[{CRASH_WINDOW}]) >= {CRASH_LOOP_RESTARTS}",
              "0s", "critical",
              "{{ $labels.service }} on {{ $labels.host }}: systemd restarted it "
              f"{CRASH_LOOP_RESTARTS} times or more in {CRASH_WINDOW}",
              "vllm-orch logs {{ $labels.service }} --host {{ $labels.host }} (the root-cause line); "
              "vllm-orch status --host {{ $labels.host }}"),
        Alert("VllmSleepingGpuMemoryGrowing",
              # each service's GPUs (a GPU is listed for its sleepers and its awake service: the
              # services are the "many" side) times the one DCGM series of that GPU
              f"max by ({BY}) (vllm_orch_service_gpu_info * on (host, gpu) group_left "
              f"delta(DCGM_FI_DEV_FB_USED[{SLEEP_WINDOW}])) > {SLEEP_GROWTH_MIB} and on (host, service) "
              f'max by ({BY}) ({m.SLEEP_STATE}{{sleep_state="awake"}}) == 0',
              "10m", "warning",
              "{{ $labels.service }} on {{ $labels.host }}: asleep, yet its GPUs' memory grew "
              f"more than {SLEEP_GROWTH_MIB} MiB in {SLEEP_WINDOW}",
              "vllm-orch status --host {{ $labels.host }} (GPU processes: service, left behind, foreign)"),
    ]
    return out


def rules(targets: list[Target], timing: Timing) -> dict:
    """The rule file: one group of recording rules, one of alerts."""
    return {"groups": [
        {"name": "vllm-orch-recording", "interval": timing.interval,
         "rules": [{"record": name, "expr": expr} for name, expr in recorded(timing).items()]},
        {"name": "vllm-orch-alerts", "interval": timing.interval,
         "rules": [{"alert": a.name, "expr": a.expr, "for": timing.hold(a.hold),
                    "labels": {"severity": a.severity},
                    "annotations": {"summary": a.summary, "answer": a.answer}}
                   for a in alerts(targets)]},
    ]}


# -- promtool test rules --------------------------------------------------------------------------

def seconds(duration: str) -> int:
    """'5m' -> 300 (the durations written above: s, m, h)."""
    return int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def expand(template: str, labels: dict[str, str]) -> str:
    """An annotation as Prometheus renders it for these labels (only $labels.NAME is used above)."""
    for k, v in labels.items():
        template = template.replace(f"{{{{ $labels.{k} }}}}", v)
    return template


def _series(name: str, labels: dict[str, str], values: str) -> dict:
    inner = ", ".join(f"{k}={q(v)}" for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def promtool_tests(targets: list[Target], timing: Timing) -> dict:
    """`promtool test rules` cases: for every alert one input that fires it (with the labels and
    annotations it must carry) and one, as close as possible, that does not."""
    by_name: dict[str, list[Alert]] = {}
    for a in alerts(targets):
        by_name.setdefault(a.name, []).append(a)
    host, service = "gpu1", "svc"
    svc = {"host": host, "service": service}
    vllm = {"job": "vllm", "instance": "gpu1:8000", **svc, "model_name": "served"}
    state = {"job": "vllm-orch", "instance": "state:9101", **svc}
    i = timing.interval_s

    def case(alert: Alert, inputs: list[dict], fires: bool, labels: dict[str, str]) -> dict:
        at = seconds(timing.hold(alert.hold)) + 8 * i
        expected = ([{"exp_labels": {**labels, "severity": alert.severity},
                      "exp_annotations": {"summary": expand(alert.summary, labels),
                                          "answer": expand(alert.answer, labels)}}] if fires else [])
        return {"interval": timing.interval, "input_series": inputs,
                "alert_rule_test": [{"eval_time": f"{at}s", "alertname": alert.name, "exp_alerts": expected}]}

    def n(alert: Alert) -> int:
        return seconds(timing.hold(alert.hold)) // i + 12

    tests = []
    [down] = by_name["VllmServiceDown"]
    up = {"job": "vllm", "instance": "gpu1:8000", **svc}
    tests += [case(down, [_series("up", up, f"0x{n(down)}")], True, up),
              case(down, [_series("up", up, f"1x{n(down)}")], False, up)]

    [hung] = by_name["VllmServiceHung"]
    k = n(hung)
    flight = [_series(m.RUNNING, {**vllm, "engine": "0"}, f"1x{k}"),
              _series(m.WAITING, {**vllm, "engine": "0"}, f"2x{k}"),
              _series(m.PROMPT_TOKENS, {**vllm, "engine": "0"}, f"500x{k}")]
    idle = [_series(m.RUNNING, {**vllm, "engine": "0"}, f"0x{k}"), _series(m.WAITING, {**vllm, "engine": "0"}, f"0x{k}"),
            _series(m.PROMPT_TOKENS, {**vllm, "engine": "0"}, f"500x{k}"),
            _series(m.GENERATION_TOKENS, {**vllm, "engine": "0"}, f"100x{k}")]
    tests += [case(hung, [*flight, _series(m.GENERATION_TOKENS, {**vllm, "engine": "0"}, f"100x{k}")], True, svc),
              case(hung, [*flight, _series(m.GENERATION_TOKENS, {**vllm, "engine": "0"}, f"100+10x{k}")],
                   False, svc),
              case(hung, idle, False, svc)]           # no token and nothing asked: idle, not hung

    [kv] = by_name["VllmKvCacheFull"]
    k = n(kv)
    full = [_series(m.KV_CACHE, {**vllm, "engine": "0"}, f"0.97x{k}"),
            _series(m.KV_CACHE, {**vllm, "engine": "1"}, f"0.2x{k}")]
    tests += [case(kv, [*full, _series(m.WAITING, {**vllm, "engine": "0"}, f"3x{k}"),
                        _series(m.WAITING, {**vllm, "engine": "1"}, f"0x{k}")], True, svc),
              # requests wait, but at the engine with room: not this alert
              case(kv, [*full, _series(m.WAITING, {**vllm, "engine": "0"}, f"0x{k}"),
                        _series(m.WAITING, {**vllm, "engine": "1"}, f"3x{k}")], False, svc)]

    for slo, t in zip(by_name.get("VllmTtftSlo", []), [t for t in targets if t.slo_ttft_p95_s is not None]):
        k, s = n(slo), t.slo_ttft_p95_s or 0.0
        lab = {**vllm, "host": t.host, "service": t.service, "engine": "0"}
        bucket = f"{m.TTFT}_bucket"

        def hist(fast: str, slow: str, lab: dict = lab, s: float = s) -> list[dict]:
            return [_series(bucket, {**lab, "le": f"{s / 2:g}"}, fast),
                    _series(bucket, {**lab, "le": f"{s * 2:g}"}, slow),
                    _series(bucket, {**lab, "le": "+Inf"}, slow)]
        where = {"host": t.host, "service": t.service}
        tests += [case(slo, hist(f"0x{k}", f"0+10x{k}"), True, where),      # every request slower than s/2
                  case(slo, hist(f"0+10x{k}", f"0+10x{k}"), False, where)]  # every one within s/2

    [health] = by_name["VllmHealthRestart"]
    k = n(health)
    op = {**state, "operation": "health-restart", "result": "ok"}
    tests += [case(health, [_series("vllm_orch_operations_total", op, f"0 0 1x{k}")], True, op),
              case(health, [_series("vllm_orch_operations_total", op, f"0x{k}")], False, op)]

    [crash] = by_name["VllmCrashLoop"]
    k = n(crash)
    tests += [case(crash, [_series("vllm_orch_systemd_restarts_total", state, f"0+1x{k}")], True, state),
              case(crash, [_series("vllm_orch_systemd_restarts_total", state, f"2x{k}")], False, state)]

    [sleep] = by_name["VllmSleepingGpuMemoryGrowing"]
    k = n(sleep)
    gpu = [_series("DCGM_FI_DEV_FB_USED", {"job": "dcgm", "instance": "gpu1:9400", "host": host, "gpu": "0"},
                   f"1000+100x{k}"),
           _series("vllm_orch_service_gpu_info", {**state, "gpu": "0"}, f"1x{k}")]
    awake = {**vllm, "engine": "0", "sleep_state": "awake"}
    tests += [case(sleep, [*gpu, _series(m.SLEEP_STATE, awake, f"0x{k}")], True, svc),
              case(sleep, [*gpu, _series(m.SLEEP_STATE, awake, f"1x{k}")], False, svc)]
    # the sleep layout: the sleeper and the awake service of the same GPU (both listed for it); the
    # memory grows with the awake one's work: only the sleeper's alert can fire, and it does
    other = {"host": host, "service": "awake-svc"}
    shared = [*gpu, _series("vllm_orch_service_gpu_info", {**state, **other, "gpu": "0"}, f"1x{k}"),
              _series(m.SLEEP_STATE, awake, f"0x{k}"),
              _series(m.SLEEP_STATE, {**vllm, **other, "instance": "gpu1:8001", "engine": "0",
                                      "sleep_state": "awake"}, f"1x{k}")]
    tests.append(case(sleep, shared, True, svc))
    tests.append(recording_case(timing))
    return {"rule_files": ["vllm-orch.rules.yml"], "evaluation_interval": timing.interval, "tests": tests}


def recording_case(timing: Timing) -> dict:
    """The recording rules over a DP2 service: requests and tokens summed over the engines, KV usage
    their mean and max (0.2 and 0.8 are 0.5 and 0.8, never 1.0), latency quantiles from the
    engines' buckets summed per `le`."""
    i = timing.interval_s
    svc = {"host": "gpu1", "service": "svc"}
    vllm = {"job": "vllm", "instance": "gpu1:8000", **svc, "model_name": "served"}
    k = 12
    series = []
    for engine, kv, waiting, running, tokens in (("0", 0.2, 1, 4, 10), ("1", 0.8, 2, 3, 20)):
        lab = {**vllm, "engine": engine}
        series += [_series(m.KV_CACHE, lab, f"{kv}x{k}"), _series(m.WAITING, lab, f"{waiting}x{k}"),
                   _series(m.RUNNING, lab, f"{running}x{k}"),
                   _series(m.GENERATION_TOKENS, lab, f"0+{tokens * i}x{k}"),
                   _series(m.PROMPT_TOKENS, lab, f"0+{tokens * 10 * i}x{k}")]
        for hist in (m.TTFT, m.TPOT):          # 10 requests/s each: engine 0's within 0.5 s, engine 1's in (0.5, 1]
            fast = f"0+{10 * i}x{k}" if engine == "0" else f"0x{k}"
            series += [_series(f"{hist}_bucket", {**lab, "le": "0.5"}, fast),
                       _series(f"{hist}_bucket", {**lab, "le": "1"}, f"0+{10 * i}x{k}"),
                       _series(f"{hist}_bucket", {**lab, "le": "+Inf"}, f"0+{10 * i}x{k}")]
    expected = {"vllm_orch:kv_cache_usage:mean": 0.5, "vllm_orch:kv_cache_usage:max": 0.8,
                "vllm_orch:requests_waiting": 3, "vllm_orch:requests_running": 7,
                "vllm_orch:generation_tokens:rate": 30, "vllm_orch:prompt_tokens:rate": 300,
                # half the requests within 0.5 s: p50 is that bucket's top; p95 is 90% into (0.5, 1]
                "vllm_orch:ttft_seconds:p50": 0.5, "vllm_orch:ttft_seconds:p95": 0.95,
                "vllm_orch:tpot_seconds:p50": 0.5, "vllm_orch:tpot_seconds:p95": 0.95}
    inner = ", ".join(f"{k}={q(v)}" for k, v in svc.items())
    return {"interval": timing.interval, "input_series": series,
            "promql_expr_test": [{"expr": name, "eval_time": f"{8 * i}s",
                                  "exp_samples": [{"labels": f"{name}{{{inner}}}", "value": value}]}
                                 for name, value in expected.items()]}


# -- Grafana ------------------------------------------------------------------------------------

# (title, unit, [(legend, expression with {sel} for the service's label matchers)]) per service row
SERVICE_PANELS = (
    ("Tokens/s", "short", [("output", "vllm_orch:generation_tokens:rate{sel}"),
                           ("prompt", "vllm_orch:prompt_tokens:rate{sel}")]),
    ("Time to first token", "s", [("p50", "vllm_orch:ttft_seconds:p50{sel}"),
                                  ("p95", "vllm_orch:ttft_seconds:p95{sel}")]),
    ("Time per output token", "s", [("p50", "vllm_orch:tpot_seconds:p50{sel}"),
                                    ("p95", "vllm_orch:tpot_seconds:p95{sel}")]),
    ("KV-cache usage (engines)", "percentunit", [("mean", "vllm_orch:kv_cache_usage:mean{sel}"),
                                                 ("fullest engine", "vllm_orch:kv_cache_usage:max{sel}")]),
    ("Requests", "short", [("running", "vllm_orch:requests_running{sel}"),
                           ("waiting", "vllm_orch:requests_waiting{sel}")]),
    ("Scrape up", "short", [("up", UP[:-1] + ", {inner}}")]),
)
# a gateway's own series (HAProxy 2.6's Prometheus exporter; `service` relabelled from its backend
# svc_NAME by gateway_job): what callers of every model saw through the one endpoint
GATEWAY_SERIES = ("haproxy_backend_http_requests_total", "haproxy_backend_http_responses_total",
                  "haproxy_backend_current_sessions", "haproxy_backend_response_time_average_seconds",
                  "haproxy_frontend_current_sessions")
GATEWAY_PANELS = (
    ("Requests/s by model (gateway)", "reqps",
     [("{{service}}", 'sum by (service) (rate(haproxy_backend_http_requests_total{{inner}, service!=""}[1m]))')]),
    ("5xx answers/s by model (gateway)", "reqps",
     [("{{service}}", 'sum by (service) (rate(haproxy_backend_http_responses_total{{inner}, service!="", '
                      'code="5xx"}[1m]))')]),
    ("In flight by model (gateway)", "short",
     [("{{service}}", 'sum by (service) (haproxy_backend_current_sessions{{inner}, service!=""})')]),
    ("Response time by model (gateway, last 1024)", "s",
     [("{{service}}", 'max by (service) (haproxy_backend_response_time_average_seconds{{inner}, service!=""})')]),
    ("Client connections (gateway)", "short",
     [("connections", 'sum(haproxy_frontend_current_sessions{{inner}, proxy="gateway"})')]),
)
FLEET_PANELS = (
    ("Services up", "short", [("up", f"sum({UP})")]),
    ("Output tokens/s by service", "short", [("{{host}}/{{service}}", "vllm_orch:generation_tokens:rate")]),
    ("Requests waiting by service", "short", [("{{host}}/{{service}}", "vllm_orch:requests_waiting")]),
    ("Deploys, swaps, rollbacks, health restarts (24h)", "short",
     [("{{operation}}", 'sum by (operation) (increase(vllm_orch_operations_total'
                        '{operation=~"deploy|swap|rollback|health-restart"}[24h]))')]),
    ("Swap downtime (total)", "s", [("{{host}}/{{service}}", "vllm_orch_swap_downtime_seconds_total")]),
    ("Services ready", "short", [("{{host}}/{{service}}", "vllm_orch_service_ready")]),
)


def dashboard(targets: list[Target], gateways: Sequence[str] = ()) -> dict:
    """The fleet overview row, a row per host's gateway (`gateways`: the hosts whose metrics are
    scraped), then one row per service, each panel a recorded series or a gateway series."""
    panels: list[dict] = []
    y = 0

    def row(title: str) -> None:
        nonlocal y
        panels.append({"type": "row", "title": title, "collapsed": False, "id": len(panels) + 1,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        y += 1

    def add(specs: tuple, sel: str, inner: str) -> None:
        nonlocal y
        for n, (title, unit, exprs) in enumerate(specs):
            panels.append({
                "type": "timeseries", "title": title, "id": len(panels) + 1,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "gridPos": {"x": (n % 3) * 8, "y": y + (n // 3) * 8, "w": 8, "h": 8},
                "targets": [{"refId": chr(ord("A") + k), "legendFormat": legend,
                             "expr": expr.replace("{sel}", sel).replace("{inner}", inner),
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for k, (legend, expr) in enumerate(exprs)]})
        y += 8 * ((len(specs) + 2) // 3)

    row("Fleet")
    add(FLEET_PANELS, "", "")
    for host in gateways:
        inner = f"job=\"gateway\", host={q(host)}"
        row(f"gateway on {host}")
        add(GATEWAY_PANELS, "{" + inner + "}", inner)
    for t in targets:
        inner = f"host={q(t.host)}, service={q(t.service)}"
        row(f"{t.service} on {t.host} ({t.model}, GPUs {','.join(map(str, t.gpus))})")
        add(SERVICE_PANELS, "{" + inner + "}", inner)
    return {"title": "vllm-orch fleet", "uid": "vllm-orch-fleet", "schemaVersion": 39, "version": 1,
            "editable": True, "tags": ["vllm", "vllm-orch"], "time": {"from": "now-6h", "to": "now"},
            "refresh": "30s",
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "label": "Prometheus"}]},
            "panels": panels}


def panel_expressions(board: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of a dashboard."""
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
