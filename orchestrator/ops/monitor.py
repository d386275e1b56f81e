"""`vllm-orch monitor --out DIR` and `vllm-orch status --prometheus`.

monitor: the services every selected host runs (status's one round trip per host: records, ports,
GPUs, vLLM version, node role), turned into what a Prometheus needs (ops/monitor_rules.py: file_sd
targets, prometheus.yml, rules, their promtool tests, a Grafana dashboard), written under DIR.
No scrape carries a key by default, keyed services' neither: vLLM 0.33 leaves /metrics outside
--api-key's guarded prefixes (vllm/entrypoints/serve/middleware/authenticate.py GUARDED_PREFIX;
/metrics is mounted by entrypoints/serve/instrumentator/metrics.py), and the service's key is a
full-access one that a plain-http scrape would send on every interval. Opt-in, for a proxy that
guards /metrics: `scrape_key_file`, the operator's own scrape credential, referenced as it is (never
copied, never the service's API key: refused), for keyed services only, over https
(`scheme`) unless `key_over_http` forces plain http. No file written holds a key.

status --prometheus: vllm-orch's own state in Prometheus text format (what vLLM's /metrics cannot
say: deploys, swaps and their downtime, rollbacks, health restarts, systemd's restarts, the last
success), from each host's records and history.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import RefusedError
from orchestrator.fmt import hostport
from orchestrator.ops import monitor_rules as rules
from orchestrator.ops.status import HostStatus
from orchestrator.secret import Secret

STATE_HISTORY_TAIL = 100_000        # history lines `status --prometheus` counts (a line per operation)


@dataclass(frozen=True)
class ServiceFacts:
    """What the manifest says about a service's monitoring: keyed, and its TTFT objective."""

    keyed: bool = False
    slo_ttft_p95_s: float | None = None
    bind: str | None = None         # serving.host, the address vLLM listens on (None: manifest unread)


