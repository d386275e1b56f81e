"""One copy of each checkpoint on a SIMULATED host (issue 43): the layouts of one model share its
weights. A manifest following a branch adopts a folder that holds the commit the branch resolves
to (a swap from kimi-k25-int4 to kimi-k25-int4-dcp8 downloads 0 bytes: it fetched all 64 shards
again before); manifests pinned to a commit share the commit's own folder (`org--name--<commit>`);
gc keeps a shared folder while any service uses it, and `gc NAME` refuses it."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import HfApi

from orchestrator.config.manifest import Manifest
from orchestrator.errors import RefusedError
from orchestrator.host.state import read_records
from orchestrator.ops.stop import gc_plan
from orchestrator.plan.inputs import LockFacts

from .deployhelp import deploy, entry, free_port, on_port, statuses, swap


def pinned(m: Manifest, commit: str) -> Manifest:
    data = m.model_dump()
    data["source"]["revision"] = commit
    return Manifest.model_validate(data)


def folders(sim_host) -> list[str]:
    return sorted(p.name for p in (sim_host.dir / "models").iterdir() if p.is_dir())


def cmdline_folder(sim_host, name: str) -> str:
    pid = int((sim_host.dir / "state" / "run" / f"vllm-{name}.pid").read_text().split()[0])
    argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    return argv[argv.index(b"serve") + 1].decode()


def test_a_second_layout_of_one_model_downloads_nothing_and_gc_keeps_the_shared_folder(sim_host):
    port = free_port()
    int4, dcp8 = on_port("kimi-k25-int4", port), on_port("kimi-k25-int4-dcp8", port)
    e = entry(sim_host)
    first = deploy(e, int4)
    assert first.ok, first.error
    assert statuses(first)["download"] == "done"
    assert folders(sim_host) == ["kimi-k25-int4"]

    res = swap(e, dcp8, {int4.name: int4, dcp8.name: dcp8})
    assert res.ok, res.error
    assert statuses(res)["download"] == "skipped", statuses(res)        # 0 bytes: the commit is there
    step = next(a for a in res.plan.actions if a.step == "download")
    assert "is downloaded and verified" in step.summary and "kimi-k25-int4" in step.summary, step.summary
    assert folders(sim_host) == ["kimi-k25-int4"]                        # no second copy
    rec = read_records(sim_host.host, e)[dcp8.name]
    assert rec.folder == "kimi-k25-int4", rec
    assert cmdline_folder(sim_host, dcp8.name) == str(sim_host.dir / "models" / "kimi-k25-int4")

    gc = gc_plan(sim_host.host, e, LockFacts(held=True))
    assert gc.info["delete"] == [] and ["kimi-k25-int4", "the weights of kimi-k25-int4-dcp8"] in gc.info["keep"]
    with pytest.raises(RefusedError) as refused:
        gc_plan(sim_host.host, e, LockFacts(held=True), ["kimi-k25-int4"])
    assert "kimi-k25-int4 stays: the weights of kimi-k25-int4-dcp8" in refused.value.message


def test_manifests_pinned_to_one_commit_share_the_commits_folder(sim_host):
    e = entry(sim_host)
    api = HfApi(endpoint=sim_host.entry["env"]["HF_ENDPOINT"], token=False)
    commit = api.model_info("MiniMaxAI/MiniMax-M2.5", revision="main").sha
    assert commit and len(commit) == 40
    port = free_port()
    tp4 = pinned(on_port("minimax-m25", port), commit)
    ep = pinned(on_port("minimax-m25-ep", port), commit)
    store = f"MiniMaxAI--MiniMax-M2.5--{commit}"
    first = deploy(e, tp4)
    assert first.ok, first.error
    assert folders(sim_host) == [store]
    record = json.loads((sim_host.dir / "models" / store / ".vllm-orch" / "verified.json").read_text())
    assert record["complete"] and record["patterns"] == {"allow": tp4.source.allow_patterns,
                                                         "ignore": tp4.source.ignore_patterns}
    res = swap(e, ep, {tp4.name: tp4, ep.name: ep})
    assert res.ok, res.error
    assert statuses(res)["download"] == "skipped", statuses(res)
    assert folders(sim_host) == [store]
    assert read_records(sim_host.host, e)[ep.name].folder == store
    assert cmdline_folder(sim_host, ep.name) == str(sim_host.dir / "models" / store)
