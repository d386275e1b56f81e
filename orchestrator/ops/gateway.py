"""`vllm-orch gateway up | down | status` on one host (docs/gateway.md).

up: haproxy found, the client keys (the inventory's gateway.keys_env, from this process's
environment; a later `up` without them keeps the installed ones), the routes from the host's
records, the unit (or start script) and its record written, started, and proved serving: GET
/health through the gateway's own port, and GET /v1/models with a client key. Idempotent: an `up`
of a running gateway re-renders and reloads (its streams go on). down: stopped, its files deleted
(only those it wrote). status: its state, URL, routes and per-model counters from every worker.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import CommandFailed, ConfigError, DeployFailed
from orchestrator.host import cancel, http, state
from orchestrator.host import gateway as hg
from orchestrator.host.base import Host, Script
from orchestrator.host.records import GatewayRecord, HistoryEntry
from orchestrator.ops.session import session
from orchestrator.render import gateway as gw
from orchestrator.secret import Secret

READY_TIMEOUT_S = 30


@dataclass
class GatewayResult:
    host: str
    state: str                                  # serving | stopped | failed | not installed
    urls: list[str] = field(default_factory=list)
    port: int | None = None
    routes: list[dict] = field(default_factory=list)
    metrics_port: int | None = None             # its Prometheus metrics (GET /metrics), None: off
    listen: list[str] = field(default_factory=list)     # the addresses it listens on (the record's)
    counters: dict = field(default_factory=dict)
    runs: str | None = None                     # the unit or start script
    changed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def url(self) -> str | None:
        return self.urls[0] if self.urls else None

    def as_dict(self) -> dict:
        return {"host": self.host, "state": self.state, "url": self.url, "urls": self.urls, "port": self.port,
                "metrics_port": self.metrics_port,
                "routes": self.routes, "counters": self.counters, "runs": self.runs, "changed": self.changed,
                "seconds": round(self.seconds, 3), "error": self.error}


def route_rows(routes: list[gw.Route]) -> list[dict]:
    return [{"service": r.service, "models": list(r.names), "target": r.target, "up": r.up, "held": r.hold and not r.up,
             "key": r.key is not None} for r in routes]


def client_keys(entry: HostEntry, environ=os.environ) -> list[Secret] | None:
    """The keys from gateway.keys_env (None: it is not set; exit 2 when it is set but empty or unsafe)."""
    name = entry.gateway.keys_env
    if name not in environ:
        return None
    keys = gw.parse_client_keys(environ[name])
    if not keys:
        raise ConfigError(f"{name} is set but holds no key", hint=f"{name}=KEY1,KEY2 (each 16 characters or more)")
    try:
        gw.client_keys_file(keys)
    except gw.GatewayInputError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    short = [k for k in keys if len(k.reveal()) < 16]
    if short:
        raise ConfigError(f"{name}: a key has fewer than 16 characters", hint="use e.g. `openssl rand -hex 24`")
    return keys


def probe(host: Host, cfg: gw.GatewayConfig, key: Secret | None = None, timeout: float = READY_TIMEOUT_S) -> None:
    """Until the gateway answers /health (and /v1/models with `key`) on its port, or DeployFailed."""
    address = cfg.listen[0] if cfg.listen[0] not in ("0.0.0.0", "::") else "127.0.0.1"
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            r = http.request(host, cfg.port, "GET", "/health", timeout=5, address=address)
            if r.status == 200:
                if key is None:
                    return
                m = http.request(host, cfg.port, "GET", "/v1/models", api_key=key, timeout=5, address=address)
                if m.status == 200 and isinstance(m.json().get("data"), list):
                    return
                last = f"/v1/models answered {m.status}"
            else:
                last = f"/health answered {r.status}"
        except (http.HttpError, ValueError) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise DeployFailed(f"the gateway does not serve on {address}:{cfg.port} after {timeout:.0f} s: {last}",
                               host=None, step="gateway")
        cancel.sleep(0.3)


def up(entry: HostEntry, *, accept_new_host_key: bool = False, environ=os.environ) -> GatewayResult:
    t0 = time.monotonic()
    keys = client_keys(entry, environ)
    with session(entry, "gateway up", False, accept_new_host_key) as s:
        host = s.host
        haproxy = hg.find_haproxy(host, entry)
        old = hg.read_record(host, entry)
        cfg = hg.config(entry)
        clients = cfg.path("clients.lst")
        if keys is None and host.get(clients) is None:
            raise ConfigError(f"no client keys: set {entry.gateway.keys_env} in the environment of `vllm-orch "
                              f"gateway up` (KEY1,KEY2)", host=entry.name,
                              hint=f"export {entry.gateway.keys_env}=$(openssl rand -hex 24)")
        hg.make_folders(host, entry)
        changed = []
        if keys is not None:
            data = gw.client_keys_file(keys).encode()
            if host.get(clients) != data:
                hg.install_file(host, clients, data, entry.service_user)
                changed.append("clients.lst")
        rec = GatewayRecord(port=cfg.port, listen=list(cfg.listen), haproxy=haproxy, hold_s=cfg.hold_s,
                            drain_s=cfg.drain_s, metrics_port=cfg.metrics_port, installed_at=state.now_iso())
        svc = hg.service(host, entry)
        moved = old is not None and (old.port, old.listen, old.metrics_port) != (rec.port, rec.listen,
                                                                                 rec.metrics_port)
        if cfg.metrics_port == cfg.port:
            raise ConfigError(f"gateway.metrics_port {cfg.port} is its own port: the metrics need a port of their "
                              f"own", host=entry.name, hint="set hosts.NAME.gateway.metrics_port, e.g. 8405")
        try:
            routes = hg.current_routes(host, entry)
            for port, what, hint in ((cfg.port, "the gateway", "set hosts.NAME.gateway.port, or pass --port"),
                                     (cfg.metrics_port, "the gateway's metrics", "set hosts.NAME.gateway.metrics_port")):
                clash = [r.service for r in routes if port and r.port == port]
                if clash:
                    raise ConfigError(f"port {port} is {clash[0]}'s: {what} needs a port of its own",
                                      host=entry.name, hint=hint)
            changed += hg.write_config(host, entry, cfg, routes)
        except gw.GatewayInputError as exc:
            raise ConfigError(f"the gateway: {exc}", host=entry.name) from None
        unit = hg.unit_text(entry, cfg, haproxy).encode()
        path = hg.unit_path(entry)
        unit_changed = host.get(path) != unit
        if unit_changed:
            host.run(["mkdir", "-p", path.rsplit("/", 1)[0]]).check(entry.name, "create folder")
            host.put(path, unit, 0o644 if entry.service_manager == "systemd" else 0o755)
            svc.run_all(svc.reload_commands(), "daemon-reload")
            changed.append(path)
        state.write_json(host, hg.record_path(entry), rec.dump())
        st = svc.state()
        if st.active and (unit_changed or moved):
            svc.run_all(svc.stop_commands(), "stop the gateway")
            st = svc.state()
        if not st.active:
            svc.run_all(svc.start_commands() + svc.enable_commands(), "start the gateway")
            svc.wait_started(timeout=30)
        elif changed:
            hg.ctl(host, entry, "reload", cfg.run_dir, cfg.path("haproxy.cfg"), haproxy)
        try:
            probe(host, cfg, keys[0] if keys else None)
        except DeployFailed as exc:
            tail = " | ".join(svc.tail(5))
            raise DeployFailed(f"{exc.message}" + (f" (its log: {tail})" if tail else ""), host=entry.name,
                               step="gateway", hint=f"vllm-orch gateway status --host {entry.name}") from None
        state.append_history(host, entry, HistoryEntry(operation="gateway-up", ok=True, port=cfg.port,
                                                       routes=[r.service for r in routes],
                                                       seconds=round(time.monotonic() - t0, 3)))
        return GatewayResult(entry.name, "serving", cfg.urls(), cfg.port, route_rows(routes), runs=svc.describe(),
                             changed=changed, seconds=time.monotonic() - t0, metrics_port=cfg.metrics_port)


def down(entry: HostEntry, *, accept_new_host_key: bool = False) -> GatewayResult:
    t0 = time.monotonic()
    with session(entry, "gateway down", False, accept_new_host_key) as s:
        host = s.host
        rec = hg.read_record(host, entry)
        svc = hg.service(host, entry)
        st = svc.state()
        if rec is None and not st.active:
            return GatewayResult(entry.name, "not installed", seconds=time.monotonic() - t0)
        svc.run_all(svc.stop_commands() + svc.disable_commands(), "stop the gateway")
        cfg = hg.config(entry, rec)
        files = [cfg.path(n) for n in gw.FILES] + [hg.record_path(entry), hg.unit_path(entry)]
        host.run(["rm", "-f", *files]).check(entry.name, "delete the gateway's files")
        q = shlex.quote
        # the release files (hold.lua) are in a folder of its own, made by `up`: its svc_* files only
        host.run(Script(f"find {q(cfg.release_dir)} -maxdepth 1 -type f -name 'svc_*' -delete 2>/dev/null; "
                        f"rmdir {q(cfg.release_dir)} {q(cfg.run_dir)} {q(cfg.folder)} 2>/dev/null; true"))
        svc.run_all(svc.reload_commands(), "daemon-reload")
        state.append_history(host, entry, HistoryEntry(operation="gateway-down", ok=True,
                                                       seconds=round(time.monotonic() - t0, 3)))
        return GatewayResult(entry.name, "stopped", port=cfg.port, runs=svc.describe(), seconds=time.monotonic() - t0)


def status_of(host: Host, entry: HostEntry, rec: GatewayRecord | None = None) -> GatewayResult:
    """The gateway's state on an open host (also status's gateway line: `rec` the record it read)."""
    rec = rec or hg.read_record(host, entry)
    svc = hg.service(host, entry)
    st = svc.state()
    if rec is None:
        return GatewayResult(entry.name, "serving" if st.active else "not installed", runs=svc.describe())
    cfg = hg.config(entry, rec)
    res = GatewayResult(entry.name, "serving" if st.active else ("failed" if st.failed else "stopped"),
                        cfg.urls(), cfg.port, runs=svc.describe(), metrics_port=cfg.metrics_port,
                        listen=list(cfg.listen))
    try:
        res.routes = route_rows(hg.current_routes(host, entry))
    except gw.GatewayInputError as exc:
        res.error = str(exc)
    if st.active:
        try:
            answer = hg.state_of(host, entry, rec)
            res.counters = {"workers": len(answer.get("workers", [])), "backends": answer.get("backends", {})}
        except CommandFailed as exc:
            res.error = exc.message
    return res


def summary(res: GatewayResult) -> dict:
    """`status`'s gateway line: its state and URL, the models it routes, and its counters summed."""
    backends = {k: v for k, v in (res.counters.get("backends") or {}).items() if k.startswith("svc_")}
    loads = [hg.load_of(b) for b in backends.values()]
    return {"state": res.state, "url": res.url, "runs": res.runs, "error": res.error, "port": res.port,
            "metrics_port": res.metrics_port, "listen": res.listen,
            "models": [n for r in res.routes for n in r["models"]],
            "held": [r["service"] for r in res.routes if r["held"]],
            "requests": sum(b.get("requests", 0) for b in backends.values()),
            "errors_5xx": sum(b.get("errors_5xx", 0) for b in backends.values()),
            "in_flight": sum(inflight for inflight, _ in loads), "waiting": sum(waiting for _, waiting in loads)}


def status(entry: HostEntry, *, accept_new_host_key: bool = False) -> GatewayResult:
    from orchestrator.host.connect import open_host

    with open_host(entry, accept_new_host_key) as host:
        return status_of(host, entry)
