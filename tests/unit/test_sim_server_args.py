"""The simulated server's argv handling mirrors vLLM 0.33's FlexibleArgumentParser, and its
rate profiles match the field report."""

from __future__ import annotations

import importlib.util
import json

import pytest

from orchestrator.paths import package_file

spec = importlib.util.spec_from_file_location("sim_vllm", package_file("sim", "vllm_server.py"))
vs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs)


def parse(line: str):
    return vs.build_parser().parse_args(vs.normalize_argv(line.split()))


def test_manifest_style_argv():
    a = parse("serve /m/kimi --served-model-name kimi-k25 kimi -tp 8 --trust-remote-code "
              "--enable-expert-parallel --decode-context-parallel-size 8 --max_model_len 65536 "
              "--gpu-memory-utilization 0.93 --kv-cache-dtype fp8 --attention-backend TRITON_MLA "
              "--moe-backend marlin --mm-encoder-tp-mode data --language-model-only "
              "--load-format fastsafetensors --max-num-batched-tokens 4096 --max-num-seqs 128 "
              "--enable-prefix-caching --enable-chunked-prefill --async-scheduling "
              "--disable-custom-all-reduce --shutdown-timeout 30 --api-key k "
              "--uvicorn-log-level warning --enable-auto-tool-choice --tool-call-parser kimi_k2 "
              "--reasoning-parser kimi_k2 --host 0.0.0.0 --port 8000")
    assert a.model_tag == "/m/kimi" and a.served_model_name == ["kimi-k25", "kimi"]
    assert (a.tensor_parallel_size, a.decode_context_parallel_size, a.max_model_len) == (
        "8", "8", "65536")
    assert a.enable_expert_parallel and a.disable_custom_all_reduce and a.language_model_only
    assert a.api_key == ["k"] and a.moe_backend == "marlin"


def test_dotted_json_args_and_model_option():
    a = parse("serve --model /m/x --compilation-config.pass_config.fuse_allreduce_rms true "
              "--compilation_config.cudagraph_mode=PIECEWISE -O3")
    assert a.model_tag == "/m/x"
    assert json.loads(a.compilation_config) == {
        "pass_config": {"fuse_allreduce_rms": True}, "cudagraph_mode": "PIECEWISE"}
    assert a.optimization_level == "3"


