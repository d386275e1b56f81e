"""The gateway's HAProxy files (render/gateway.py), checked by the real `haproxy -c`, and its steps in
a plan (plan/gateway.py): where they go, and the recovery branches' step numbers after them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.host.records import GatewayRecord
from orchestrator.plan.gateway import with_gateway
from orchestrator.plan.model import Action, Plan
from orchestrator.render import gateway as gw
from orchestrator.secret import Secret

ROUTES = [gw.Route("kimi-k25-int4", ("kimi-k2.5",), 8000, "0.0.0.0", Secret("svc-key-1")),
          gw.Route("minimax-m25", ("minimax-m2.5",), 8001, "127.0.0.1", None, up=False)]


def write(tmp_path: Path, routes=ROUTES) -> Path:
    cfg = gw.GatewayConfig(str(tmp_path), str(tmp_path / "run"), 18090, ("127.0.0.1", "::1"), hold_s=5, host="gpu1")
    (tmp_path / "run").mkdir(exist_ok=True)
    files = gw.render(cfg, routes, "test")
    files["clients.lst"] = gw.client_keys_file([Secret("client-key-0123456789")])
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path / "haproxy.cfg"


def test_the_rendered_configuration_is_valid_for_the_real_haproxy(tmp_path):
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    assert Path(haproxy).exists(), "the suite needs haproxy (./dev installs it)"
    cfg = write(tmp_path)
    r = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    text = cfg.read_text()
    assert "svc-key-1" not in text and "kimi-k2.5" not in text      # names and keys live in the map files
    assert "server s1 127.0.0.1:8000\n" in text                      # a wildcard bind is reached on loopback
    assert "server s1 127.0.0.1:8001 disabled" in text
    assert "bind [::1]:18090" in text
    assert (tmp_path / "routes.map").read_text() == "kimi-k2.5 svc_kimi-k25-int4\nminimax-m2.5 svc_minimax-m25\n"
    assert (tmp_path / "keys.map").read_text() == "svc_kimi-k25-int4 Bearer svc-key-1\n"
    assert b"Retry-After: 2\r\n" in (tmp_path / "503.http").read_bytes()


@pytest.mark.parametrize("routes, why", [
    ([gw.Route("a", ("same",), 1), gw.Route("b", ("same",), 2)], "both serve the model name 'same'"),
    ([gw.Route("a", ("x y",), 1)], "cannot route"),
    ([gw.Route("a", ("x",), 1, key=Secret("has space"))], "spaces or control characters"),
    ([gw.Route("A_b", ("x",), 1)], "not a service name"),
])
def test_routes_that_would_break_the_files_are_refused(routes, why):
    with pytest.raises(gw.GatewayInputError, match=why):
        gw.render(gw.GatewayConfig("/f", "/f/run", 1), routes)


def test_a_name_two_services_serve_in_a_swap_goes_to_the_one_coming_up():
    """Two manifests of one served name: the one that serves takes it, else the one waking or starting
    (held); the one stopping or asleep (503) yields. A sleep swap back to a model asleep has neither
    up: the waking one's route is kept, the other's dropped (both kept, check_routes refused them)."""
    serving, stopping = gw.Route("a", ("m",), 1), gw.Route("b", ("m",), 2, up=False)
    waking, asleep = gw.Route("b", ("m",), 2, up=False, hold=True), gw.Route("a", ("m",), 1, up=False)
    other = gw.Route("c", ("n",), 3, up=False)
    assert gw.one_per_name([serving, stopping, other]) == [serving, other]
    assert gw.one_per_name([serving, waking]) == [serving]
    assert gw.one_per_name([asleep, waking, other]) == [waking, other]
    assert gw.one_per_name([asleep, stopping]) == [asleep, stopping]     # neither comes up: check_routes says so
    with pytest.raises(gw.GatewayInputError, match="both serve"):
        gw.check_routes(gw.one_per_name([asleep, stopping]))
    gw.check_routes(gw.one_per_name([asleep, waking]))


def test_client_keys_are_split_on_commas_and_unsafe_ones_refused():
    assert [k.reveal() for k in gw.parse_client_keys(" a1 , b2,,")] == ["a1", "b2"]
    with pytest.raises(gw.GatewayInputError):
        gw.client_keys_file([Secret("new\nline")])


def test_the_gateway_steps_surround_stops_and_starts_and_keep_the_recovery_numbers():
    rec = GatewayRecord(port=8090, haproxy="/usr/sbin/haproxy")
    from orchestrator.config.inventory import HostEntry

    entry = HostEntry(name="gpu1", address="gpu1")
    plan = Plan("swap", "gpu1", "b", actions=[
        Action("lock", "held", noop=True), Action("install", "write b's unit"),
        Action("stop", "stop a", subject="a"), Action("start", "start b", subject="b"),
        Action("ready", "wait for b"), Action("record", "record b")])
    plan.recover(plan.actions[2], "roll back to a", [Action("stop", "stop b", subject="b"),
                                                     Action("start", "start a", subject="a")])
    out = with_gateway(plan, rec, entry)
    assert [a.summary.split(" at ")[0] if a.step == "gateway" else a.step for a in out.actions] == [
        "lock", "install", "drain a", "stop", "route b", "start", "ready", "record", out.actions[-1].summary]
    assert out.actions[-1].step == "gateway"
    r = out.recoveries[0]
    assert (out.actions[r.first - 1].step, out.actions[r.last - 1].step) == ("stop", "record")
    assert [a.step for a in r.actions] == ["gateway", "stop", "gateway", "start", "gateway"]
    assert with_gateway(plan, None, entry) is plan                  # no gateway on the host: the plan as it was
    quiet = Plan("deploy", "gpu1", "a", actions=[Action("start", "nothing to do", noop=True, subject="a")])
    assert with_gateway(quiet, rec, entry) is quiet                 # nothing starts or stops: no gateway step


def test_a_held_route_waits_for_its_release_file_in_a_valid_configuration(tmp_path):
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    held = [*ROUTES, gw.Route("kimi-k25-nvfp4", ("kimi-k2.5-nvfp4",), 8002, up=False, hold=True)]
    cfg = write(tmp_path, held)
    r = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    text = cfg.read_text()
    # its server is enabled (the requests go on once released), the 503 one stays disabled
    assert "server s1 127.0.0.1:8002\n" in text and "server s1 127.0.0.1:8001 disabled" in text
    assert f"lua.vllm_orch_hold 5000 {tmp_path}/run/awake if {{ var(txn.backend) -m str svc_kimi-k25-nvfp4 }}" in text
    assert "hdr Retry-After 2 if { var(txn.held_out) -m found }" in text
    assert "core.msleep" in (tmp_path / "hold.lua").read_text()
    assert gw.plan_lines(held)[-1].endswith("(kimi-k25-nvfp4, held until it serves)")


def test_a_wake_is_held_before_and_released_after_its_canary():
    rec = GatewayRecord(port=8090, haproxy="/usr/sbin/haproxy")
    from orchestrator.config.inventory import HostEntry

    entry = HostEntry(name="gpu1", address="gpu1")
    plan = Plan("swap", "gpu1", "b", actions=[Action("sleep", "sleep a", subject="a"),
                                                Action("wake", "wake b", subject="b"), Action("record", "record b")])
    out = with_gateway(plan, rec, entry)
    assert [a.summary.split(" at ")[0] if a.step == "gateway" else a.step for a in out.actions][:6] == [
        "drain a", "sleep", "route b", "wake", "release b", "record"]


def test_a_restart_in_place_holds_its_requests_until_its_readiness_gates_passed():
    """regen --restart (step "restart a", then "ready a") and a deploy that restarts the running
    service with a changed unit: held before, released after the readiness gates, in the recovery
    branch too; a fresh start is routed (no hold)."""
    rec = GatewayRecord(port=8090, haproxy="/usr/sbin/haproxy")
    from orchestrator.config.inventory import HostEntry

    entry = HostEntry(name="gpu1", address="gpu1")
    plan = Plan("regen", "gpu1", "a", actions=[
        Action("install a", "write a's unit"), Action("restart a", "restart a", subject="a", restart=True),
        Action("ready a", "wait for a", subject="a"), Action("record a", "record a"),
        Action("start", "start b", subject="b"), Action("ready", "wait for b", subject="b")])
    plan.recover(plan.actions[1], "put a's unit back", [
        Action("restore", "put back"), Action("start", "restart a", subject="a", restart=True),
        Action("ready", "wait for a", subject="a")], last=plan.actions[2])
    out = with_gateway(plan, rec, entry)
    steps = [a.summary.split(" at ")[0] if a.step == "gateway" else a.step for a in out.actions]
    assert steps[:-1] == ["install a", "hold a", "restart a", "ready a", "release a", "record a", "route b", "start",
                          "ready"]
    assert "its readiness gates passed" in out.actions[4].summary and "wait while it restarts" in out.actions[1].summary
    r = out.recoveries[0]
    assert (out.actions[r.first - 1].step, out.actions[r.last - 1].step) == ("restart a", "ready a")
    assert [a.summary.split(" at ")[0] if a.step == "gateway" else a.step for a in r.actions][:5] == [
        "restore", "hold a", "start", "ready", "release a"]


def _group(**kw):
    from orchestrator.config.inventory import WakeGroup

    return WakeGroup(services=["a", "b"], **kw)


def test_the_waker_takes_turns_instead_of_thrashing():
    from orchestrator.ops.waker import FAILED_WAKE_PAUSE_S, Member, Memory, decide

    g = _group(min_awake_seconds=30, ttl_seconds=60)
    mem = Memory(woke_at={"a": 100.0})
    busy_a = {"a": Member("a", False, inflight=3, routed=10), "b": Member("b", True, waiting=2)}
    assert decide(g, busy_a, mem, 110.0) is None                      # a serves its turn: b waits
    kind, name, why = decide(g, busy_a, mem, 131.0)
    assert (kind, name) == ("wake", "b") and "30 s turn" in why       # after it, b's waiting requests go first
    idle_a = {"a": Member("a", False, routed=10), "b": Member("b", True, waiting=1)}
    assert decide(g, idle_a, mem, 101.0)[:2] == ("wake", "b")         # an idle model gives way at once
    none_awake = {"a": Member("a", True, waiting=1), "b": Member("b", True, waiting=4)}
    assert decide(g, none_awake, mem, 0.0)[:2] == ("wake", "b")       # the most waiting first
    mem.failed_at["b"] = 200.0
    assert decide(g, none_awake, mem, 201.0)[:2] == ("wake", "a")     # a failed wake pauses
    assert decide(g, {"b": none_awake["b"]}, mem, 200.0 + FAILED_WAKE_PAUSE_S - 1) is None
    # the ttl: idle (no request, the routed count unchanged) for ttl_seconds
    quiet = {"a": Member("a", False, routed=10), "b": Member("b", True)}
    mem2 = Memory()
    mem2.see(quiet, 0.0)
    assert decide(g, quiet, mem2, 59.0) is None
    mem2.see(quiet, 61.0)
    assert decide(g, quiet, mem2, 61.0)[:2] == ("sleep", "a")
    mem2.see({"a": Member("a", False, routed=11), "b": quiet["b"]}, 62.0)    # a request came: idle again from 62
    assert decide(g, quiet, mem2, 100.0) is None
    assert decide(_group(), quiet, Memory(), 1e9) is None               # ttl 0: never


def test_wake_groups_are_checked():
    from pydantic import ValidationError

    from orchestrator.config.inventory import Gateway

    with pytest.raises(ValidationError, match="in two wake groups"):
        Gateway(wake_groups=[{"services": ["a", "b"]}, {"services": ["b", "c"]}])
    with pytest.raises(ValidationError, match="not a service name"):
        Gateway(wake_groups=[{"services": ["A;rm"]}])
    assert Gateway(wake_groups=[{"services": ["a", "b"]}]).group_of("b").services == ["a", "b"]


def test_status_shows_the_gateway_line_and_a_stopped_gateway_needs_attention():
    from orchestrator.cli.views import gateway_line
    from orchestrator.host.gateway import load_of
    from orchestrator.ops.gateway import GatewayResult, summary
    from orchestrator.ops.status import HostStatus

    # in flight at the server (queued there too) and waiting at the gateway: one rule for every reader
    assert load_of({"inflight": 2, "queued": 1, "active": 5}) == (3, 2)
    assert load_of({"inflight": "x"}) == (0, 0) and load_of({}) == (0, 0)
    res = GatewayResult("gpu1", "serving", ["http://gpu1:8090/v1"], 8090, routes=[
        {"service": "a", "models": ["kimi-k2.5"], "target": "127.0.0.1:8000", "up": True, "held": False, "key": True},
        {"service": "b", "models": ["kimi-k2.5-nvfp4"], "target": "127.0.0.1:8001", "up": False, "held": True,
         "key": True}],
        counters={"workers": 2, "backends": {
            "svc_a": {"requests": 10, "errors_5xx": 1, "inflight": 2, "queued": 0, "active": 2},
            "svc_b": {"requests": 3, "errors_5xx": 0, "inflight": 0, "queued": 0, "active": 4},
            "frontend:gateway": {"requests": 99}}})
    g = summary(res)
    assert (g["requests"], g["errors_5xx"], g["in_flight"], g["waiting"], g["held"]) == (13, 1, 2, 4, ["b"])
    assert gateway_line(g) == ("gateway: serving at http://gpu1:8090/v1, 2 models (kimi-k2.5, kimi-k2.5-nvfp4; held "
                               "while they wake or restart: b); 13 requests, 2 in flight, 4 waiting, 1 5xx")
    assert HostStatus("gpu1", gateway=g).attention() == []
    down = summary(GatewayResult("gpu1", "failed", ["http://gpu1:8090/v1"], 8090))
    assert gateway_line(down) == "gateway: failed"
    assert HostStatus("gpu1", gateway=down).attention() == [
        "gpu1: its gateway is failed (every model behind it is unreachable through it)"]
