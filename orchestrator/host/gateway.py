"""The gateway on a host: its files, its service, its routes kept in step with the host's records.

The configuration comes from render/gateway.py; this module reads what it needs from the host
(service records, installed records, each service's key from its 0600 env file), writes the files
for the service user (0600 from their first byte), and drives HAProxy's master CLI through
host/remote/gateway_ctl.py (reload, drain). The gateway is a service like the models' (unit
`vllm-orch-gateway.service`, or a start script with a proven process-group record on a `process`
host: host/services.py), named NAME.

Routes: every service with a record (it was proved serving; a sleeping one is listed but answers
503 + Retry-After until it wakes), plus what the running operation says: `up` (a service it is
starting: requests wait for its port, up to hold_s), `down` (a service it drains or stops: new
requests get 503 + Retry-After), `held` (a service it restarts in place); a service in `up` that
still sleeps (it is being woken), and one in `held`, hold their requests at the gateway until
`release` lets them through, once its canary or its readiness gates passed. A service of
an on-demand wake group (inventory gateway.wake_groups) that sleeps or drains is held too: its
requests wait while the waker (ops/waker.py) wakes it.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection
from dataclasses import replace

from orchestrator import __version__
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import RESERVED_SERVICE
from orchestrator.errors import CommandFailed, ConfigError, RefusedError
from orchestrator.host import scripts, state
from orchestrator.host.base import Host, Script
from orchestrator.host.records import GatewayRecord, InstalledRecord, ServiceRecord
from orchestrator.host.services import Service
from orchestrator.render import gateway as gw
from orchestrator.render.artifacts import _template, read_env_values
from orchestrator.secret import Secret

NAME = RESERVED_SERVICE               # unit vllm-orch-gateway.service; process: vllm-orch-gateway.sh
UNIT = f"vllm-{NAME}.service"


def folder(entry: HostEntry) -> str:
    return f"{entry.state_dir}/gateway"


def record_path(entry: HostEntry) -> str:
    return f"{folder(entry)}/gateway.json"


def config(entry: HostEntry, rec: GatewayRecord | None = None) -> gw.GatewayConfig:
    """Where the gateway listens and keeps its files: the record's (what is installed) or the inventory's."""
    s = entry.gateway
    port, listen = (rec.port, tuple(rec.listen)) if rec else (s.port, tuple(s.listen))
    run_dir = s.run_dir.rstrip("/") or f"{folder(entry)}/run"
    if len(f"{run_dir}/master.sock".encode()) > 107:
        raise ConfigError(f"the gateway's sockets would be {run_dir}/master.sock, longer than a Unix socket's "
                          f"107 bytes", host=entry.name, hint=f"set hosts.{entry.name}.gateway.run_dir to a shorter "
                                                              f"folder (e.g. /run/vllm-orch-gateway)")
    return gw.GatewayConfig(folder=folder(entry), run_dir=run_dir, port=port, listen=listen,
                            hold_s=rec.hold_s if rec else s.hold_seconds,
                            drain_s=rec.drain_s if rec else s.drain_seconds, host=entry.name,
                            metrics_port=rec.metrics_port if rec else s.metrics_port)


def read_record(host: Host, entry: HostEntry) -> GatewayRecord | None:
    return GatewayRecord.read(state.read_json(host, record_path(entry)))


def service(host: Host | None, entry: HostEntry) -> Service:
    return Service.for_host(host, entry, NAME)


def key_of(host: Host, inst: InstalledRecord | None) -> Secret | None:
    """The service's own VLLM_API_KEY, from its installed 0600 env file (None: it has none)."""
    if inst is None or not inst.env_file:
        return None
    data = host.get(inst.env_file)
    if data is None:
        return None
    value = read_env_values(data.decode(errors="replace")).get("VLLM_API_KEY")
    return Secret(value) if value else None


def route_of(host: Host, name: str, rec: ServiceRecord | None, inst: InstalledRecord | None,
             up: bool = True) -> gw.Route | None:
    """The route of service NAME from its records (None: nothing says where it listens)."""
    port = (inst.port if inst and inst.port else 0) or (rec.port if rec else 0)
    if not port or (rec is not None and rec.multinode and rec.rank not in (0, None)):
        return None
    served = (inst.served_name if inst else None) or (rec.served_name if rec else None) or name
    address = (inst.address if inst else None) or "127.0.0.1"
    asleep = rec is not None and rec.asleep is not None
    return gw.Route(service=name, names=(served,), port=port, address=address, key=key_of(host, inst),
                    up=up and not asleep)


