"""Text views of status, history and gc plans (rich). Pure: data in, printed lines out."""

from __future__ import annotations

import time
from datetime import datetime

from rich import box
from rich.table import Table

from orchestrator.fmt import escape, fmt_bytes, fmt_duration
from orchestrator.host.ownership import gpu_list
from orchestrator.ops.status import HostStatus, ServiceStatus

STATE_STYLE = {"ready": "bold green", "asleep": "cyan", "loading": "bold yellow", "failed": "bold red",
               "stopped": "dim", "unreachable": "bold red", "running": "green", "unknown": "yellow"}

# The headline figures `vllm-orch bench --host` records (orchestrator/bench/report.py: headline()).
BENCH_FIGURES = {"single_stream_tok_s": "single stream", "peak_output_tok_s": "peak"}


def fmt_ago(epoch: float | None, now: float | None = None) -> str:
    if not epoch:
        return "never"
    return fmt_duration((now or time.time()) - epoch) + " ago"


def fmt_at(iso: str | None) -> str:
    if not iso:
        return "-"
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return iso


def gpu_summary(gpus: list[dict]) -> str:
    """'709/765G': memory used / total over every GPU of the host."""
    if not gpus:
        return "-"
    used = sum(g.get("memory_used_mib") or 0 for g in gpus)
    total = sum(g.get("memory_total_mib") or 0 for g in gpus)
    return f"{used / 1024:.0f}/{total / 1024:.0f}G"


def gpu_lines(gpus: list[dict]) -> str:
    """Per-GPU memory, runs of equal GPUs folded: 'GPU 0-7 89/96 GiB'."""
    groups: list[tuple[list[int], str]] = []
    for g in gpus:
        text = f"{(g.get('memory_used_mib') or 0) / 1024:.0f}/{(g.get('memory_total_mib') or 0) / 1024:.0f} GiB"
        if groups and groups[-1][1] == text and groups[-1][0][-1] == g["index"] - 1:
            groups[-1][0].append(g["index"])
        else:
            groups.append(([g["index"]], text))
    return ", ".join((f"GPU {ix[0]}-{ix[-1]}" if len(ix) > 1 else f"GPU {ix[0]}") + f" {text}"
                     for ix, text in groups)


