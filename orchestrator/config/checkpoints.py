"""How a checkpoint's folder under models_root is named, and which folder a service keeps its
weights in. Pure.

One copy of each checkpoint: a manifest pinned to a commit keeps its weights in the folder named
after the repo and that commit (`store_name`: `moonshotai--Kimi-K2.5--<commit>`), which every
manifest of that repo@commit shares (the TP8 and DCP8 layouts of one model download it once, and
gc keeps it while any service uses it). A manifest that follows a branch starts in a folder named
after the model, and once the download plan has resolved the branch (`move_for`) uses a complete
folder that holds that commit already, or its commit's own folder rather than change the weights
under another service. `folder_for` picks a service's folder once, when an operation gathers its
inputs (ops/gather.py); the service's records keep it, and a regen never moves it. A folder counts
as vllm-orch's only with its record (`is_ours`; host/modeldirs.py deletes nothing else).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def store_name(repo: str, revision: str, pinned: bool) -> str | None:
    """The shared folder of repo@commit (`org--name--<40 hex>`: the `--` a repo id cannot hold, a
    plain folder name), None for a revision that is a branch."""
    return f"{repo.replace('/', '--')}--{revision}" if pinned else None


def holds(record: object, repo: str, commit: str) -> bool:
    """A folder's record says it holds repo@commit (complete or not: a download resumes there): the
    commit it was downloaded at (`commit`; a branch's record names the branch as its `revision`)."""
    return is_ours(record) and isinstance(record, dict) and record.get("repo") == repo and \
        (record.get("commit") or record.get("revision")) == commit


def move_for(repo: str, commit: str, pinned: bool, folder: str, fetches: bool, others: set[str],
             records: Mapping[str, Any]) -> str | None:
    """After a branch resolved to `commit` (the download plan): the folder the service should use
    instead of `folder`, or None to stay. A complete folder of vllm-orch's that holds this commit
    under another name is used (the other layout of one model: 0 bytes downloaded); and when the
    download would change `folder` (`fetches`) while another service uses it (`others`: their
    folders), the commit's own shared folder (store_name): a deploy never changes the weights
    under another service. A pinned manifest's folder is its commit's already (folder_for)."""
    if pinned:
        return None
    same = sorted(n for n, r in records.items() if n != folder and holds(r, repo, commit) and r.get("complete"))
    if same and fetches:
        return same[0]
    if fetches and folder in others:
        return store_name(repo, commit, True)
    return None


def folder_for(repo: str, revision: str, pinned: bool, model: str, recorded: str | None,
               records: Mapping[str, Any]) -> str:
    """The folder under models_root a service of `model` keeps repo@revision in. `recorded`: the
    folder its installed record names (or its model's, for a record from before folders were
    recorded); `records`: each folder's parsed .vllm-orch/verified.json (None: not ours). In order:
    the recorded folder when it holds this very commit (a redeploy, a regen: never moved); the
    commit's shared folder when it exists (store_name); a complete folder of vllm-orch's that holds
    this commit under another name (a model's folder from before the store: adopted, 0 bytes
    downloaded); else the shared folder (a new download). A branch: the recorded folder, else the
    model's own."""
    if recorded and holds(records.get(recorded), repo, revision):
        return recorded
    name = store_name(repo, revision, pinned)
    if name is None:
        return recorded or model
    if name in records:
        return name
    same = sorted(n for n, r in records.items() if holds(r, repo, revision) and r.get("complete"))
    return same[0] if same else name


def is_ours(record: object) -> bool:
    """A folder's parsed .vllm-orch/verified.json marks it as made by vllm-orch's download."""
    return isinstance(record, dict) and bool(record.get("repo")) and isinstance(record.get("files"), dict)
