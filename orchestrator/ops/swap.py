"""swap: sessions on the new service's nodes and the old one's (one host, or the hosts of a
multi-node service; the locks in sorted host order) -> gather on every node at once -> ONE plan
(orchestrator.plan.swap, rollback branch included) -> show or run it, each step on its node ->
history records on every node (the swap, and the rollback if one ran). Downtime = old stopped ->
new ready, stamped by those two steps in the run records.

The old service's nodes are read before any lock (its records on the new service's head name them,
host/state.read_records: one round trip, and the facts only when a record names several nodes):
every lock is taken once every host is known, and the planner re-reads the facts under them.

A swap that ends with its old model stopped and no rollback finished (killed, interrupted twice,
or the host unreachable for the rollback) leaves state_dir/swap.json on the host; its error then
says which command finishes or undoes it (orchestrator.plan.interrupted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Request, node_roles
from orchestrator.errors import ConfigError, Interrupted, OrchestratorError
from orchestrator.host import state
from orchestrator.host.connect import open_host
from orchestrator.host.facts import gather as read_facts
from orchestrator.host.records import HistoryEntry
from orchestrator.ops import gather
from orchestrator.ops.deploy import not_run
from orchestrator.ops.execute import Ask, Reporter, run_plan
from orchestrator.ops.nodes import as_nodes, node_envs, open_sessions, parallel
from orchestrator.ops.session import OpResult
from orchestrator.ops.stop import recorded_nodes
from orchestrator.plan import gateway
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.interrupted import sleep_half
from orchestrator.plan.multinode import OldService
from orchestrator.plan.run import Options, RunEnv
from orchestrator.plan.swap import old_model_name, plan_sleep_swap, plan_swap
from orchestrator.plan.warm import history_fields
from orchestrator.probe.readiness import failure_fields


def swap_source(entry: HostEntry, m: Manifest, request: Request, opts: Options,
                accept_new_host_key: bool) -> tuple[str | None, list[str]]:
    """(the service a swap to M on `entry` replaces, its nodes, head first) when that service spans
    several hosts, read before any lock; (None, []) when it is on this host alone (or there is none)."""
    name = request.name or m.name
    with open_host(entry, accept_new_host_key) as host:
        if not any(r.multinode for r in state.read_records(host, entry).values()):
            return None, []
        facts = read_facts(host, entry, [name])
        old = old_model_name(facts, name, entry.name, opts.replace)
        if old is None or old == name:
            return None, []
        nodes = recorded_nodes(host, entry, old)
        return (old, nodes) if len(nodes) > 1 else (None, [])


def run_swap(nodes: HostEntry | Sequence[HostEntry], m: Manifest, manifests: dict[str, Manifest], opts: Options,
             reporter: Reporter, dry_run: bool, accept_new_host_key: bool = False, ask: Ask | None = None,
             request: Request = Request(), node_entry: Callable[[str], HostEntry | None] | None = None) -> OpResult:
    """Swap to model M as the service `request` names (default: M's own) on its nodes (head first;
    one host for a one-host model). The service it replaces may span other hosts too (its records
    say which; `node_entry` looks them up in the inventory)."""
    t0 = time.monotonic()
    entries = as_nodes(nodes)
    names, name = [e.name for e in entries], request.name or m.name
    if m.multinode is not None:
        node_roles(m, entries)                  # the wrong hosts: exit 2 before any is reached
    multi_old, old_nodes = swap_source(entries[0], m, request, opts, accept_new_host_key)
    if old_nodes and old_nodes[0] not in names:
        raise ConfigError(f"{multi_old} has its head on {old_nodes[0]}, which is no node of {name} here "
                          f"({', '.join(names)}): a swap keeps the old head among the new nodes",
                          hint=f"select {old_nodes[0]} among the hosts, or stop {multi_old} and deploy {name}")
    by_name = {e.name: e for e in entries}
    for n in old_nodes:
        if n not in by_name:
            found = node_entry(n) if node_entry is not None else None
            if found is None:
                raise ConfigError(f"{multi_old} runs on {n} too (its records say so), which is not in the inventory")
            by_name[n] = found
    with ExitStack() as stack:
        sessions = open_sessions(stack, list(by_name.values()), f"swap to {name}", dry_run, accept_new_host_key)
        facts = dict(zip(names, parallel(entries, lambda e: gather.host_facts(sessions[e.name].host, e, m, request,
                                                                              manifests, entries)), strict=True))
        spec = gather.swap_spec(facts, entries, m, request, opts)

        def one(e: HostEntry) -> PlanInput:
            s = sessions[e.name]
            if e is entries[0] or e.name in old_nodes:
                inp = gather.for_swap(s.host, e, m, request, manifests, opts, s.lock, spec=spec, facts=facts[e.name])
                if multi_old and (inp.old is None or inp.old.name != multi_old):
                    raise ConfigError(f"{e.name} does not say {name} replaces {multi_old} there "
                                      f"({inp.old.name if inp.old else 'nothing'} instead)", host=e.name,
                                      hint=f"name it: --replace {multi_old}")
                return inp
            return gather.for_deploy(s.host, e, m, spec, opts, s.lock, facts[e.name])

        inputs = parallel(entries, one)
        old = None
        if multi_old:
            head_old = next(i.old for i in inputs if i.entry.name == old_nodes[0])
            if head_old is None:
                raise ConfigError(f"{multi_old} has no manifest in the models folder, so it could not be rolled "
                                  f"back to", host=old_nodes[0], hint=f"restore models/{multi_old}.yaml, or stop it first")
            running = {n for n in old_nodes if (st := (facts[n] if n in facts else read_facts(
                sessions[n].host, by_name[n], [multi_old])).services.get(multi_old)) is not None and st.active}
            old = OldService(multi_old, tuple(old_nodes), head_old, frozenset(running))
        elsewhere = {n: (by_name[n], sessions[n].lock) for n in old_nodes if n not in names}
        head_facts = inputs[0].facts
        sleeping = len(by_name) == 1 and (opts.sleep_old or head_facts.asleep(name) is not None
                                          or sleep_half(head_facts, name))
        plan = plan_sleep_swap(inputs[0]) if sleeping else plan_swap(*inputs, old=old, elsewhere=elsewhere)
        # the head's gateway (a service across nodes is reached at its head; its steps go around the head's)
        plan = gateway.with_gateway(plan, gateway.read(sessions[names[0]].host, entries[0]), entries[0])
        info = dict(plan.info)
        result = OpResult("swap", ", ".join(names), name, ok=False, dry_run=dry_run, plan=plan, extra=dict(info))
        if info.get("noop"):
            reporter.plan(plan)
            result.ok, result.seconds = True, time.monotonic() - t0
            return result
        if not_run(plan, result, reporter, opts, ask, names[0]):
            result.seconds = time.monotonic() - t0
            return result
        head = node_envs(sessions, by_name, names[0], opts, reporter)
        outcome = run_plan(plan, head, reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        _read_outcome(result, head, inputs, entries, m.name)
        result.seconds = time.monotonic() - t0
        records = _history(result, head, spec.model, inputs, old_nodes if len(by_name) > 1 else None)
        _append_everywhere(sessions, by_name, names, records, result)
        return result


def _read_outcome(result: OpResult, head: RunEnv, inputs: Sequence[PlanInput], entries: Sequence[HostEntry],
                  model: str) -> None:
    """The swap's figures and what to say about its end: downtime (the first stop of the old service
    -> the new one ready), load time, a half-done swap's hint, the rollback's result."""
    name, names, outcome = result.model, [e.name for e in entries], result.outcome
    assert outcome is not None
    envs = head.nodes or {names[0]: head}
    ready = head.record.ready.get(name)
    stopped = [e.record.stopped_at for e in envs.values() if e.record.stopped_at is not None]
    if outcome.ok:
        if stopped and head.record.ready_at is not None:
            result.extra["downtime_s"] = round(head.record.ready_at - min(stopped), 3)
        elif not stopped:
            # nothing was stopped or put to sleep: nothing served before this swap (a failed service,
            # a failed rollback), so it ended a downtime it did not start and cannot measure
            result.extra["nothing_served"] = True
        if ready is not None:
            result.extra["load_s"] = round(ready.seconds, 3)
    old_name, rb = result.extra.get("from"), outcome.recovery
    half = inputs[0].facts.half_swap is not None or any(r.step.startswith(("stop", "sleep")) and r.status in ("done", "failed")
                                                         for r in outcome.results)
    if not outcome.ok and half and not (rb is not None and rb.ok) and result.error is not None and old_name:
        result.extra["half_done"] = True
        result.error.hint = (f"the swap is half done ({entries[0].state_dir}/swap.json says so): run `vllm-orch "
                             f"swap {model} --host {','.join(names)}` to finish it (it rolls back to {old_name} "
                             f"if {name} fails), or `vllm-orch swap {old_name} --host {names[0]}` to go back")
    if rb is not None and old_name and result.extra.get("staged"):
        old_ready = head.record.ready.get(old_name)
        woke = head.record.wakes.get(old_name)
        text = (f"{old_name} serves again ({old_ready.smoke.summary()})" if rb.ok and old_ready
                else f"{old_name} serves again (woken, its canary matches)" if rb.ok and woke and not woke.get("cold")
                else f"{old_name} did not come back: {rb.error.message if rb.error else '?'}")
        result.extra["rollback"] = {"ok": rb.ok, "result": text, "seconds": round(rb.seconds, 3)}
        if result.error is not None and result.error.details:
            result.error.details[-1] = f"rollback: {text}"     # the executor's line, with the smoke answer


def _history(result: OpResult, head: RunEnv, model: str, inputs: Sequence[PlanInput],
             old_nodes: list[str] | None) -> list[dict]:
    """The swap's history line (and the rollback's, if one ran); `old_nodes`: with several hosts."""
    name, outcome, extra = result.model, result.outcome, result.extra
    assert outcome is not None
    record = {"operation": "swap", "from": extra.get("from"), "model": model, "service": name, "ok": outcome.ok,
              "staged": extra.get("staged"), "seconds": round(result.seconds, 2), "steps": outcome.timings(),
              "downtime_s": extra.get("downtime_s"), "unit_hash": inputs[0].target.rendered.unit_hash}
    if old_nodes is not None:
        names = [i.entry.name for i in inputs]
        record.update(nodes=names, from_nodes=old_nodes or names[:1])
    record.update(failure_fields(result.error))
    if isinstance(result.error, Interrupted):
        record["interrupted"] = result.error.step
    if extra.get("half_done"):
        record["half_done"] = True
    record.update(history_fields(head.record, name, extra.get("expected_downtime_s")))
    extra.update({k: v for k, v in record.items() if k in ("warm", "weights_s")})
    if "rollback" in extra:
        record["rollback"] = extra["rollback"]
    if head.record.sleeps or head.record.wakes or extra.get("sleep"):
        record["sleep"] = extra["sleep_run"] = {
            "mode": extra.get("sleep"), "level": extra.get("sleep_level"),
            "slept": dict(head.record.sleeps), "woke": dict(head.record.wakes)}
    ready = head.record.ready.get(name)
    if ready is not None:
        record["tokens_per_s"] = ready.smoke.tokens_per_s
    if name in head.record.perf:
        record["perf"] = extra["perf"] = head.record.perf[name]
    if head.record.warnings:
        extra["warnings"] = list(head.record.warnings)
    if "rollback" not in extra:
        return [record]
    return [record, {"operation": "rollback", "model": extra.get("from"), "ok": extra["rollback"]["ok"],
                     "seconds": extra["rollback"]["seconds"],
                     "after": ("interrupted" if isinstance(result.error, Interrupted) else "failed")
                              + f" swap to {name}"}]


def _append_everywhere(sessions: dict, by_name: dict[str, HostEntry], names: list[str], records: list[dict],
                       result: OpResult) -> None:
    """The history lines on every host the swap touched (its rank on a node of the new service),
    where the lock is still ours."""
    for n, e in by_name.items():
        if not sessions[n].holds_lock():        # without its lock, write nothing more there
            continue
        rank = {"rank": names.index(n)} if n in names and len(names) > 1 else {}
        for rec in records:
            try:
                state.append_history(sessions[n].host, e, HistoryEntry(**rec, **rank))
            except OrchestratorError as exc:     # the connection is gone: the result still reaches the user
                if result.error is not None:
                    result.error.details.append(f"history not recorded on {n}: {exc}")
                break