def recorded_route(host: Host, entry: HostEntry, name: str) -> gw.Route | None:
    """Service NAME's route by its own records (None: nothing says where it listens)."""
    return route_of(host, name, state.read_record(host, entry, name), state.read_installed(host, entry, name))


def names_of(host: Host, entry: HostEntry, name: str) -> set[str]:
    """The model names service NAME serves, by its records (empty: none recorded)."""
    r = recorded_route(host, entry, name)
    return set(r.names) if r is not None else set()


def current_routes(host: Host, entry: HostEntry, up: Collection[str] = (), down: Collection[str] = (),
                   held: Collection[str] = ()) -> list[gw.Route]:
    """The routes now: every recorded service and `up`; those in `down` answer 503 + Retry-After;
    those in `held` (restarting), one in `up` that sleeps (waking now), and a wake group's that is
    not up hold their requests."""
    records = state.read_records(host, entry)
    routes = []
    for name in sorted(set(records) | set(up) | set(held)):
        r = route_of(host, name, records.get(name), state.read_installed(host, entry, name),
                     up=name not in down and name not in held)
        if r is not None:
            waking = name in up and name not in down
            grouped = entry.gateway.group_of(name) is not None
            routes.append(replace(r, hold=not r.up and (waking or grouped or name in held)))
    return gw.one_per_name(routes)


def install_file(host: Host, path: str, data: bytes, user: str, mode: int = 0o600) -> None:
    """Write PATH atomically for USER: the host's one atomic write (Host.put_command: a mktemp file,
    0600 from its first byte, in root's folder), given to the user before it is moved in place."""
    host.run(host.put_command(path, mode, owner=user), input=data).check(host.name, f"write {path}")


def make_folders(host: Host, entry: HostEntry) -> None:
    """state_dir/gateway (root's, 0755: the files in it are the user's own, 0600) and its run
    folder (the user's, 0700: the sockets)."""
    q = shlex.quote
    f, run, awake = folder(entry), config(entry).run_dir, config(entry).release_dir
    u = q(entry.service_user)
    host.run(Script(f"mkdir -p {q(f)} {q(run)} {q(awake)} && chmod 0755 {q(f)} && chmod 0700 {q(run)} {q(awake)} && "
                    f"{{ [ \"$(id -u)\" != 0 ] || chown -h {u} {q(run)} {q(awake)}; }}")).check(entry.name,
                                                                                         "gateway folders")


def write_config(host: Host, entry: HostEntry, cfg: gw.GatewayConfig, routes: list[gw.Route]) -> list[str]:
    """Write the files that differ from what is there; the names of those written."""
    files = gw.render(cfg, routes, __version__)
    changed = []
    for name, text in files.items():
        path = cfg.path(name)
        data = text.encode()
        if host.get(path) != data:
            install_file(host, path, data, entry.service_user)
            changed.append(name)
    return changed


def ctl(host: Host, entry: HostEntry, *args: str, timeout: float = 60) -> dict:
    """gateway_ctl.py's answer; CommandFailed when it has none or says it failed."""
    answer, result = scripts.run_json(host, entry.python, "gateway_ctl.py", list(args), timeout=timeout)
    if answer is None or not answer.get("ok"):
        why = (answer or {}).get("error") or (result.stderr or result.stdout).strip()[-300:] or f"exit {result.exit_code}"
        raise CommandFailed(f"the gateway: {why}", host=entry.name)
    return answer


def sync(host: Host, entry: HostEntry, rec: GatewayRecord, up: Collection[str] = (),
         down: Collection[str] = (), held: Collection[str] = ()) -> tuple[list[gw.Route], bool]:
    """Render the routes now (with `up`, `down` and `held`), write what changed, reload when it did."""
    cfg = config(entry, rec)
    routes = current_routes(host, entry, up, down, held)
    hold(host, cfg, routes)
    try:
        changed = write_config(host, entry, cfg, routes)
    except gw.GatewayInputError as exc:
        raise RefusedError(f"the gateway: {exc}", host=entry.name, step="gateway") from None
    if changed and service(host, entry).state().active:
        ctl(host, entry, "reload", cfg.run_dir, cfg.path("haproxy.cfg"), rec.haproxy)
    return routes, bool(changed)


