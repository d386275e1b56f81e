"""The synthetic repo catalog: real names and counts, metadata that matches the bytes, cheap ranges."""

import hashlib
import json
import struct

from orchestrator.sim.repo_files import git_blob_oid
from orchestrator.sim.repos import Catalog, commit_for, revisions_from_manifests


def test_real_shard_layouts_and_sizes():
    cat = Catalog()
    kimi = cat.repo("moonshotai/Kimi-K2.5")
    shards = [p for p in kimi.files if p.endswith(".safetensors")]
    assert len(shards) == 64
    assert shards[0] == "model-00001-of-000064.safetensors"
    assert shards[-1] == "model-00064-of-000064.safetensors"
    # ~547 GB real, scaled by 10000 (plus the small files)
    assert 54_000_000 < kimi.total_bytes < 56_000_000
    assert sum(kimi.files[p].real_size for p in shards) == 547_000_000_000
    minimax = cat.repo("MiniMaxAI/MiniMax-M2.5")
    mm = [p for p in minimax.files if p.endswith(".safetensors")]
    assert len(mm) == 126 and mm[0] == "model-00000-of-00126.safetensors"
    assert mm[-1] == "model-00125-of-00126.safetensors"
    assert len([p for p in cat.repo("nvidia/Kimi-K2.5-NVFP4").files if p.endswith(".safetensors")]) == 119
    # remote code for trust_remote_code models, and the config names the repo
    for repo_id in ("moonshotai/Kimi-K2.5", "nvidia/Kimi-K2.5-NVFP4", "MiniMaxAI/MiniMax-M2.5"):
        repo = cat.repo(repo_id)
        assert any(p.endswith(".py") for p in repo.files)
        config = json.loads(repo.files["config.json"].read())
        assert config["_name_or_path"] == repo_id and "auto_map" in config


def test_metadata_matches_served_bytes():
    repo = Catalog().repo("vllm-orch-sim/tiny-random-3shard")
    for f in repo.files.values():
        data = f.read()
        assert len(data) == f.size
        assert hashlib.sha256(data).hexdigest() == f.sha256
        if f.lfs:
            assert f.tree_entry()["lfs"]["oid"] == f.sha256
            assert f.blob_id == git_blob_oid(f.pointer)
        else:
            assert f.blob_id == git_blob_oid(data)   # what `git hash-object` gives


def test_any_range_equals_the_slice_of_the_whole():
    f = Catalog().repo("vllm-orch-sim/tiny-random-3shard").files["model-00001-of-00003.safetensors"]
    whole = f.read()
    for start, end in [(0, 10), (5, 1 << 20), ((1 << 20) - 3, (1 << 20) + 3), (f.size - 7, f.size)]:
        assert f.read(start, end) == whole[start:end]
    assert b"".join(f.iter_bytes(100, 5000, chunk=333)) == whole[100:5000]


def test_shards_are_valid_safetensors_files():
    f = Catalog().repo("MiniMaxAI/MiniMax-M2.5").files["model-00007-of-00126.safetensors"]
    data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    (tensor,) = [k for k in header if k != "__metadata__"]
    start, end = header[tensor]["data_offsets"]
    assert 8 + hlen + end == len(data) and start == 0


def test_index_keeps_the_unscaled_total():
    repo = Catalog(scale=20000).repo("moonshotai/Kimi-K2.5")
    index = json.loads(repo.files["model.safetensors.index.json"].read())
    assert index["metadata"]["total_size"] == 547_000_000_000
    assert set(index["weight_map"].values()) == {p for p in repo.files if p.endswith(".safetensors")}
    assert repo.files["model.safetensors.index.json"].lfs        # LFS-tracked, as in the real repo


def test_deterministic_across_instances_and_scale_changes_content():
    a = Catalog().repo("vllm-orch-sim/gated-tiny").files["model.safetensors"]
    b = Catalog().repo("vllm-orch-sim/gated-tiny").files["model.safetensors"]
    assert a.sha256 == b.sha256
    c = Catalog(scale=20000).repo("vllm-orch-sim/gated-tiny").files["model.safetensors"]
    assert c.size < a.size and c.sha256 != a.sha256


def test_revisions_main_pinned_and_unknown():
    pinned = "0123456789abcdef0123456789abcdef01234567"
    cat = Catalog(revisions=[("moonshotai/Kimi-K2.5", pinned), ("moonshotai/Kimi-K2.5", "v1.0")])
    assert cat.resolve("moonshotai/Kimi-K2.5", "main") == commit_for("moonshotai/Kimi-K2.5")
    assert cat.resolve("moonshotai/Kimi-K2.5", pinned) == pinned
    assert cat.resolve("moonshotai/Kimi-K2.5", "v1.0") == commit_for("moonshotai/Kimi-K2.5", "v1.0")
    assert cat.resolve("moonshotai/Kimi-K2.5", "v2.0") is None
    assert cat.resolve("MiniMaxAI/MiniMax-M2.5", pinned) is None   # pinned for another repo only
    assert cat.resolve("nobody/nothing", "main") is None
    assert len(commit_for("x/y")) == 40 and commit_for("x/y") == commit_for("x/y")


def test_revisions_from_manifests(tmp_path):
    (tmp_path / "kimi.yaml").write_text("name: kimi\nsource:\n  repo: moonshotai/Kimi-K2.5\n  revision: abc\n")
    (tmp_path / "bad.yaml").write_text("{not yaml: [")
    (tmp_path / "nosource.yaml").write_text("name: x\n")
    assert revisions_from_manifests(tmp_path) == [("moonshotai/Kimi-K2.5", "abc")]
