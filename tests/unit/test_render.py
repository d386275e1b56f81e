"""Rendering: golden files for every shipped manifest (reviewed by eye), systemd-analyze verify,
escaping and secret masking."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all, load_manifest
from orchestrator.paths import shipped_dir
from orchestrator.render.artifacts import env_value, render, systemd_quote
from orchestrator.secret import Secret

GOLDEN = Path(__file__).parent.parent / "golden"
MODELS, _ = load_all(shipped_dir("models"))
SYSTEMD_HOST = HostEntry(name="gpu1", address="gpu1.example")
PROCESS_HOST = HostEntry(name="box", address="local", service_manager="process",
                         models_root="/srv/models", vllm="/srv/venv/bin/vllm", units_dir="/srv/vllm-orch/units",
                         state_dir="/srv/vllm-orch/state")


def _golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        if os.environ.get("UPDATE_GOLDEN") != "1":
            pytest.fail(f"golden file {name} was missing and has been written: review it and re-run")
    assert actual == path.read_text(), f"{name} differs; review and re-run with UPDATE_GOLDEN=1 if intended"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_golden_systemd(model):
    r = render(MODELS[model], SYSTEMD_HOST)
    _golden(f"{model}/vllm-{model}.service", r.unit.text)
    _golden(f"{model}/{model}.env", r.env_file.text)
    _golden(f"{model}/argv.json", json.dumps(r.argv, indent=1) + "\n")
    assert r.unit.path == f"/etc/systemd/system/vllm-{model}.service"
    assert r.env_file.path == f"/etc/vllm-orch/{model}.env" and r.env_file.mode == 0o600


@pytest.mark.parametrize("model", sorted(MODELS))
def test_golden_process_host(model):
    r = render(MODELS[model], PROCESS_HOST)
    _golden(f"{model}/vllm-{model}.process.sh", r.unit.text)
    assert r.unit.mode == 0o755 and r.unit.path == f"/srv/vllm-orch/units/vllm-{model}.sh"


def _verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """systemd-analyze verify, with the ExecStart binary (absent here) swapped for a stub file."""
    stub = tmp_path / "vllm-stub"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    text = unit_text.replace("ExecStart=/opt/vllm/bin/vllm ", f"ExecStart={stub} ")
    name = [l for l in unit_text.splitlines() if l.startswith("SyslogIdentifier=")][0].split("=")[1]
    unit = tmp_path / f"{name}.service"
    unit.write_text(text)
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
@pytest.mark.parametrize("model", sorted(MODELS))
def test_systemd_analyze_verify_is_clean(model, tmp_path):
    proc = _verify(render(MODELS[model], SYSTEMD_HOST).unit.text, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_verify_catches_a_bad_unit(tmp_path):
    """The check above is not vacuous: a bad key shows up on stderr."""
    text = render(MODELS["minimax-m25"], SYSTEMD_HOST).unit.text.replace("KillMode=control-group", "KillMode=bogus")
    assert "Failed to parse kill mode" in _verify(text, tmp_path).stderr


def test_systemd_quoting():
    assert systemd_quote("--port") == "--port"
    assert systemd_quote('{"a":"b c"}') == '"{\\"a\\":\\"b c\\"}"'
    assert systemd_quote("50%") == '"50%%"'
    assert systemd_quote("$HOME") == '"$$HOME"'
    assert systemd_quote(";") == '";"'
    assert systemd_quote("") == '""'


def test_env_value_quoting():
    assert env_value("fp8") == "fp8"
    assert env_value("a b") == "'a b'"
    assert env_value("$X") == "'$X'"
    with pytest.raises(ValueError):
        env_value("it's")


def test_secrets_are_masked_in_text_and_revealed_in_data():
    m = MODELS["example"]
    r = render(m, SYSTEMD_HOST, secrets={"HF_TOKEN": Secret("hf_supersecret")})
    assert "HF_TOKEN=***" in r.env_file.text and "hf_supersecret" not in r.env_file.text
    assert b"HF_TOKEN=hf_supersecret" in r.env_file.data()
    assert "hf_supersecret" not in r.unit.text and "hf_supersecret" not in " ".join(r.argv)


def test_missing_secret_is_noted_not_invented():
    r = render(MODELS["example"], SYSTEMD_HOST)
    assert "# HF_TOKEN was not set" in r.env_file.text
    assert "HF_TOKEN=" not in r.env_file.text


def test_provenance_maps_every_token_to_a_field():
    r = render(MODELS["kimi-k25-int4"], SYSTEMD_HOST)
    assert [t for t, _ in r.provenance] == r.argv
    fields = dict(r.provenance)
    assert fields["--tensor-parallel-size"] == "vllm.tensor_parallel_size"
    assert fields["--reasoning-parser"] == "vllm.reasoning_parser"


def test_shell_metacharacters_stay_single_argv_items(tmp_path):
    f = tmp_path / "evil.yaml"
    f.write_text('source: {repo: a/b}\nserving: {gpus: 1}\nvllm: {extra_args: ["--x", "$(touch /tmp/pwned); echo"]}\n')
    r = render(load_manifest(f), PROCESS_HOST)
    assert r.argv[-1] == "$(touch /tmp/pwned); echo"
    assert "'$(touch /tmp/pwned); echo'" in r.unit.text     # shell-quoted in the start script
    unit = render(load_manifest(f), SYSTEMD_HOST).unit.text
    assert '"$$(touch /tmp/pwned); echo"' in unit              # systemd-quoted, $ escaped


def test_percent_in_inventory_paths_is_not_a_systemd_specifier(tmp_path):
    """`%h` in a folder name would be the service user's home to systemd: every value the unit takes
    from the inventory has `%` doubled, so the unit names the folder that was written."""
    host = HostEntry(name="gpu1", address="gpu1.example", models_root="/data/%h/models", env_dir="/etc/v%n")
    unit = render(MODELS["example"], host).unit.text
    assert "WorkingDirectory=/data/%%h/models/example" in unit
    assert "EnvironmentFile=/etc/v%%n/example.env" in unit
    assert '"/data/%%h/models/example"' in unit or "/data/%%h/models/example " in unit    # ExecStart's model path
    assert not [l for l in unit.splitlines() if not l.startswith("#") and "%" in l.replace("%%", "")]
