"""The parts of a plan that only a service over several nodes has, pure: a step named after its
node (`on`), the parallel download on every node, the check that every node holds the same
weights (verify-same), the service a swap replaces across its nodes (OldService) and the removal
of its record from a node the new service does not use. The planners themselves (plan/deploy.py,
plan/swap.py) plan a service over N >= 1 nodes: a one-host service is the case N = 1.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import DeployFailed, OrchestratorError, RefusedError
from orchestrator.host import modeldirs, state
from orchestrator.plan import prepare
from orchestrator.plan.inputs import PlanInput, ServiceInput
from orchestrator.plan.model import Action
from orchestrator.plan.run import RunEnv


def on(node: str, action: Action) -> Action:
    """The action, run on one node."""
    action.node = node
    return action


def nodes_desc(inputs: Sequence[PlanInput]) -> str:
    """`gpu1 (head), gpu2 (rank 1)`: the plan's hosts, head first."""
    return ", ".join(f"{i.entry.name} ({'head' if n == 0 else f'rank {n}'})" for n, i in enumerate(inputs))


# -- the same weights on every node ----------------------------------------------------------------

def weights_fingerprint(record: Mapping | None) -> tuple[str | None, dict[str, tuple]] | None:
    """What must be equal on every node: the resolved commit and every file's size and hash (sha256
    for LFS files, the git blob id for small ones), from the node's .vllm-orch/verified.json. None:
    no complete record."""
    if not isinstance(record, Mapping) or not record.get("complete"):
        return None
    files = record.get("files") if isinstance(record.get("files"), Mapping) else {}
    assert isinstance(files, Mapping)
    return record.get("commit") or record.get("revision"), {
        str(name): (f.get("size"), f.get("sha256") or f.get("blob_id")) for name, f in files.items()
        if isinstance(f, Mapping)}


def weights_differ(records: Mapping[str, Mapping | None], head: str) -> tuple[str, str] | None:
    """(node, why) for the first node whose verified weights differ from the head's; None when all
    are the same. `records`: each node's verified.json (None: missing or unreadable)."""
    prints = {n: weights_fingerprint(r) for n, r in records.items()}
    base = prints.get(head)
    if base is None:
        return head, "has no complete verified record of the model (.vllm-orch/verified.json)"
    for node, got in prints.items():
        if node == head:
            continue
        if got is None:
            return node, "has no complete verified record of the model (.vllm-orch/verified.json)"
        if got[0] != base[0]:
            return node, f"holds commit {str(got[0])[:12]}, the head {head} holds {str(base[0])[:12]}"
        names = sorted(set(got[1]) | set(base[1]))
        wrong = [n for n in names if got[1].get(n) != base[1].get(n)]
        if wrong:
            return node, (f"{len(wrong)} file{'s' if len(wrong) != 1 else ''} differ{'s' if len(wrong) == 1 else ''} "
                          f"from the head {head}'s: " + ", ".join(wrong[:3]) + (", ..." if len(wrong) > 3 else ""))
    return None


