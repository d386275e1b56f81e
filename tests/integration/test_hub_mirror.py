"""The REAL huggingface_hub client against the SIMULATED Hub mirror (a separate process per test).

The client runs in a subprocess with HF_ENDPOINT set (huggingface_hub reads it at import time)."""

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from orchestrator.sim.hub import SIM_TOKEN, make_server
from orchestrator.sim.repos import Catalog, commit_for

TINY = "vllm-orch-sim/tiny-random-3shard"
GATED = "vllm-orch-sim/gated-tiny"


def client(mirror, code: str, **env) -> dict:
    """Run `code` with the real huggingface_hub against the mirror, in the mirror's (temporary) host
    folder so relative local_dirs never outlive the test; it prints one JSON object."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=mirror.env(**env), timeout=120, cwd=mirror.hostdir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_snapshot_and_hf_hub_download_sha256_match_metadata(hub_mirror, tmp_path):
    out = client(hub_mirror, f"""
        import json, hashlib, pathlib
        from huggingface_hub import HfApi, snapshot_download, hf_hub_download
        info = HfApi().model_info("{TINY}", files_metadata=True)
        root = pathlib.Path(snapshot_download("{TINY}", local_dir="{tmp_path}/snap"))
        one = hf_hub_download("{TINY}", "model-00002-of-00003.safetensors", local_dir="{tmp_path}/one")
        got = {{p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts}}
        meta = {{s.rfilename: [s.size, s.lfs.sha256 if s.lfs else None, s.blob_id] for s in info.siblings}}
        print(json.dumps({{"sha": info.sha, "got": got, "meta": meta,
                          "one": hashlib.sha256(open(one, "rb").read()).hexdigest()}}))
    """)
    assert out["sha"] == commit_for(TINY)
    assert set(out["got"]) == set(out["meta"])
    shards = [n for n in out["meta"] if n.endswith(".safetensors")]
    assert len(shards) == 3
    for name in shards:
        assert out["got"][name] == out["meta"][name][1]
    assert out["one"] == out["meta"]["model-00002-of-00003.safetensors"][1]
    repo = Catalog().repo(TINY)
    for name, (size, _, blob_id) in out["meta"].items():
        assert size == repo.files[name].size and blob_id == repo.files[name].blob_id
    # the plain HTTP path: HEAD + GET per file, no xet
    paths = [r["path"] for r in hub_mirror.requests()]
    assert all("xet" not in p for p in paths)


def test_model_info_tree_and_paths_info_values(hub_mirror):
    out = client(hub_mirror, """
        import json
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile, RepoFolder
        api = HfApi()
        repo = "MiniMaxAI/MiniMax-M2.5"
        info = api.model_info(repo, files_metadata=True)
        top = list(api.list_repo_tree(repo))
        rec = list(api.list_repo_tree(repo, recursive=True))
        docs = list(api.list_repo_tree(repo, path_in_repo="docs", expand=True))
        paths = api.get_paths_info(repo, ["config.json", "model-00003-of-00126.safetensors", "docs", "nope"])
        def d(x):
            if isinstance(x, RepoFolder):
                return {"folder": x.path}
            return {"path": x.path, "size": x.size, "blob_id": x.blob_id, "xet": x.xet_hash,
                    "sha256": x.lfs.sha256 if x.lfs else None,
                    "commit": x.last_commit.oid if x.last_commit else None}
        print(json.dumps({"sha": info.sha, "siblings": len(info.siblings),
                          "lfs": sum(1 for s in info.siblings if s.lfs),
                          "top": [d(x) for x in top], "rec": [d(x) for x in rec],
                          "docs": [d(x) for x in docs], "paths": [d(x) for x in paths]}))
    """)
    repo = Catalog().repo("MiniMaxAI/MiniMax-M2.5")
    assert out["siblings"] == len(repo.files)
    assert out["lfs"] == sum(1 for f in repo.files.values() if f.lfs)
    assert {"folder": "docs"} in out["top"] and {"folder": "figures"} in out["top"]
    assert not any("/" in x.get("path", "") for x in out["top"])                  # not recursive
    assert sum(1 for x in out["rec"] if "path" in x) == len(repo.files)           # every file, recursively
    assert len(out["docs"]) == 8 and all(x["commit"] == out["sha"] for x in out["docs"])  # expand: 50/page
    by_path = {x.get("path") or x.get("folder"): x for x in out["paths"]}
    assert set(by_path) == {"config.json", "model-00003-of-00126.safetensors", "docs"}
    shard = repo.files["model-00003-of-00126.safetensors"]
    assert by_path["model-00003-of-00126.safetensors"]["sha256"] == shard.sha256
    assert by_path["model-00003-of-00126.safetensors"]["size"] == shard.size
    assert by_path["config.json"]["blob_id"] == repo.files["config.json"].blob_id
    assert all(x.get("xet") is None for x in out["rec"])


def test_tree_pagination_follows_link_headers(tmp_path):
    server = make_server(tmp_path, page_size=7)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        class M:   # the bits of HubMirror `client` needs
            hostdir = tmp_path

            def env(self, **extra):
                from tests.plugins.sim_hosts import HubMirror
                return HubMirror(tmp_path, server.server_address[1], None).env(**extra)
        out = client(M(), """
            import json
            from huggingface_hub import HfApi
            print(json.dumps([f.path for f in HfApi().list_repo_tree("moonshotai/Kimi-K2.5", recursive=True)]))
        """)
    finally:
        server.shutdown()
        server.server_close()
    assert len(out) == len(set(out)) == len(Catalog().repo("moonshotai/Kimi-K2.5").files) + 2   # + 2 folders
    pages = [r for r in (json.loads(l) for l in (tmp_path / "hub-requests.jsonl").read_text().splitlines())
             if "/tree/" in r["path"]]
    assert len(pages) == -(-len(out) // 7)


def test_gated_repo_401_403_and_the_accepted_token(hub_mirror):
    code = f"""
        import json
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import GatedRepoError
        try:
            hf_hub_download("{GATED}", "config.json", local_dir="x")
            print(json.dumps({{"ok": True}}))
        except GatedRepoError as e:
            print(json.dumps({{"status": e.response.status_code}}))
    """
    assert client(hub_mirror, code) == {"status": 401}
    assert client(hub_mirror, code, HF_TOKEN="hf_not_the_right_one") == {"status": 403}
    assert client(hub_mirror, code, HF_TOKEN=SIM_TOKEN) == {"ok": True}


def test_wrong_revision_repo_and_file_raise_the_library_errors(hub_mirror):
    out = client(hub_mirror, f"""
        import json
        from huggingface_hub import HfApi, hf_hub_download, snapshot_download
        from huggingface_hub.errors import (RevisionNotFoundError, RepositoryNotFoundError,
                                            EntryNotFoundError)
        res = {{}}
        for name, call in [
            ("info_rev", lambda: HfApi().model_info("{TINY}", revision="no-such-branch")),
            ("snap_rev", lambda: snapshot_download("{TINY}", revision="deadbeef" * 5, local_dir="s")),
            ("file_rev", lambda: hf_hub_download("{TINY}", "config.json", revision="v9", local_dir="f")),
            ("repo", lambda: HfApi().model_info("nobody/nothing")),
            ("file", lambda: hf_hub_download("{TINY}", "missing.bin", local_dir="m")),
        ]:
            try:
                call()
                res[name] = "no error"
            except Exception as e:
                res[name] = [type(e).__name__, isinstance(e, RevisionNotFoundError),
                             isinstance(e, RepositoryNotFoundError), isinstance(e, EntryNotFoundError)]
        print(json.dumps(res))
    """)
    for name in ("info_rev", "snap_rev", "file_rev"):
        assert out[name][1], out[name]
    assert out["repo"][2] and out["file"][3], out


def test_pinned_revision_resolves_when_registered(tmp_path):
    from tests.plugins.sim_hosts import start_hub_mirror, stop_hub_mirror
    pinned = "54383e83fa343a1331754112fb9e3410c55efa2f"
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.yaml").write_text(f"name: m\nsource:\n  repo: {TINY}\n  revision: {pinned}\n")
    mirror = start_hub_mirror(tmp_path / "host", "--models-dir", str(models))
    try:
        out = client(mirror, f"""
            import json
            from huggingface_hub import HfApi, hf_hub_download
            sha = HfApi().model_info("{TINY}", revision="{pinned}").sha
            p = hf_hub_download("{TINY}", "config.json", revision="{pinned}", local_dir="d")
            print(json.dumps({{"sha": sha, "cfg": json.load(open(p))["_name_or_path"]}}))
        """)
    finally:
        stop_hub_mirror(mirror)
    assert out == {"sha": pinned, "cfg": TINY}


def test_resolve_headers_and_range_requests(hub_mirror):
    f = Catalog().repo(TINY).files["model-00001-of-00003.safetensors"]
    url = f"{hub_mirror.url}/{TINY}/resolve/main/{f.path}"
    head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10)
    assert head.headers["X-Linked-Etag"] == f'"{f.sha256}"' and head.headers["ETag"] == f'"{f.sha256}"'
    assert int(head.headers["X-Linked-Size"]) == f.size == int(head.headers["Content-Length"])
    assert head.headers["X-Repo-Commit"] == commit_for(TINY)
    assert "X-Xet-Hash" not in head.headers and "xet" not in (head.headers.get("Link") or "")
    part = urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=1000-"}), timeout=10)
    assert part.status == 206
    assert part.headers["Content-Range"] == f"bytes 1000-{f.size - 1}/{f.size}"
    assert part.read() == f.read(1000)
    try:
        urllib.request.urlopen(urllib.request.Request(url, headers={"Range": f"bytes={f.size}-"}), timeout=10)
        raise AssertionError("expected 416")
    except urllib.error.HTTPError as e:
        assert e.code == 416
    small = urllib.request.urlopen(f"{hub_mirror.url}/{TINY}/resolve/main/config.json", timeout=10)
    assert small.headers["ETag"] == f'"{Catalog().repo(TINY).files["config.json"].blob_id}"'
    assert "X-Linked-Etag" not in small.headers


def test_hub_5xx_is_retried_by_the_client(hub_mirror, tmp_path):
    hub_mirror.add_fault("hub-5xx", None)
    out = client(hub_mirror, f"""
        import json, hashlib
        from huggingface_hub import hf_hub_download
        p = hf_hub_download("{TINY}", "model-00003-of-00003.safetensors", local_dir="{tmp_path}/d")
        print(json.dumps({{"sha": hashlib.sha256(open(p, "rb").read()).hexdigest()}}))
    """)
    assert out["sha"] == Catalog().repo(TINY).files["model-00003-of-00003.safetensors"].sha256
    assert [r["status"] for r in hub_mirror.requests() if r["fault"] == "hub-5xx"] == [503]
    assert json.loads((hub_mirror.hostdir / "faults.json").read_text()) == []      # consumed once


def test_hub_slow_throttles_bodies(hub_mirror):
    hub_mirror.add_fault("hub-slow", None, rate_bps=4_000_000)
    f = Catalog().repo(TINY).files["model-00001-of-00003.safetensors"]     # ~2.3 MB
    t = time.monotonic()
    data = urllib.request.urlopen(f"{hub_mirror.url}/{TINY}/resolve/main/{f.path}", timeout=10).read()
    took = time.monotonic() - t
    assert hashlib.sha256(data).hexdigest() == f.sha256
    assert took >= f.size / 4_000_000 * 0.9
    assert json.loads((hub_mirror.hostdir / "faults.json").read_text())[0]["fault"] == "hub-slow"  # persists


def test_port_file_and_clean_stop_on_sigterm(tmp_path):
    from tests.plugins.sim_hosts import start_hub_mirror
    mirror = start_hub_mirror(tmp_path / "h")
    assert (tmp_path / "h" / "hub.port").read_text().strip() == str(mirror.port)
    mirror.proc.terminate()
    assert mirror.proc.wait(5) == 0
    assert not (tmp_path / "h" / "hub.port").exists()
    assert "SIMULATED hub mirror" in Path(tmp_path / "h" / "hub.log").read_text()
