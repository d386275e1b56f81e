"""Preflight against the REAL vLLM 0.33.0 argument parser (cached venv, CPU torch).

Every shipped manifest's rendered argv must parse; removed, misspelt and wrongly typed flags must
fail with the parser's own message, mapped to the manifest field; deprecated ones must warn.
Parsing many argvs shares one parser build (argcheck's batch request): importing vLLM is ~5 s,
each parse after it ~1 ms.
"""

from __future__ import annotations

import functools
import json
import shlex
import time
from pathlib import Path

import pytest

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_manifest, manifest_files
from orchestrator.host import nvidia_smi, scripts
from orchestrator.host.local import LocalHost
from orchestrator.host.ownership import holders, read_gpus
from orchestrator.ops.gather import preflight_facts
from orchestrator.paths import shipped_dir
from orchestrator.plan.preflight import FAIL, OK, WARN, check_env, check_flags, evaluate, needs_for
from orchestrator.render.artifacts import build_argv

pytestmark = pytest.mark.vllm_parser

HOST = HostEntry(name="t", address="local", vllm="/opt/vllm/bin/vllm", models_root="/models")

# Published command lines, verbatim (the model positional is the repo id): rtx6kpro =
# https://github.com/voipmonitor/rtx6kpro/blob/main/models/ (kimi-k25.md, minimax-m25.md); recipes =
# https://github.com/vllm-project/recipes (models/moonshotai/Kimi-K2.5.yaml nvfp4, MiniMax/MiniMax-M2.md).
FACTS_ARGVS = {
    "kimi-int4-tp8-dcp8 (rtx6kpro)": """serve moonshotai/Kimi-K2.5 --served-model-name Kimi-K2.5
        --trust-remote-code --host 0.0.0.0 --port 5000 --tensor-parallel-size 8
        --pipeline-parallel-size 1 --enable-chunked-prefill --enable-prefix-caching
        --load-format fastsafetensors --tool-call-parser kimi_k2 --enable-auto-tool-choice
        --reasoning-parser kimi_k2 --async-scheduling --gpu-memory-utilization 0.95
        --max-num-batched-tokens 4096 --attention-backend TRITON_MLA --kv-cache-dtype fp8
        --mm-encoder-tp-mode data --decode-context-parallel-size 8""",
    "kimi-nvfp4 (recipes)": """serve nvidia/Kimi-K2.5-NVFP4 -tp 4 --mm-encoder-tp-mode data
        --compilation_config.pass_config.fuse_allreduce_rms true --tool-call-parser kimi_k2
        --reasoning-parser kimi_k2 --enable-auto-tool-choice --trust-remote-code
        --kv-cache-dtype fp8""",
    "minimax-tp4 (recipes)": """serve MiniMaxAI/MiniMax-M2.5 --tensor-parallel-size 4
        --tool-call-parser minimax_m2 --reasoning-parser minimax_m2 --enable-auto-tool-choice
        --trust-remote-code""",
    "minimax-tp4-ep (recipes)": """serve MiniMaxAI/MiniMax-M2.5 --tensor-parallel-size 4
        --enable-expert-parallel --tool-call-parser minimax_m2 --reasoning-parser minimax_m2
        --compilation-config '{"cudagraph_mode":"PIECEWISE"}' --enable-auto-tool-choice""",
    "minimax-dp8-ep (recipes)": """serve MiniMaxAI/MiniMax-M2.5 --data-parallel-size 8
        --enable-expert-parallel --tool-call-parser minimax_m2 --reasoning-parser minimax_m2
        --enable-auto-tool-choice --trust-remote-code""",
    "minimax-tp4 (rtx6kpro)": """serve MiniMaxAI/MiniMax-M2.5 --tensor-parallel-size 4
        --tool-call-parser minimax_m2 --reasoning-parser minimax_m2_append_think
        --enable-auto-tool-choice --trust-remote-code""",
}

