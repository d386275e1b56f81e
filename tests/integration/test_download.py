"""The host-side download script (run by a real Python with the real huggingface_hub) against the
SIMULATED Hub mirror, and the controller functions that drive it through a LocalHost.

Proofs come from the mirror's request log: which files were GET, with which Range, how many bytes."""

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
from rich.console import Console

from orchestrator.errors import DeployFailed
from orchestrator.host.download import plan_download, run_download
from orchestrator.host.local import LocalHost
from orchestrator.ops.progress import DownloadProgress
from orchestrator.paths import package_file
from orchestrator.secret import Secret
from orchestrator.sim.hub import SIM_TOKEN
from orchestrator.sim.repos import Catalog

SCRIPT = str(package_file("host", "remote", "download.py"))
TINY = "vllm-orch-sim/tiny-random-3shard"
GATED = "vllm-orch-sim/gated-tiny"
FAST = ["--backoff", "0.05", "--stall-timeout", "5"]


def run_script(mirror, local_dir, *args, repo=TINY, env=None):
    proc = subprocess.run([sys.executable, SCRIPT, "--repo", repo, "--revision", "main", "--local-dir",
                           str(local_dir), *FAST, *args], capture_output=True, text=True,
                          env=mirror.env(**(env or {})), timeout=120)
    events = [json.loads(line) for line in proc.stdout.splitlines()]   # stdout is JSON lines only
    return proc, events


def of(events, kind):
    return [e for e in events if e["event"] == kind]


def shard_gets(mirror, repo=TINY):
    return [r for r in mirror.requests() if r["method"] == "GET" and "/resolve/" in r["path"]
            and r["path"].endswith(".safetensors") and repo in r["path"]]


def test_fresh_download_then_a_second_run_skips_everything(hub_mirror, tmp_path):
    dest = tmp_path / "tiny"
    proc, events = run_script(hub_mirror, dest)
    assert proc.returncode == 0, proc.stderr
    repo = Catalog().repo(TINY)
    plan = of(events, "plan")[0]
    assert plan["files"] == len(repo.files) and plan["to_fetch_bytes"] == plan["total_bytes"] == repo.total_bytes
    assert plan["have_bytes"] == 0
    files = {e["file"]: e for e in of(events, "file")}
    assert set(files) == set(repo.files) and {e["status"] for e in files.values()} == {"ok"}
    for name, f in repo.files.items():
        assert hashlib.sha256((dest / name).read_bytes()).hexdigest() == f.sha256 == files[name]["sha256"]
    done = of(events, "done")[0]
    assert done["verified"] and done["bytes"] == repo.total_bytes
    record = json.loads((dest / ".vllm-orch" / "verified.json").read_text())
    assert record["complete"] and record["repo"] == TINY and record["total_bytes"] == repo.total_bytes
    assert record["files"]["model-00001-of-00003.safetensors"]["sha256"] == \
        repo.files["model-00001-of-00003.safetensors"].sha256
    assert len(shard_gets(hub_mirror)) == 3

    t = time.monotonic()
    proc, events = run_script(hub_mirror, dest, "--plan-only")
    plan_seconds = time.monotonic() - t
    assert proc.returncode == 0 and of(events, "plan")[0]["to_fetch"] == []
    assert of(events, "plan")[0]["have_bytes"] == repo.total_bytes and not of(events, "done")
    proc, events = run_script(hub_mirror, dest)
    assert proc.returncode == 0
    assert {e["status"] for e in of(events, "file")} == {"skipped"} and of(events, "done")[0]["bytes"] == 0
    assert len(shard_gets(hub_mirror)) == 3                     # no GET of any shard the second time
    print(f"plan of a verified folder: {plan_seconds:.2f} s")    # a figure, not an assertion (benchmarks/)


def test_a_changed_file_is_fetched_again(hub_mirror, tmp_path):
    dest = tmp_path / "tiny"
    assert run_script(hub_mirror, dest)[0].returncode == 0
    victim = dest / "model-00002-of-00003.safetensors"
    victim.write_bytes(b"tampered")                           # size and mtime no longer match the record
    proc, events = run_script(hub_mirror, dest)
    assert proc.returncode == 0
    assert of(events, "plan")[0]["to_fetch"] == [victim.name]
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == \
        Catalog().repo(TINY).files[victim.name].sha256


