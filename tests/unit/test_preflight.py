"""Preflight's pure checks, the host-side inspect_env.py (with fake dist-info folders, as simulated
hosts have), nvidia-smi parsing, and the runner on a LocalHost without a real vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.host.local import LocalHost
from orchestrator.host.nvidia_smi import Gpu
from orchestrator.host.ownership import ABANDONED, Proc, holders
from orchestrator.ops.gather import preflight_facts
from orchestrator.paths import package_file
from orchestrator.plan.preflight import (
    FAIL,
    OK,
    REUSED,
    SKIPPED,
    WARN,
    GpuNeeds,
    PreflightNeeds,
    check_env,
    check_flags,
    check_gpus,
    check_package_pairs,
    check_required_packages,
    check_torch_cuda,
    check_vllm_version,
    evaluate,
    field_for,
    packages_needed,
    version_key,
)

PROVENANCE = [("/opt/vllm/bin/vllm", "host.vllm"), ("serve", "(command)"),
              ("/models/kimi", "name"), ("--tensor-parallel-size", "vllm.tensor_parallel_size"),
              ("eight", "vllm.tensor_parallel_size"), ("--enable-reasoning", "vllm.extra_args[0]"),
              ("--swap-space", "vllm.extra_args[1]"), ("4", "vllm.extra_args[2]")]

RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def gpus(n=8, name=RTX, mib=97887):
    return [Gpu(index=i, name=name, memory_total_mib=mib, uuid=f"GPU-{i}") for i in range(n)]


# -- flags --------------------------------------------------------------------------------------------
def test_unrecognized_flag_is_reported_against_the_field_that_produced_it():
    result = {"ok": False, "stage": "parse", "vllm_version": "0.33.0",
              "error": "unrecognized arguments: --enable-reasoning",
              "error_line": "vllm: error: unrecognized arguments: --enable-reasoning",
              "bad_args": ["--enable-reasoning"]}
    c = check_flags(result, PROVENANCE, manifest="models/x.yaml")
    assert c.status == FAIL and c.field == "vllm.extra_args[0]"
    assert c.summary == ("models/x.yaml: vllm.extra_args[0]: vLLM 0.33.0 rejects it: "
                         "unrecognized arguments: --enable-reasoning")
    assert "--reasoning-parser" in c.fix
    assert "vllm: error: unrecognized arguments: --enable-reasoning" in c.details


def test_a_reused_parser_answer_says_so_and_keeps_its_warnings():
    ok = {"ok": True, "stage": None, "vllm_version": "0.33.0", "seconds": 6.2, "deprecated": []}
    c = check_flags(ok, PROVENANCE, reused=True)
    assert c.status == OK and c.summary.startswith(REUSED) and "--verify-engine" in c.summary and "6.2" not in c.summary
    assert REUSED not in check_flags(ok, PROVENANCE).summary
    warned = dict(ok, deprecated=[{"arg": "--swap-space", "message": "--swap-space is deprecated"}])
    c = check_flags(warned, PROVENANCE, reused=True)
    assert c.status == WARN and REUSED in c.details and "vllm.extra_args[1]" in c.details[0]


def test_several_removed_flags_each_get_their_field_and_fix():
    result = {"ok": False, "stage": "parse", "vllm_version": "0.33.0",
              "error": "unrecognized arguments: --swap-space 4 --enable_reasoning",
              "bad_args": ["--swap-space", "4", "--enable_reasoning"]}
    c = check_flags(result, PROVENANCE)
    assert c.field == "vllm.extra_args[1]"
    assert "--enable_reasoning: from vllm.extra_args[0]" in c.details  # underscores = dashes
    assert "swap_space was removed" in c.fix and "--reasoning-parser" in c.fix


def test_wrong_type_maps_through_the_option_name():
    result = {"ok": False, "stage": "parse", "vllm_version": "0.33.0",
              "error": "argument --tensor-parallel-size/-tp: invalid int value: 'eight'",
              "bad_args": ["--tensor-parallel-size", "-tp", "eight"]}
    c = check_flags(result, PROVENANCE, manifest="models/x.yaml")
    assert c.status == FAIL and c.field == "vllm.tensor_parallel_size"
    assert c.summary.endswith("invalid int value: 'eight'")
    assert "vllm serve --help=all" in c.fix


def test_deprecated_argument_is_a_warning_with_its_message():
    result = {"ok": True, "vllm_version": "0.33.0", "bad_args": [],
              "deprecated": [{"arg": "--swap-space", "message": "--swap-space is deprecated"}]}
    c = check_flags(result, PROVENANCE)
    assert c.status == WARN and c.field == "vllm.extra_args[1]"
    assert "deprecates --swap-space" in c.summary and "swap_space was removed" in c.fix


def test_parser_that_cannot_be_built_fails_and_accepted_argv_passes():
    c = check_flags({"ok": False, "stage": "import", "error": "ModuleNotFoundError: No module named 'vllm'"}, [])
    assert c.status == FAIL and "No module named 'vllm'" in c.summary and "python" in c.fix
    c = check_flags({"ok": True, "vllm_version": "0.33.0", "deprecated": [], "seconds": 5.2}, [])
    assert c.status == OK and "0.33.0" in c.summary and "5.2 s" in c.summary


def test_field_for_prefers_option_tokens_and_handles_equals_form():
    assert field_for(["4", "--swap-space"], PROVENANCE) == ("vllm.extra_args[1]", "--swap-space")
    assert field_for(["--tensor_parallel_size=eight"], PROVENANCE)[0] == "vllm.tensor_parallel_size"
    assert field_for(["--nope"], PROVENANCE) == (None, "--nope")


def test_skip_check_yields_a_skipped_check():
    c = check_flags({"ok": False, "error": "x"}, [], skip={"flags"})
    assert c.status == SKIPPED and "--skip-check flags" in c.summary
    assert check_gpus([], GpuNeeds(8), skip={"gpus"}).status == SKIPPED


# -- env ----------------------------------------------------------------------------------------------
def test_env_renamed_and_ignored_fails_with_the_flag_to_use():
    c = check_env({"VLLM_ATTENTION_BACKEND": "TRITON_MLA"}, ["VLLM_ATTENTION_BACKEND"])
    assert c.status == FAIL and c.field == "env.VLLM_ATTENTION_BACKEND"
    assert "--attention-backend" in c.fix
    w = check_env({"VLLM_SLEEP_WHEN_IDL": "1"}, ["VLLM_SLEEP_WHEN_IDL"])
    assert w.status == WARN and "misspelt" in w.summary
    assert check_env({"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "NCCL_PROTO": "LL"}, []).status == OK


# -- versions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("low,high", [("0.19.1", "0.33.0"), ("0.33.0rc1", "0.33.0"),
                                      ("0.33.0.dev12+gabc", "0.33.0"), ("0.33.0", "0.33.0.post1"),
                                      ("0.9.2", "0.10.0"), ("1.0", "1.0.1")])
def test_version_order(low, high):
    assert version_key(low) < version_key(high)


def test_vllm_version_check():
    assert check_vllm_version("0.33.0", "0.19.1").status == OK
    c = check_vllm_version("0.18.0", "0.19.1", python="/opt/vllm/bin/python")
    assert c.status == FAIL and "0.18.0" in c.summary and "0.19.1" in c.summary
    assert "vllm>=0.19.1" in c.fix
    assert check_vllm_version(None, "0.19.1").status == FAIL


def test_flashinfer_pair_mismatch_quotes_the_runtime_error():
    c = check_package_pairs({"flashinfer-python": "0.6.14", "flashinfer-cubin": "0.6.13"})
    assert c.status == FAIL
    assert ("RuntimeError: flashinfer-cubin version (0.6.13) does not match flashinfer version "
            "(0.6.14). Please install the same version of both packages. Set "
            "FLASHINFER_DISABLE_VERSION_CHECK=1 to bypass this check.") in c.details[-1]
    assert "flashinfer-cubin==0.6.14" in c.fix
    bypassed = check_package_pairs({"flashinfer-python": "0.6.14", "flashinfer-cubin": "0.6.13"},
                                   {"FLASHINFER_DISABLE_VERSION_CHECK": "1"})
    assert bypassed.status == WARN
    jit = check_package_pairs({"flashinfer-python": "0.7.2", "flashinfer-cubin": "0.7.2",
                               "flashinfer-jit-cache": "0.7.1+cu130"})
    assert jit.status == FAIL and "flashinfer-jit-cache" in jit.summary
    ok = check_package_pairs({"flashinfer-python": "0.7.2", "flashinfer-jit-cache": "0.7.2+cu130"})
    assert ok.status == OK


def test_torch_cuda_against_driver():
    assert check_torch_cuda("13.0", "13.0", torch_version="2.13.0+cu130").status == OK
    assert check_torch_cuda("12.8", "13.0").status == OK
    c = check_torch_cuda("13.0", "12.8", torch_version="2.13.0+cu130", driver_version="570.86.15")
    assert c.status == FAIL
    assert "CUDA 13.0" in c.summary and "CUDA <= 12.8" in c.summary and "570.86.15" in c.summary
    assert "R580" in c.fix
    assert check_torch_cuda(None, "13.0", torch_version="2.13.0+cpu").status == FAIL
    assert check_torch_cuda("13.0", None).status == WARN


def test_required_packages_from_flags():
    needs = packages_needed(["serve", "m", "--load-format", "fastsafetensors",
                             "--attention-backend=FLASHINFER"])
    assert set(needs) == {"fastsafetensors", "flashinfer-python"}
    c = check_required_packages(needs, {"flashinfer-python": "0.7.2", "fastsafetensors": None})
    assert c.status == FAIL and c.fix == "pip install fastsafetensors into the host's vLLM Python"
    assert "--load-format fastsafetensors" in c.details[0]
    assert check_required_packages({}, {}).status == OK


# -- hardware -----------------------------------------------------------------------------------------
def test_gpu_count_model_and_vram():
    assert check_gpus(gpus(8), GpuNeeds(8, "RTX PRO 6000", 83 * 1024)).status == OK
    c = check_gpus(gpus(4), GpuNeeds(8))
    assert c.status == FAIL and c.summary == "4 GPUs available, 8 needed"
    c = check_gpus(gpus(8, name="NVIDIA H100 80GB HBM3", mib=81559), GpuNeeds(8, "RTX PRO 6000"))
    assert c.status == FAIL and "H100" in c.summary and "RTX PRO 6000" in c.summary
    c = check_gpus(gpus(8, mib=49140), GpuNeeds(8, None, 83 * 1024))
    assert "49140 MiB" in c.summary and "84992 MiB" in c.summary
    c = check_gpus(gpus(8), GpuNeeds(4, indices=[6, 7, 8, 9]))
    assert c.status == FAIL and "8, 9 does not exist" in c.summary
    assert check_gpus([], GpuNeeds(1)).status == FAIL


# -- inspect_env.py (host-side, stdlib only) ----------------------------------------------------------
def run_inspect(site_packages, *args):
    env = {**os.environ, "PYTHONPATH": str(site_packages)}
    out = subprocess.run([sys.executable, "-S", str(package_file("host", "remote", "inspect_env.py")), *args],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def test_inspect_env_reads_fake_dist_info_and_torch_cuda_suffix(fake_site_packages):
    sp = fake_site_packages({"vllm": "0.33.0", "torch": "2.13.0+cu130",
                             "flashinfer-python": "0.7.2", "flashinfer-cubin": "0.7.1"})
    info = run_inspect(sp, "fastapi")
    p = info["packages"]
    assert (p["vllm"], p["torch"], p["flashinfer-cubin"], p["fastsafetensors"]) == \
        ("0.33.0", "2.13.0+cu130", "0.7.1", None)
    assert "fastapi" in p
    assert (info["torch_cuda"], info["torch_cuda_source"]) == ("13.0", "version suffix")
    assert check_package_pairs(p).status == FAIL


def test_inspect_env_reads_torch_version_py_without_importing_torch(fake_site_packages, tmp_path):
    sp = fake_site_packages({"torch": "2.13.0"})
    (sp / "torch").mkdir()
    # importing this package would raise: proves inspect_env reads version.py as text only
    (sp / "torch" / "__init__.py").write_text("raise SystemExit('torch was imported')\n")
    (sp / "torch" / "version.py").write_text("__version__ = '2.13.0'\ncuda: Optional[str] = '12.8'\n")
    info = run_inspect(sp)
    assert (info["torch_cuda"], info["torch_cuda_source"]) == ("12.8", "torch/version.py")


# -- gathering + evaluating, on this machine, without a real vLLM -------------------------------------
def run_preflight(host, python, argv, skip=(), gpu_list=None, procs=(), min_vllm=None, gpu_needs=None,
                  driver_cuda="13.0"):
    pf = preflight_facts(host, python, list(argv), {}, None, set(skip))
    pf.gpus, pf.driver_cuda, pf.driver_version = gpu_list, driver_cuda, "580.95.05"
    needs = PreflightNeeds(argv=list(argv), provenance=[], env={}, min_vllm=min_vllm, gpu_needs=gpu_needs)
    targets = gpu_needs.indices or list(range(gpu_needs.count)) if gpu_needs else []
    return evaluate(pf, needs, holders(procs, [], "m", targets, protected=()) if gpu_needs else None, skip=skip)


def test_run_preflight_without_vllm_reports_each_problem(fake_site_packages, tmp_path):
    sp = fake_site_packages({"vllm": "0.18.0", "torch": "2.13.0+cu130",
                             "flashinfer-python": "0.6.14", "flashinfer-cubin": "0.6.13"})
    host = LocalHost("t", env={"PYTHONPATH": str(sp)})
    leftover = Proc(pid=4242, name="VLLM::Worker_TP0", used_mib=90000, gpu_index=0, kind=ABANDONED, start_time=424200)
    checks = run_preflight(host, sys.executable, ["vllm", "serve", "m", "--load-format", "fastsafetensors"],
                           skip={"flags", "env"}, gpu_list=gpus(2), procs=[leftover], min_vllm="0.19.1",
                           gpu_needs=GpuNeeds(8, "RTX PRO 6000"))
    by = {c.name: c for c in checks}
    assert [c.name for c in checks] == ["flags", "env", "service-user", "root-programs", "root-folders",
                                        "vllm-version", "version-traps",
                                        "package-pairs", "torch-cuda", "required-packages", "gpus",
                                        "foreign-gpu-processes"]
    assert by["service-user"].status == OK and "not checked" in by["service-user"].summary   # no host facts
    assert by["version-traps"].status == OK
    assert by["flags"].status == SKIPPED and by["env"].status == SKIPPED
    assert by["vllm-version"].status == FAIL and "0.18.0" in by["vllm-version"].summary
    assert by["package-pairs"].status == FAIL
    assert by["torch-cuda"].status == OK and "13.0" in by["torch-cuda"].summary
    assert by["required-packages"].status == FAIL and "fastsafetensors" in by["required-packages"].summary
    assert by["gpus"].status == FAIL and by["gpus"].summary == "2 GPUs available, 8 needed"
    assert by["foreign-gpu-processes"].status == WARN        # the leftover VLLM::Worker_TP0 on GPU 0
    assert all(c.seconds is not None for c in checks if c.status not in (SKIPPED,) and c.name not in
               ("service-user", "root-programs", "root-folders", "gpus", "foreign-gpu-processes"))


def test_run_preflight_with_a_python_lacking_vllm_fails_the_flag_check(tmp_path):
    checks = run_preflight(LocalHost("t"), sys.executable, ["serve", "m"])
    flags = checks[0]
    assert flags.name == "flags" and flags.status == FAIL
    assert "could not build vLLM's argument parser" in flags.summary
    missing = run_preflight(LocalHost("t"), str(tmp_path / "no-python"), ["serve", "m"])
    assert missing[0].status == FAIL and "exit 127" in missing[0].summary


# -- service-user: can the unprivileged service user run vllm? (the host side: test_facts_script.py) ----
def test_check_service_user_fails_with_the_folder_and_the_fix():
    from orchestrator.plan.preflight import check_service_user

    bad = {"user": "vllm", "path": "/root/venv/bin/vllm", "exists": True,
           "problems": ["/root (drwx------ root) does not let vllm in"], "unchecked": []}
    c = check_service_user(bad)
    assert c.status == FAIL and c.summary == ("the service user vllm cannot run /root/venv/bin/vllm: "
                                              "/root (drwx------ root) does not let vllm in")
    assert "service_user" in c.fix and "/opt/vllm" in c.fix
    assert check_service_user(bad, skip={"service-user"}).status == SKIPPED
    assert check_service_user({"user": "root", "path": "/root/venv/bin/vllm"}).status == OK
    ok = check_service_user({"user": "vllm", "path": "/opt/vllm/bin/vllm", "exists": False, "problems": [],
                             "unchecked": []})
    assert ok.status == OK and ok.summary == ("vllm (to be created: judged by the 'other' permission bits) "
                                              "can run /opt/vllm/bin/vllm")
    unsure = {"user": "vllm", "path": "/srv/x/vllm", "exists": True, "problems": [],
              "unchecked": ["/srv/x: Permission denied"]}
    assert check_service_user(unsure).status == WARN


def test_root_programs_and_folders_fail_on_what_another_user_could_change():
    from orchestrator.plan.preflight import check_root_folders, check_root_programs

    trust = {"programs": [{"path": "/opt/vllm/bin/python", "problem": "/opt/vllm is owned by alice"},
                          {"path": "/usr/bin/nvidia-smi", "problem": None}],
             "folders": [{"path": "/var/lib/vllm-orch/state", "problem": None}]}
    c = check_root_programs(trust)
    assert c.status == FAIL and "/opt/vllm is owned by alice" in c.summary and "chown -R root:root" in c.fix
    assert c.details == ["/opt/vllm/bin/python: /opt/vllm is owned by alice"]
    assert check_root_folders(trust).status == OK
    assert check_root_programs(trust, skip={"root-programs"}).status == SKIPPED
    assert check_root_programs(None).status == OK          # facts from before: not checked, said so


def test_sleep_mode_refuses_a_host_without_nft():
    """A sleep-capable service's start installs its nftables guard (render/artifacts.py
    dev_guard_rules): a host without nft fails preflight (deploy refuses, exit 3) and says what to
    install; not skippable. A service without sleep mode is not asked for nft."""
    from orchestrator.config.manifest import load_all
    from orchestrator.paths import shipped_dir
    from orchestrator.plan.preflight import PreflightFacts, check_dev_guard, evaluate, needs_for

    c = check_dev_guard({"programs": [], "folders": [], "nft": None})
    assert c.status == FAIL and "needs nft" in c.summary and "\n" not in c.summary and "nftables" in (c.fix or "")
    assert check_dev_guard({"programs": [], "folders": [], "nft": "/usr/sbin/nft"}).status == OK
    models, _ = load_all(shipped_dir("models"))
    data = models["tiny-llama-a"].model_dump()
    data["sleep"] = {"level": 1}
    sleepy = type(models["tiny-llama-a"]).model_validate(data)
    pf = PreflightFacts(python="python3", packages=None, argcheck=None, gpus=None,
                        root_trust={"programs": [], "folders": [], "nft": None})
    names = lambda m: {c.name: c.status for c in evaluate(pf, needs_for(m, [], []), None)}  # noqa: E731
    assert names(sleepy)["dev-guard"] == FAIL
    assert "dev-guard" not in names(models["tiny-llama-a"])
    off = check_dev_guard({"programs": [], "folders": [], "nft": None}, guarded=False)
    assert off.status == WARN and "open to every local user" in off.summary     # inventory dev_guard: false
