"""A state-machine test (hypothesis's RuleBasedStateMachine) of deploy, swap, stop, regen and gc
against a fake 8-GPU systemd host: random sequences of commands with random models, service names,
placements, manifest changes and failures (a readiness gate failing, Ctrl-C in the readiness
wait). Every command goes through the product: the facts are parsed by host/facts.parse from the
host's state, gather's pure parts build the service value and the inputs, the planners plan, and
the executor runs the plan's own steps (their run callables: state.py's record writers, the
unit's systemctl commands, the install) against the fake host, which keeps files in memory and
runs units from their installed files (the GPUs in the env file's CUDA_VISIBLE_DEVICES, the port
in the unit's --port). Stop and gc run ops/stop.py's own functions.

After every step it checks:
  - no two running services share a GPU or a port;
  - every running unit has a record, every record an installed unit, and a running service's record
    names the GPUs and port it runs with (what the overlap check trusts);
  - regen, and a redeploy without --gpus/--port, never move a placed service (nor, with no manifest
    change, any service);
  - a refused command changed nothing;
  - an interrupted or failed swap leaves the old or the new service serving.

The run's figures (steps, seconds) are printed with -s and in the test's report.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest, load_all
from orchestrator.config.placement import Request
from orchestrator.errors import ConfigError, OrchestratorError, RefusedError
from orchestrator.host import services as services_mod
from orchestrator.host.base import Command, Host, Result, Script, printable
from orchestrator.host.facts import HostFacts, parse
from orchestrator.host.services import ServiceState, SystemdService
from orchestrator.ops import gather
from orchestrator.ops import stop as stop_ops
from orchestrator.ops.execute import Reporter, run_plan
from orchestrator.paths import shipped_dir
from orchestrator.plan import prepare
from orchestrator.plan import service as service_steps
from orchestrator.plan import stop as stop_steps
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput, RegenInput
from orchestrator.plan.preflight import OK, Check
from orchestrator.plan.regen import plan_regen
from orchestrator.plan.run import Options, RunEnv
from orchestrator.plan.swap import plan_swap
from orchestrator.probe import api
from orchestrator.probe.readiness import NotReady, Ready

SHIPPED, _ = load_all(shipped_dir("models"))
MODELS = ("tiny-llama-a", "tiny-llama-b", "minimax-m25")    # 1, 1 and 4 GPUs
NAMES = (None, "svc-b", "svc-c")
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
ENTRY = HostEntry(name="gpu1", address="gpu1.example")
LOCK = LockFacts(held=True, path="/var/lib/vllm-orch/state/lock/deploy.lock")
OPTS = Options(poll_s=0.0, gpu_release_timeout_s=1)
CHECKS = [Check("gpus", OK, "8 GPUs")]
STATS = {"runs": 0, "steps": 0, "seconds": 0.0}


@dataclass
class Unit:
    active: bool = False
    enabled: bool = False
    gpus: tuple[int, ...] = ()
    port: int = 0
    pid: int = 0


@dataclass
class FakeHost(Host):
    """An 8-GPU systemd host in memory: files, and units that run from their installed files."""

    files: dict[str, bytes] = field(default_factory=dict)
    units: dict[str, Unit] = field(default_factory=dict)
    fail_ready: str | None = None           # the service whose readiness gate fails next
    interrupt_ready: str | None = None      # the service whose readiness wait gets Ctrl-C next
    next_pid: int = 1000

    def __post_init__(self) -> None:
        super().__init__("gpu1")

    def run(self, cmd: Command, *, timeout: float = 60.0, input: bytes | None = None, env=None, sudo=None) -> Result:
        text = cmd.text if isinstance(cmd, Script) else printable(cmd)
        code = 0
        for part in re.split(r";|&&", text):
            words = shlex.split(part.strip().replace("2>/dev/null", ""))
            if not words:
                continue
            if words[:2] == ["rm", "-f"]:
                self.files.pop(words[2], None)
            elif words[:2] == ["rm", "-rf"]:
                for p in [p for p in self.files if p == words[2] or p.startswith(words[2] + "/")]:
                    del self.files[p]
            elif words[0] == "systemctl" and len(words) > 1:
                code = max(code, self._systemctl(words[1:]))
        return Result(text, code, "", "" if code == 0 else "Unit not found", 0.0)

    def _systemctl(self, args: list[str]) -> int:
        verb = args[0]
        units = [a for a in args[1:] if a.endswith(".service")]
        for unit in units:
            name = unit.removeprefix("vllm-").removesuffix(".service")
            u = self.units.setdefault(name, Unit())
            if verb == "start":
                env = self.files.get(f"{ENTRY.env_dir}/{name}.env")
                text = self.files.get(f"{ENTRY.units_dir}/{unit}")
                if env is None or text is None:
                    return 5                                    # no such unit installed
                gpus = re.search(rb"CUDA_VISIBLE_DEVICES=([\d,]+)", env)
                port = re.search(rb"--port (\d+)", text)
                assert gpus and port, "an installed unit without its GPUs or port"
                self.next_pid += 1
                u.active, u.pid = True, self.next_pid
                u.gpus, u.port = tuple(int(i) for i in gpus.group(1).split(b",")), int(port.group(1))
            elif verb == "stop":
                u.active = False
            elif verb == "enable":
                u.enabled = True
            elif verb == "disable":
                u.enabled = False
        return 0

    def stream(self, cmd, *, on_line, timeout=3600.0, input=None, env=None, sudo=None) -> Result:
        return self.run(cmd)

    def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files[path] = data

    def get(self, path: str) -> bytes | None:
        return self.files.get(path)

    def connect_tcp(self, port: int, address: str = "127.0.0.1", timeout: float = 5.0):
        raise OSError("no network on the fake host")

    def spawn(self, cmd, *, env=None, sudo=None):
        raise NotImplementedError

    # -- what the facts script would report -----------------------------------------------------
    def json_files(self, folder: str) -> dict:
        out = {}
        for path, data in self.files.items():
            if path.startswith(folder + "/") and path.endswith(".json") and "/" not in path[len(folder) + 1:]:
                out[path[len(folder) + 1:-5]] = json.loads(data)
        return out

    def facts(self) -> HostFacts:
        state = ENTRY.state_dir
        installed, records = self.json_files(f"{state}/installed"), self.json_files(f"{state}/services")
        services = {}
        for name in sorted(set(installed) | set(records) | set(self.units)):
            u = self.units.get(name, Unit())
            services[name] = {"LoadState": "loaded", "ActiveState": "active" if u.active else "inactive",
                              "SubState": "running" if u.active else "dead", "MainPID": str(u.pid if u.active else 0),
                              "Result": "success", "NRestarts": "0", "ExecMainStartTimestampMonotonic": "1",
                              "ControlGroup": f"/system.slice/vllm-{name}.service",
                              "UnitFileState": "enabled" if u.enabled else "disabled"}
        models = []
        for path, data in self.files.items():
            m = re.fullmatch(rf"{re.escape(ENTRY.models_root)}/([^/]+)/\.vllm-orch/verified\.json", path)
            if m:
                models.append({"name": m.group(1), "bytes": 10 ** 9, "mtime": 1.0, "verified": json.loads(data)})
        swap = self.files.get(f"{state}/swap.json")
        gpus = "".join(f"{i}, {RTX}, 97887, 0, 0, GPU-{i}, 580.95.05, 0\n" for i in range(8))
        return parse({"hostname": "gpu1", "time": 1.0, "disk": {"path": ENTRY.models_root, "total": 4 * 10 ** 12,
                                                                "free": 2 * 10 ** 12},
                      "gpus_raw": {"rc": 0, "out": gpus}, "apps_raw": {"rc": 0, "out": ""},
                      "vllm": {"version": "0.33.0"}, "models": models, "services": services,
                      "users": {"vllm": {"uid": 998, "gid": 998, "home": "/var/lib/vllm-orch/home"}},
                      "memory": {"total": 10 ** 12, "available": 5 * 10 ** 11},
                      "records": records, "installed": installed,
                      "swap": json.loads(swap) if swap else None}, "gpu1")

    def snapshot(self) -> tuple:
        return (dict(self.files), {n: (u.active, u.enabled, u.gpus, u.port) for n, u in self.units.items()})


class FakeService(SystemdService):
    def state(self) -> ServiceState:
        u = self.host.units.get(self.model, Unit())                     # type: ignore[attr-defined]
        return ServiceState(active=u.active, main_pid=u.pid if u.active else None, ready=u.active)

    def log_cursor(self) -> str:
        return "c"


@dataclass
class HostReadsOf:
    host: FakeHost

    def get(self, path: str) -> bytes | None:
        return self.host.files.get(path)

    def serving(self, m: Manifest, api_key) -> bool:
        return any(u.active and u.port == m.serving.port for u in self.host.units.values())


def fake_ready(host, service, m, cursor, **kw) -> Ready:
    if host.interrupt_ready == m.name:
        host.interrupt_ready = None
        raise KeyboardInterrupt
    if host.fail_ready == m.name:
        host.fail_ready = None
        raise NotReady(f"{m.name} crashed while loading", kind="crash", root_cause=None, last_lines=[], gates=[])
    return Ready(gates=[("smoke test", 0.1)], smoke=api.SmokeResult(True, "4", 0, 1, 0.01, 0.01, 50.0),
                 seconds=0.1, log_lines=1)


def fake_download(host, python, repo, revision, local_dir, *args, **kw) -> dict:
    host.put(f"{local_dir}/.vllm-orch/verified.json",
             json.dumps({"repo": repo, "revision": "r" * 40, "commit": "r" * 40, "complete": True,
                         "files": {}}).encode())
    return {"done": {"bytes": 1, "files": 1, "commit": "r" * 40}, "seconds": 0.0}


FOLLOWS = (None, "manifest", "inventory")       # origins that follow the manifest and the inventory


def placements(host: FakeHost) -> dict[str, tuple[tuple[int, ...], int, bool, bool]]:
    """Each installed service: (GPUs, port, GPUs placed by a run, port placed by a run) as its
    installed record says."""
    out = {}
    for name, rec in host.json_files(f"{ENTRY.state_dir}/installed").items():
        out[name] = (tuple(rec.get("gpus") or ()), int(rec.get("port") or 0),
                     rec.get("gpus_from") not in FOLLOWS, rec.get("port_from") not in FOLLOWS)
    return out


class Operations(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.host = FakeHost()
        self.models = dict(SHIPPED)
        self.changed = False                      # a manifest was changed since the last regen

    @initialize()
    def start(self) -> None:
        STATS["runs"] += 1

    # -- helpers ----------------------------------------------------------------------------------
    def request(self, model: str, name: str | None, gpus: list[int] | None, port: int | None) -> Request:
        m = self.models[model]
        ids = tuple(gpus[:m.serving.gpus]) if gpus is not None else None
        return Request(name, ids if ids is None or len(ids) == m.serving.gpus else None, port)

    def node(self, facts: HostFacts, m: Manifest, spec, old=None) -> PlanInput:
        target = gather.service_input(HostReadsOf(self.host), ENTRY, m, facts, spec)
        have = facts.models.get(spec.model)
        dl = DownloadPlan(total_bytes=10 ** 9, have_bytes=10 ** 9 if have else 0, to_fetch_bytes=0 if have else 10 ** 9,
                          files=1, to_fetch=() if have else ("model.safetensors",), commit="r" * 40)
        return PlanInput(entry=ENTRY, facts=facts, opts=OPTS, lock=LOCK, target=target, download=dl,
                         preflight=CHECKS, old=old)

    def run(self, plan) -> bool:
        """Run the plan (False: refused, and then nothing changed)."""
        STATS["steps"] += 1
        if plan.refusal is not None:
            return False
        run_plan(plan, RunEnv(self.host, ENTRY, OPTS), Reporter(None, quiet=True))
        return True

    def refused_changes_nothing(self, before: tuple, fn) -> None:
        try:
            ran = fn()
        except (ConfigError, RefusedError):
            ran = False
        if not ran:
            assert self.host.snapshot() == before, "a refused command changed the host"

    # -- rules --------------------------------------------------------------------------------------
    @rule(model=st.sampled_from(MODELS), name=st.sampled_from(NAMES),
          gpus=st.one_of(st.none(), st.permutations(range(8))), port=st.sampled_from([None, 8101, 8102, 8000, 8003]),
          failure=st.sampled_from([None, None, "fail", "interrupt"]))
    def deploy(self, model, name, gpus, port, failure) -> None:
        before, placed_before = self.host.snapshot(), placements(self.host)
        request = self.request(model, name, gpus, port)
        service = request.name or model

        def go() -> bool:
            facts = self.host.facts()
            m = self.models[model]
            spec = gather.service_spec(m, [ENTRY], request, {"gpu1": facts})
            if failure == "fail":
                self.host.fail_ready = service
            elif failure == "interrupt":
                self.host.interrupt_ready = service
            return self.run(plan_deploy(self.node(facts, m, spec)))

        self.refused_changes_nothing(before, go)
        self.host.fail_ready = self.host.interrupt_ready = None
        same_model = json.loads(before[0].get(f"{ENTRY.state_dir}/installed/{service}.json", b"{}")).get("model") == model
        if request.gpus is None and request.port is None and service in placed_before and not self.changed \
                and same_model:
            after = placements(self.host).get(service)
            assert after is None or after[:2] == placed_before[service][:2], \
                f"a redeploy without --gpus/--port moved {service}: {placed_before[service]} -> {after}"

    @rule(model=st.sampled_from(MODELS), name=st.sampled_from(NAMES), replace=st.sampled_from([None, 0, 1, 2]),
          failure=st.sampled_from([None, "fail", "interrupt"]))
    def swap(self, model, name, replace, failure) -> None:
        before = self.host.snapshot()
        facts = self.host.facts()
        recorded = sorted(facts.records)
        replacing = recorded[replace] if replace is not None and replace < len(recorded) else None
        request = Request(name)
        service = name or model
        old_serving: list[str] = []

        def go() -> bool:
            m = self.models[model]
            opts = Options(replace=replacing)
            spec, old = gather.swap_services(facts, ENTRY, m, request, self.models, opts)
            old_input = None
            if old is not None:
                old_input = gather.service_input(HostReadsOf(self.host), ENTRY, old[0], facts, old[1], True)
                st_ = facts.services.get(old_input.name)
                if st_ is not None and st_.active:
                    old_serving.append(old_input.name)
            if failure == "fail":
                self.host.fail_ready = service
            elif failure == "interrupt":
                self.host.interrupt_ready = service
            inp = self.node(facts, m, spec, old_input)
            return self.run(plan_swap(PlanInput(**{**inp.__dict__, "opts": opts})))

        self.refused_changes_nothing(before, go)
        self.host.fail_ready = self.host.interrupt_ready = None
        if old_serving:             # the old service or the new one serves (a failed swap rolled back)
            units = self.host.units
            assert units.get(old_serving[0], Unit()).active or units.get(service, Unit()).active, \
                f"after a swap from {old_serving[0]} to {service} neither serves"

    @precondition(lambda self: bool(self.host.json_files(f"{ENTRY.state_dir}/installed")))
    @rule(which=st.integers(0, 3))
    def stop(self, which) -> None:
        names = sorted(self.host.json_files(f"{ENTRY.state_dir}/installed"))
        STATS["steps"] += 1
        stop_ops.stop_model(self.host, ENTRY, names[which % len(names)], release_timeout=1, poll=0.0, lock=LOCK)

    @rule(restart=st.booleans(), change=st.sampled_from([None, "utilization", "port", "gpus"]))
    def regen(self, restart, change) -> None:
        if change is not None:
            model = "tiny-llama-a" if change != "gpus" else "tiny-llama-b"
            data = self.models[model].model_dump()
            if change == "utilization":
                data["vllm"]["gpu_memory_utilization"] = 0.8 if data["vllm"]["gpu_memory_utilization"] != 0.8 else 0.85
            elif change == "port":
                data["serving"]["port"] = 8102 if data["serving"]["port"] != 8102 else 8101
            else:
                data["serving"]["gpu_ids"] = [7] if data["serving"]["gpu_ids"] != [7] else [0]
            self.models[model] = Manifest.model_validate(data)
            self.changed = self.changed or change != "utilization"
        before, placed_before = self.host.snapshot(), placements(self.host)

        def go() -> bool:
            facts = self.host.facts()
            found, orphaned = gather.regen_services(facts, ENTRY, self.models)
            inputs = [gather.service_input(HostReadsOf(self.host), ENTRY, m, facts, spec, True) for m, spec in found]
            return self.run(plan_regen(RegenInput(entry=ENTRY, facts=facts, opts=OPTS, lock=LOCK, services=inputs,
                                                  orphaned=orphaned, restart=restart)))

        ran: list[bool] = []
        self.refused_changes_nothing(before, lambda: ran.append(go()) or ran[-1])
        after = placements(self.host)
        for name, (gpus, port, gpus_placed, port_placed) in placed_before.items():
            if name not in after:
                continue
            if gpus_placed or not self.changed:
                assert after[name][0] == gpus, f"regen moved {name}'s GPUs: {gpus} -> {after[name][0]}"
            if port_placed or not self.changed:
                assert after[name][1] == port, f"regen moved {name}'s port: {port} -> {after[name][1]}"
        if ran and ran[0]:
            self.changed = False                # installed: the manifests and the host agree again

    @rule()
    def gc(self) -> None:
        STATS["steps"] += 1
        stop_ops.run_gc(self.host, ENTRY, stop_ops.gc_plan(self.host, ENTRY, LOCK))

    # -- invariants ---------------------------------------------------------------------------------
    @invariant()
    def no_two_running_services_share_a_gpu_or_a_port(self) -> None:
        active = {n: u for n, u in self.host.units.items() if u.active}
        names = sorted(active)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                shared = set(active[a].gpus) & set(active[b].gpus)
                assert not shared, f"{a} and {b} both run on GPUs {sorted(shared)}"
                assert active[a].port != active[b].port, f"{a} and {b} both serve port {active[a].port}"

    @invariant()
    def records_and_units_agree(self) -> None:
        if self.host.files.get(f"{ENTRY.state_dir}/swap.json"):
            return                                  # a half-done swap: status says what is where
        records = self.host.json_files(f"{ENTRY.state_dir}/services")
        for name, u in self.host.units.items():
            if u.active:
                assert name in records, f"{name} runs without a record"
                rec = records[name]
                assert (tuple(rec.get("gpus") or ()), rec.get("port")) == (u.gpus, u.port), \
                    f"{name}'s record says GPUs {rec.get('gpus')} port {rec.get('port')}, it runs on {u.gpus} {u.port}"
        for name in records:
            assert f"{ENTRY.units_dir}/vllm-{name}.service" in self.host.files, f"{name} is recorded, not installed"


@pytest.fixture
def fake_world(monkeypatch):
    monkeypatch.setattr(services_mod.Service, "for_host",
                        staticmethod(lambda host, entry, model: FakeService(host, entry, model) if isinstance(host, FakeHost)
                                     else SystemdService(host, entry, model)))
    monkeypatch.setattr(service_steps, "gather", lambda host, entry, models=None, ports=None: host.facts())
    monkeypatch.setattr(service_steps, "wait_released", lambda *a, **kw: "released")
    monkeypatch.setattr(service_steps, "wait_ready", fake_ready)
    monkeypatch.setattr(prepare, "run_download", fake_download)
    monkeypatch.setattr(stop_ops, "gather", lambda host, entry, models=None, ports=None: host.facts())
    monkeypatch.setattr(stop_steps, "gather", lambda host, entry, models=None, ports=None: host.facts())
    monkeypatch.setattr(stop_steps, "read_gpus", lambda host, entry: ({}, {}))
    monkeypatch.setattr(stop_steps, "wait_released", lambda *a, **kw: "released")
    monkeypatch.setattr(stop_steps.modeldirs, "delete_script",
                        lambda root, name: Script(f"rm -rf {shlex.quote(root + '/' + name)}"))


def test_random_operations_keep_the_invariants(fake_world):
    t0 = time.monotonic()
    run_state_machine_as_test(Operations, settings=settings(
        max_examples=int(__import__("os").environ.get("VLLM_ORCH_STATE_EXAMPLES", "60")),
        stateful_step_count=int(__import__("os").environ.get("VLLM_ORCH_STATE_STEPS", "15")),
        deadline=None, suppress_health_check=list(HealthCheck), derandomize=True))
    STATS["seconds"] = time.monotonic() - t0
    print(f"\nstate machine (fake host): {STATS['runs']} runs, {STATS['steps']} steps, {STATS['seconds']:.1f} s")


def test_orchestrator_errors_from_the_fake_are_not_swallowed():
    """The fake host answers what the product asks; a command it does not know is no error, so the
    invariants (not the fake) decide what is wrong. Sanity: a unit started without its files fails."""
    host = FakeHost()
    assert host.run(["systemctl", "start", "vllm-x.service"]).exit_code == 5
    assert isinstance(RefusedError("x"), OrchestratorError)
