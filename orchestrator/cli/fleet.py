"""The fleet view: a command run on several hosts (orchestrator.ops.fleet) shown as one live line
per host on a terminal (phase, seconds), plain `host: phase` lines otherwise, then one summary table
(host, result, seconds, root cause); --json prints one object per host. Exits with the worst code.
"""

from __future__ import annotations

import difflib
import json
import threading
from collections.abc import Callable, Sequence

import click
from rich.table import Table

from orchestrator.cli.common import console, is_tty
from orchestrator.config.inventory import HostEntry
from orchestrator.fmt import escape
from orchestrator.ops.fleet import Board, HostRow, PerHost, group_plans, normalised_plan, run_fleet, worst_exit

STYLE = {"ok": "green", "failed": "bold red", "refused": "yellow", "bad input": "yellow",
         "interrupted": "bold red", "not run": "dim"}


def progress_table(board: Board, title: str) -> Table:
    t = Table(title=title, title_justify="left", box=None, show_header=False, pad_edge=False)
    for host, phase, seconds in board.snapshot():
        t.add_row(host, f"[{STYLE.get(phase, 'cyan')}]{escape(phase)}[/]",
                  f"{seconds:6.1f}s" if seconds is not None else "")
    return t


def run_with_view(title: str, entries: Sequence[HostEntry], per_host: PerHost, parallel: int | None,
                  as_json: bool, stop_on_failure: bool = False) -> list[HostRow]:
    """Run per_host on the hosts with the progress view (none for --json); the rows."""
    return with_view(title, entries, as_json,
                     lambda board: run_fleet(entries, per_host, parallel, board, stop_on_failure))


def with_view(title: str, entries: Sequence[HostEntry], as_json: bool,
              run: Callable[[Board], list[HostRow]]) -> list[HostRow]:
    """run(board) with the progress view of the board: one live line per host on a terminal,
    plain `host: phase` lines otherwise, nothing for --json."""
    names = [e.name for e in entries]
    c = console()
    if as_json or not is_tty():
        lock = threading.Lock()

        def plain(host: str, phase: str) -> None:
            if not as_json:
                with lock:
                    click.echo(f"{host}: {phase}")

        if not as_json:
            click.echo(f"{title}: {', '.join(names)}")
        return run(Board(names, plain))
    from rich.live import Live

    board = Board(names)
    with Live(get_renderable=lambda: progress_table(board, title), console=c, refresh_per_second=4,
              transient=True):
        rows = run(board)
    return rows


def summary_table(rows: Sequence[HostRow], note_header: str = "") -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold")
    t.add_column("host")
    t.add_column("result")
    t.add_column("seconds", justify="right")
    if note_header:
        t.add_column(note_header)
    t.add_column("root cause")
    for r in rows:
        cells = [r.host, f"[{STYLE.get(r.result, '')}]{r.result}[/]", f"{r.seconds:.1f}" if r.ran else "-"]
        if note_header:
            cells.append(escape(r.note or "-"))
        cells.append(escape(r.cause or ""))
        t.add_row(*cells)
    return t


def finish_fleet(title: str, rows: Sequence[HostRow], as_json: bool, note_header: str = "") -> int:
    """Print the summary (or the JSON list); the command's exit code: the worst of the hosts'."""
    code = worst_exit([r.code for r in rows])
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2, default=str))
        return code
    c = console()
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.result] = counts.get(r.result, 0) + 1
    c.print(f"[bold]{escape(title)}[/]: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    c.print(summary_table(rows, note_header))
    return code


def show_fleet_plans(rows: Sequence[HostRow], entries: Sequence[HostEntry]) -> None:
    """The fleet's dry run: each distinct per-host plan once with its hosts (the most common one in
    full), the others as a diff against it."""
    by_name = {e.name: e for e in entries}
    plans = [(r.host, normalised_plan(r.value.plan.text(), by_name[r.host])) for r in rows
             if getattr(r.value, "plan", None) is not None]
    c = console()
    groups = group_plans(plans)
    if not groups:
        return
    base_hosts, base = groups[0]
    c.print(f"[bold]{'Identical plan' if len(base_hosts) > 1 else 'Plan'} on {len(base_hosts)} host"
            f"{'s' if len(base_hosts) > 1 else ''}: {', '.join(base_hosts)}[/]  (<host> stands for each)")
    c.print(base, markup=False, highlight=False, soft_wrap=True)
    for hosts, text in groups[1:]:
        c.print(f"\n[bold]Differs on {', '.join(hosts)}[/] (diff against the plan above):")
        diff = difflib.unified_diff(base.splitlines(), text.splitlines(), "plan above", ", ".join(hosts),
                                    lineterm="", n=0)
        c.print("\n".join(list(diff)[2:]), markup=False, highlight=False, soft_wrap=True)
    c.print()


def fleet_op(title: str, entries: Sequence[HostEntry], parallel: int | None, as_json: bool, dry_run: bool,
             run_one, note_header: str = "", stop_on_failure: bool = False) -> int:
    """A per-host operation returning an OpResult (deploy, swap, regen) across the hosts: the view,
    the fleet plan for a dry run, the summary, the exit (never returns)."""
    from orchestrator.ops.fleet import outcome_of

    rows = run_with_view(f"{title}{' (dry run)' if dry_run else ''}", entries,
                         lambda e, rep: outcome_of(run_one(e, rep)), parallel, as_json, stop_on_failure)
    if dry_run and not as_json:
        show_fleet_plans(rows, entries)
    return finish_fleet(title, rows, as_json, note_header)


def rolling_swap(app, name: str, entries: Sequence[HostEntry], run_one, max_unavailable: int, continue_on_failure: bool,
                 as_json: bool, dry_run: bool, accept_new_host_key: bool) -> int:
    """swap across hosts, rolling (the policy: orchestrator.ops.fleet.rolling_swap), shown live; the
    summary says what every host serves afterwards, asked of the hosts themselves (`status`)."""
    from orchestrator.cli.ops import _manifest_lookups
    from orchestrator.ops import fleet
    from orchestrator.ops.status import serving

    if dry_run:                                   # a dry run changes nothing: every host's plan at once
        return fleet_op(f"swap to {name}", entries, None, as_json, True, run_one)
    title = f"rolling swap to {name} ({max_unavailable} host{'s' if max_unavailable > 1 else ''} at a time)"
    rows = with_view(title, entries, as_json,
                     lambda board: fleet.rolling_swap(entries, run_one, max_unavailable, continue_on_failure, board))
    port_of, served_name_of, api_key_of = _manifest_lookups(app)
    now = serving(entries, port_of, served_name_of, api_key_of, accept_new_host_key)
    for r in rows:
        r.note = now.get(r.host, "?")
    return finish_fleet(title, rows, as_json, "serves")
