"""Hub file names are untrusted. A compromised Hub, or any HF_ENDPOINT mirror, can list names such as
`../../x.py`; the download runs as root on the GPU host. The SIMULATED Hub serves such a listing
(orchestrator/sim/repos.py, HOSTILE_REPO) to the real huggingface_hub client inside the real
download script: nothing may be written outside the model folder, nor over vllm-orch's records."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from orchestrator.errors import RefusedError
from orchestrator.host.download import run_download
from orchestrator.host.local import LocalHost
from orchestrator.paths import package_file
from orchestrator.sim.repos import HOSTILE_NAMES, HOSTILE_REPO

SCRIPT = str(package_file("host", "remote", "download.py"))
TINY = "vllm-orch-sim/tiny-random-3shard"


def load_script():
    spec = importlib.util.spec_from_file_location("vllm_orch_download_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(mirror, local_dir, *args, repo=HOSTILE_REPO):
    proc = subprocess.run([sys.executable, SCRIPT, "--repo", repo, "--revision", "main", "--local-dir",
                           str(local_dir), "--backoff", "0.05", "--retries", "0", *args],
                          capture_output=True, text=True, env=mirror.env(), timeout=120)
    return proc, [json.loads(line) for line in proc.stdout.splitlines()]


def tree(path) -> set[str]:
    """Every path under `path`, but the mirror's own folder."""
    return {str(p.relative_to(path)) for p in path.rglob("*") if "hub-host" not in p.parts}


@pytest.mark.parametrize("name,why", [
    ("../../x.py", "`..`"), ("a/../../x.py", "`..`"), ("/etc/cron.d/x", "absolute"), ("a\\b.txt", "backslash"),
    ("./x.json", "`.`"), ("a//b.json", "empty"), ("", "empty"), ("a/", "empty"), ("x\n.json", "control"),
    (".vllm-orch/verified.json", "bookkeeping"), (".cache/huggingface/download/x.json", "bookkeeping"),
])
def test_unsafe_names_are_named_with_the_reason(name, why):
    assert why in load_script().unsafe_name(name)


@pytest.mark.parametrize("name", ["config.json", "sub/folder/model.safetensors", ".gitattributes", "a..b.json",
                                  "figures/kimi-logo.png", "tokenizer.model"])
def test_ordinary_names_pass(name):
    assert load_script().unsafe_name(name) is None


def test_a_hostile_listing_writes_nothing_anywhere(hub_mirror, tmp_path):
    dest = tmp_path / "models" / "hostile"
    proc, events = run_script(hub_mirror, dest)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (err,) = [e for e in events if e["event"] == "error"]
    assert err["kind"] == "unsafe" and f"{len(HOSTILE_NAMES)} file names" in err["message"]
    assert "../../escaped-by-dotdot.py" in err["message"]
    assert tree(tmp_path) == {"models"} or tree(tmp_path) == set()       # not even the model folder
    assert not os.path.exists("/tmp/vllm-orch-sim-absolute.json")
    assert not [r for r in hub_mirror.requests() if "/resolve/" in r["path"]]    # nothing fetched
    proc, events = run_script(hub_mirror, dest, "--plan-only")               # planning refuses too
    assert proc.returncode == 1 and events[-1]["kind"] == "unsafe"


def test_the_controller_refuses_with_exit_3_and_a_hint(hub_mirror, tmp_path):
    host = LocalHost("sim", env={k: v for k, v in hub_mirror.env().items() if k.startswith("HF_")})
    with pytest.raises(RefusedError) as info:
        run_download(host, sys.executable, HOSTILE_REPO, "main", str(tmp_path / "m"), state_dir=str(tmp_path / "s"))
    assert info.value.exit_code == 3 and info.value.step == "download" and "HF_ENDPOINT" in info.value.hint
    assert not (tmp_path / "m").exists()


def test_a_symlink_planted_in_the_model_folder_is_not_followed(hub_mirror, tmp_path):
    """Someone who can write the model folder plants `.cache/huggingface/download` -> elsewhere: the
    partial files (written as root) would land there. The download refuses instead."""
    dest = tmp_path / "tiny"
    outside = tmp_path / "outside"
    outside.mkdir()
    (dest / ".cache" / "huggingface").mkdir(parents=True)
    (dest / ".cache" / "huggingface" / "download").symlink_to(outside)
    proc, events = run_script(hub_mirror, dest, repo=TINY)
    assert proc.returncode == 1
    err = [e for e in events if e["event"] == "error"][0]
    assert err["kind"] == "unsafe" and "symlink" in err["message"], err
    assert list(outside.iterdir()) == []


def test_a_symlinked_file_is_replaced_not_written_through(hub_mirror, tmp_path):
    """A symlink where a model file goes (config.json -> a file outside) is never opened for writing
    or hashing: the verified file replaces the link, the target is untouched."""
    dest = tmp_path / "tiny"
    dest.mkdir()
    target = tmp_path / "precious.json"
    target.write_text("precious\n")
    (dest / "config.json").symlink_to(target)
    proc, events = run_script(hub_mirror, dest, repo=TINY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert target.read_text() == "precious\n"
    assert not (dest / "config.json").is_symlink() and json.loads((dest / "config.json").read_text())


def test_hub_hashes_that_are_paths_are_refused_before_anything_is_touched(tmp_path, monkeypatch, capsys):
    """The listing's sha256 / blob_id name the partial files (`<name>.<sha256>.incomplete`): a hostile
    mirror that lists `sha256: /../../../victim` would make root truncate and delete a file of that
    name outside the model folder. Hashes are checked like names, before anything is written."""
    script = load_script()
    dest = tmp_path / "models" / "m"
    made = dest / ".cache" / "huggingface" / "download" / "x."   # as an earlier file `x./y` of the listing made it
    made.mkdir(parents=True)
    victim = tmp_path / "victim.incomplete"
    victim.write_text("someone else's data\n")
    up = "/".join([".."] * len(made.relative_to(tmp_path).parts))
    listing = [{"name": "x", "size": 0, "sha256": f"/{up}/victim", "blob_id": None, "lfs": True}]
    monkeypatch.setattr(script, "fetch_metadata", lambda *a: ("0" * 40, listing))
    code = script.main(["--repo", "a/b", "--revision", "main", "--local-dir", str(dest), "--retries", "0"])
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1 and victim.read_text() == "someone else's data\n"
    assert events[-1]["event"] == "error" and events[-1]["kind"] == "unsafe", events
    assert "sha256" in events[-1]["message"] and not (dest / ".vllm-orch").exists()


@pytest.mark.parametrize("field,value,ok", [
    ("sha256", "a" * 64, True), ("sha256", None, True), ("sha256", "A" * 64, False), ("sha256", "a" * 63, False),
    ("sha256", "../" + "a" * 61, False), ("blob_id", "b" * 40, True), ("blob_id", "b" * 64, True),
    ("blob_id", "b" * 39 + "/", False), ("blob_id", 7, False),
])
def test_only_hex_hashes_of_the_hubs_lengths_pass(field, value, ok):
    f = {"name": "x", "size": 1, "sha256": None, "blob_id": None, "lfs": False, field: value}
    assert (load_script().unsafe_hash(f) is None) == ok
