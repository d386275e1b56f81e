"""The engine step in deploy's and swap's plans, an upgrade's rollback, and gc of engine venvs, from
hand-made facts (the helpers of test_planners.py)."""

from __future__ import annotations

import json
from dataclasses import replace

from orchestrator.config.effective import effective
from orchestrator.config.engine import lock_of
from orchestrator.config.manifest import Engine
from orchestrator.host.engine import EngineState
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import LockFacts, ServiceInput
from orchestrator.plan.stop import plan_gc
from orchestrator.plan.swap import plan_swap
from orchestrator.render.artifacts import render
from tests.unit.test_planners import ENTRY, MODELS, RTX, download, facts, inp, records, running

NAME = "kimi-k25-int4"


def engine_svc(vllm: str, *, installed_from: ServiceInput | None = None, serving: bool = False) -> ServiceInput:
    """The model with `engine: {vllm: VERSION}`; `installed_from`: the files installed now are that one's."""
    m = MODELS[NAME].model_copy(update={"engine": Engine(vllm=vllm, torch="2.13.0+cu130", flashinfer="0.6.14")})
    eff = effective(m, ENTRY, {i: RTX for i in range(8)})
    r = render(eff.manifest, ENTRY, {})
    files = {f.path: None for f in r.files}
    if installed_from is not None:
        files = {f.path: f.data() for f in installed_from.rendered.files}
    return ServiceInput(manifest=eff.manifest, rendered=r, installed_files=files, serving=serving, effective=eff)


def state(t: ServiceInput, ok: bool) -> EngineState:
    lock = lock_of(t.manifest.engine)  # type: ignore[arg-type]
    path = f"{ENTRY.engines_root}/{lock.name}"
    return EngineState(lock, path, "ok", vllm_version=lock.vllm_version, bytes=7 * 10 ** 9) if ok else \
        EngineState(lock, path, "missing", f"{path} does not exist")


def test_deploy_builds_a_missing_engine_after_the_download_and_before_the_gpus():
    t = engine_svc("0.33.0")
    plan = plan_deploy(replace(inp(t, facts(users={}), download(10)), engine=state(t, ok=False)))
    steps = [a.step for a in plan.actions]
    assert steps == ["lock", "preflight", "disk", "download", "engine", "gpus", "user", "install", "start", "ready",
                     "perf", "record"]
    engine = plan.actions[4]
    assert not engine.noop and "vllm-0.33.0-" in engine.summary and "registries" in engine.summary
    assert "lock: flashinfer-cubin==0.6.14" in engine.details and "lock: flashinfer-python==0.6.14" in engine.details
    assert render(t.manifest, ENTRY, {}).argv[0].startswith(f"{ENTRY.engines_root}/vllm-0.33.0-")


def test_an_engine_that_verifies_is_nothing_to_do_and_a_wheelhouse_host_builds_offline():
    t = engine_svc("0.33.0")
    plan = plan_deploy(replace(inp(t, facts(users={}), download(10)), engine=state(t, ok=True)))
    engine = next(a for a in plan.actions if a.step == "engine")
    assert engine.noop and "exists and verifies" in engine.summary
    offline = replace(inp(t, facts(users={}), download(10)), engine=state(t, ok=False),
                      entry=ENTRY.model_copy(update={"wheelhouse": "/srv/wheels"}))
    engine = next(a for a in plan_deploy(offline).actions if a.step == "engine")
    assert "uploaded wheelhouse (offline)" in engine.summary


def test_a_manifest_without_engine_has_no_engine_step():
    from tests.unit.test_planners import svc
    plan = plan_deploy(inp(svc(NAME), facts(users={}), download(10)))
    assert "engine" not in [a.step for a in plan.actions]


def test_an_upgrade_is_a_swap_that_builds_first_and_rolls_back_to_the_previous_unit():
    old = engine_svc("0.24.0")
    new = engine_svc("0.33.0", installed_from=old)
    f = facts(services=running(NAME), active={"model": NAME, "unit_hash": old.rendered.unit_hash,
                                              "gpus": list(range(8))})
    plan = plan_swap(replace(inp(new, f, download(0, 10)), engine=state(new, ok=False)))
    steps = [a.step for a in plan.actions]
    assert steps.index("engine") < steps.index("install") < steps.index("start")
    start = next(a for a in plan.actions if a.step == "start")
    rec = plan.recovery_for(plan.number_of(start))
    assert rec is not None and [a.step for a in rec.actions] == ["stop", "restore", "start", "ready"]
    assert "previous engine" in rec.title
    restore = rec.actions[1]
    assert old.rendered.unit.path in restore.summary


def test_gc_deletes_engines_no_record_or_installed_unit_names_and_keeps_the_others():
    used, spare = "vllm-0.33.0-" + "a" * 16, "vllm-0.24.0-" + "b" * 16
    partial = "vllm-0.25.0-" + "c" * 16
    f = facts(installed={NAME: {"model": NAME, "engine": used}})
    f = replace(f, records=records(**{NAME: {"model": NAME, "engine": used}}))
    listing = [{"name": used, "complete": True, "vllm_version": "0.33.0", "bytes": 7 * 10 ** 9},
               {"name": spare, "complete": True, "vllm_version": "0.24.0", "bytes": 6 * 10 ** 9},
               {"name": partial, "complete": False, "vllm_version": None, "bytes": 10 ** 9}]
    gc = plan_gc(ENTRY, f, LockFacts(held=True), listing)
    assert gc.info["delete_engines"] == [spare, partial]
    assert [c for c in gc.confirmations() if "engines" in c] == [
        f"delete {ENTRY.engines_root}/{spare} on gpu1 (6.0 GB)", f"delete {ENTRY.engines_root}/{partial} on gpu1 (1.0 GB)"]
    keep = next(a for a in gc.actions if a.step == "keep")
    assert f"{used}: a service uses it" in keep.details
    unread = plan_gc(ENTRY, f, LockFacts(held=True), engines_error="no answer")
    assert not unread.info["delete_engines"]