def release(host: Host, entry: HostEntry, rec: GatewayRecord, name: str) -> None:
    """The requests held for NAME go on: its release file (render/gateway.py hold.lua), which every
    HAProxy worker reads, an old one still holding requests after a reload included."""
    make_folders(host, entry)          # the release folder: a gateway `up` installed before it had none
    install_file(host, f"{config(entry, rec).release_dir}/svc_{name}", b"released\n", entry.service_user)


def hold(host: Host, cfg: gw.GatewayConfig, routes: list[gw.Route]) -> None:
    """The held routes' release files are gone before a worker holds their requests."""
    held = [f"{cfg.release_dir}/{r.backend}" for r in routes if r.hold and not r.up]
    if held:
        host.run(Script("rm -f -- " + " ".join(shlex.quote(p) for p in held))).check(host.name, "gateway hold")


def state_of(host: Host, entry: HostEntry, rec: GatewayRecord) -> dict:
    """gateway_ctl.py state: the workers, and per backend its counters summed over them."""
    return ctl(host, entry, "state", config(entry, rec).run_dir, timeout=30)


def load_of(counters: dict) -> tuple[int, int]:
    """(in flight, waiting) of a backend's counters (state_of): in flight at its server (queued there
    included), and the rest of the requests now routed to it (the demand table's conn_cur): held at
    the gateway. The one rule the waker, `gateway status` and `status` count with."""
    try:
        inflight = int(counters.get("inflight", 0)) + int(counters.get("queued", 0))
        return inflight, max(int(counters.get("active", 0)) - inflight, 0)
    except (TypeError, ValueError):
        return 0, 0


def drain(host: Host, entry: HostEntry, rec: GatewayRecord, name: str, up: Collection[str] = (),
          down: Collection[str] = (), held: Collection[str] = ()) -> str:
    """New requests for NAME get 503 + Retry-After (or, NAME in `held`, wait at the gateway); wait
    (up to drain_s) until none is in flight at its server."""
    cfg = config(entry, rec)
    sync(host, entry, rec, up, set(down) | ({name} - set(held)), held)
    if not service(host, entry).state().active:
        return "the gateway does not run"
    # its requests in flight are counted under its backend in every worker, an old one's included
    # (a name another service takes over is no longer routed to it, its streams go on); where nothing
    # listens on its port, they only wait for one (its start failed, or it died): not waited for
    r = recorded_route(host, entry, name)
    answer = ctl(host, entry, "idle", cfg.run_dir, f"svc_{name}", str(cfg.drain_s), *([r.target] if r else []),
                 timeout=cfg.drain_s + 60)
    left, waited = answer.get("left", 0), answer.get("waited_s", 0)
    if left and answer.get("closed"):
        return (f"{left} request(s) of {name} wait for {r.target if r else 'its port'}, where nothing listens: not "
                f"waited for (they keep waiting for a service on that port, up to the hold bound of {cfg.hold_s} s, "
                f"then 503 + Retry-After)")
    if left:
        return f"{left} request(s) of {name} still in flight after {waited:.1f} s (drain bound {cfg.drain_s} s)"
    return f"no request of {name} in flight (waited {waited:.1f} s)"


def unit_text(entry: HostEntry, cfg: gw.GatewayConfig, haproxy: str) -> str:
    template = "vllm-orch-gateway.service.j2" if entry.service_manager == "systemd" else "vllm-orch-gateway.sh.j2"
    return _template(template).render(version=__version__, host=entry, port=cfg.port, haproxy=haproxy,
                                      cfg=cfg.path("haproxy.cfg"), master_socket=cfg.master_socket,
                                      run_dir=cfg.run_dir)


def unit_path(entry: HostEntry) -> str:
    return service(None, entry).describe() if entry.service_manager != "systemd" else f"{entry.units_dir}/{UNIT}"


def find_haproxy(host: Host, entry: HostEntry) -> str:
    r = host.run(Script("command -v haproxy || { [ -x /usr/sbin/haproxy ] && echo /usr/sbin/haproxy; }"))
    path = r.stdout.strip().splitlines()[-1] if r.ok and r.stdout.strip() else ""
    if not path.startswith("/"):
        raise RefusedError(f"{entry.name} has no haproxy", host=entry.name, step="gateway",
                           hint="install it (Debian/Ubuntu: apt-get install haproxy; 2.6 or newer), then run "
                                "`vllm-orch gateway up` again")
    return path
