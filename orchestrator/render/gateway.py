"""The gateway's HAProxy configuration, rendered from a host's routes (pure: no I/O).

One port routes every OpenAI request by the `model` its JSON body names to the service that serves
that name, on whatever port and address the service listens (a sleep-capable service's loopback
port included). Chosen after measuring (docs/design.md "The gateway's proxy"): HAProxy parses the
body as JSON (`req.body,json_query('$.model')`), answers in OpenAI's shapes without a backend,
holds a request while its service's port is not open yet (`retry-on conn-failure`), and its
master process reloads a new configuration while the old one's connections finish.

What the files hold, each written 0600 for the service user (host/gateway.py writes them):

  haproxy.cfg    the configuration: no model name and no key in it, only the services' ports
  routes.map     served name -> backend (HAProxy's map file: one exact name per line)
  keys.map       backend -> "Bearer KEY", the service's own key (vLLM's --api-key)
  clients.lst    "Bearer KEY" per line: the keys clients must send (inventory gateway.keys_env)
  models.json    GET /v1/models: every model behind the gateway, awake or asleep
  503.http       the answer past the hold bound, with Retry-After
  hold.lua       holds a request for a model that wakes until its release file run_dir/awake/BACKEND
                 exists (written once its canary matched), up to hold_s

Per model, a stick table (`gw_demand`, keyed by backend) counts the requests routed to it and those
waiting or in flight now (conn_cur): what the on-demand waker (ops/waker.py) and `gateway status` read.

Only POST /v1/... with a routable model, GET /v1/models and GET /health pass; the client's
Authorization header never reaches a service (each backend sets the service's own key), and vLLM's
development-mode paths (/sleep, /wake_up, /collective_rpc...) are 404 at the gateway.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from orchestrator.fmt import hostport
from orchestrator.secret import Secret, reveal

# The largest request body the gateway parses to find `model`: HAProxy reads a buffered body from
# one buffer (tune.bufsize), so a bigger one gets 413 instead of being forwarded unrouted.
BODY_LIMIT = 1 << 20
BUFSIZE = BODY_LIMIT + (64 << 10)        # the buffer also holds the request line and headers
# What a 503 tells a client to wait: a drain or a stop lasts seconds, and the OpenAI clients honour it
# (they retry a 503 twice by default); past the hold bound, a long load answers it again each time.
RETRY_AFTER_S = 2
CONNECT_TIMEOUT_S = 1                    # a refused connection is retried about once per second
# What a key may hold to sit in a map file and a header: printable ASCII without spaces.
KEY_TEXT = re.compile(r"^[\x21-\x7e]{1,512}$")
# A served name as the manifests allow it (config/manifest.Serving._served).
NAME_TEXT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")

FILES = ("haproxy.cfg", "routes.map", "keys.map", "clients.lst", "models.json", "503.http", "hold.lua")
DEMAND_TABLE = "gw_demand"
HOLD_POLL_MS = 25                        # how soon a held request sees its server enabled

# HAProxy's Lua (built in Debian's haproxy: USE_LUA): the held request yields (core.msleep) until
# the service's release file exists (run_dir/awake/BACKEND, written once its canary matched), so the
# wait costs no thread. A file, not a runtime state: every worker sees it, an old one that still
# holds requests after a reload included (its proxies no longer take runtime commands). Past the
# bound the request gets 503 + Retry-After.
HOLD_LUA = f"""-- Managed by vllm-orch: hold a request while the model it names wakes (docs/gateway.md).
core.register_action("vllm_orch_hold", {{"http-req"}}, function(txn, bound_ms, folder)
  local name = txn:get_var("txn.backend")
  if name == nil then return end
  local path, waited, bound = folder .. "/" .. name, 0, tonumber(bound_ms) or 0
  while true do
    local f = io.open(path, "r")
    if f ~= nil then f:close(); txn:set_var("txn.held_ms", waited); return end
    if waited >= bound then break end
    core.msleep({HOLD_POLL_MS})
    waited = waited + {HOLD_POLL_MS}
  end
  txn:set_var("txn.held_out", 1)
end, 2)
"""


def _error(status: int, kind: str, message: str, param: str | None = None) -> str:
    """OpenAI's error shape (what vLLM answers too), as one line of JSON."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return json.dumps(body, separators=(",", ":"))


NOT_FOUND_MODEL = _error(404, "NotFoundError", "The model does not exist at this gateway (GET /v1/models lists "
                                               "the models it serves).", "model")
NO_MODEL = _error(400, "BadRequestError", "The request body must be a JSON object with a string `model` "
                                          "(at most 1 MiB).", "model")
TOO_LARGE = _error(413, "BadRequestError", "The request body is larger than the gateway parses (1 MiB).")
UNAUTHORIZED = _error(401, "AuthenticationError", "Unauthorized: send a key of the gateway as Authorization: Bearer KEY.")
NOT_FOUND_PATH = _error(404, "NotFoundError", "Not Found: the gateway serves /v1/ and /health only.")
UNAVAILABLE = _error(503, "ServiceUnavailableError", "The model is starting, waking or stopping: retry after the "
                                                     "time Retry-After gives.")


