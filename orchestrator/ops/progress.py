"""The live progress bars of a download and a warm-up (rich), fed with the events the host-side
scripts stream (host/remote/download.py, host/remote/warm.py). Shown by the Reporter
(ops/execute.py) when a step asks for one; plan/ sees only the StepReporter protocol (plan/run.py)
and host/ no terminal at all.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from orchestrator.fmt import fmt_bytes
from orchestrator.host.warm import REASONS


class DownloadProgress:
    """Renders the script's events: one bar for the bytes to fetch (rate, ETA, files done), and a
    one-line summary. Feed it with `handle(event)`; use as a context manager to show it live."""

    def __init__(self, console: Console | None = None, label: str = "download"):
        self.console = console or Console(stderr=True)
        self.label = label
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[files]}"), console=self.console, transient=False)
        self.task: TaskID | None = None
        self.plan: dict | None = None
        self.done_event: dict | None = None
        self.error: dict | None = None
        self.per_file: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.files_done = 0
        self.skipped = 0
        self.refetched = 0

    def __enter__(self) -> DownloadProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def _files_text(self) -> str:
        total = len(self.plan.get("to_fetch", [])) if self.plan else 0
        return f"{self.files_done}/{total} files"

    def _refresh(self) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=sum(self.per_file.values()), files=self._files_text())

    def handle(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "plan":
            self.plan = event
            self.task = self.progress.add_task(self.label, total=event.get("to_fetch_bytes") or 0,
                                               files=self._files_text())
        elif kind == "progress":
            self.per_file[event["file"]] = int(event.get("done", 0))
            self._refresh()
        elif kind == "file":
            if event.get("status") == "skipped":
                self.skipped += 1
                return
            self.per_file[event["file"]] = int(event.get("size", 0))
            self.files_done += 1
            self.refetched += event.get("status") == "refetched"
            self._refresh()
        elif kind == "error":
            self.error = event
        elif kind == "done":
            self.done_event = event
            self._refresh()

    def summary(self) -> str:
        if self.error:
            return f"download failed ({self.error.get('kind')}): {self.error.get('message')}"
        if not self.done_event:
            return "download did not finish"
        d = self.done_event
        secs = max(float(d.get("seconds", 0)), 1e-6)
        mb = d.get("bytes", 0) / 1e6
        parts = [f"{d.get('files', 0)} files verified ({d.get('total_bytes', 0) / 1e9:.2f} GB)",
                 f"fetched {mb:.1f} MB in {secs:.1f} s ({mb / secs:.1f} MB/s)"]
        if self.skipped:
            parts.append(f"{self.skipped} already verified")
        if self.refetched:
            parts.append(f"{self.refetched} re-fetched after a checksum mismatch")
        return ", ".join(parts)


class WarmProgress:
    """Renders the script's events: one bar over the bytes to cover (rate, ETA, the memory
    headroom left), like the download's. Feed it with `handle(event)`; a context manager."""

    def __init__(self, target_bytes: int, console: Console | None = None, label: str = "warm"):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[note]}"), console=self.console, transient=False)
        self.task: TaskID = self.progress.add_task(label, total=max(target_bytes, 1), note="")
        self.done_event: dict | None = None

    def __enter__(self) -> WarmProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def handle(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "progress":
            headroom = event.get("headroom")
            note = f"headroom {fmt_bytes(headroom)}" if isinstance(headroom, int) else ""
            self.progress.update(self.task, completed=int(event.get("covered", 0)), note=note)
        elif kind == "done":
            self.done_event = event
            self.progress.update(self.task, completed=int(event.get("covered_bytes", 0)),
                                 note=REASONS.get(event.get("reason", ""), ""))
