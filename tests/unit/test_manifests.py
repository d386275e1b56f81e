"""Manifests: the shipped ones load; each bad-manifest fixture gives exactly its expected message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config.manifest import Manifest, get_manifest, load_all, load_manifest, manifest_schema
from orchestrator.errors import ConfigError
from orchestrator.paths import shipped_dir

BAD = Path(__file__).parent.parent / "fixtures" / "bad-manifests"
SHIPPED = ["example", "kimi-k25-int4", "kimi-k25-int4-2node", "kimi-k25-int4-dcp8", "kimi-k25-nvfp4", "minimax-m25",
           "minimax-m25-ep", "tiny-llama-a", "tiny-llama-b"]


def test_shipped_manifests_load():
    good, bad = load_all(shipped_dir("models"))
    assert not bad, [str(b) for b in bad]
    assert sorted(good) == sorted(SHIPPED)
    kimi = good["kimi-k25-int4"]
    assert kimi.source.repo == "moonshotai/Kimi-K2.5"
    assert kimi.vllm.tensor_parallel_size == 8 and kimi.vllm.trust_remote_code
    assert kimi.vllm.tool_call_parser == kimi.vllm.reasoning_parser == "kimi_k2"
    assert good["minimax-m25"].vllm.tensor_parallel_size == 4
    ep = good["minimax-m25-ep"].vllm
    assert ep.enable_expert_parallel and ep.world_size == 8


@pytest.mark.parametrize("fixture", sorted(p.stem for p in BAD.glob("*.yaml")))
def test_bad_manifest_message(fixture, monkeypatch):
    monkeypatch.chdir(BAD)
    expected = (BAD / f"{fixture}.expected").read_text().strip()
    with pytest.raises(ConfigError) as info:
        load_manifest(Path(f"{fixture}.yaml"))
    assert str(info.value) == expected
    assert info.value.exit_code == 2


def test_every_bad_fixture_has_an_expectation():
    assert {p.stem for p in BAD.glob("*.yaml")} == {p.stem for p in BAD.glob("*.expected")}


def test_cli_validate_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "validate",
                           str(BAD / "misspelt-key.yaml"), str(shipped_dir("models") / "minimax-m25.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "did you mean 'tensor_parallel_size'" in proc.stdout
    assert "ok      " in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_unknown_model_suggests_name():
    with pytest.raises(ConfigError) as info:
        get_manifest("kimi-k25-in4", shipped_dir("models"))
    assert info.value.hint == "did you mean 'kimi-k25-int4'?"


def test_schema_has_descriptions_for_every_field():
    schema = manifest_schema()
    missing = []

    def walk(node, path):
        for name, prop in node.get("properties", {}).items():
            if "description" not in prop:
                missing.append(f"{path}{name}")
    walk(schema, "")
    for name, sub in schema.get("$defs", {}).items():
        walk(sub, f"{name}.")
    assert not missing
    json.dumps(schema)


def test_every_field_has_a_description_in_the_models():
    def walk(model, path=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{path}{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, Manifest.__mro__[1]):
                walk(ann, f"{path}{name}.")
    walk(Manifest)


def test_secret_like_env_is_refused_but_secret_env_allowed(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("source: {repo: a/b}\nserving: {gpus: 1, secret_env: [HF_TOKEN, VLLM_API_KEY]}\n")
    m = load_manifest(f)
    assert m.serving.secret_env == ["HF_TOKEN", "VLLM_API_KEY"]


def test_manifest_reference_is_in_sync():
    from orchestrator.devtools.docgen import reference

    doc = Path(__file__).parents[2] / "docs" / "manifest-reference.md"
    assert doc.read_text() == reference(), "run: python -m orchestrator.devtools.docgen > docs/manifest-reference.md"


BAD_INV = Path(__file__).parent.parent / "fixtures" / "bad-inventories"


@pytest.mark.parametrize("fixture", sorted(p.stem for p in BAD_INV.glob("*.yaml")))
def test_bad_inventory_messages(fixture, monkeypatch):
    from orchestrator.config.inventory import load_inventory_file

    monkeypatch.chdir(BAD_INV)
    expected = (BAD_INV / f"{fixture}.expected").read_text().strip().splitlines()
    with pytest.raises(ConfigError) as info:
        load_inventory_file(Path(f"{fixture}.yaml"))
    assert [str(info.value), *info.value.details] == expected
    assert info.value.exit_code == 2


def test_the_example_inventory_ships_in_the_wheel_and_hosts_example_prints_it():
    # hosts.example.yaml, which every "no inventory" hint points at, was not in the wheel.
    import tomllib

    from click.testing import CliRunner

    from orchestrator.cli.main import cli
    from orchestrator.config.inventory import validate_inventory_file
    from orchestrator.paths import _PKG, example_inventory

    repo = Path(__file__).resolve().parents[2]
    wheel = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    shipped = wheel["force-include"]["hosts.example.yaml"]
    assert (_PKG.parent / shipped).relative_to(_PKG / "_shipped") == Path("hosts.example.yaml")
    assert example_inventory() == repo / "hosts.example.yaml"
    out = CliRunner().invoke(cli, ["hosts", "--example"])
    assert out.exit_code == 0 and out.output == (repo / "hosts.example.yaml").read_text()
    validate_inventory_file(example_inventory())


def test_the_stats_turned_back_on_are_no_problem():
    from orchestrator.config.manifest import VllmArgs
    assert VllmArgs(extra_args=["--no-disable-log-stats"]).extra_args == ["--no-disable-log-stats"]
