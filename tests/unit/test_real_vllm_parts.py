"""The parts of the real-vLLM tier that need no vLLM: the tiny model generator, the cached-venv
builder, the venv's metadata fix, a real-vLLM host's inventory entry and the fake nvidia-smi's view
of real vLLM processes. (Against vLLM itself: tests/integration/test_real_vllm*.py.)"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import time

import pytest

from orchestrator.devtools import cached_venv
from orchestrator.devtools.real_vllm_venv import VLLM_VERSION, write_vllm_metadata
from orchestrator.sim import manager
from orchestrator.sim.inventory import SimHost
from orchestrator.sim.nvidia_smi import real_vllm_holders
from orchestrator.sim.repos import Catalog
from orchestrator.sim.tinymodel import MODELS, SPECIAL, model_files, train_vocab


def _tensors(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__")
    return header, 8 + n


@pytest.mark.parametrize("repo", sorted(MODELS))
def test_tiny_model_files_are_deterministic_and_loadable_shapes(repo):
    files = model_files(MODELS[repo])
    assert files == model_files(MODELS[repo])                    # same bytes in every process
    spec = MODELS[repo]
    cfg = json.loads(files["config.json"])
    assert cfg["head_dim"] == 64 == cfg["hidden_size"] // cfg["num_attention_heads"]  # CPU attention
    header, start = _tensors(files["model.safetensors"])
    assert len([k for k in header if k.endswith("q_proj.weight")]) == spec.num_hidden_layers
    ends = sorted((v["data_offsets"][0], v["data_offsets"][1]) for v in header.values())
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))   # contiguous
    assert start + ends[-1][1] == len(files["model.safetensors"]) and start % 8 == 0
    assert header["lm_head.weight"]["shape"] == [cfg["vocab_size"], cfg["hidden_size"]]
    lm = header["lm_head.weight"]["data_offsets"]
    special = files["model.safetensors"][start + lm[0]:start + lm[0] + 4 * len(SPECIAL) * cfg["hidden_size"]]
    assert special == b"\0" * len(special)          # special tokens can never be the greedy choice


def test_tiny_tokenizer_is_words_with_vowels_and_the_chat_template_uses_its_specials():
    for spec in MODELS.values():
        vocab = train_vocab(spec.sentences)
        assert list(vocab)[:len(SPECIAL)] == list(SPECIAL) and len(set(vocab.values())) == len(vocab)
        words = list(vocab)[len(SPECIAL):]
        assert all(re.fullmatch(r"[a-z]+", w) and re.search(r"[aeiouy]", w) for w in words)
    files = model_files(MODELS["vllm-orch-sim/tiny-llama-a"])
    tok = json.loads(files["tokenizer.json"])
    assert tok["model"]["type"] == "WordLevel" and tok["pre_tokenizer"] == {"type": "Whitespace"}
    template = json.loads(files["tokenizer_config.json"])["chat_template"]
    assert "<|{{ message['role'] }}|>" in template and "<|assistant|>" in template
    assert set(train_vocab(MODELS["vllm-orch-sim/tiny-llama-a"].sentences)) != \
        set(train_vocab(MODELS["vllm-orch-sim/tiny-llama-b"].sentences))   # two distinct models


def test_the_hub_catalog_serves_the_tiny_repos_byte_for_byte_at_any_scale():
    for scale in (1, 10000):
        repo = Catalog(scale).repo("vllm-orch-sim/tiny-llama-b")
        files = model_files(MODELS["vllm-orch-sim/tiny-llama-b"])
        assert {p: f.read() for p, f in repo.files.items()} == files
        assert repo.files["model.safetensors"].lfs and not repo.files["config.json"].lfs


def test_cached_venv_builds_once_under_the_lock_and_rebuilds_a_half_built_one(tmp_path):
    calls = []

    def build(venv, log):
        calls.append(venv)
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text("")
        return {"checked": True}

    venv = tmp_path / "v"
    first = cached_venv.ensure(venv, {"r": 1}, build)
    again = cached_venv.ensure(venv, {"r": 1}, build)
    assert first.built_now and not again.built_now and again.facts == {"checked": True}
    assert len(calls) == 1 and cached_venv.is_built(venv)
    (venv / cached_venv.INFO_FILE).unlink()              # as if a build had been interrupted
    (venv / "junk").write_text("half")
    assert cached_venv.ensure(venv, {"r": 1}, build).built_now and not (venv / "junk").exists()

    def broken(venv, log):
        venv.mkdir()
        raise cached_venv.BuildError("pip failed", "log", offline=False)

    with pytest.raises(cached_venv.BuildError):
        cached_venv.ensure(tmp_path / "w", {"r": 2}, broken)
    assert not (tmp_path / "w").exists()                 # never left half-built


def test_the_vllm_metadata_fix_is_what_the_cli_and_platform_detection_read(tmp_path):
    write_vllm_metadata(tmp_path)
    dist = next(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert (dist.metadata["Name"], dist.version) == ("vllm", VLLM_VERSION) and "cpu" in dist.version


def test_a_real_vllm_host_entry_runs_the_venv_and_fakes_no_packages(tmp_path):
    real = {"venv": "/v", "vllm": "/v/bin/vllm", "python": "/v/bin/python", "version": VLLM_VERSION}
    hdir = tmp_path / "hosts" / "sim"
    info = manager.prepare_host("sim", hdir, speed=1, scale=10000, flavour="process",
                                python=sys.executable, cpu_vllm=real)
    entry = SimHost("sim", hdir, "process", 1, 10000, sys.executable, hub_port=1234,
                    cpu_vllm=real).host_entry()
    assert (entry["vllm"], entry["python"]) == ("/v/bin/vllm", "/v/bin/python")
    assert "PYTHONPATH" not in entry["env"] and entry["env"]["HF_ENDPOINT"] == "http://127.0.0.1:1234"
    assert entry["skip_checks"] == ["torch-cuda"]      # the parser is real; the torch is a CPU build
    assert not list((hdir / "site-packages").iterdir())
    assert info["real_vllm"]["models_roots"] == [str(hdir / "models")]
    assert info["vllm_version"] == VLLM_VERSION
    with pytest.raises(Exception, match="cannot be combined"):
        manager.up(1, real_vllm=True, vllm_python=sys.executable, home=tmp_path / "home")


def test_fake_nvidia_smi_lists_real_vllm_engine_and_worker_processes(tmp_path):
    """Processes titled like vLLM's, started in a model folder: holders on the GPU of their rank."""
    models = tmp_path / "models" / "m"
    models.mkdir(parents=True)
    procs = []
    try:
        for title in ("VLLM::EngineCore_DP1", "VLLM::DPCoordinator", "python-api-server"):
            procs.append(subprocess.Popen([title, "-c", "import time; time.sleep(60)"],
                                          executable=sys.executable, cwd=models,
                                          env={"CUDA_VISIBLE_DEVICES": "4,5"}))
        elsewhere = subprocess.Popen(["VLLM::Worker", "-c", "import time; time.sleep(60)"],
                                     executable=sys.executable, cwd=tmp_path,
                                     env={"CUDA_VISIBLE_DEVICES": "0"})
        procs.append(elsewhere)
        deadline = time.monotonic() + 10
        while True:
            found = {h["pid"]: h for h in real_vllm_holders([tmp_path / "models"], tmp_path)}
            if procs[0].pid in found or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert set(found) == {procs[0].pid}, found          # only the engine, only in the models
        assert found[procs[0].pid]["gpu_index"] == 5 and found[procs[0].pid]["used_mib"] >= 1
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _server_of(tmp_path, command: list[str]):
    """A RealServer whose 'vllm serve' is `command` (its own process group, an empty log)."""
    from tests.plugins.real_vllm import RealServer

    srv = object.__new__(RealServer)
    srv.log_path = tmp_path / "serve.log"
    srv.log_path.write_text("")
    srv.proc = subprocess.Popen(command, start_new_session=True)
    return srv