def verify_same_action(inputs: Sequence[PlanInput]) -> tuple[Action, RefusedError | None]:
    """Every node's verified record names the same commit and the same hash of every file, checked
    after the downloads and before any start. Refused at plan time already when the nodes resolve
    the revision to different commits (a node behind another mirror, a branch that moved)."""
    head, m, folder = inputs[0], inputs[0].target.manifest, inputs[0].target.folder
    names = [i.entry.name for i in inputs]
    planned = {i.entry.name: i.download.commit for i in inputs if i.download is not None and i.download.commit}
    base = planned.get(head.entry.name)
    for node, commit in planned.items():
        if base is not None and commit != base:
            err = RefusedError(f"{m.source.repo}@{m.source.revision} resolves to commit {commit[:12]} on {node} but "
                               f"{base[:12]} on the head {head.entry.name}: the nodes would load different weights",
                               host=node, step="verify-same",
                               hint="pin source.revision to a commit, or make every node reach the same Hub")
            return Action("verify-same", f"{node} would download other weights than the head"), err
    path = modeldirs.RECORD

    def run(env: RunEnv) -> str:
        records = {}
        for n in names:
            e = env.nodes[n]
            records[n] = state.read_json(e.host, f"{prepare.model_path(e.entry, folder)}/{path}")
        differs = weights_differ(records, names[0])
        if differs is not None:
            bad, why = differs
            raise DeployFailed(f"{bad} {why}: the nodes must load the same weights", host=bad,
                               step="verify-same",
                               hint=f"delete {folder} on {bad} (`vllm-orch gc {folder} --host {bad}`) and deploy "
                                    f"again")
        fp = weights_fingerprint(records[names[0]])
        assert fp is not None
        return f"{len(names)} nodes hold commit {str(fp[0])[:12]}, {len(fp[1])} files with the same hashes"

    return Action("verify-same", f"check that {', '.join(names)} hold the same commit and the same sha256 of "
                                 f"every file ({path} of each), before any start", run=run), None


# -- downloads on all nodes at once ----------------------------------------------------------------

def download_all_action(inputs: Sequence[PlanInput]) -> Action:
    """Each node's download step (plan/prepare.py), all of them at once: one thread per node."""
    per = [(i.entry.name, prepare.download_action(i)) for i in inputs]
    todo = [(n, a) for n, a in per if not a.noop]
    details: list[str] = []
    for n, a in per:
        details += [f"{n}: {line}" for line in a.lines()]
    if not todo:
        return Action("download", f"nothing to do, because every node ({len(per)}) has the model downloaded and "
                                  f"verified", noop=True, details=details)

    def run(env: RunEnv) -> str:
        outcomes: dict[str, str | BaseException] = {}

        def one(node: str, action: Action) -> None:
            assert action.run is not None
            try:        # each node's download quiet: one live progress bar per node would fight over the terminal
                outcomes[node] = action.run(dataclasses.replace(env.nodes[node], reporter=None)) or ""
            except BaseException as exc:        # handed to the caller's thread below
                outcomes[node] = exc

        # Daemon threads: an interrupt ends the run at once (the downloads end with their connections)
        # instead of vllm-orch waiting at exit for every node's download to finish.
        threads = [threading.Thread(target=one, args=(n, a), name=f"download-{n}", daemon=True) for n, a in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done = [f"{n}: {outcomes[n]}" for n, _ in todo if isinstance(outcomes.get(n), str)]
        errors = [(n, e) for n, _ in todo if isinstance(e := outcomes.get(n), BaseException)]
        for n, exc in errors:
            if not isinstance(exc, OrchestratorError):
                raise exc
            exc.host = exc.host or n
        if errors:
            first = errors[0][1]
            assert isinstance(first, OrchestratorError)
            first.details = first.details + [str(e) for _, e in errors[1:]] + done
            raise first
        return "; ".join(done)

    return Action("download", f"fetch on {', '.join(n for n, _ in todo)} in parallel (every node downloads and "
                              f"verifies its own copy)", details=details, run=run)


# -- the service a swap replaces --------------------------------------------------------------------

@dataclass(frozen=True)
class OldService:
    """The service a multi-node swap replaces: its name, its nodes (head first; one for a one-host
    service) and, on the head, how it serves (its manifest and files: the rollback's gates)."""

    name: str
    nodes: tuple[str, ...]
    head: ServiceInput
    running: frozenset[str]                     # the nodes it runs on now


def forget_record_action(entry: HostEntry, name: str) -> Action:
    """A node of the old service that is no node of the new one: its record of the old one goes."""
    def run(env: RunEnv) -> str:
        state.write_record(env.host, env.entry, name, None)
        return f"removed {name}'s record"

    return Action("record", f"remove {name}'s record (this host is no node of the new service)", run=run)