def test_regen_refuses_a_unit_whose_engine_is_not_built_and_points_to_swap():
    from orchestrator.plan.inputs import RegenInput
    from orchestrator.plan.regen import plan_regen
    from orchestrator.plan.run import Options

    t = engine_svc("0.33.0")
    lock = LockFacts(held=True)
    base = dict(entry=ENTRY, facts=facts(), opts=Options(), lock=lock, services=[t])
    refused = plan_regen(RegenInput(**base, engines={t.name: state(t, ok=False)}))
    assert refused.refusal is not None and refused.refusal.step == "engine"
    assert f"vllm-orch swap {NAME}" in (refused.refusal.hint or "")
    assert plan_regen(RegenInput(**base, engines={t.name: state(t, ok=True)})).refusal is None


def test_the_engine_step_says_whether_it_trusted_the_recorded_verdict_or_ran_the_full_check():
    t = engine_svc("0.33.0")
    ok = state(t, ok=True)

    def summary(s: EngineState) -> str:
        plan = plan_deploy(replace(inp(t, facts(users={}), download(10)), engine=s))
        engine = next(a for a in plan.actions if a.step == "engine")
        assert engine.noop and not engine.commands
        return engine.summary

    earlier = summary(replace(ok, verified="earlier", verified_at=1796169600.0, verify_seconds=43.2))
    assert "verified earlier, unchanged" in earlier and "2026-12-02 00:00 UTC" in earlier, earlier
    assert "--verify-engine" in earlier and "full check" not in earlier.split(";")[0]
    now = summary(replace(ok, verified="now", verify_seconds=43.2, why_verified="the venv changed since it was verified"))
    assert "exists and verifies" in now and "the full check in 43s" in now and "the venv changed" in now, now
    # a time the host wrote is untrusted: any number reads as some time, never a crash
    assert "at an unknown time" in summary(replace(ok, verified="earlier", verified_at=1e300))


def test_the_hosts_answer_about_a_verdict_is_untrusted_and_force_reaches_the_script(monkeypatch):
    from orchestrator.host import engine, scripts
    from orchestrator.host.base import Result

    t = engine_svc("0.33.0")
    lock = lock_of(t.manifest.engine)  # type: ignore[arg-type]
    sent: list[dict] = []

    def run_json(host, python, name, args=(), *, timeout=180.0):
        sent.append(json.loads(args[1]))
        return {"state": "ok", "vllm_version": "0.33.0", "verified": "earlier", "verified_at": float("nan"),
                "verify_seconds": "12", "bytes": "lots"}, Result("engine.py check", 0)

    monkeypatch.setattr(scripts, "run_json", run_json)
    st = engine.check(None, ENTRY, lock, force=True)  # type: ignore[arg-type]
    assert sent[0]["force"] is True and sent[0]["lock"]["hash"] == lock.hash
    assert (st.verified_at, st.verify_seconds, st.bytes) == (None, None, None)
    plan = plan_deploy(replace(inp(t, facts(users={}), download(10)), engine=st))
    assert "verified earlier, unchanged" in next(a.summary for a in plan.actions if a.step == "engine")


def test_a_wheel_url_outside_the_hosts_prefixes_is_refused_by_the_plan_even_for_a_venv_built_earlier():
    import pytest

    from orchestrator.errors import ConfigError
    url = "https://wheels.example/vllm/vllm-0.33.0-py3-none-any.whl"
    t = engine_svc(url)
    for ok in (False, True):
        with pytest.raises(ConfigError) as refused:
            plan_deploy(replace(inp(t, facts(users={}), download(10)), engine=state(t, ok=ok)))
        assert refused.value.exit_code == 2 and "wheel_url_prefixes" in refused.value.message
    allowed = replace(inp(t, facts(users={}), download(10)), engine=state(t, ok=False),
                      entry=ENTRY.model_copy(update={"wheel_url_prefixes": ["https://wheels.example/vllm/"]}))
    engine = next(a for a in plan_deploy(allowed).actions if a.step == "engine")
    assert not engine.noop and "vllm-0.33.0-" in engine.summary


def test_a_host_that_requires_hashes_refuses_the_plan_of_an_engine_without_a_lock_file_even_one_built_earlier():
    import pytest

    from orchestrator.errors import ConfigError
    t = engine_svc("0.33.0")
    strict = ENTRY.model_copy(update={"require_hashes": True})
    for ok in (False, True):
        with pytest.raises(ConfigError) as refused:
            plan_deploy(replace(inp(t, facts(users={}), download(10)), engine=state(t, ok=ok), entry=strict))
        assert refused.value.exit_code == 2 and "require_hashes" in refused.value.message
        assert f"{NAME}'s engine: has no lock_file" in refused.value.message
    engine = next(a for a in plan_deploy(replace(inp(t, facts(users={}), download(10)), engine=state(t, ok=False)))
                  .actions if a.step == "engine")
    assert not engine.noop and "hashes required" not in engine.summary