# (extra_args appended to the kimi manifest's argv, expected error text, field, fix substring)
BAD = {
    "removed --enable-reasoning": (["--enable-reasoning"],
                                   "unrecognized arguments: --enable-reasoning",
                                   "vllm.extra_args[0]", "--reasoning-parser"),
    "removed --guided-decoding-backend": (["--guided-decoding-backend", "xgrammar"],
                                          "unrecognized arguments: --guided-decoding-backend xgrammar",
                                          "vllm.extra_args[0]", "--structured-outputs-config.backend"),
    "removed --swap-space": (["--swap-space", "16"], "unrecognized arguments: --swap-space 16",
                             "vllm.extra_args[0]", "swap_space was removed"),
    "misspelt flag": (["--tensor-paralel-size", "8"],
                      "unrecognized arguments: --tensor-paralel-size 8", "vllm.extra_args[0]", None),
    "wrong type": (["--max-num-seqs", "eight"],
                   "argument --max-num-seqs: invalid int value: 'eight'", "vllm.extra_args[0]", None),
    "invalid choice": (["--mm-processor-cache-type", "disk"],
                       "argument --mm-processor-cache-type: invalid choice: 'disk'",
                       "vllm.extra_args[0]", None),
}


def shipped_manifests():
    return [p for p in manifest_files(shipped_dir("models")) if p.stem != "example"]


_BATCHES: dict[str, list[dict]] = {}


def argcheck_batch(python: Path, requests: list[dict]) -> list[dict]:
    """Results for `requests`. The first call of the module sends every request the module will
    ever ask (ALL_REQUESTS) in one argcheck batch, so vLLM is imported once, not once per test."""
    if not _BATCHES:
        everything = [r for build in ALL_REQUESTS for r in build()]
        out, res = scripts.run_json(LocalHost("t"), str(python), "argcheck.py",
                                    [json.dumps({"batch": everything})], timeout=300)
        assert out is not None, res.stderr[-3000:]
        for req, result in zip(everything, out["results"]):
            _BATCHES[json.dumps(req, sort_keys=True)] = result
    missing = [r for r in requests if json.dumps(r, sort_keys=True) not in _BATCHES]
    if missing:   # a request not registered in ALL_REQUESTS: still answered, in its own process
        out, res = scripts.run_json(LocalHost("t"), str(python), "argcheck.py",
                                    [json.dumps({"batch": missing})], timeout=300)
        assert out is not None, res.stderr[-3000:]
        for req, result in zip(missing, out["results"]):
            _BATCHES[json.dumps(req, sort_keys=True)] = result
    return [_BATCHES[json.dumps(r, sort_keys=True)] for r in requests]


@functools.cache
def kimi_render():
    m = load_manifest(shipped_dir("models") / "kimi-k25-int4.yaml")
    return m, build_argv(m, HOST)


@pytest.fixture
def kimi():
    return kimi_render()


def shipped_rendered():
    """Every shipped manifest as each of its hardware classes gets it (and without a class)."""
    out = {}
    for p in shipped_manifests():
        m = load_manifest(p)
        for cls in [None, *m.requires.hardware]:
            out[f"{p.name}@{cls or 'any'}"] = build_argv(effective(m, HOST, hardware=cls).manifest, HOST)
    return out


def shipped_env_requests():
    """The service environment of every shipped manifest on each class, plus names only the host's
    vLLM can place: one read outside envs.py's table, one nothing reads."""
    env: dict[str, str] = {"VLLM_CUSTOM_ALLREDUCE_ALGO": "x", "SAFETENSORS_FAST_GPU": "1", "NCCL_PROTO": "LL"}
    for p in shipped_manifests():
        m = load_manifest(p)
        for cls in [None, *m.requires.hardware]:
            env.update(effective(m, HOST, hardware=cls).manifest.env)
    return [{"argv": kimi_render()[1][0], "env": env}]


def shipped_requests():
    return [{"argv": argv} for argv, _ in shipped_rendered().values()]


def facts_requests():
    return [{"argv": shlex.split(v)} for v in FACTS_ARGVS.values()]


