"""Which folder a service keeps its weights in (config/checkpoints.py): one per repo@commit, shared."""

from __future__ import annotations

from orchestrator.config.checkpoints import folder_for, holds, move_for, store_name
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all
from orchestrator.paths import shipped_dir
from orchestrator.render.artifacts import render

REPO, C1, C2 = "moonshotai/Kimi-K2.5", "a" * 40, "b" * 40
STORE1 = f"moonshotai--Kimi-K2.5--{C1}"


def rec(commit: str = C1, repo: str = REPO, complete: bool = True, branch: bool = False) -> dict:
    return {"repo": repo, "revision": "main" if branch else commit, "commit": commit, "files": {},
            "complete": complete}


def test_a_pinned_manifest_keeps_its_commit_in_the_commits_own_folder():
    assert store_name(REPO, C1, True) == STORE1
    assert store_name(REPO, "main", False) is None
    assert folder_for(REPO, C1, True, "kimi-k25-int4", None, {}) == STORE1              # a new download
    assert folder_for(REPO, C1, True, "kimi-k25-int4-dcp8", None, {STORE1: rec()}) == STORE1   # shared


def test_a_folder_from_before_the_store_holding_the_commit_is_adopted_and_a_recorded_one_kept():
    legacy = {"kimi-k25-int4": rec(branch=True)}
    assert folder_for(REPO, C1, True, "kimi-k25-int4-dcp8", None, legacy) == "kimi-k25-int4"
    # an incomplete one is not adopted (another manifest's download under way), another commit neither
    assert folder_for(REPO, C1, True, "x", None, {"kimi-k25-int4": rec(complete=False)}) == STORE1
    assert folder_for(REPO, C1, True, "x", None, {"kimi-k25-int4": rec(C2)}) == STORE1
    # a folder not vllm-orch's (no record) is never taken
    assert folder_for(REPO, C1, True, "x", None, {"kimi-k25-int4": None}) == STORE1
    # the service's own recorded folder, when it holds the commit (complete or resuming)
    assert folder_for(REPO, C1, True, "x", "mine", {"mine": rec(complete=False), STORE1: rec()}) == "mine"
    assert folder_for(REPO, C1, True, "x", "mine", {"mine": rec(C2)}) == STORE1
    # a branch: its recorded folder, else the model's own (the commit is known only from the Hub)
    assert folder_for(REPO, "main", False, "x", None, legacy) == "x"
    assert folder_for(REPO, "main", False, "x", "kimi-k25-int4", legacy) == "kimi-k25-int4"
    assert holds(rec(branch=True), REPO, C1) and not holds(rec(), "other/repo", C1)


def test_a_branch_moves_to_a_folder_holding_its_commit_and_never_changes_another_services_weights():
    records = {"kimi-k25-int4": rec(branch=True)}
    # the commit is there under another layout's name: 0 bytes
    assert move_for(REPO, C1, False, "kimi-k25-int4-dcp8", True, set(), records) == "kimi-k25-int4"
    assert move_for(REPO, C1, False, "kimi-k25-int4-dcp8", False, set(), records) is None   # nothing to fetch
    # the branch moved (C2) and its folder serves another service: the new commit's own folder
    assert move_for(REPO, C2, False, "kimi-k25-int4", True, {"kimi-k25-int4"}, records) == store_name(REPO, C2, True)
    assert move_for(REPO, C2, False, "kimi-k25-int4", True, set(), records) is None     # its own: updated there
    assert move_for(REPO, C1, True, "x", True, {"x"}, records) is None                   # pinned: folder_for's


def test_a_bare_render_of_a_pinned_manifest_serves_from_its_commits_folder():
    m = load_all(shipped_dir("models"))[0]["minimax-m25"]
    data = m.model_dump()
    data["source"]["revision"] = C1
    pinned = type(m).model_validate(data)
    host = HostEntry(name="h", address="h")
    r = render(pinned, host)
    assert r.folder == f"MiniMaxAI--MiniMax-M2.5--{C1}"
    assert r.argv[2] == f"{host.models_root}/MiniMaxAI--MiniMax-M2.5--{C1}"
    assert render(m, host).folder == "minimax-m25"           # a branch: the model's own, as before