def test_interrupted_download_resumes_without_refetching_finished_shards(hub_mirror, tmp_path):
    dest = tmp_path / "tiny"
    dropped_name = "model-00002-of-00003.safetensors"
    hub_mirror.add_fault("hub-drop", None, file=dropped_name)
    # one worker, no retries: shard 1 completes, the dropped shard 2 ends the run (like a lost link)
    proc, events = run_script(hub_mirror, dest, "--workers", "1", "--retries", "0",
                              "--allow", "*.safetensors")
    assert proc.returncode == 1
    err = of(events, "error")[0]
    assert err["kind"] == "network" and err["file"] == dropped_name
    finished = {e["file"] for e in of(events, "file")}
    assert finished == {"model-00001-of-00003.safetensors"}
    first_run = shard_gets(hub_mirror)
    (dropped,) = [r for r in first_run if r["fault"] == "hub-drop"]
    repo = Catalog().repo(TINY)
    assert 0 < dropped["bytes"] < repo.files[dropped_name].size

    proc, events = run_script(hub_mirror, dest, "--workers", "1", "--allow", "*.safetensors")
    assert proc.returncode == 0, proc.stderr
    plan = of(events, "plan")[0]
    assert plan["to_fetch"] == [dropped_name, "model-00003-of-00003.safetensors"]
    assert plan["partial_bytes"] == dropped["bytes"]
    second = shard_gets(hub_mirror)[len(first_run):]
    assert [r["path"].rsplit("/", 1)[1] for r in second] == plan["to_fetch"]   # shard 1 not fetched again
    resumed = second[0]
    assert resumed["range"] == f"bytes={dropped['bytes']}-" and resumed["status"] == 206
    # every byte of the dropped shard crossed the wire exactly once
    assert dropped["bytes"] + resumed["bytes"] == repo.files[dropped_name].size
    assert [e["status"] for e in of(events, "file")] == ["skipped", "ok", "ok"]   # shard 1 from the record
    for name in repo.files:
        if name.endswith(".safetensors"):
            assert hashlib.sha256((dest / name).read_bytes()).hexdigest() == repo.files[name].sha256


def test_dropped_connection_is_retried_within_one_run(hub_mirror, tmp_path):
    hub_mirror.add_fault("hub-drop", None)
    proc, events = run_script(hub_mirror, tmp_path / "tiny")
    assert proc.returncode == 0, proc.stderr
    assert of(events, "done")[0]["verified"]
    gets = shard_gets(hub_mirror)
    assert len(gets) == 4 and sum(1 for r in gets if r["status"] == 206) == 1   # 3 shards + 1 resume
    assert sum(r["bytes"] for r in gets) == sum(f.size for n, f in Catalog().repo(TINY).files.items()
                                                if n.endswith(".safetensors"))


def test_corrupt_shard_is_detected_and_refetched(hub_mirror, tmp_path):
    hub_mirror.add_fault("hub-corrupt", None)
    proc, events = run_script(hub_mirror, tmp_path / "tiny")
    assert proc.returncode == 0, proc.stderr
    refetched = [e for e in of(events, "file") if e["status"] == "refetched"]
    assert len(refetched) == 1
    name = refetched[0]["file"]
    # one corrupt GET, then one clean one; the mirror logs each when its response ends, so on a busy
    # machine the refetch's line can come first: the log's order is not the requests' order
    gets = [r["fault"] for r in shard_gets(hub_mirror) if r["path"].endswith(name)]
    assert sorted(gets, key=lambda f: f is None) == ["hub-corrupt", None], gets
    assert hashlib.sha256((tmp_path / "tiny" / name).read_bytes()).hexdigest() == \
        Catalog().repo(TINY).files[name].sha256


def test_corrupt_twice_is_a_checksum_error(hub_mirror, tmp_path):
    hub_mirror.add_fault("hub-corrupt", None)
    hub_mirror.add_fault("hub-corrupt", None)
    proc, events = run_script(hub_mirror, tmp_path / "tiny", "--workers", "1", "--allow", "*.safetensors")
    assert proc.returncode == 1
    err = of(events, "error")[0]
    assert err["kind"] == "checksum" and "sha256 mismatch" in err["message"]
    assert not (tmp_path / "tiny" / err["file"]).exists()          # a bad shard is never installed


def test_stall_is_retried_then_reported(hub_mirror, tmp_path):
    hub_mirror.add_fault("hub-slow", None, rate_bps=1000)          # 64 KiB then silence for a minute
    t = time.monotonic()
    proc, events = run_script(hub_mirror, tmp_path / "tiny", "--stall-timeout", "0.5", "--retries", "1",
                              "--allow", "model-00001-*")
    assert proc.returncode == 1 and time.monotonic() - t < 10
    err = of(events, "error")[0]
    assert err["kind"] == "network" and "timed out" in err["message"]


