"""A manifest's `engine:`: its lock (what one venv holds), the venv's content address, and the
unit that runs it. Hostile values are in test_hostile_input.py (cases `engine-*`)."""

from __future__ import annotations

import pytest

from orchestrator.config.engine import allowed_wheel_url, lock_of, python_path, venv_path, vllm_path
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Engine, Manifest
from orchestrator.errors import ConfigError
from orchestrator.render.artifacts import render

HOST = HostEntry(name="gpu1", address="gpu1.example")


def manifest(engine: dict | None = None, name: str = "tiny") -> Manifest:
    data: dict = {"name": name, "source": {"repo": "org/tiny"}, "serving": {"gpus": 1}}
    if engine is not None:
        data["engine"] = engine
    return Manifest.model_validate(data)


def test_the_lock_pins_flashinfer_halves_together_and_sorts_its_lines():
    lock = lock_of(Engine(vllm="0.33.0", torch="2.10.0", flashinfer="0.6.1",
                          packages={"Transformers": "4.57.1"}, python="3.11"))
    assert lock.requirements == ("flashinfer-cubin==0.6.1", "flashinfer-python==0.6.1", "torch==2.10.0",
                                 "transformers==4.57.1", "vllm==0.33.0")
    assert lock.python == "3.11" and lock.vllm_version == "0.33.0"
    assert lock.name == f"vllm-0.33.0-{lock.hash}" and len(lock.hash) == 16


def test_the_same_lock_is_the_same_venv_and_any_change_is_another():
    base = lock_of(Engine(vllm="0.33.0", torch="2.10.0"))
    assert lock_of(Engine(torch="2.10.0", vllm="0.33.0")).hash == base.hash     # field order does not count
    changed = [Engine(vllm="0.33.1", torch="2.10.0"), Engine(vllm="0.33.0", torch="2.10.1"),
               Engine(vllm="0.33.0", torch="2.10.0", python="3.11"),
               Engine(vllm="0.33.0", torch="2.10.0", flashinfer="0.6.1")]
    assert len({base.hash, *(lock_of(e).hash for e in changed)}) == 1 + len(changed)


def test_a_wheel_address_is_a_direct_requirement_and_its_name_gives_the_version():
    url = "https://wheels.example/cu130/vllm-0.33.0%2Bcu130-cp38-abi3-manylinux_2_35_x86_64.whl"
    lock = lock_of(Engine(vllm=url))
    assert lock.requirements == (f"vllm @ {url}",)
    assert lock.vllm_version == "0.33.0+cu130" and lock.name.startswith("vllm-0.33.0+cu130-")


def test_render_names_the_venv_in_execstart_and_without_engine_the_inventorys_vllm():
    m = manifest({"vllm": "0.30.1", "torch": "2.9.0"})
    lock = lock_of(m.engine)  # type: ignore[arg-type]
    venv = venv_path(HOST, lock)
    assert venv == f"/var/lib/vllm-orch/engines/vllm-0.30.1-{lock.hash}"
    r = render(m, HOST, {})
    assert r.argv[0] == f"{venv}/bin/vllm" and r.provenance[0] == (f"{venv}/bin/vllm", "engine.vllm")
    assert f"ExecStart={venv}/bin/vllm serve" in r.unit.text
    assert python_path(m, HOST) == f"{venv}/bin/python"
    plain = manifest()
    assert render(plain, HOST, {}).argv[0] == HOST.vllm == vllm_path(plain, HOST)
    assert python_path(plain, HOST) == HOST.python


@pytest.mark.parametrize("version", ["0.33.0", "0.25.0rc1", "0.33.0.post1", "2.10.0+cu130", "1.0.dev20261201"])
def test_versions_pip_writes_are_accepted(version):
    assert lock_of(Engine(vllm=version)).vllm_version == version


WHEEL = "vllm-0.33.0-py3-none-any.whl"


ALLOWED = ["https://wheels.example/vllm/"]


@pytest.mark.parametrize("url, prefixes", [
    (f"https://wheels.example/vllm/{WHEEL}", []),                          # no prefixes: no URL at all
    (f"https://evil.example/vllm/{WHEEL}", ALLOWED),                       # another host
    (f"https://wheels.example.evil.example/vllm/{WHEEL}", ALLOWED),        # a host the prefix's text starts
    (f"https://wheels.example/vllm-other/{WHEEL}", ALLOWED),               # a folder the prefix's text starts
    (f"https://wheels.example/vllm/../other/{WHEEL}", ALLOWED),            # leaves the folder once resolved
    (f"https://wheels.example/vllm/%2E%2E/other/{WHEEL}", ALLOWED),
])
def test_a_wheel_url_outside_the_hosts_prefixes_is_refused_with_exit_2_in_one_line(url, prefixes):
    entry = HOST.model_copy(update={"wheel_url_prefixes": prefixes})
    with pytest.raises(ConfigError) as refused:
        allowed_wheel_url(Engine(vllm=url).vllm, entry)
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value), refused.value
    assert url in refused.value.message


def test_a_wheel_url_under_a_prefix_and_a_version_pass():
    entry = HostEntry(name="gpu1", address="gpu1.example",
                      wheel_url_prefixes=["https://mirror.example/x/", "https://wheels.example/vllm/"])
    allowed_wheel_url(Engine(vllm=f"https://wheels.example/vllm/cu130/{WHEEL}").vllm, entry)
    allowed_wheel_url("0.33.0", HOST)