@dataclass(frozen=True)
class Route:
    """One service behind the gateway: the names clients send, where it listens, its own key."""

    service: str
    names: tuple[str, ...]
    port: int
    address: str = "127.0.0.1"
    key: Secret | None = None
    up: bool = True             # False: draining or stopping, every new request gets 503 + Retry-After
    hold: bool = False          # (not up) new requests wait at the gateway until the service's release
                                # file exists (it woke), up to hold_s, then 503 + Retry-After

    @property
    def backend(self) -> str:
        return f"svc_{self.service}"

    @property
    def target(self) -> str:
        """Where the gateway connects: a wildcard bind is reached on loopback."""
        a = self.address
        if a in ("0.0.0.0", "::", ""):
            return f"127.0.0.1:{self.port}"
        return hostport(a, self.port)


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens and keeps its files, and how long it holds and drains."""

    folder: str                  # its files (state_dir/gateway)
    run_dir: str                 # its sockets (the service user's)
    port: int
    listen: tuple[str, ...] = ("127.0.0.1",)
    hold_s: int = 30
    drain_s: int = 60
    host: str = ""               # the inventory host, for the header line
    metrics_port: int | None = None      # HAProxy's Prometheus exporter on a port of its own (None: off)

    @property
    def release_dir(self) -> str:
        """A file per backend whose held requests may go on (hold.lua)."""
        return f"{self.run_dir}/awake"

    @property
    def admin_socket(self) -> str:
        return f"{self.run_dir}/admin.sock"

    @property
    def master_socket(self) -> str:
        return f"{self.run_dir}/master.sock"

    def path(self, name: str) -> str:
        return f"{self.folder}/{name}"

    def urls(self) -> list[str]:
        return [f"http://{hostport(a, self.port)}/v1" for a in self.listen]


class GatewayInputError(ValueError):
    """A route or key the gateway cannot carry (said in one line)."""


def one_per_name(routes: list[Route]) -> list[Route]:
    """Where services going down and one coming up serve one name (a swap between two manifests of
    one served name), the name goes to the one coming up: one that serves, else one whose requests
    wait for it (starting or waking); a route that answers 503 (stopping, asleep) yields to either.
    What stays ambiguous, check_routes refuses."""
    live = {n for r in routes if r.up for n in r.names}
    waiting = {n for r in routes if r.hold and not r.up for n in r.names}
    return [r for r in routes
            if r.up or not set(r.names) & (live if r.hold else live | waiting)]


def check_routes(routes: list[Route]) -> None:
    """Refuse what would break the files: an unsafe name or key, one name served twice."""
    owner: dict[str, str] = {}
    for r in routes:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", r.service):
            raise GatewayInputError(f"{r.service!r} is not a service name")
        for n in r.names:
            if not NAME_TEXT.match(n):
                raise GatewayInputError(f"{r.service}: served name {n!r} has characters the gateway cannot route")
            if n in owner and owner[n] != r.service:
                raise GatewayInputError(f"{owner[n]} and {r.service} both serve the model name {n!r}: the gateway "
                                        f"cannot tell which a request means")
            owner[n] = r.service
        if r.key is not None and not KEY_TEXT.match(reveal(r.key)):
            raise GatewayInputError(f"{r.service}: its API key has spaces or control characters, which no "
                                    f"Authorization header carries")


def client_keys_file(keys: list[Secret]) -> str:
    """clients.lst: one `Bearer KEY` per line (HAProxy's pattern file, matched exactly)."""
    for k in keys:
        if not KEY_TEXT.match(reveal(k)):
            raise GatewayInputError("a gateway key has spaces, commas or control characters")
    return "".join(f"Bearer {reveal(k)}\n" for k in keys)


def parse_client_keys(text: str) -> list[Secret]:
    """The keys of the inventory's gateway.keys_env variable: separated by commas (blanks around ignored)."""
    return [Secret(k.strip()) for k in text.split(",") if k.strip()]


def render(cfg: GatewayConfig, routes: list[Route], version: str = "") -> dict[str, str]:
    """Every file but clients.lst (written once by `gateway up`), by name."""
    check_routes(routes)
    p = cfg.path
    q = _quote
    lines = [
        f"# Managed by vllm-orch {version}: the gateway of {cfg.host or 'this host'} (docs/gateway.md).",
        "# Rendered from the host's service records: re-rendered by every operation, do not edit.",
        "global",
        "  maxconn 4096",
        f"  tune.bufsize {BUFSIZE}",
        f"  stats socket {cfg.admin_socket} mode 600 level admin expose-fd listeners",
        # an old process after a reload ends once its streams do, or after the drain bound
        f"  hard-stop-after {max(cfg.drain_s, 10) + 30}s",
        "  log stderr format short local0 notice",
        f"  lua-load {p('hold.lua')}",
        "defaults",
        "  mode http",
        "  log global",
        f"  timeout connect {CONNECT_TIMEOUT_S}s",
        "  timeout client 600s",
        "  timeout server 600s",
        "  timeout http-request 60s",
        "  timeout http-keep-alive 60s",
        "  option http-buffer-request",
        "  option http-no-delay",          # else the first SSE chunk waited ~200 ms (measured)
        # a port not open yet (the service starting) is retried about once a second, hold_s times
        f"  retries {max(cfg.hold_s, 1)}",
        "  retry-on conn-failure empty-response",
        f"  errorfile 503 {p('503.http')}",
    ]
    if cfg.metrics_port:        # its own counters for Prometheus: no key, no route to a service
        lines += ["frontend metrics", "  no log"]
        lines += [f"  bind {hostport(a, cfg.metrics_port)}" for a in cfg.listen]
        lines += ["  http-request use-service prometheus-exporter if { path /metrics } { method GET }",
                  f"  http-request return status 404 content-type application/json string {q(NOT_FOUND_PATH)}"]
    lines += ["frontend gateway"]
    lines += [f"  bind {hostport(a, cfg.port)}" for a in cfg.listen]
    lines += [
        f"  http-request return status 200 content-type application/json string {q('{}')} "
        "if { path /health } { method GET HEAD }",
        f"  http-request return status 404 content-type application/json string {q(NOT_FOUND_PATH)} "
        "unless { path_beg /v1/ }",
        f"  http-request return status 401 content-type application/json string {q(UNAUTHORIZED)} "
        f"hdr WWW-Authenticate Bearer unless {{ req.hdr(authorization) -m str -f {p('clients.lst')} }}",
        f"  http-request return status 200 content-type application/json file {p('models.json')} "
        "if { path /v1/models } { method GET HEAD }",
        f"  http-request return status 413 content-type application/json string {q(TOO_LARGE)} "
        f"if {{ req.hdr_val(content-length) gt {BODY_LIMIT} }}",
        "  http-request set-var(txn.model) req.body,json_query('$.model') if { method POST }",
        f"  http-request return status 400 content-type application/json string {q(NO_MODEL)} "
        "unless { var(txn.model) -m found }",
        f"  http-request set-var(txn.backend) var(txn.model),map({p('routes.map')})",
        f"  http-request return status 404 content-type application/json string {q(NOT_FOUND_MODEL)} "
        "unless { var(txn.backend) -m found }",
        # the client's key is the gateway's: it never reaches a service
        "  http-request del-header authorization",
        f"  http-request track-sc0 var(txn.backend) table {DEMAND_TABLE}",
    ]
    held = [r.backend for r in routes if r.hold and not r.up]
    if held:
        lines += [f"  http-request lua.vllm_orch_hold {max(cfg.hold_s, 0) * 1000} {cfg.release_dir} "
                  f"if {{ var(txn.backend) -m str {' '.join(held)} }}",
                  f"  http-request return status 503 content-type application/json string {q(UNAVAILABLE)} "
                  f"hdr Retry-After {RETRY_AFTER_S} if {{ var(txn.held_out) -m found }}"]
    lines += [
        "  use_backend %[var(txn.backend)]",
        f"backend {DEMAND_TABLE}",
        "  stick-table type string len 80 size 1k expire 24h store conn_cur,http_req_cnt",
    ]
    for r in routes:
        lines += [
            f"backend {r.backend}",
            f"  http-request set-header authorization %[str({r.backend}),map({p('keys.map')})] "
            f"if {{ str({r.backend}),map({p('keys.map')}) -m found }}",
            f"  server s1 {r.target}" + ("" if r.up or r.hold else " disabled"),
        ]
    models = {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "vllm", "root": n,
                                          "service": r.service} for r in routes for n in r.names]}
    retry = RETRY_AFTER_S
    body = UNAVAILABLE
    return {
        "haproxy.cfg": "\n".join(lines) + "\n",
        "routes.map": "".join(f"{n} {r.backend}\n" for r in routes for n in r.names),
        "keys.map": "".join(f"{r.backend} Bearer {reveal(r.key)}\n" for r in routes if r.key is not None),
        "models.json": json.dumps(models, indent=1) + "\n",
        "hold.lua": HOLD_LUA,
        "503.http": (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     f"Retry-After: {retry}\r\nCache-Control: no-cache\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n{body}"),
    }


def _quote(text: str) -> str:
    """A string argument as HAProxy reads it: in single quotes, nothing inside is interpreted."""
    if "'" in text:
        raise GatewayInputError("a gateway message holds a quote")
    return f"'{text}'"


def plan_lines(routes: list[Route]) -> list[str]:
    """What a plan shows of the routes (no key): `kimi-k25-int4 -> 127.0.0.1:8000 (kimi-k25-int4)`."""
    return [f"{', '.join(r.names)} -> {r.target} ({r.service}{_state(r)})" for r in routes]


def _state(r: Route) -> str:
    return "" if r.up else ", held until it serves" if r.hold else ", 503 + Retry-After"