def test_token_from_env_or_file_is_used_and_never_printed(hub_mirror, tmp_path):
    wrong = "hf_wrongTokenThatMustNotLeak123"
    proc, events = run_script(hub_mirror, tmp_path / "g1", repo=GATED, env={"HF_TOKEN": wrong})
    assert proc.returncode == 1 and of(events, "error")[0]["kind"] == "auth"
    assert "403" in of(events, "error")[0]["message"]
    assert wrong not in proc.stdout + proc.stderr
    proc, events = run_script(hub_mirror, tmp_path / "g2", repo=GATED)
    assert of(events, "error")[0]["kind"] == "auth" and "401" in of(events, "error")[0]["message"]
    token_file = tmp_path / "token"
    token_file.write_text(SIM_TOKEN + "\n")
    proc, events = run_script(hub_mirror, tmp_path / "g3", "--token-file", str(token_file), repo=GATED)
    assert proc.returncode == 0 and of(events, "done")[0]["verified"]
    assert SIM_TOKEN not in proc.stdout + proc.stderr
    proc, events = run_script(hub_mirror, tmp_path / "g4", repo=GATED, env={"HF_TOKEN": SIM_TOKEN})
    assert proc.returncode == 0 and SIM_TOKEN not in proc.stdout + proc.stderr


def test_the_apply_downloads_the_commit_its_plan_showed_even_when_the_branch_moved(tmp_path):
    """`main` moved between a plan and its apply: the apply is given the plan's commit (--commit) and
    downloads exactly that, and the record still names the branch with the commit it holds. Here the
    mirror resolves `main` to one commit and serves an older one too (as the Hub does)."""
    from orchestrator.sim.repos import commit_for
    from tests.plugins.sim_hosts import start_hub_mirror, stop_hub_mirror

    older = commit_for(TINY, "v1.0")
    mirror = start_hub_mirror(tmp_path / "hub", "--revision", f"{TINY}@v1.0")
    try:
        assert older != Catalog().repo(TINY).commit
        proc, events = run_script(mirror, tmp_path / "tiny", "--commit", older)
        assert proc.returncode == 0, proc.stderr
        assert of(events, "plan")[0]["commit"] == of(events, "done")[0]["commit"] == older
        assert of(events, "plan")[0]["revision"] == "main"
        record = json.loads((tmp_path / "tiny" / ".vllm-orch" / "verified.json").read_text())
        assert (record["revision"], record["commit"], record["complete"]) == ("main", older, True)
        files = {r["path"] for r in mirror.requests() if "/resolve/" in r["path"]}
        assert files and all(f"/resolve/{older}/" in f for f in files), files
        # a commit the hub does not have is not found, named
        proc, events = run_script(mirror, tmp_path / "other", "--commit", "0" * 40)
        (err,) = of(events, "error")
        assert proc.returncode == 1 and err["kind"] == "not_found" and "0" * 40 in err["message"]
    finally:
        stop_hub_mirror(mirror)


