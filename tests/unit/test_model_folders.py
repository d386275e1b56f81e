"""Only our folders: disk freeing (deploy, swap, gc) deletes folders vllm-orch made (they carry its
record), never another folder that happens to sit under models_root, and the delete re-checks on
the host that the resolved models_root is not a system folder."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all
from orchestrator.host.facts import HostFacts, ModelDir
from orchestrator.host.modeldirs import delete_script
from orchestrator.paths import shipped_dir
from orchestrator.plan import prepare
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput, ServiceInput
from orchestrator.plan.run import Options
from orchestrator.plan.stop import gc_choice
from orchestrator.render.artifacts import render

GIB = 1024 ** 3
MODELS, _ = load_all(shipped_dir("models"))
ENTRY = HostEntry(name="gpu1", address="gpu1.example")
OURS = {"repo": "a/b", "revision": "main", "complete": True, "files": {}, "total_bytes": 1}


def folder(root: Path, name: str, ours: bool = True) -> Path:
    d = root / name
    (d / "weights").mkdir(parents=True)
    (d / "weights" / "w.safetensors").write_bytes(b"x" * 10)
    if ours:
        (d / ".vllm-orch").mkdir()
        (d / ".vllm-orch" / "verified.json").write_text(json.dumps(OURS))
    return d


def run(script) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script.text], capture_output=True, text=True)


def test_a_folder_without_our_record_is_never_deleted(tmp_path):
    root = tmp_path / "models"
    theirs, ours = folder(root, "alice-experiments", ours=False), folder(root, "old")
    r = run(delete_script(str(root), "alice-experiments"))
    assert r.returncode == 3 and "not a folder vllm-orch made" in r.stderr and theirs.is_dir()
    assert run(delete_script(str(root), "old")).returncode == 0 and not ours.exists()


def test_a_record_reached_through_a_symlink_does_not_count(tmp_path):
    root = tmp_path / "models"
    d = folder(root, "x", ours=False)
    elsewhere = folder(tmp_path / "elsewhere", "real")
    (d / ".vllm-orch").symlink_to(elsewhere / ".vllm-orch")
    assert run(delete_script(str(root), "x")).returncode == 3 and d.is_dir()


def test_the_host_rechecks_the_resolved_models_root(tmp_path):
    """models_root passed the inventory's check, but on the host it is a symlink to /tmp (or any
    system folder): the delete refuses. (Were the guard missing, only this test's own folder in
    /tmp would go.)"""
    name = f"vllm-orch-test-{uuid.uuid4().hex[:8]}"
    victim = folder(Path("/tmp"), name)
    try:
        alias = tmp_path / "models"
        alias.symlink_to("/tmp")
        r = run(delete_script(str(alias), name))
        assert r.returncode == 3 and "system or home folder" in r.stderr and victim.is_dir()
    finally:
        subprocess.run(["rm", "-rf", str(victim)])


def facts(models: dict[str, ModelDir], disk_free: int = 100 * GIB, active=None) -> HostFacts:
    return HostFacts(hostname="gpu1", disk_path="/var/lib/vllm-orch/models", disk_total=4000 * GIB,
                     disk_free=disk_free, gpus=[], gpu_error=None, driver_version=None, cuda_version=None,
                     procs=[], vllm_version="0.33.0", vllm_error=None, models=models, active=active,
                     installed={}, services={}, usage={})


def mdir(name: str, gib: float, last_used: float, ours: bool = True) -> ModelDir:
    return ModelDir(name, int(gib * GIB), dict(OURS) if ours else None, last_used)


def plan_input(f: HostFacts, need_gib: float, **opts) -> PlanInput:
    m = MODELS["minimax-m25"]
    target = ServiceInput(manifest=m, rendered=render(m, ENTRY, {}))
    dl = DownloadPlan(total_bytes=int(need_gib * GIB), have_bytes=0, to_fetch_bytes=int(need_gib * GIB), files=3,
                      to_fetch=("a", "b", "c"), commit="a" * 40)
    return PlanInput(entry=ENTRY, facts=f, opts=Options(**opts), lock=LockFacts(held=False, path="/x/deploy.lock"),
                     target=target, download=dl)


def test_disk_freeing_skips_someone_elses_older_bigger_folder():
    f = facts({"alice-experiments": mdir("alice-experiments", 500, 1.0, ours=False),
               "kimi-k25-int4": mdir("kimi-k25-int4", 550, 5.0)}, disk_free=300 * GIB)
    action, err = prepare.disk_action(plan_input(f, 250 + 20 + 100), keep=set())
    assert err is None
    assert len(action.commands) == 1 and "/kimi-k25-int4" in str(action.commands[0])
    assert "alice-experiments" not in " ".join(str(c) for c in action.commands)
    assert any("alice-experiments" in d and "not made by vllm-orch" in d for d in action.details)


def test_only_foreign_folders_could_make_room_so_it_refuses():
    f = facts({"alice-experiments": mdir("alice-experiments", 500, 1.0, ours=False)}, disk_free=100 * GIB)
    action, err = prepare.disk_action(plan_input(f, 200), keep=set())
    assert err is not None and err.exit_code == 3 and not action.commands
    assert "alice-experiments" in (err.hint or "") and "not made by vllm-orch" in (err.hint or "")


def test_the_budget_counts_only_our_folders():
    entry = HostEntry(name="gpu1", address="gpu1.example", models_disk_budget_gib=100)
    f = facts({"alice-experiments": mdir("alice-experiments", 500, 1.0, ours=False)}, disk_free=3000 * GIB)
    inp = plan_input(f, 50)
    available, why = prepare.disk_available(PlanInput(**{**inp.__dict__, "entry": entry}))
    assert available == 100 * GIB and "0 B used" in why


def test_deleting_asks_first_and_the_plan_says_so():
    f = facts({"kimi-k25-int4": mdir("kimi-k25-int4", 550, 5.0)}, disk_free=300 * GIB)
    plan = plan_deploy(plan_input(f, 400))
    disk = [a for a in plan.actions if a.step == "disk"][0]
    assert disk.confirm and "kimi-k25-int4" in disk.confirm
    assert plan.confirmations() == [disk.confirm]
    assert "asks before deleting (--yes accepts)" in plan.text()
    yes = plan_deploy(plan_input(f, 400, yes=True))
    assert "accepted with --yes" in yes.text() and yes.confirmations() == [disk.confirm]


def test_gc_keeps_folders_it_did_not_make():
    f = facts({"alice-experiments": mdir("alice-experiments", 5, 1.0, ours=False), "old": mdir("old", 5, 2.0)})
    delete, keep = gc_choice(f)
    assert [c.name for c in delete] == ["old"]
    assert "not made by vllm-orch" in dict(keep)["alice-experiments"]