def loopback(address: str | None) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from the host itself only."""
    if address is None:
        return False
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def scrape_address(entry: HostEntry) -> str:
    """The address Prometheus reaches a host at: inventory monitoring.address, else its address."""
    if entry.monitoring.address:
        return entry.monitoring.address
    return "127.0.0.1" if entry.address in ("local", "localhost") else entry.address


def fleet(results: list[HostStatus], entries: dict[str, HostEntry],
          facts_of: Callable[[str], ServiceFacts]) -> tuple[list[rules.Target], list[rules.Exporter]]:
    """The scrape targets of every service status found (workers of a multi-node service have no
    HTTP: their head's /metrics covers the service) and of the exporters the inventory names."""
    targets, exporters = [], []
    for st in results:
        entry = entries[st.host]
        addr = scrape_address(entry)
        for v in st.services:
            if not v.port:
                continue
            f = facts_of(v.model or v.name)
            # a service listening on loopback only (every sleep-capable one) is reached from its own
            # host or not at all: an agent there scrapes it (agent/HOST/), never the fleet's Prometheus
            # at the host's address (refused) or at its own 127.0.0.1 (another machine's port)
            on_host = loopback(f.bind) and not loopback(addr)
            at = ("::1" if ":" in (f.bind or "") else "127.0.0.1") if on_host else addr
            targets.append(rules.Target(
                host=st.host, service=v.name, model=v.model or v.name, served_name=v.served_name or v.name,
                gpus=tuple(v.gpus), node_role="head" if v.node_names else "single",
                vllm_version=st.vllm_version or "unknown", address=hostport(at, v.port),
                keyed=f.keyed, slo_ttft_p95_s=f.slo_ttft_p95_s, on_host=on_host))
        for kind, port in (("node", entry.monitoring.node_exporter_port),
                           ("dcgm", entry.monitoring.dcgm_exporter_port)):
            if port:
                exporters.append(rules.Exporter(st.host, kind, hostport(addr, port)))
        g = st.gateway or {}
        if g.get("metrics_port") and gateway_reachable(g.get("listen") or [], addr):
            exporters.append(rules.Exporter(st.host, "gateway", hostport(addr, g["metrics_port"])))
    return targets, exporters


def gateway_reachable(listen: list[str], addr: str) -> bool:
    """Prometheus at `addr` reaches the gateway's metrics: it listens there, on every address, or
    both are this machine's loopback. A gateway on loopback only of a remote host is not scraped
    (docs/gateway.md: name its LAN address in gateway.listen)."""
    return addr in listen or any(a in ("0.0.0.0", "::") for a in listen) or \
        (loopback(addr) and any(loopback(a) for a in listen))


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Atomically (Prometheus re-reads file_sd files when they change: never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def scrape_credential(path: str, scheme: str, key_over_http: bool, service_key: Secret | None) -> str:
    """The scrape credential file as prometheus.yml references it (absolute); RefusedError (exit 3)
    over plain http unless forced, or when the file holds the service's own API key."""
    ref = str(Path(path).expanduser().resolve())
    if scheme == "http" and not key_over_http:
        raise RefusedError(f"a keyed scrape over plain http would send the credential in {ref} in the clear on "
                           f"every scrape", hint="scrape over TLS (--scheme https), or pass --scrape-key-over-http "
                           "when the path to the targets is private (loopback)")
    try:
        held = Path(ref).read_text(errors="replace").strip()
    except OSError:                 # Prometheus's to read, maybe not ours: nothing to compare
        held = None
    if service_key is not None and held is not None and held == service_key.reveal().strip():
        raise RefusedError(f"{ref} holds the service's own API key (full access to the model, not only "
                           f"/metrics)", hint="give the scrape a credential of its own, e.g. one your proxy "
                           "in front of /metrics accepts; vLLM 0.33 serves /metrics without a key")
    return ref


def write(out: Path, targets: list[rules.Target], exporters: list[rules.Exporter], timing: rules.Timing,
          scrape_key_file: str | None = None, scheme: str = "http", key_over_http: bool = False,
          service_key: Secret | None = None, state_target: str | None = None,
          remote_write: str | None = None) -> list[Path]:
    """Every file under `out`; the paths written. Keyed services are scraped with a credential only
    when `scrape_key_file` is given (scrape_credential's checks first: nothing is written when
    they refuse); `service_key` is only compared with it, never written. A service listening on
    loopback of a host Prometheus reaches over the network is in agent/HOST/ (a Prometheus in agent
    mode on that host, remote-writing to `remote_write`), not in targets/."""
    ref = scrape_credential(scrape_key_file, scheme, key_over_http, service_key) if scrape_key_file else None
    remote = [t for t in targets if not t.on_host]
    keyed = [t for t in remote if t.keyed and ref]
    files = {
        "targets/vllm.json": json.dumps(rules.file_sd([t for t in remote if t not in keyed]), indent=2),
        "targets/vllm-keyed.json": json.dumps(rules.file_sd(keyed), indent=2),
        "targets/node.json": json.dumps(rules.exporter_sd(exporters, "node"), indent=2),
        "targets/dcgm.json": json.dumps(rules.exporter_sd(exporters, "dcgm"), indent=2),
        "targets/gateway.json": json.dumps(rules.exporter_sd(exporters, "gateway"), indent=2),
        "targets/vllm-orch.json": json.dumps([{"targets": [state_target]}] if state_target else [], indent=2),
        "prometheus.yml": yaml.safe_dump(rules.scrape_config(timing, ref, scheme), sort_keys=False),
        "rules/vllm-orch.rules.yml": yaml.safe_dump(rules.rules(targets, timing), sort_keys=False, width=1000),
        "rules/vllm-orch.rules.test.yml": yaml.safe_dump(rules.promtool_tests(targets, timing), sort_keys=False,
                                                         width=1000),
        "grafana/vllm-orch-fleet.json": json.dumps(rules.dashboard(
            targets, sorted({e.host for e in exporters if e.kind == "gateway"})), indent=2),
    }
    for host in sorted({t.host for t in targets if t.on_host}):
        mine = [t for t in targets if t.on_host and t.host == host]
        local_keyed = [t for t in mine if t.keyed and ref]
        files[f"agent/{host}/targets/vllm.json"] = json.dumps(
            rules.file_sd([t for t in mine if t not in local_keyed]), indent=2)
        files[f"agent/{host}/targets/vllm-keyed.json"] = json.dumps(rules.file_sd(local_keyed), indent=2)
        files[f"agent/{host}/prometheus.yml"] = yaml.safe_dump(
            rules.agent_config(timing, ref, scheme, remote_write), sort_keys=False)
    written = []
    for rel, text in files.items():
        _write(out / rel, text + "\n")
        written.append(out / rel)
    return written


# -- vllm-orch's own state ----------------------------------------------------------------------

RESTARTS = ("health-restart", "head-lost-restart")    # written by the watchers: a restart done is "ok"
WATCHERS = (*RESTARTS, "health-busy")                  # not operations that succeed (no last success)


def _result(rec: dict) -> str:
    if rec.get("refused"):
        return "refused"
    return "ok" if rec.get("ok") or rec.get("operation") in RESTARTS else "failed"


def _epoch(at: object) -> float | None:
    try:
        return datetime.fromisoformat(str(at)).timestamp()
    except ValueError:
        return None


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _line(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value:.17g}" if math.isfinite(value) else f"{name}{{{inner}}} NaN"


FAMILIES = {
    "vllm_orch_host_up": ("gauge", "1 when vllm-orch reached the host and read its state."),
    "vllm_orch_service_info": ("gauge", "A service vllm-orch placed on a host (value 1)."),
    "vllm_orch_service_ready": ("gauge", "1 when the service is ready (status's state), else 0."),
    "vllm_orch_service_gpu_info": ("gauge", "A GPU a service takes (value 1; gpu is nvidia-smi's index)."),
    "vllm_orch_systemd_restarts_total": ("counter", "systemd's automatic restarts of the service since its "
                                                    "last start (NRestarts)."),
    "vllm_orch_operations_total": ("counter", "vllm-orch operations on the service, from the host's history, "
                                              "by operation and result (ok, failed, refused)."),
    "vllm_orch_swap_downtime_seconds_total": ("counter", "Seconds the service did not serve during swaps."),
    "vllm_orch_last_success_timestamp_seconds": ("gauge", "When an operation last succeeded on the service "
                                                          "(deploy, swap, rollback, regen, ...)."),
}


def state_metrics(results: list[HostStatus]) -> str:
    """Prometheus text format of every host's state and history (host and service labels)."""
    rows: dict[str, list[str]] = {name: [] for name in FAMILIES}
    for st in results:
        rows["vllm_orch_host_up"].append(_line("vllm_orch_host_up", {"host": st.host}, float(st.reachable)))
        for v in st.services:
            svc = {"host": st.host, "service": v.name}
            rows["vllm_orch_service_info"].append(_line("vllm_orch_service_info", {
                **svc, "model": v.model or v.name, "served_name": v.served_name or ""}, 1))
            rows["vllm_orch_service_ready"].append(_line("vllm_orch_service_ready", svc,
                                                         float(v.state == "ready")))
            for g in v.gpus:
                rows["vllm_orch_service_gpu_info"].append(_line("vllm_orch_service_gpu_info",
                                                                {**svc, "gpu": str(g)}, 1))
            if v.restarts is not None:
                rows["vllm_orch_systemd_restarts_total"].append(
                    _line("vllm_orch_systemd_restarts_total", svc, float(v.restarts)))
        counts: dict[tuple[str, str, str], int] = {}
        downtime: dict[str, float] = {v.name: 0.0 for v in st.services}     # none yet is a figure too
        last: dict[tuple[str, str], float] = {}
        for rec in st.history:
            op, service = rec.get("operation"), rec.get("service") or rec.get("model")
            if not isinstance(op, str) or not isinstance(service, str):
                continue            # gc, bench without a service: not a service's operation
            result = _result(rec)
            counts[(service, op, result)] = counts.get((service, op, result), 0) + 1
            if op == "swap" and isinstance(rec.get("downtime_s"), (int, float)):
                downtime[service] = downtime.get(service, 0.0) + float(rec["downtime_s"])
            when = _epoch(rec.get("at"))
            if result == "ok" and when is not None and op not in WATCHERS:
                last[(service, op)] = max(last.get((service, op), 0.0), when)
        for (service, op, result), c in sorted(counts.items()):
            rows["vllm_orch_operations_total"].append(_line("vllm_orch_operations_total", {
                "host": st.host, "service": service, "operation": op, "result": result}, c))
        for service, s in sorted(downtime.items()):
            rows["vllm_orch_swap_downtime_seconds_total"].append(
                _line("vllm_orch_swap_downtime_seconds_total", {"host": st.host, "service": service}, s))
        for (service, op), t in sorted(last.items()):
            rows["vllm_orch_last_success_timestamp_seconds"].append(_line(
                "vllm_orch_last_success_timestamp_seconds", {"host": st.host, "service": service, "operation": op}, t))
    out = []
    for name, (kind, doc) in FAMILIES.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *rows[name]]
    return "\n".join(out) + "\n"
