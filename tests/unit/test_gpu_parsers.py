"""nvidia-smi parsers on recorded real output (tests/fixtures/nvidia-smi) and on the fake's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.host.nvidia_smi import (
    COMPUTE_APPS_FIELDS,
    GPU_QUERY_FIELDS,
    DriverInfo,
    Gpu,
    GpuProcess,
    parse_compute_apps,
    parse_driver_info,
    parse_gpus,
    query_compute_apps_argv,
    query_gpus_argv,
)
from orchestrator.sim import manager

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nvidia-smi"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def test_real_query_gpu_with_header_and_units():
    (g,) = parse_gpus(fixture("query-gpu-rtx-pro-6000-units.csv"))
    assert g == Gpu(name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                    memory_total_mib=97887, memory_used_mib=71977, memory_free_mib=24622,
                    utilization_pct=64)
    (g,) = parse_gpus(fixture("query-gpu-rtx-5060ti-units.csv"))
    assert (g.name, g.memory_total_mib, g.driver_version) == ("NVIDIA GeForce RTX 5060 Ti",
                                                              16311, "580.178.04")


def test_real_query_gpu_noheader_nounits_needs_fields():
    text = fixture("query-gpu-a6000-noheader-nounits.csv")
    with pytest.raises(ValueError, match="no header"):
        parse_gpus(text)
    gpus = parse_gpus(text, ["index", "uuid", "name", "memory.free"])
    assert [(g.index, g.memory_free_mib) for g in gpus] == [(0, 3495), (1, 3497)]
    assert gpus[1].uuid == "GPU-9c468c54-b125-4903-1476-77c4d63270be"


def test_real_compute_apps():
    apps = parse_compute_apps(fixture("compute-apps-a6000-vllm-noheader-nounits.csv"),
                              ["gpu_uuid", "pid", "process_name", "used_memory"])
    assert apps == [
        GpuProcess(1337099, "VLLM::Worker_TP0", 44974, "GPU-9de4332b-3b09-a3b4-5589-30229f0c14fe"),
        GpuProcess(1337100, "VLLM::Worker_TP1", 44974, "GPU-9c468c54-b125-4903-1476-77c4d63270be")]
    assert parse_compute_apps(fixture("compute-apps-vllm-worker-units.csv")) == [
        GpuProcess(2065247, "VLLM::Worker_TP0", 102843)]
    assert parse_compute_apps(fixture("compute-apps-empty.csv")) == []
    assert parse_compute_apps("", list(COMPUTE_APPS_FIELDS)) == []


def test_not_available_values_and_commas_in_names():
    apps = parse_compute_apps("12, /opt/a, b/python, [N/A], GPU-x\n", list(COMPUTE_APPS_FIELDS))
    assert apps == [GpuProcess(12, "/opt/a, b/python", None, "GPU-x")]


def test_real_banner_versions():
    assert parse_driver_info(fixture("banner-rtx-pro-6000.txt")) == DriverInfo("580.95.05", "13.0")
    assert parse_driver_info("no banner here") == DriverInfo(None, None)


@pytest.fixture
def fake_host(tmp_path):
    hdir = tmp_path / "hosts" / "sim"
    manager.prepare_host("sim", hdir, speed=1, scale=1, flavour="process",
                         python=os.sys.executable)
    return hdir


def smi(hdir, *args):
    return subprocess.run([str(hdir / "bin" / "nvidia-smi"), *args], capture_output=True,
                          text=True, check=True).stdout


def test_fake_output_parses_like_real(fake_host):
    me = os.getpid()
    entry = {"pid": me, "process_name": "VLLM::Worker_TP0", "gpu_index": 3, "used_mib": 81234,
             "start_time": manager.start_time(me)}
    (fake_host / "gpu-procs" / f"{me}-3.json").write_text(json.dumps(entry))
    dead = dict(entry, pid=999999999, gpu_index=4)    # a dead holder frees its memory
    (fake_host / "gpu-procs" / "999999999-4.json").write_text(json.dumps(dead))

    gpus = parse_gpus(smi(fake_host, "--query-gpu=" + ",".join(GPU_QUERY_FIELDS),
                          "--format=csv,noheader,nounits"), GPU_QUERY_FIELDS)
    assert len(gpus) == 8
    assert {g.name for g in gpus} == {"NVIDIA RTX PRO 6000 Blackwell Server Edition"}
    assert [g.memory_used_mib for g in gpus] == [0, 0, 0, 81234, 0, 0, 0, 0]
    assert gpus[3].memory_free_mib == 97887 - 81234 - 445
    assert gpus[0].driver_version == "580.95.05" and gpus[0].uuid.startswith("GPU-")

    with_units = smi(fake_host, "--query-gpu=memory.total,index", "--format=csv")
    assert with_units.splitlines()[0] == "memory.total [MiB], index"
    assert with_units.splitlines()[1] == "97887 MiB, 0"
    assert [g.memory_total_mib for g in parse_gpus(with_units)] == [97887] * 8

    apps_text = smi(fake_host, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                    "--format=csv")
    assert apps_text.splitlines()[0] == "pid, process_name, used_gpu_memory [MiB], gpu_uuid"
    (app,) = parse_compute_apps(apps_text)
    assert (app.pid, app.process_name, app.used_memory_mib, app.gpu_uuid) == (
        me, "VLLM::Worker_TP0", 81234, gpus[3].uuid)
    (app2,) = parse_compute_apps(smi(fake_host, *query_compute_apps_argv()[1:]),
                                 COMPUTE_APPS_FIELDS)
    assert app2 == app
    assert parse_gpus(smi(fake_host, *query_gpus_argv()[1:]), GPU_QUERY_FIELDS) == gpus

    banner = smi(fake_host)
    assert parse_driver_info(banner) == DriverInfo("580.95.05", "13.0")
    assert "Driver Version: 580.95.05      CUDA Version: 13.0     |" in banner
    assert "VLLM::Worker_TP0" in banner and "81234MiB" in banner
    assert smi(fake_host, "-L").splitlines()[0].startswith(
        "GPU 0: NVIDIA RTX PRO 6000 Blackwell Server Edition (UUID: GPU-")
    assert smi(fake_host, "--query-compute-apps=pid", "--format=csv,noheader", "-i", "0") == ""


def test_fake_rejects_unknown_field(fake_host):
    out = subprocess.run([str(fake_host / "bin" / "nvidia-smi"), "--query-gpu=bogus",
                          "--format=csv"], capture_output=True, text=True)
    assert out.returncode != 0 and 'Field "bogus" is not a valid field to query.' in out.stdout
