"""The multi-node deploy's planner (plan/multinode.py) with hand-made facts of two 8-GPU hosts: the
order of its steps and the node each runs on, the parallel download and verify-same, workers
started before the head, the recovery that stops every node, refusals on either node; and the
comparison of the nodes' verified records (weights_differ) on its own. The 2-node plan's text is
pinned by a golden file."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import node_roles
from orchestrator.errors import DeployFailed
from orchestrator.host.ownership import FOREIGN, Proc
from orchestrator.host.services import ServiceState
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput, ServiceInput
from orchestrator.plan.multinode import verify_same_action, weights_differ
from orchestrator.plan.preflight import FAIL, Check
from orchestrator.plan.run import Options, RunEnv
from orchestrator.render.artifacts import render

from .test_planners import CHECKS, MODELS, RTX, download, facts, golden

HEAD = HostEntry(name="gpu1", address="10.0.0.1", sudo=True)
WORKER = HostEntry(name="gpu2", address="gpu2.example", sudo=True, cluster={"address": "10.0.0.2"})


def two_node() -> Manifest:
    """The shipped 2-node manifest: Kimi-K2.5 INT4, TP 8 x PP 2 over two 8-GPU hosts."""
    return MODELS["kimi-k25-int4-2node"]


def node_inputs(m: Manifest, per_node: dict[str, dict] | None = None, **opts) -> list[PlanInput]:
    """One PlanInput per node, head first, each rendered with its role; per_node: facts() keyword
    arguments (or "download", "preflight", "files_installed", "serving") by node name."""
    entries = [HEAD, WORKER]
    out = []
    for e, role in zip(entries, node_roles(m, entries), strict=True):
        given = dict((per_node or {}).get(e.name, {}))
        dl = given.pop("download", download(547 * 10 ** 9))
        checks = given.pop("preflight", CHECKS)
        installed, serving = given.pop("files_installed", False), given.pop("serving", False)
        eff = effective(m, e, {i: RTX for i in range(8)})
        r = render(eff.manifest, e, {}, role=role)
        target = ServiceInput(manifest=eff.manifest, rendered=r, effective=eff, serving=serving,
                              installed_files={f.path: (f.data() if installed else None) for f in r.files})
        out.append(PlanInput(entry=e, facts=facts(**given), opts=Options(**opts),
                             lock=LockFacts(held=False, path="/var/lib/vllm-orch/state/lock/deploy.lock"),
                             target=target, download=dl, preflight=checks))
    return out


def keys(plan) -> list[str]:
    return [a.key for a in plan.actions]


def test_a_fresh_two_node_deploy_runs_each_step_on_its_node_workers_before_the_head():
    plan = plan_deploy(*node_inputs(two_node(), {"gpu1": {"users": {}}, "gpu2": {"users": {}}}))
    assert plan.refusal is None
    assert keys(plan) == [
        "lock[gpu1]", "lock[gpu2]", "preflight[gpu1]", "preflight[gpu2]", "disk[gpu1]", "disk[gpu2]",
        "download", "verify-same", "gpus[gpu1]", "gpus[gpu2]", "user[gpu1]", "user[gpu2]",
        "install[gpu1]", "install[gpu2]", "start[gpu2]", "start[gpu1]", "ready[gpu1]", "perf[gpu1]",
        "record[gpu1]", "record[gpu2]"]
    download_step = plan.actions[6]
    assert not download_step.noop and "gpu1, gpu2 in parallel" in download_step.summary
    ready = plan.actions[keys(plan).index("ready[gpu1]")]
    assert "gpu2" in ready.summary                              # the worker's log is followed too
    # a failure from the first start to the last record stops every node, workers then the head
    first, last = keys(plan).index("start[gpu2]") + 1, len(plan.actions)
    rec = plan.recovery_for(first)
    assert rec is not None and (rec.first, rec.last) == (first, last)
    assert [a.key for a in rec.actions] == ["stop[gpu2]", "stop[gpu1]"]
    assert plan.recovery_for(first - 1) is None
    golden("plan-deploy-2-nodes.txt", plan.text())


def test_the_workers_unit_has_the_headless_argv_and_the_record_names_every_node():
    inputs = node_inputs(two_node())
    head, worker = (i.target.rendered for i in inputs)
    assert "--headless" in worker.argv and "--headless" not in head.argv
    assert worker.argv[worker.argv.index("--master-addr") + 1] == "10.0.0.1"
    from orchestrator.host.records import InstalledRecord, NodeFields

    fields = NodeFields.of(worker.role)
    assert fields == {"nodes": ["gpu1", "gpu2"], "rank": 1, "head": "gpu1", "head_address": "10.0.0.1"}
    assert InstalledRecord(**fields).role() == worker.role          # regen re-renders the node as it is
    assert InstalledRecord(nodes=["gpu1"], rank=3, head_address="x").role() is None
    assert NodeFields.of(render(MODELS["kimi-k25-int4"], HEAD, {}).role) == {}     # one host: no node fields


def test_a_running_unchanged_service_on_every_node_is_all_noops():
    m = two_node()
    per = {}
    for i in node_inputs(m):
        rec = {"model": m.name, "unit_hash": i.target.rendered.unit_hash, "gpus": list(range(8))}
        per[i.entry.name] = {"services": {m.name: ServiceState(active=True, main_pid=7)}, "active": rec,
                             "download": download(0, 547 * 10 ** 9), "files_installed": True,
                             "serving": i.entry.name == "gpu1"}
    plan = plan_deploy(*node_inputs(m, per))
    assert plan.refusal is None and not plan.changes and not plan.recoveries
    assert all(a.noop for a in plan.actions if a.step not in ("lock", "verify-same"))


def test_one_nodes_changed_unit_restarts_every_node_head_stopped_first():
    m = two_node()
    running = {"services": {m.name: ServiceState(active=True, main_pid=7)}}
    inputs = node_inputs(m, {"gpu1": {**running, "files_installed": True}, "gpu2": {**running}})   # gpu2: new files
    plan = plan_deploy(*inputs)
    k = keys(plan)
    assert k.index("stop[gpu1]") < k.index("stop[gpu2]") < k.index("start[gpu2]") < k.index("start[gpu1]")
    assert plan.actions[k.index("install[gpu1]")].noop and not plan.actions[k.index("install[gpu2]")].noop


@pytest.mark.parametrize("node", ["gpu1", "gpu2"])
def test_a_refusal_on_either_node_ends_the_plan_before_anything_changes(node):
    failed = [*CHECKS, Check("vllm-version", FAIL, "vLLM 0.10.0 < 0.19.1", fix="upgrade vLLM")]
    plan = plan_deploy(*node_inputs(two_node(), {node: {"preflight": failed}}))
    assert plan.refusal is not None and plan.refusal.host == node and plan.refusal.step == "preflight"
    assert keys(plan)[-1] == "preflight[gpu2]" and "download" not in keys(plan)
    stranger = [Proc(pid=5151, name="python3 train.py", used_mib=4000, gpu_index=3, kind=FOREIGN, start_time=515100)]
    plan = plan_deploy(*node_inputs(two_node(), {node: {"procs": stranger}}))
    assert plan.refusal is not None and plan.refusal.host == node and plan.refusal.step == "gpus"
    assert keys(plan)[-1] == f"gpus[{node}]" and not any(a.step == "start" for a in plan.actions)


def test_nodes_resolving_the_revision_to_different_commits_are_refused_at_plan_time():
    other = replace(download(547 * 10 ** 9), commit="b" * 40)
    plan = plan_deploy(*node_inputs(two_node(), {"gpu2": {"download": other}}))
    assert plan.refusal is not None and plan.refusal.host == "gpu2" and plan.refusal.step == "verify-same"
    assert "bbbbbbbbbbbb on gpu2" in str(plan.refusal) and keys(plan)[-1] == "verify-same"


def record(commit: str = "a" * 40, **files) -> dict:
    base = {"model-00001-of-00002.safetensors": {"size": 10, "sha256": "11" * 32, "mtime_ns": 1},
            "config.json": {"size": 2, "blob_id": "cafe", "mtime_ns": 5}}
    return {"repo": "moonshotai/Kimi-K2.5", "commit": commit, "complete": True, "files": {**base, **files}}


def test_weights_differ_names_the_node_and_ignores_mtimes():
    assert weights_differ({"gpu1": record(), "gpu2": record()}, "gpu1") is None
    moved = record(**{"config.json": {"size": 2, "blob_id": "cafe", "mtime_ns": 99}})
    assert weights_differ({"gpu1": record(), "gpu2": moved}, "gpu1") is None       # another mtime: same file
    node, why = weights_differ({"gpu1": record(), "gpu2": record("c" * 40)}, "gpu1")
    assert node == "gpu2" and "cccccccccccc" in why and "aaaaaaaaaaaa" in why
    bad = record(**{"model-00001-of-00002.safetensors": {"size": 10, "sha256": "22" * 32}})
    assert weights_differ({"gpu1": record(), "gpu2": bad}, "gpu1") == \
        ("gpu2", "1 file differs from the head gpu1's: model-00001-of-00002.safetensors")
    assert weights_differ({"gpu1": record(), "gpu2": None}, "gpu1")[0] == "gpu2"
    assert weights_differ({"gpu1": {**record(), "complete": False}, "gpu2": record()}, "gpu1")[0] == "gpu1"


class FakeHost:
    """Just enough of a Host for verify-same: the files it holds."""

    def __init__(self, name: str, files: dict[str, bytes]):
        self.name, self.files = name, files

    def get(self, path: str) -> bytes | None:
        return self.files.get(path)


def test_verify_same_fails_naming_the_node_whose_weights_differ():
    import json

    inputs = node_inputs(two_node())
    action, refusal = verify_same_action(inputs)
    assert refusal is None

    def env_with(worker_record: dict) -> RunEnv:
        envs = {}
        for i, rec in zip(inputs, (record(), worker_record), strict=True):
            path = f"{i.entry.models_root}/{i.target.model}/.vllm-orch/verified.json"
            envs[i.entry.name] = RunEnv(FakeHost(i.entry.name, {path: json.dumps(rec).encode()}), i.entry, Options())
        envs["gpu1"].nodes = envs
        return envs["gpu1"]

    assert action.run is not None
    assert "2 nodes hold commit aaaaaaaaaaaa, 2 files" in str(action.run(env_with(record())))
    with pytest.raises(DeployFailed) as err:
        action.run(env_with(record("d" * 40)))
    assert err.value.host == "gpu2" and err.value.step == "verify-same" and "dddddddddddd" in err.value.message


def test_one_download_step_for_every_node_is_a_noop_when_all_have_the_weights():
    have = DownloadPlan(total_bytes=5, have_bytes=5, to_fetch_bytes=0, files=3, commit="a" * 40, from_record=True)
    need = download(547 * 10 ** 9)
    plan = plan_deploy(*node_inputs(two_node(), {"gpu1": {"download": have}, "gpu2": {"download": have}}))
    step = next(a for a in plan.actions if a.step == "download")
    assert step.noop and step.node is None
    plan = plan_deploy(*node_inputs(two_node(), {"gpu1": {"download": have}, "gpu2": {"download": need}}))
    step = next(a for a in plan.actions if a.step == "download")
    assert not step.noop and "fetch on gpu2 in parallel" in step.summary
    assert any(d.startswith("gpu1: nothing to do") for d in step.details)


def test_a_swap_from_one_node_to_two_stages_everywhere_first_and_rolls_back_on_every_node():
    from orchestrator.plan.swap import plan_swap

    from .test_planners import svc

    old = svc("kimi-k25-int4", installed=True)
    on_head = {"services": {old.name: ServiceState(active=True, main_pid=7)},
               "active": {"model": old.name, "gpus": list(range(8))}}
    inputs = node_inputs(two_node(), {"gpu1": on_head})
    inputs[0] = replace(inputs[0], old=old)
    plan = plan_swap(*inputs)           # the old service: the head's, one host
    assert plan.refusal is None
    k = keys(plan)
    assert k.index("verify-same") < k.index("install[gpu2]") < k.index("stop[gpu1]") < k.index("start[gpu2]") \
        < k.index("start[gpu1]") < k.index("ready[gpu1]")
    assert "swap.json" in plan.actions[k.index("stop[gpu1]")].details[0]
    rb = plan.recovery_for(k.index("ready[gpu1]") + 1)
    assert rb is not None and rb.first == k.index("stop[gpu1]") + 1
    assert [a.key for a in rb.actions] == ["stop[gpu2]", "stop[gpu1]", "gpus[gpu1]", "start[gpu1]", "ready[gpu1]",
                                           "record[gpu1]"]
    assert plan.recovery_for(k.index("download") + 1) is None        # the old one still serves then
    golden("plan-swap-1-to-2-nodes.txt", plan.text())


def test_the_parallel_download_runs_every_node_and_fails_naming_the_node_that_failed(monkeypatch):
    from orchestrator.plan import prepare
    from orchestrator.plan.multinode import download_all_action

    seen = []

    def fake_download(host, python, repo, revision, local_dir, *args, **kw):
        seen.append(host.name)
        if host.name == "gpu2":
            raise DeployFailed("the Hub answered 503", step="download")
        return {"done": {"bytes": 10, "files": 2, "commit": "a" * 40}, "seconds": 0.1}

    monkeypatch.setattr(prepare, "run_download", fake_download)
    inputs = node_inputs(two_node())
    envs = {i.entry.name: RunEnv(FakeHost(i.entry.name, {}), i.entry, Options()) for i in inputs}
    envs["gpu1"].nodes = envs
    action = download_all_action(inputs)
    assert action.run is not None
    with pytest.raises(DeployFailed) as err:
        action.run(envs["gpu1"])
    assert sorted(seen) == ["gpu1", "gpu2"] and err.value.host == "gpu2" and "503" in err.value.message
    assert any(d.startswith("gpu1: ") for d in err.value.details)        # what the other node did
    assert envs["gpu1"].record.download is not None and envs["gpu2"].record.download is None


def test_a_swap_from_two_nodes_back_to_one_stops_the_old_service_on_every_node():
    """The new service on one host, the old one on two: every step names its node, so the old
    service's stop on the other host runs there (it ran on the head twice before)."""
    from orchestrator.plan.multinode import OldService
    from orchestrator.plan.swap import plan_swap

    from .test_planners import inp, svc

    old_head = node_inputs(two_node())[0].target
    f = facts(services={old_head.name: ServiceState(active=True, main_pid=7)},
              active={"model": old_head.name, "gpus": list(range(8))})
    new = inp(svc("kimi-k25-int4"), f, download(0, 547 * 10 ** 9), old=old_head)
    new = replace(new, entry=HEAD)
    old = OldService(old_head.name, ("gpu1", "gpu2"), old_head, frozenset({"gpu1", "gpu2"}))
    lock = new.lock
    plan = plan_swap(new, old=old, elsewhere={"gpu2": (WORKER, lock)})
    assert plan.refusal is None, plan.refusal
    k = keys(plan)
    assert "stop[gpu1]" in k and "stop[gpu2]" in k and "lock[gpu2]" in k and "record[gpu2]" in k
    rb = plan.recovery_for(k.index("stop[gpu1]") + 1)
    assert rb is not None and "start[gpu2]" in [a.key for a in rb.actions]