def bad_cases():
    _m, (argv, prov) = kimi_render()
    cases = {}
    for name, (extra, *_rest) in BAD.items():
        prov_x = prov + [(tok, f"vllm.extra_args[{i}]") for i, tok in enumerate(extra)]
        cases[name] = (argv + extra, prov_x)
    return cases


def bad_requests():
    return [{"argv": a} for a, _ in bad_cases().values()]


def typed_requests():
    _m, (argv, _prov) = kimi_render()
    i = argv.index("--tensor-parallel-size")
    j = argv.index("--tool-call-parser")
    return [{"argv": argv[:i + 1] + ["eight"] + argv[i + 2:]}, {"argv": argv[:j] + argv[j + 2:]}]


DEPRECATED_EXTRA = ["--disable-cascade-attn", "--log-config-file", "/etc/log.json"]
OLD_ENV = {"VLLM_ATTENTION_BACKEND": "TRITON_MLA", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def deprecated_requests():
    return [{"argv": kimi_render()[1][0] + DEPRECATED_EXTRA}]


def env_requests():
    return [{"argv": kimi_render()[1][0], "env": OLD_ENV}]


# -- multi-node: every node's argv (issue 14) ---------------------------------------------------

NODE_HOSTS = [HostEntry(name="gpu1", address="10.0.0.1", vllm="/opt/vllm/bin/vllm", models_root="/models"),
              HostEntry(name="gpu2", address="gpu2.example", cluster={"address": "10.0.0.2"},
                        vllm="/opt/vllm/bin/vllm", models_root="/models")]


def _variant(m, **sections):
    from orchestrator.config.manifest import Manifest

    data = m.model_dump()
    for section, values in sections.items():
        data[section] = {**data[section], **values}
    return Manifest.model_validate(data)


@functools.cache
def multinode_rendered():
    """name -> Rendered, every node of: the shipped 2-node manifest (mp: TP 8 x PP 2 across the
    nodes) as each of its hardware classes gets it; a data-parallel-across-nodes variant (4 replicas
    of TP 4 with expert parallel, 2 per node); a Ray variant (vLLM on the head only)."""
    from orchestrator.config.placement import node_roles
    from orchestrator.render.artifacts import render

    two = load_manifest(shipped_dir("models") / "kimi-k25-int4-2node.yaml")
    variants = {f"mp@{cls or 'any'}": effective(two, NODE_HOSTS[0], hardware=cls).manifest
                for cls in [None, *two.requires.hardware]}
    variants["dp"] = _variant(two, vllm={"tensor_parallel_size": 4, "pipeline_parallel_size": 1,
                                         "data_parallel_size": 4, "enable_expert_parallel": True})
    variants["ray"] = _variant(two, multinode={"backend": "ray"})
    out = {}
    for name, m in variants.items():
        for host, role in zip(NODE_HOSTS, node_roles(m, NODE_HOSTS)):
            out[f"{name}/node{role.rank}"] = render(m, host, role=role)
    return out


def multinode_requests():
    return [{"argv": r.argv} for r in multinode_rendered().values() if r.runs_vllm]


ALL_REQUESTS = (shipped_requests, facts_requests, bad_requests, typed_requests, deprecated_requests,
                env_requests, shipped_env_requests, multinode_requests)


def test_every_nodes_argv_passes_the_real_parser(vllm_parser_python):
    """Each node's own argv (its rank's flags included) through vLLM 0.33.0's `vllm serve` parser and
    its serve-time validation, as preflight runs it on that node; a Ray worker runs `ray start`,
    not vLLM, so it has no vLLM argv to check."""
    rendered = {k: r for k, r in multinode_rendered().items() if r.runs_vllm}
    assert sorted(k for k, r in multinode_rendered().items() if not r.runs_vllm) == ["ray/node1"]
    assert len(rendered) == 2 * 4 + 2 + 1            # mp on 4 classes x 2 nodes, dp x 2, ray head
    results = argcheck_batch(vllm_parser_python, multinode_requests())
    for (name, r), res in zip(rendered.items(), results):
        assert res["ok"], f"{name}: {res['error']} ({r.argv})"
        assert res["vllm_version"] == "0.33.0" and res["parser"] == "vllm serve"
        assert check_flags(res, r.provenance, manifest=f"models/{name}").status == OK


FIELDS_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import argcheck
from vllm.engine.arg_utils import AsyncEngineArgs
top, serve, kind, validate = argcheck._build_parser()
out = []
for argv in json.loads(sys.stdin.read()):
    args = top.parse_args(["serve"] + argcheck._strip_prefix(argv))
    validate(args)
    ea = AsyncEngineArgs.from_cli_args(args)
    out.append({k: getattr(ea, k) for k in (
        "nnodes", "node_rank", "master_addr", "master_port", "tensor_parallel_size", "pipeline_parallel_size",
        "data_parallel_size", "data_parallel_size_local", "data_parallel_start_rank", "data_parallel_address",
        "data_parallel_rpc_port", "distributed_executor_backend", "distributed_timeout_seconds")} | {"headless": args.headless,
                                                                     "api_server_count": args.api_server_count})
print(json.dumps(out))
"""


def test_the_node_flags_reach_vllms_engine_arguments(vllm_parser_python):
    """Beyond "accepted": the parsed flags land in the EngineArgs fields vLLM's multi-node code reads
    (vllm/engine/arg_utils.py create_engine_config; vllm/entrypoints/cli/serve.py run_headless): rank,
    head address and port, the local data-parallel share and start rank; `--headless` without
    `--api-server-count` (serve.py sets 0 itself and refuses a positive count with --headless)."""
    import subprocess

    from orchestrator.paths import package_file

    rendered = {k: r for k, r in multinode_rendered().items()
                if r.runs_vllm and (k.startswith("mp@any") or not k.startswith("mp@"))}
    proc = subprocess.run([str(vllm_parser_python), "-c", FIELDS_SCRIPT,
                           str(package_file("host", "remote", "argcheck.py").parent)],
                          input=json.dumps([r.argv for r in rendered.values()]), capture_output=True, text=True,
                          timeout=300, env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = dict(zip(rendered, json.loads(proc.stdout.strip().splitlines()[-1])))
    mp0, mp1 = got["mp@any/node0"], got["mp@any/node1"]
    for rank, f in enumerate((mp0, mp1)):
        assert (f["nnodes"], f["node_rank"], f["master_addr"], f["master_port"]) == (2, rank, "10.0.0.1", 29501)
        assert (f["tensor_parallel_size"], f["pipeline_parallel_size"]) == (8, 2)
        assert f["api_server_count"] is None and f["distributed_executor_backend"] is None
    assert (mp0["headless"], mp1["headless"]) == (False, True)
    dp0, dp1 = got["dp/node0"], got["dp/node1"]
    for f in (dp0, dp1):
        assert (f["data_parallel_size"], f["data_parallel_size_local"]) == (4, 2)
        assert (f["data_parallel_address"], f["data_parallel_rpc_port"], f["nnodes"]) == ("10.0.0.1", 29550, 1)
    assert (dp0["data_parallel_start_rank"], dp0["headless"]) == (None, False)
    assert (dp1["data_parallel_start_rank"], dp1["headless"]) == (2, True)
    ray = got["ray/node0"]
    assert ray["distributed_executor_backend"] == "ray" and ray["nnodes"] == 1 and not ray["headless"]
    for key in ("mp@any/node0", "mp@any/node1", "dp/node0", "dp/node1"):   # multinode.collective_timeout_seconds
        argv = rendered[key].argv
        rendered_timeout = int(argv[argv.index("--distributed-timeout-seconds") + 1])
        assert got[key]["distributed_timeout_seconds"] == rendered_timeout > 0


def test_every_shipped_manifest_and_facts_argv_parses(vllm_parser_python):
    rendered = shipped_rendered()
    assert len(rendered) >= 4
    requests = shipped_requests() + facts_requests()
    results = argcheck_batch(vllm_parser_python, requests)
    names = list(rendered) + list(FACTS_ARGVS)
    for name, r, req in zip(names, results, requests):
        assert r["ok"], f"{name}: {r['error']} ({req['argv']})"
        assert r["vllm_version"] == "0.33.0" and r["parser"] == "vllm serve"
    for (name, (argv, prov)), r in zip(rendered.items(), results):
        assert check_flags(r, prov, manifest=f"models/{name}").status == OK


def test_bad_flags_fail_with_the_parsers_message_mapped_to_the_field(vllm_parser_python):
    cases = bad_cases()
    results = argcheck_batch(vllm_parser_python, bad_requests())
    for (name, (a, prov_x)), r in zip(cases.items(), results):
        _extra, error, fld, fix = BAD[name]
        assert not r["ok"] and r["stage"] == "parse", name
        assert r["error"].startswith(error), (name, r["error"])
        c = check_flags(r, prov_x, manifest="models/kimi-k25-int4.yaml")
        assert c.status == FAIL and c.field == fld, (name, c)
        assert c.summary.startswith(f"models/kimi-k25-int4.yaml: {fld}: vLLM 0.33.0 rejects it: {error}")
        if fix:
            assert fix in c.fix, (name, c.fix)
    assert results[0]["error_line"] == "vllm: error: unrecognized arguments: --enable-reasoning"


def test_wrong_type_from_a_manifest_field_and_serve_validation(vllm_parser_python, kimi):
    _m, (_argv, prov) = kimi
    r1, r2 = argcheck_batch(vllm_parser_python, typed_requests())
    assert r1["error"] == "argument --tensor-parallel-size/-tp: invalid int value: 'eight'"
    assert check_flags(r1, prov).field == "vllm.tensor_parallel_size"
    # `vllm serve` also validates before loading: the same check the service would die on
    assert r2["stage"] == "validate"
    assert r2["error"] == "--enable-auto-tool-choice requires --tool-call-parser"
    assert check_flags(r2, prov).field == "vllm.enable_auto_tool_choice"


def test_deprecated_arguments_warn(vllm_parser_python, kimi):
    _m, (_argv, prov) = kimi
    prov_x = prov + [(t, f"vllm.extra_args[{i}]") for i, t in enumerate(DEPRECATED_EXTRA)]
    (r,) = argcheck_batch(vllm_parser_python, deprecated_requests())
    assert r["ok"]
    args = {d["arg"]: d["message"] for d in r["deprecated"]}
    assert "--disable-cascade-attn" in args and "--log-config-file" in args
    assert "deprecated" in args["--log-config-file"]
    c = check_flags(r, prov_x)
    assert c.status == WARN and c.field == "vllm.extra_args[0]"
    assert "--disable-cascade-attn" in c.summary


def test_env_var_vllm_no_longer_reads(vllm_parser_python):
    (r,) = argcheck_batch(vllm_parser_python, env_requests())
    assert r["unknown_env"] == ["VLLM_ATTENTION_BACKEND"]
    c = check_env(OLD_ENV, r["unknown_env"])
    assert c.status == FAIL and "--attention-backend" in c.fix


def test_every_env_var_the_shipped_manifests_set_is_read_and_others_are_named(vllm_parser_python):
    """vLLM 0.33 reads every variable the shipped manifests set; a name it reads outside envs.py's
    table is not reported; one no vLLM file names is (SAFETENSORS_FAST_GPU, once in minimax-m25)."""
    (req,) = shipped_env_requests()
    (r,) = argcheck_batch(vllm_parser_python, [req])
    assert r["unknown_env"] == []
    assert r["not_read_env"] == ["SAFETENSORS_FAST_GPU"]
    c = check_env(req["env"], r["unknown_env"], not_read=r["not_read_env"])
    assert c.status == WARN and "nothing reads SAFETENSORS_FAST_GPU" in c.summary


def fake_nvidia_smi(folder: Path, n: int = 8, cuda: str = "13.0", apps: str = "") -> str:
    # the field order of orchestrator.host.nvidia_smi.GPU_QUERY_FIELDS
    gpus = "\n".join(f"{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887, 1, 97441, GPU-{i:04d}, "
                     "580.95.05, 0" for i in range(n))
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\ncase \"$1\" in\n"
        f"  --query-gpu=*) printf '%s\\n' '{gpus}' ;;\n"
        f"  --query-compute-apps=*) printf '%s' '{apps}' ;;\n"
        f"  *) echo '| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: {cuda} |' ;;\n"
        "esac\n")
    script.chmod(0o755)
    return str(script)


def run_preflight(host, python, argv, prov, m, smi_path):
    """Preflight as deploy runs it: the host's answers gathered, the GPUs read with nvidia-smi."""
    needs = needs_for(m, argv, prov, manifest_label="models/kimi-k25-int4.yaml")
    pf = preflight_facts(host, python, list(argv), dict(needs.env), None, set())
    entry = HostEntry(name="t", address="local", nvidia_smi=smi_path)
    gpus, apps = read_gpus(host, entry)
    info = nvidia_smi.parse_driver_info(host.run([smi_path]).stdout)
    pf.gpus, pf.gpu_error, pf.driver_version, pf.driver_cuda = gpus, None, info.driver_version, info.cuda_version
    return evaluate(pf, needs, holders([], [], m.name, needs.gpu_needs.indices or [], protected=()))


def test_run_preflight_end_to_end_on_a_local_host(vllm_parser_python, kimi, fake_site_packages,
                                                  tmp_path):
    """The whole preflight as deploy runs it: real parser, fake packages/GPUs like a sim host."""
    m, (argv, prov) = kimi
    sp = fake_site_packages({"vllm": "0.33.0", "torch": "2.13.0+cu130", "flashinfer-python": "0.7.2",
                             "flashinfer-cubin": "0.7.2"})
    host = LocalHost("sim", env={"PYTHONPATH": str(sp)})
    started = time.monotonic()
    checks = run_preflight(host, str(vllm_parser_python), argv, prov, m, fake_nvidia_smi(tmp_path))
    took = time.monotonic() - started
    summary = {c.name: (c.status, c.summary, c.seconds) for c in checks}
    assert all(c.status == OK for c in checks), summary
    # A figure, not a bound: 6-9 s on an idle machine, several times that beside three busy workers
    # (docs/figures.md, "Preflight"); each check's own timeout is what bounds a hang.
    print(f"\nFIGURE whole preflight with the real parser: {took:.1f} s")
    print(json.dumps({"preflight_seconds": round(took, 2), "checks": summary}, indent=1))

    # Same host, old driver and a cubin mismatch: both named, with numbers and fixes.
    sp2 = fake_site_packages({"vllm": "0.33.0", "torch": "2.13.0+cu130", "flashinfer-python": "0.7.2",
                              "flashinfer-cubin": "0.7.1"}, name="site-packages-2")
    host2 = LocalHost("sim", env={"PYTHONPATH": str(sp2)})
    old = tmp_path / "old"
    old.mkdir()
    checks = run_preflight(host2, str(vllm_parser_python), argv + ["--swap-space", "4"],
                           prov + [("--swap-space", "vllm.extra_args[0]"), ("4", "vllm.extra_args[1]")],
                           m, fake_nvidia_smi(old, n=4, cuda="12.8"))
    by = {c.name: c for c in checks}
    assert by["flags"].status == FAIL and by["flags"].field == "vllm.extra_args[0]"
    assert by["package-pairs"].status == FAIL and "0.7.1" in by["package-pairs"].summary
    assert by["torch-cuda"].status == FAIL and "CUDA <= 12.8" in by["torch-cuda"].summary
    assert by["gpus"].summary == "4 GPUs available, 8 needed"
