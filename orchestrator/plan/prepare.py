"""Plan steps that prepare a host before anything serving changes: the lock, preflight, disk room,
the download. Each returns an Action (the exact commands, or "nothing to do, because ...") and, for
steps that may refuse, the RefusedError. Pure: facts in, actions out.
"""

from __future__ import annotations

import shlex
import time

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import COMMIT
from orchestrator.errors import RefusedError
from orchestrator.fmt import fmt_bytes
from orchestrator.host import modeldirs, scripts
from orchestrator.host.base import Command, Script
from orchestrator.host.download import SCRIPT, download_args, run_download
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput
from orchestrator.plan.model import Action
from orchestrator.plan.preflight import FAIL, SKIPPED, WARN, Check
from orchestrator.plan.run import DownloadResult, RunEnv

GIB = 1024 ** 3


def model_path(entry: HostEntry, name: str) -> str:
    return f"{entry.models_root}/{name}"


# -- lock ------------------------------------------------------------------------------------------

def lock_action(lock: LockFacts) -> Action:
    if lock.held:
        return Action("lock", f"holding the deploy lock {lock.path} for this run", run=lambda env: "held")
    if lock.holder:
        h = lock.holder
        return Action("lock", f"the deploy lock {lock.path} is held by {h.get('operation', '?')} "
                              f"({h.get('holder', '?')}, since {h.get('since', '?')}): a real run would be refused")
    return Action("lock", f"take the deploy lock {lock.path} (free now; released when vllm-orch exits)")


# -- preflight -------------------------------------------------------------------------------------

def preflight_lines(checks: list[Check]) -> list[str]:
    out = []
    for c in checks:
        mark = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skipped": "skipped"}[c.status]
        timing = f" ({c.seconds:.1f}s)" if c.seconds else ""
        out.append(f"{mark:<7} {c.name}: {c.summary}{timing}")
        if c.status in (FAIL, WARN):
            out += [f"          {d}" for d in c.details[:4]]
            if c.fix:
                out.append(f"          fix: {c.fix}")
    return out


def preflight_action(inp: PlanInput) -> tuple[Action, RefusedError | None]:
    """The checks gathered and evaluated before planning (orchestrator.plan.preflight): nothing on
    the host changes, nothing is downloaded before they pass."""
    checks = inp.preflight
    details = preflight_lines(checks)
    if inp.facts.gpu_error:
        details.append(f"          nvidia-smi: {inp.facts.gpu_error}")
    failed = [c for c in checks if c.status == FAIL]
    skipped = [c.name for c in checks if c.status == SKIPPED]
    if failed:
        first = failed[0]
        err = RefusedError(f"{first.name}: {first.summary}", host=inp.entry.name, step="preflight",
                           hint=(first.fix + "; " if first.fix else "") + f"--skip-check {first.name} if you know better",
                           details=[f"{c.name}: {c.summary}" for c in failed[1:]])
        return Action("preflight", f"{len(failed)} of {len(checks)} checks failed", details=details), err
    warned = [c.name for c in checks if c.status == WARN]
    summary = f"{len(checks) - len(skipped)} checks passed" + \
        (f" ({len(warned)} with warnings: {', '.join(warned)})" if warned else "") + \
        (f", {len(skipped)} skipped: {', '.join(skipped)}" if skipped else "")
    return Action("preflight", summary, noop=True, details=details), None


# -- disk ------------------------------------------------------------------------------------------

def disk_available(inp: PlanInput) -> tuple[int, str]:
    """Bytes the download may use now: min(disk free - reserve, budget - managed bytes), and why."""
    f, entry, m = inp.facts, inp.entry, inp.target.manifest
    host_reserve = entry.disk_reserve_gib is not None
    reserve_gib = entry.disk_reserve_gib if entry.disk_reserve_gib is not None else m.requires.disk_reserve_gib
    reserve = int(reserve_gib * GIB)
    available = f.disk_free - reserve
    limit_txt = f"{fmt_bytes(f.disk_free)} free on {f.disk_path} - {fmt_bytes(reserve)} reserve" + \
        (" (host setting)" if host_reserve else "")
    if entry.models_disk_budget_gib is not None:
        used = sum(d.bytes for d in f.models.values() if d.ours)
        budget_left = int(entry.models_disk_budget_gib * GIB) - used
        if budget_left < available:
            available = budget_left
            limit_txt = (f"models budget {entry.models_disk_budget_gib:g} GiB - {fmt_bytes(used)} used by "
                         f"managed models")
    return available, limit_txt


def delete_command(entry: HostEntry, name: str) -> Command:
    """The guarded delete of one model folder (orchestrator/host/modeldirs.py)."""
    return modeldirs.delete_script(entry.models_root, name)


def deletion_note(opts_yes: bool) -> str:
    return "accepted with --yes" if opts_yes else "asks before deleting (--yes accepts)"