def test_enable_disable_pairs():
    assert parse("serve m --no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("serve m --disable-prefix-caching").enable_prefix_caching is False
    # real 0.33 pairs --enable-log-requests with --disable-log-requests, so the latter parses
    assert parse("serve m --disable-log-requests").enable_log_requests is False


@pytest.mark.parametrize("flag", ["--swap-space 4", "--enable-reasoning",
                                  "--guided-decoding-backend xgrammar", "--no-such-flag"])
def test_removed_and_unknown_flags_exit_2(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(f"serve m {flag}")
    assert exc.value.code == 2
    assert f"vllm: error: unrecognized arguments: {flag}" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit):
        vs.build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == "0.33.0"


def test_profiles_match_their_sources():
    p = vs.PROFILES
    assert vs.pick_profile("moonshotai/Kimi-K2.5", False) == "kimi-k25-int4"
    assert vs.pick_profile("nvidia/Kimi-K2.5-NVFP4", False) == "kimi-k25-nvfp4"
    assert vs.pick_profile("MiniMaxAI/MiniMax-M2.5", True) == "minimax-m25-ep"
    assert vs.pick_profile("Qwen/Qwen3-8B", False) == "generic"
    assert vs.stream_rate(p["kimi-k25-int4"], 1) == 79.0
    assert vs.pick_profile("moonshotai/Kimi-K2.5", False, dcp=8) == "kimi-k25-int4-dcp8"
    assert vs.stream_rate(p["kimi-k25-int4-dcp8"], 1) == 62.0
    assert vs.aggregate_rate(p["kimi-k25-int4-dcp8"], 100) == 900
    assert vs.stream_rate(p["kimi-k25-nvfp4"], 1) == 61.3
    assert vs.aggregate_rate(p["kimi-k25-nvfp4"], 32) == 800
    assert vs.aggregate_rate(p["kimi-k25-nvfp4"], 128) == 1238
    assert vs.aggregate_rate(p["minimax-m25-ep"], 128) == 4000
    assert vs.aggregate_rate(p["minimax-m25"], 128) < 4000
    for key, prof in p.items():
        rates = [vs.aggregate_rate(prof, c) for c in range(1, 200)]
        assert rates == sorted(rates), key          # more streams never lower the total
        # each profile says where its figures come from: a public page, or "chosen"
        assert "https://github.com/" in prof["source"] or prof["source"].startswith("chosen"), key


def test_sim_versions_compare_like_releases():
    assert vs.version_before("0.24.0", "0.25.0") and vs.version_before("0.24.0+cu130", "0.25.0")
    assert not vs.version_before("0.25.0", "0.25.0") and not vs.version_before("0.33.0", "0.25.0")
    assert vs.version_before("0.9.2", "0.18.0")


def test_canned_answers():
    assert vs.answer_for("What is 2+2? Answer with one number.")[1] == "4"
    assert vs.answer_for("Explain KV caches")[1] == vs.FILLER.strip()


@pytest.mark.parametrize("version, shutdown, swap_space", [("0.17.1", False, True), ("0.18.0", True, False),
                                                           ("0.24.0", True, False), ("0.33.0", True, False)])
def test_the_flag_set_follows_the_version(version, shutdown, swap_space, monkeypatch, capsys):
    """A simulated engine venv's parser is its version's: --shutdown-timeout from 0.18.0 (vllm PR
    #34730), --swap-space until 0.17.1 (absent from 0.18.0 on)."""
    monkeypatch.setattr(vs, "VERSION", version)
    for flag, there in (("--shutdown-timeout", shutdown), ("--swap-space", swap_space)):
        if there:
            parse(f"serve /m/x {flag} 4")
            continue
        with pytest.raises(SystemExit) as exc:
            parse(f"serve /m/x {flag} 4")
        assert exc.value.code == 2 and f"unrecognized arguments: {flag} 4" in capsys.readouterr().err


@pytest.mark.parametrize("version, where, words", [("0.33.0", "entry.py:139", "Starting vLLM server on"),
                                                   ("0.24.0", "api_server.py:581", "Starting vLLM server on"),
                                                   ("0.19.1", "api_server.py:1874", "Starting vLLM API server 0 on")])
def test_the_start_line_follows_the_version_and_vllm_orch_reads_each(version, where, words, monkeypatch):
    from orchestrator.probe.logsig import phase_of

    monkeypatch.setattr(vs, "VERSION", version)
    at, text = vs.start_line("0.0.0.0", 8000)
    assert (at, text) == (where, f"{words} http://0.0.0.0:8000")
    assert phase_of(f"(APIServer pid=7) INFO 12-01 10:00:00 [{at}] {text}") == "starting API server"


def test_a_fault_finds_its_server_by_the_start_script_that_execs_it_not_by_a_shared_folder_or_port(tmp_path,
                                                                                                  monkeypatch):
    """Two services of one checkpoint share its weights folder, and during a swap both name one port:
    the simulated server knows which it is from the start script vllm-orch installed for it (a process
    host) or its own cgroup (systemd), so a fault meant for the new one never hits the old one."""
    installed = tmp_path / "state" / "installed"
    installed.mkdir(parents=True)
    argv = {}
    for name, extra in (("minimax-m25", []), ("minimax-m25-ep", ["--enable-expert-parallel"])):
        argv[name] = ["/opt/vllm/bin/vllm", "serve", "/models/minimax-m25", "--port", "8000", *extra]
        script = tmp_path / f"vllm-{name}.sh"
        script.write_text("#!/bin/sh\ncd /models/minimax-m25 || exit 1\nset -- "
                          + " ".join(f"'{a}'" for a in argv[name]) + "\nexec \"$@\"\n")
        (installed / f"{name}.json").write_text(json.dumps({
            "service": name, "model": name, "folder": "minimax-m25", "port": 8000, "unit": str(script)}))
    monkeypatch.setattr(vs, "STATE_DIRS", (tmp_path / "state",))
    cgroup = {"text": "0::/user.slice/session-1.scope\n"}
    real_read = vs.Path.read_text
    monkeypatch.setattr(vs.Path, "read_text", lambda self, *a, **k: cgroup["text"] if str(self) == "/proc/self/cgroup"
                        else real_read(self, *a, **k))
    assert vs.fault_names("/models/minimax-m25", ["minimax-m2.5"], ["x", *argv["minimax-m25-ep"][1:]])[:2] == [
        "minimax-m25-ep", "minimax-m25-ep"]
    assert vs.fault_names("/models/minimax-m25", ["minimax-m2.5"], ["y", *argv["minimax-m25"][1:]])[0] == "minimax-m25"
    # a server no record proves (started by hand) is known by its folder's name only
    assert vs.fault_names("/models/minimax-m25", [], ["z", "serve", "/models/minimax-m25"]) == [
        "minimax-m25", "/models/minimax-m25"]
    # under systemd, the unit in its cgroup names it, whatever its argv
    (installed / "minimax-m25.json").write_text(json.dumps({
        "service": "minimax-m25", "model": "minimax-m25", "port": 8000,
        "unit": "/etc/systemd/system/vllm-minimax-m25.service"}))
    cgroup["text"] = "0::/system.slice/vllm-minimax-m25.service\n"
    assert vs.fault_names("/models/minimax-m25", [], ["z", "serve", "/models/minimax-m25"])[0] == "minimax-m25"