def since_iso(iso: str | None) -> str:
    if not iso:
        return "-"
    try:
        return fmt_duration(time.time() - datetime.fromisoformat(iso).timestamp()) + " ago"
    except ValueError:
        return iso


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def render_status(console, results: list[HostStatus]) -> None:
    """One row per host (fits 80 columns), then a few detail lines per host."""
    table = Table(title="vllm-orch status", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    widest = max([len(r.active_model or "-") for r in results] + [len(v.name) for r in results for v in r.services]
                 + [5])
    for col in ("host", "model", "state", "up", "GPU mem", "KV", "run/wait", "disk free"):
        table.add_column(col, overflow="fold", min_width=widest if col == "model" else None)
    for r in results:
        name = escape(r.host)
        if not r.reachable:
            table.add_row(name, "-", f"[{STATE_STYLE['unreachable']}]unreachable[/]", "-", "-", "-", "-", "-")
            continue
        run_wait = "-" if r.requests_running is None else \
            f"{_num(r.requests_running)}/{_num(r.requests_waiting)}"
        table.add_row(name, escape(r.active_model or node_label(r) or "-"),
                      f"[{STATE_STYLE.get(r.state, '')}]{r.state}[/]", fmt_duration(r.uptime_s),
                      gpu_summary(r.gpus) if not r.gpu_error else "[red]error[/]",
                      _pct(r.kv_cache_usage), run_wait,
                      fmt_bytes(r.disk.get("free", 0)) if r.disk else "-")
        for v in r.services[1:]:                # a host with several services: one row each
            vrw = "-" if v.requests_running is None else f"{_num(v.requests_running)}/{_num(v.requests_waiting)}"
            table.add_row("", escape(v.name), f"[{STATE_STYLE.get(v.state, '')}]{v.state}[/]",
                          fmt_duration(v.uptime_s), gpu_list(v.gpus) if v.gpus else "", _pct(v.kv_cache_usage),
                          vrw, "")
    console.print(table)
    for r in results:
        if r.reachable:
            render_host_details(console, r)
        else:
            console.print(f"[bold]{escape(r.host)}[/]: [red]unreachable[/] - {escape(r.error or '')}")


def node_label(r: HostStatus) -> str | None:
    """A host that only runs worker nodes of multi-node services: `kimi-k25-int4 (rank 1)`."""
    return ", ".join(f"{n['service']} (rank {n['rank']})" for n in r.node_of) or None


def node_lines(v) -> list[str]:
    """A multi-node service's nodes under its head's line: host, rank, state, unit."""
    return [f"node {n['host']} (rank {n['rank']}{', head' if n['rank'] == 0 else ''}): {n['state']}"
            + (f" [{n['unit_state']}]" if n.get("unit_state") else "")
            + (f" - {n['reason']}" if n["rank"] and n.get("reason") and n["state"] != "running" else "")
            for n in v.nodes]


def process_lines(procs: list[dict]) -> list[tuple[str, bool]]:
    """(line, attention?) per GPU process; a running service's processes folded into one line."""
    out: list[tuple[str, bool]] = []
    owned: dict[str, list[dict]] = {}
    for p in procs:
        if p["owner"]:
            owned.setdefault(p["owner"], []).append(p)
    for owner, ps in owned.items():
        gpus = sorted({p["gpu"] for p in ps if p["gpu"] is not None})
        mib = sum(p["used_mib"] for p in ps)
        out.append((f"{len(ps)} processes of {owner} on {gpu_list(gpus)} "
                    f"({mib / 1024:.0f} GiB, e.g. PID {ps[0]['pid']} {ps[0]['name']})", False))
    for p in procs:
        if p["owner"]:
            continue
        who = f"left behind by {p['left_by']}" if p["left_by"] else p["kind"]
        if p.get("user"):
            who = f"user {p['user']}, {who}"
        command = f": {p['command'][:80]}" if p.get("command") and p["kind"] == "foreign" else ""
        out.append((f"GPU {p['gpu'] if p['gpu'] is not None else '?'}: PID {p['pid']} {p['name']} "
                    f"{p['used_mib']} MiB ({who}){command}", True))
    return out


def engine_words(v: ServiceStatus) -> str:
    """What a service runs: `vLLM 0.33.0 (engine vllm-0.33.0-<hash>)`, or the host's vLLM."""
    return f"vLLM {v.vllm_version or '?'}" + (f" (engine {v.engine})" if v.engine else "")


def render_host_details(console, r: HostStatus) -> None:
    """The per-host lines under the table: why this state, GPUs, processes, models, bench."""
    head = f"[bold]{escape(r.host)}[/]{f' ({escape(r.label)})' if r.label else ''}: " \
           f"{escape(r.active_model or node_label(r) or 'no active model')} " \
           f"[{STATE_STYLE.get(r.state, '')}]{r.state}[/] - {escape(r.state_reason)}"
    if r.port:
        head += f" (port {r.port}" + (f", PID {r.main_pid}" if r.main_pid else "") + ")"
    if len(r.services) > 1:
        head += escape(f" [GPUs {','.join(map(str, r.services[0].gpus))}]") if r.services[0].gpus else ""
    if r.services and r.services[0].engine:
        head += escape(f" {engine_words(r.services[0])}")
    asleep = [v.name for v in r.services if v.state == "asleep"]
    if asleep:
        head += escape(f"; {len(asleep)} asleep ({', '.join(asleep)})")
    console.print(head)
    for line in node_lines(r.services[0]) if r.services else []:
        console.print(f"  {line}", markup=False)
    for n in r.node_of:
        console.print(f"  node (rank {n['rank']}) of {n['service']}, shown with its head {n['head']}: {n['state']}",
                      markup=False)
    for v in r.services[1:]:
        line = f"  + {escape(v.name)} [{STATE_STYLE.get(v.state, '')}]{v.state}[/] - {escape(v.state_reason)}"
        if v.port:
            line += f" (port {v.port}" + (f", PID {v.main_pid}" if v.main_pid else "") + ")"
        if v.gpus:
            line += escape(f" [GPUs {','.join(map(str, v.gpus))}]")
        if v.vllm_version:
            line += escape(f" {engine_words(v)}")
        console.print(line)
        for extra in unit_lines(v) + node_lines(v):
            console.print(f"    {extra}", markup=False)
    if r.gateway:
        console.print(f"  {gateway_line(r.gateway)}", markup=False)
    if r.interrupted_swap:
        console.print(f"  [bold red]half-done swap[/]: {escape(r.interrupted_swap['text'])}")
        console.print(f"  [yellow]hint:[/] {escape(r.interrupted_swap['hint'])}")
    for bad in r.bad_records:
        console.print(f"  [yellow]unreadable record[/] (left out): {escape(bad)}")
    for line in unit_lines(r):
        console.print(f"  {line}", markup=False)
    if r.lock:
        console.print(f"  lock: {escape(str(r.lock.get('operation')))} by {escape(str(r.lock.get('holder')))} "
                      f"since {escape(str(r.lock.get('since')))}")
    if r.gpu_error:
        console.print(f"  GPUs: nvidia-smi failed: {r.gpu_error}", markup=False)
    elif r.gpus:
        console.print(f"  {gpu_lines(r.gpus)}", markup=False)
    for line, attention in process_lines(r.gpu_processes):
        console.print(f"  [yellow]{escape(line)}[/]" if attention else f"  {escape(line)}")
    if r.engines and r.engines > 1 and r.kv_cache_usage is not None:
        console.print(f"  KV cache: {_pct(r.kv_cache_usage)} mean over {r.engines} engines, "
                      f"fullest {_pct(r.kv_cache_usage_max)}", markup=False)
    if r.models or r.disk:
        parts = [f"{m['name']} {fmt_bytes(m['bytes'])}" + (" *active*" if m["active"] else "")
                 + ("" if m["verified"] else " (not verified)" if m.get("ours", True) else " (not vllm-orch's)")
                 for m in r.models]
        disk = f"{fmt_bytes(r.disk.get('free', 0))} free of {fmt_bytes(r.disk.get('total', 0))}" if r.disk else ""
        console.print(f"  disk: {disk}" + (f"; models: {', '.join(parts)}" if parts else "; no models"),
                      markup=False)
    if r.last_deploy:
        d = r.last_deploy
        line = f"  last {d.get('operation')}: {d.get('model', '?')} {d.get('result')} {since_iso(d.get('at'))}"
        if isinstance(d.get("seconds"), (int, float)):
            line += f" (took {fmt_duration(d['seconds'])})"
        if d.get("error"):
            line += f": {d['error']}"
        if d.get("later"):
            later = d["later"]
            line += (f"; since then {later['runs']} run{'s' if later['runs'] != 1 else ''} that changed nothing "
                     f"(the last: {later.get('operation')} {later.get('model', '?')} {later.get('result')} "
                     f"{since_iso(later.get('at'))})")
        console.print(line, markup=False)
    if r.last_bench:
        b = r.last_bench
        figures = ", ".join(f"{label} {b[k]:.1f} tok/s" for k, label in BENCH_FIGURES.items()
                            if isinstance(b.get(k), (int, float)))
        if "peak_concurrency" in b:
            figures += f" at concurrency {b['peak_concurrency']}"
        console.print(f"  last bench ({b.get('model', '?')}, {fmt_at(b.get('at'))}): {figures or 'no figures'}",
                      markup=False)


def gateway_line(g: dict) -> str:
    """`gateway: serving at http://gpu1:8090/v1, 2 models (kimi-k2.5, minimax-m2.5; held while they
    wake or restart: b); 120 requests, 2 in flight, 0 waiting, 0 5xx`."""
    line = f"gateway: {g.get('state')}" + (f" at {g['url']}" if g.get("url") and g.get("state") == "serving" else "")
    models = g.get("models") or []
    if g.get("state") == "serving" or models:
        line += f", {len(models)} model{'s' if len(models) != 1 else ''}"
        if models:
            line += f" ({', '.join(models)}" + (f"; held while they wake or restart: {', '.join(g['held'])}"
                                                if g.get("held") else "") + ")"
    if "requests" in g and g.get("state") == "serving":
        line += (f"; {g['requests']} requests, {g['in_flight']} in flight, {g['waiting']} waiting, "
                 f"{g['errors_5xx']} 5xx")
    if g.get("error"):
        line += f"; {g['error']}"
    return line


def unit_lines(r: HostStatus | ServiceStatus) -> list[str]:
    """The unit (systemd): its state and start at boot, the root cause of a failure, the health timer."""
    out = []
    if r.unit_state:
        boot = "starts at boot" if r.enabled else "does not start at boot"
        restarts = f"; restarted {r.restarts} time{'s' if r.restarts != 1 else ''} by systemd" if r.restarts else ""
        out.append(f"unit: {r.unit_state}, {boot}{restarts}")
    if r.root_cause:
        out.append(f"root cause: {r.root_cause}")
    last = (r.health or {}).get("last") or {}
    if last.get("ok") is True:
        out.append(f"health: ok {since_iso(last.get('at'))}" + (f" ({last['note']})" if last.get("note") else ""))
    elif last.get("ok") is False:
        n = int((r.health or {}).get("failures") or 0)
        out.append(f"health: {n} failed check{'s' if n != 1 else ''} in a row, the last {since_iso(last.get('at'))}: "
                   f"{last.get('reason')}")
    if r.last_health_restart:
        h = r.last_health_restart
        if h.get("refused"):
            out.append(f"health timer did NOT restart it {since_iso(h.get('at'))}: {h['refused']}")
        else:
            out.append(f"health timer restarted it {since_iso(h.get('at'))}: {h.get('reason')}")
    return out


def warm_summary(warm: dict) -> str:
    """What a page-cache warm-up did (its history record, orchestrator.plan.warm.WarmResult)."""
    if warm.get("error"):
        return f"failed ({warm['error']})"
    return (f"read {fmt_bytes(warm.get('warmed_bytes') or 0)} in {fmt_duration(warm.get('seconds'))}, "
            f"{fmt_bytes(warm.get('cached_bytes') or 0)} of {fmt_bytes(warm.get('total_bytes') or 0)} cached")


def warm_saving(rec: dict, cold_before: float | None) -> str:
    """The downtime a warmed swap saved: against the last swap to the same model on this host that
    did not warm (both measured), else against the plan's expected downtime without warming (the
    manifest's rates)."""
    down, warm = rec.get("downtime_s"), rec.get("warm") or {}
    if down is None or not warm.get("cached_bytes") or not rec.get("ok"):
        return ""
    if cold_before is not None:
        return (f"{fmt_duration(max(cold_before - down, 0))} less than the last swap without warming "
                f"({fmt_duration(cold_before)})")
    cold = (rec.get("expected_s") or {}).get("cold_s")
    if cold is not None:
        return (f"~{fmt_duration(max(cold - down, 0))} less than expected without warming ({fmt_duration(cold)}, "
                f"the manifest's rates)")
    return ""


def last_cold_swaps(records: list[dict]) -> list[float | None]:
    """For each record, the downtime of the latest earlier successful swap to the same model that
    did not warm the page cache (--no-warm, or a failed warm-up; None when there is none)."""
    out: list[float | None] = []
    cold: dict[str, float] = {}
    for rec in records:
        out.append(cold.get(rec.get("model") or ""))
        if rec.get("operation") == "swap" and rec.get("ok") and rec.get("downtime_s") is not None \
                and (not rec.get("warm") or rec["warm"].get("error")):
            cold[rec.get("model") or ""] = rec["downtime_s"]
    return out


# The start-up ledger's phases as `history` names them, in the order a start goes through them.
STARTUP_PHASES = (("download_s", "download"), ("warm_s", "warm-up"), ("weights_s", "weights"),
                  ("compile_s", "compile"), ("graphs_s", "CUDA graphs"), ("init_engine_s", "engine init"),
                  ("api_up_s", "API up at"), ("first_token_s", "first token at"), ("ready_s", "ready at"))


def startup_summary(ledger: dict) -> str:
    """A start's phases in one line: `download 12.0s, weights 30.2s, compile 4.1s, ...`."""
    return ", ".join(f"{label} {ledger[k]:.1f}s" for k, label in STARTUP_PHASES
                     if isinstance(ledger.get(k), (int, float)))


def sleep_summary(part: dict) -> str:
    """What a swap with sleep mode did: who slept at which level, who woke and how."""
    out = []
    for name, s in (part.get("slept") or {}).items():
        out.append(f"{name} slept (level {s.get('level')}, {s.get('seconds', 0):.1f}s, keeps {s.get('gpu_mib')} MiB"
                   f"/GPU" + (f", +{s['growth_mib']} MiB over {s.get('cycles')} cycles" if s.get("growth_mib") else "")
                   + ")")
    for name, w in (part.get("woke") or {}).items():
        out.append(f"{name} restarted cold ({w.get('reason')})" if w.get("cold") else
                   f"{name} woke in {w.get('wake_s', 0):.1f}s (canary {w.get('canary')}, warm-up "
                   f"{w.get('warmup_s', 0):.2f}s)")
    return "; ".join(out)


def history_details(rec: dict, cold_before: float | None = None) -> str:
    """One line of what a history record says beyond its operation and result (`cold_before`: the
    downtime of the last cold swap to the same model, to show what warming saved)."""
    op = rec.get("operation")
    if rec.get("refused"):
        return f"refused: {rec['refused']}"
    if op == "health-busy":
        return f"not restarted by its health timer: {rec.get('reason')}"
    if op in ("health-restart", "head-lost-restart"):
        by = "its health timer" if op == "health-restart" else "its head watch (a headless node whose head went away)"
        return f"restarted by {by}: {rec.get('reason')}" + (
            f" (restart failed: {rec['error']})" if rec.get("error") else "")
    if rec.get("interrupted"):
        return f"interrupted during {rec['interrupted']}" + (
            f"; rollback {'done' if rec['rollback'].get('ok') else 'FAILED'}" if rec.get("rollback") else "") + (
            "; left half done (status says what to run)" if rec.get("half_done") else "")
    if rec.get("error") or rec.get("root_cause"):
        return f"{rec.get('failure_kind', 'error')}: {rec.get('root_cause') or rec.get('error')}"
    if op == "gc":
        names = ", ".join(d["name"] + (" (unit disabled)" if d.get("disabled") else "")
                          for d in rec.get("deleted") or []) or "nothing"
        kept = "; ".join(f"kept {k['name']}: {k['why']}" for k in rec.get("kept") or [])
        return f"deleted {names} ({fmt_bytes(rec.get('freed_bytes') or 0)})" + (f"; {kept}" if kept else "")
    if op == "stop":
        killed = rec.get("killed") or []
        parts = [f"was {rec.get('was', '?')}"]
        if rec.get("orphans"):
            parts.append(f"{len(rec['orphans'])} orphaned workers")
        if killed:
            parts.append(f"killed {len(killed)} leftovers")
        if rec.get("gpus_free"):
            parts.append(str(rec["gpus_free"]))
        if rec.get("disabled"):
            parts.append("disabled at boot")
        return "; ".join(parts)
    if op == "bench":
        return ", ".join(f"{label} {rec[k]:.1f} tok/s" for k, label in BENCH_FIGURES.items()
                         if isinstance(rec.get(k), (int, float)))
    parts = []
    if rec.get("downtime_s") is not None:
        parts.append(f"downtime {rec['downtime_s']:.1f}s")
    if rec.get("warm"):
        parts.append(f"warm-up {warm_summary(rec['warm'])}")
    saved = warm_saving(rec, cold_before)
    if saved:
        parts.append(saved)
    if rec.get("startup"):
        parts.append("start-up " + startup_summary(rec["startup"]))
    if rec.get("sleep"):
        parts.append(sleep_summary(rec["sleep"]))
    if rec.get("steps"):
        slow = sorted(rec["steps"].items(), key=lambda kv: -kv[1])[:3]
        parts.append("slowest: " + ", ".join(f"{k} {v:.1f}s" for k, v in slow))
    if rec.get("tokens_per_s"):
        parts.append(f"smoke {rec['tokens_per_s']:.1f} tok/s")
    perf = rec.get("perf") or {}
    if perf:
        figures = [f"{perf[k]:.1f}" for k in ("single_stream_tok_s",) if perf.get(k) is not None]
        if perf.get("concurrency_tok_s"):
            figures.append(f"{perf['concurrency_tok_s']:.0f} at C={perf['concurrency']}")
        parts.append(f"perf {' / '.join(figures) or '-'} tok/s (expected {perf.get('expected')})"
                     + ("" if perf.get("ok") else " FAR BELOW"))
    if rec.get("rolled_back_to"):
        parts.append(f"rolled back to {rec['rolled_back_to']}")
    return "; ".join(parts)


def history_result(rec: dict) -> str:
    if rec.get("refused"):
        return "[yellow]refused[/]"
    if rec.get("ok"):
        return "[green]ok[/]" + (" [dim](no-op)[/]" if rec.get("noop") else "")
    return "[red]failed[/]"


def render_history(console, host: str, records: list[dict]) -> None:
    if not records:
        console.print(f"no history on {host} yet.")
        return
    table = Table(title=f"history of {host}", title_justify="left")
    for col in ("when", "operation", "model", "result", "took", "details"):
        table.add_column(col, overflow="fold")
    for rec, cold_before in zip(records, last_cold_swaps(records)):
        model = rec.get("model") or (f"{rec.get('from', '?')} -> {rec.get('to', '?')}" if rec.get("to") else "-")
        secs = rec.get("seconds")
        table.add_row(fmt_at(rec.get("at")), escape(str(rec.get("operation", "?"))), escape(str(model)),
                      history_result(rec), fmt_duration(secs) if isinstance(secs, (int, float)) else "-",
                      escape(history_details(rec, cold_before)))
    console.print(table)