def test_the_real_servers_ready_wait_gives_up_on_a_hang_and_waits_out_a_busy_start(tmp_path, monkeypatch):
    """No fixed deadline for a real start (a slow machine is not a hang), but a server that
    neither logs nor uses CPU for STILL_S is one."""
    from tests.plugins import real_vllm as plugin

    monkeypatch.setattr(plugin, "STILL_S", 2.0)
    monkeypatch.setattr(plugin, "PROGRESS_CHECK_S", 0.3)
    hung = _server_of(tmp_path, ["sleep", "60"])
    try:
        with pytest.raises(AssertionError, match="no progress for 2 s"):
            hung.wait_ready()
    finally:
        hung.stop()
    # busy for 3 s (past STILL_S) without a line, then ready: waited out
    busy = _server_of(tmp_path, [sys.executable, "-c",
                                 "import time, sys\nt = time.monotonic()\nwhile time.monotonic() - t < 3: pass\n"
                                 f"open({str(tmp_path / 'serve.log')!r}, 'a').write('Application startup complete.')\n"
                                 "time.sleep(60)"])
    try:
        assert busy.wait_ready() >= 3
    finally:
        busy.stop()


def test_a_simulated_process_host_of_a_non_root_user_guards_no_dev_endpoints(tmp_path, monkeypatch):
    """nft needs root: `sim up` as another user writes dev_guard: false (the plan warns), so the
    README's sleep examples run there; as root the guard stays on (the default)."""
    import os
    host = SimHost("sim", tmp_path, "process", 1, 10000, sys.executable)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert host.host_entry()["dev_guard"] is False
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "dev_guard" not in host.host_entry()
