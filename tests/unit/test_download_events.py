"""Controller-side parsing and rendering of the download script's JSON lines; the script's own rules."""

import ast

from rich.console import Console

from orchestrator.host.download import EVENTS, download_args
from orchestrator.host.scripts import parse_event
from orchestrator.ops.progress import DownloadProgress
from orchestrator.paths import package_file
from orchestrator.secret import Secret


def test_parse_event_accepts_only_known_json_events():
    assert parse_event('{"event":"done","verified":true,"bytes":3}', EVENTS) == {"event": "done", "verified": True,
                                                                         "bytes": 3}
    assert parse_event("  {\"event\": \"plan\", \"files\": 1}\n", EVENTS)["files"] == 1
    for line in ("", "retry 1/5 ...", "{not json", '{"event":"other"}', "[1,2]", '{"kind":"x"}'):
        assert parse_event(line, EVENTS) is None


def test_progress_renders_bytes_files_and_summary():
    console = Console(record=True, width=120, force_terminal=False)
    p = DownloadProgress(console=console, label="kimi-k25-int4")
    events = [
        {"event": "plan", "files": 3, "total_bytes": 3000, "have_bytes": 1000, "to_fetch_bytes": 2000,
         "to_fetch": ["a", "b"]},
        {"event": "file", "file": "c", "size": 1000, "sha256": "x", "status": "skipped"},
        {"event": "progress", "file": "a", "done": 500, "size": 1000},
        {"event": "file", "file": "a", "size": 1000, "sha256": "x", "status": "ok"},
        {"event": "file", "file": "b", "size": 1000, "sha256": "y", "status": "refetched"},
        {"event": "done", "verified": True, "bytes": 2000, "seconds": 2.0, "files": 3, "total_bytes": 3000},
    ]
    with p:
        for e in events:
            p.handle(e)
    task = p.progress.tasks[0]
    assert task.total == 2000 and task.completed == 2000
    assert p.files_done == 2 and p.skipped == 1 and p.refetched == 1
    summary = p.summary()
    assert "3 files verified" in summary and "1 already verified" in summary
    assert "1 re-fetched" in summary
    assert "2/2 files" in console.export_text()


def test_progress_summary_on_error():
    p = DownloadProgress(console=Console(record=True))
    p.handle({"event": "error", "kind": "auth", "message": "gated"})
    assert p.summary() == "download failed (auth): gated"


def test_argv_never_carries_a_token():
    argv = download_args("o/r", "main", "/m/x", allow=["*.json"], ignore=["*.png"], token_file="/state/secrets/t")
    assert argv[:2] == ["--repo", "o/r"] and argv[argv.index("--token-file") + 1] == "/state/secrets/t"
    assert ["--allow", "*.json"] == argv[argv.index("--allow"):argv.index("--allow") + 2]
    assert all(not isinstance(a, Secret) for a in argv)


def test_host_script_is_python39_syntax_and_stdlib_plus_hub_only():
    src = package_file("host", "remote", "download.py").read_text()
    tree = ast.parse(src, feature_version=(3, 9))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    import sys
    assert imported - set(sys.stdlib_module_names) == {"huggingface_hub"}


def test_a_failed_file_stops_the_queue_in_its_own_worker():
    """The worker that fails raises the abort itself: CI saw a 1-worker run finish the next shard
    after the dropped one, because the main thread set the abort only after the worker took the next
    file."""
    import importlib.util
    import threading

    import pytest

    spec = importlib.util.spec_from_file_location("dl_script", package_file("host", "remote", "download.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dl = mod.Downloader.__new__(mod.Downloader)
    dl.abort = threading.Event()
    started = []

    def run(f):
        started.append(f["name"])
        if f["name"] == "b":
            raise mod.Fail("network", "connection lost", "b")
        return "ok"

    dl._run_file = run
    assert dl.run_file({"name": "a"}) == "ok"
    with pytest.raises(mod.Fail):
        dl.run_file({"name": "b"})
    with pytest.raises(mod.Aborted):
        dl.run_file({"name": "c"})
    assert started == ["a", "b"]


def test_the_record_is_written_at_once_for_a_big_file_and_at_most_once_a_second_for_small_ones(tmp_path):
    """Each save writes the whole record: a repo of 160 small files rewrote it 160 times (quadratic).
    A big file is recorded at once (a kill must not cost a shard of GBs); small ones are batched, and
    flush() writes what is pending (a failed or interrupted run keeps its finished files)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("dl_script", package_file("host", "remote", "download.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    saves = []
    rec = mod.Record(tmp_path, "org/repo", "main", "c" * 40)
    real_save = rec._save
    rec._save = lambda: (saves.append(sorted(rec.data["files"])), real_save())
    rec.save()                                                   # the folder is ours from the start
    rec.SAVE_EVERY_S = 3600.0                                    # no second passes (a busy machine)
    on_disk = lambda: sorted(json.loads((tmp_path / ".vllm-orch" / "verified.json").read_text())["files"])  # noqa: E731
    for i in range(20):
        rec.add(f"small-{i:02d}", {"size": 100})
    assert len(saves) == 1 and on_disk() == []                   # batched: none written yet
    rec.add("model-00001.safetensors", {"size": mod.Record.SAVE_AT_ONCE_BYTES})
    assert len(saves) == 2 and len(on_disk()) == 21              # a big file: at once, with the pending ones
    rec.add("small-20", {"size": 100})
    rec.flush()
    assert len(saves) == 3 and len(on_disk()) == 22
    rec.flush()
    assert len(saves) == 3                                       # nothing pending: no write
    rec.SAVE_EVERY_S = 0.0                                       # the interval has passed
    rec.add("small-21", {"size": 100})
    assert len(saves) == 4 and len(on_disk()) == 23