def test_wrong_revision_is_not_found(hub_mirror, tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--repo", TINY, "--revision", "no-such", "--local-dir",
                           str(tmp_path / "x"), "--plan-only"], capture_output=True, text=True,
                          env=hub_mirror.env(), timeout=60)
    (err,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 1 and err["kind"] == "not_found" and "no-such" in err["message"]


# -- the controller side, through a LocalHost ----------------------------------------------------
def test_plan_and_run_through_a_host_with_progress(hub_mirror, tmp_path):
    host = LocalHost("sim", env={k: v for k, v in hub_mirror.env().items() if k.startswith("HF_")})
    dest = str(tmp_path / "models" / "tiny")
    plan = plan_download(host, sys.executable, TINY, "main", dest, ignore=["*.md"], state_dir=str(tmp_path / "state"))
    repo = Catalog().repo(TINY)
    assert plan["to_fetch_bytes"] == repo.total_bytes - repo.files["README.md"].size
    assert "README.md" not in plan["to_fetch"]
    console = Console(record=True, width=120, force_terminal=False)
    progress = DownloadProgress(console=console, label="tiny")
    with progress:
        result = run_download(host, sys.executable, TINY, "main", dest, ignore=["*.md"], on_event=progress.handle,
                              state_dir=str(tmp_path / "state"), workers=4)
    assert result["done"]["verified"] and len(result["files"]) == len(repo.files) - 1
    assert "files verified" in progress.summary()
    assert not (tmp_path / "state" / "scripts").exists(), "the script runs from stdin: nothing is uploaded"
    again = plan_download(host, sys.executable, TINY, "main", dest, ignore=["*.md"], state_dir=str(tmp_path / "state"))
    assert again["to_fetch"] == [] and again["have_bytes"] == plan["to_fetch_bytes"]


def test_controller_raises_with_a_hint_and_keeps_the_token_out_of_commands(hub_mirror, tmp_path):
    host = LocalHost("sim", env={k: v for k, v in hub_mirror.env().items() if k.startswith("HF_")})
    state = str(tmp_path / "state")
    with pytest.raises(DeployFailed) as exc:
        run_download(host, sys.executable, GATED, "main", str(tmp_path / "g"), state_dir=state)
    assert "auth" in str(exc.value) and exc.value.hint and exc.value.step == "download"
    seen = []
    original = host.stream

    def spy(cmd, **kw):
        seen.append(host.wrap(cmd, kw.get("env"), kw.get("sudo")))
        return original(cmd, **kw)

    host.stream = spy
    result = run_download(host, sys.executable, GATED, "main", str(tmp_path / "g"), state_dir=state,
                          token=Secret(SIM_TOKEN))
    assert result["done"]["verified"]
    assert SIM_TOKEN not in seen[0] and "--token-file" in seen[0]
    assert not list((tmp_path / "state" / "secrets").iterdir())        # the token file is removed


@pytest.mark.timeout(120)
def test_kimi_int4_synthetic_repo_at_default_scale(hub_mirror, tmp_path, capsys):
    dest = tmp_path / "kimi"
    t = time.monotonic()
    proc, events = run_script(hub_mirror, dest, repo="moonshotai/Kimi-K2.5")
    seconds = time.monotonic() - t
    assert proc.returncode == 0, proc.stderr
    done = of(events, "done")[0]
    assert done["files"] == 86 and len([n for n in of(events, "plan")[0]["to_fetch"]
                                        if n.endswith(".safetensors")]) == 64
    t = time.monotonic()
    proc, events = run_script(hub_mirror, dest, "--plan-only", repo="moonshotai/Kimi-K2.5")
    plan_seconds = time.monotonic() - t
    assert of(events, "plan")[0]["to_fetch"] == []
    with capsys.disabled():
        print(f"\n[figures] Kimi-K2.5 INT4 synthetic ({done['total_bytes'] / 1e6:.1f} MB, 64 shards): "
              f"{seconds:.2f} s wall, script {done['seconds']:.2f} s = "
              f"{done['bytes'] / 1e6 / done['seconds']:.0f} MB/s over loopback; plan-only re-run {plan_seconds:.2f} s")


def test_the_hub_token_file_is_gone_even_when_the_connection_drops_before_its_removal(hub_mirror, tmp_path):
    """The token file vllm-orch puts on the host for one download was removed by a command after the
    script: a connection that dropped first left the token behind. The script now removes the
    file it was given for one run as soon as it has read it; a file left by a run cut between the
    upload and the script's start is swept by the next run that uses a token."""
    from orchestrator.errors import ConnectError

    host = LocalHost("sim", env={k: v for k, v in hub_mirror.env().items() if k.startswith("HF_")})
    state = tmp_path / "state"
    (state / "secrets").mkdir(parents=True)
    stale = state / "secrets" / "hf-token-1"
    stale.write_text("hf_left_by_a_cut_run")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    original = host.run

    def dropped(cmd, **kw):
        if "rm -f" in host.wrap(cmd, kw.get("env"), kw.get("sudo")):
            raise ConnectError("connection to sim lost", host="sim")
        return original(cmd, **kw)

    host.run = dropped
    with pytest.raises(ConnectError):
        run_download(host, sys.executable, GATED, "main", str(tmp_path / "g"), state_dir=str(state),
                     token=Secret(SIM_TOKEN))
    assert (tmp_path / "g" / ".vllm-orch" / "verified.json").exists()     # the download itself ran
    assert [p.name for p in (state / "secrets").iterdir()] == ["hf-token-1"]
    host.run = original
    run_download(host, sys.executable, GATED, "main", str(tmp_path / "g"), state_dir=str(state),
                 token=Secret(SIM_TOKEN))
    assert list((state / "secrets").iterdir()) == []


def test_a_fleet_peer_that_does_not_answer_costs_nothing_every_file_comes_from_the_hub(hub_mirror, tmp_path):
    """download once per fleet: a holder behind a firewall (here a port nobody listens on) is given
    up at once, not after a stall per file; the token file is removed all the same."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    token = tmp_path / "peer-token"
    token.write_text("t" * 43)
    t = time.monotonic()
    proc, events = run_script(hub_mirror, tmp_path / "tiny", "--peer", f"http://127.0.0.1:{closed}",
                              "--peer-token-file", str(token))
    assert proc.returncode == 0, proc.stderr
    assert "does not answer; every file from the Hub" in proc.stderr
    done = of(events, "done")[0]
    assert done["verified"] and done["peer_bytes"] == 0 and len(shard_gets(hub_mirror)) == 3
    assert {e["status"] for e in of(events, "file")} == {"ok"} and not token.exists()
    assert "t" * 43 not in proc.stdout + proc.stderr
    print(f"download with an unreachable peer: {time.monotonic() - t:.2f} s")