def not_ours(facts_models: dict, protected: set[str]) -> list[str]:
    """Folders under models_root that vllm-orch did not make: never deleted, named so a plan explains
    why they stay."""
    return sorted(n for n, d in facts_models.items() if not d.ours and n not in protected)


def disk_action(inp: PlanInput, keep: set[str]) -> tuple[Action, RefusedError | None]:
    """Make room for the download: free = min(disk free - reserve, budget - managed bytes)."""
    assert inp.download is not None
    need = inp.download.to_fetch_bytes
    f, entry = inp.facts, inp.entry
    available, limit_txt = disk_available(inp)
    if need <= 0:
        return Action("disk", "nothing to do, because nothing needs downloading", noop=True), None
    if need <= available:
        return Action("disk", f"nothing to do, because {fmt_bytes(need)} fits: {fmt_bytes(available)} "
                              f"available ({limit_txt})", noop=True), None
    # Never a model another service on the host uses: running ones, and recorded ones (stopped by
    # a crash, or by the swap under way) come back with their files.
    protected = set(keep) | {inp.name, inp.target.model, inp.target.folder} | f.models_in_use()
    candidates = sorted((d for n, d in f.models.items() if n not in protected and d.ours),
                        key=lambda d: d.last_used)
    theirs = not_ours(f.models, protected)
    kept = [f"kept {n}: not made by vllm-orch (no .vllm-orch/verified.json), never deleted" for n in theirs]
    chosen, freed = [], 0
    for d in candidates:
        if available + freed >= need:
            break
        chosen.append(d)
        freed += d.bytes
    if available + freed < need:
        err = RefusedError(
            f"not enough disk: the download needs {fmt_bytes(need)}, {fmt_bytes(max(available, 0))} is "
            f"available ({limit_txt}) and deleting every inactive managed model would free only "
            f"{fmt_bytes(freed)}", host=entry.name, step="disk",
            hint="free space on the models disk, lower requires.disk_reserve_gib, or raise the budget"
                 + (" (protected: " + ", ".join(sorted(p for p in protected if p)) + ")" if protected else "")
                 + (f"; not made by vllm-orch, so never deleted: {', '.join(theirs)}" if theirs else ""))
        return Action("disk", f"short by {fmt_bytes(need - available - freed)}", details=kept), err
    details = [f"delete {d.name}: {fmt_bytes(d.bytes)}, last used "
               f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(d.last_used)) if d.last_used else 'never'}"
               for d in chosen] + kept
    folders = f"model folder{'s' if len(chosen) != 1 else ''}"
    return Action("disk", f"free {fmt_bytes(freed)} by deleting {len(chosen)} least recently used inactive "
                          f"{folders} (needs {fmt_bytes(need)}, {fmt_bytes(max(available, 0))} available; "
                          f"{deletion_note(inp.opts.yes)})",
                  commands=[delete_command(entry, d.name) for d in chosen], details=details,
                  confirm=f"delete {len(chosen)} {folders} on {entry.name} ("
                          + ", ".join(f"{d.name} {fmt_bytes(d.bytes)}" for d in chosen) + ")"), None


# -- the service user ------------------------------------------------------------------------------

def user_command(entry: HostEntry) -> Command:
    """useradd of the unprivileged system user the service runs as: its own group, a home beside
    state_dir for vLLM's caches, no login shell."""
    q = shlex.quote
    return Script(f"useradd --system --user-group --create-home --home-dir {q(entry.service_home)} "
                  f"--shell \"$(command -v nologin || echo /bin/false)\" {q(entry.service_user)}",
                  display=f"useradd --system --user-group --create-home --home-dir {q(entry.service_home)} "
                          f"--shell nologin {q(entry.service_user)}")


def user_action(entry: HostEntry, users: dict) -> Action:
    """The service runs as entry.service_user (least privilege): create it when the host lacks it."""
    name = entry.service_user
    if name == "root":
        return Action("user", "nothing to do, because the service runs as root (service_user: root); an "
                              "unprivileged user is safer (docs/security.md)", noop=True)
    known = users.get(name)
    if known:
        return Action("user", f"nothing to do, because the service user {name} exists (uid {known.get('uid')})",
                      noop=True)
    return Action("user", f"create the unprivileged system user {name} that the service runs as (home "
                          f"{entry.service_home} for its caches, no login shell)", commands=[user_command(entry)])


# -- download --------------------------------------------------------------------------------------

def download_action(inp: PlanInput) -> Action:
    dl, src, entry, name = inp.download, inp.target.manifest.source, inp.entry, inp.target.folder
    assert dl is not None
    commit = dl.commit or src.revision
    where = f"{src.repo}@{commit[:12]}"
    shared = "" if name == inp.target.model else f" in {model_path(entry, name)}"     # the checkpoint's folder
    seeds = inp.opts.seeds
    key = (src.repo, dl.commit) if seeds is not None and dl.commit and COMMIT.match(dl.commit) else None
    if dl.to_fetch_bytes <= 0 and not dl.to_fetch:
        if seeds is not None and key is not None:
            seeds.hold(entry.name, key, model_path(entry, name))     # the fleet's others may copy it from here
        how = "our verified record" if dl.from_record else "the Hub's metadata"
        return Action("download", f"nothing to do, because {where} is downloaded and verified{shared} "
                                  f"({dl.files} files, {fmt_bytes(dl.total_bytes)}; checked against {how})",
                      noop=True)
    token = inp.hf_token
    # exactly the commit this plan shows: a branch (`main`) can move between the plan and the apply (a
    # commit that is not 40 hex digits is the hub's nonsense, passed on to nothing)
    planned = dl.commit if dl.commit and COMMIT.match(dl.commit) and dl.commit != src.revision else None
    shown = scripts.command(entry.python, SCRIPT, download_args(
        src.repo, src.revision, model_path(entry, name), allow=src.allow_patterns, ignore=src.ignore_patterns,
        token_file=f"{entry.state_dir}/secrets/hf-token-<run>" if token else None, commit=planned))

    def run(env: RunEnv) -> str:
        peer = seeds.claim(env.entry.name, key) if seeds is not None and key is not None else None
        if peer is not None:
            env.event("download", f"copying from {peer.host} over the LAN (each file checked against the Hub's sha256)")
        try:
            with env.progress("download", name) as progress:
                result = run_download(env.host, env.entry.python, src.repo, src.revision,
                                      model_path(env.entry, name), src.allow_patterns, src.ignore_patterns,
                                      state_dir=env.entry.state_dir, token=token, commit=planned, peer=peer,
                                      on_event=progress.handle if progress else None)
        except BaseException:
            if seeds is not None and key is not None and peer is None:
                seeds.failed(env.entry.name, key)                 # the next host fetches it from the Hub
            raise
        if seeds is not None and key is not None:
            seeds.hold(env.entry.name, key, model_path(env.entry, name))
        done = result["done"]
        got = env.record.download = DownloadResult(
            bytes=int(done.get("bytes", 0)), seconds=result["seconds"], files=int(done.get("files", 0)),
            commit=done.get("commit"), peer=peer.host if peer is not None else None,
            peer_bytes=int(done.get("peer_bytes") or 0))
        via = ""
        if peer is not None:
            via = (f", {fmt_bytes(got.peer_bytes)} copied from {peer.host} over the LAN, "
                   f"{fmt_bytes(max(0, got.bytes - got.peer_bytes))} from the Hub")
        return (f"{fmt_bytes(got.bytes)} in {result['seconds']:.1f}s{via}, every file verified "
                f"(sha256 of each LFS shard while downloading)")

    have = f", {fmt_bytes(dl.have_bytes)} already present and verified" if dl.have_bytes else ""
    origin = ""
    if seeds is not None and key is not None:
        seeds.plan(entry.name, key)
        source = seeds.source(entry.name, key)
        origin = (f" from {source} over the LAN (download once per fleet; every file checked against the Hub's "
                  f"sha256)" if source else
                  " from the Hub, or from a host of the fleet that holds it by then (download once per fleet; "
                  "every file checked against the Hub's sha256)")
    return Action("download", f"fetch {fmt_bytes(dl.to_fetch_bytes)} ({len(dl.to_fetch)} of "
                              f"{dl.files} files) of {where} into {model_path(entry, name)}{have}{origin}",
                  commands=[shown], run=run)


def download_from_record(inp_target_record: dict | None, repo: str, revision: str, pinned: bool,
                         allow: list[str] | None = None, ignore: list[str] | None = None) -> DownloadPlan | None:
    """The download plan from our verified record when it covers the pinned revision (no Hub call):
    complete for the same patterns (`allow`, `ignore`: the manifest's; None: not compared). A record
    completed for other patterns (another manifest of a shared checkpoint) is planned against the
    Hub's listing: what it lacks is fetched, nothing more. A record from before the patterns were
    kept is trusted as it was (an offline host redeploys without the Hub)."""
    rec = inp_target_record
    kept = rec.get("patterns") if isinstance(rec, dict) else None
    same = allow is None or kept is None or kept == {"allow": list(allow), "ignore": list(ignore or [])}
    if rec and rec.get("complete") and rec.get("repo") == repo and pinned and rec.get("revision") == revision \
            and same:
        files = rec.get("files", {})
        total = int(rec.get("total_bytes") or sum(f.get("size", 0) for f in files.values()))
        return DownloadPlan(total_bytes=total, have_bytes=total, to_fetch_bytes=0, files=len(files),
                            commit=rec.get("revision"), from_record=True)
    return None
