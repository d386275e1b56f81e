"""Manifest `sleep: {level: 1|2}`: it renders --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1, and it
is refused where the development endpoints it opens would reach the network."""

from __future__ import annotations

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_manifest
from orchestrator.errors import ConfigError
from orchestrator.paths import shipped_dir
from orchestrator.render.artifacts import read_env_values, render

HOST = HostEntry(name="gpu1", address="gpu1.example", models_root="/srv/models",
                 vllm="/srv/venv/bin/vllm", units_dir="/srv/vllm-orch/units", state_dir="/srv/vllm-orch/state")


def manifest(tmp_path, extra: str, base: str = "tiny-llama-a"):
    text = (shipped_dir("models") / f"{base}.yaml").read_text() + extra
    path = tmp_path / f"{base}.yaml"
    path.write_text(text)
    return load_manifest(path)


def test_sleep_renders_the_flag_and_the_dev_mode(tmp_path):
    r = render(manifest(tmp_path, "sleep:\n  level: 1\n"), HOST)
    assert "--enable-sleep-mode" in r.argv
    assert ("--enable-sleep-mode", "sleep.level") in r.provenance
    assert read_env_values(r.env_file.text)["VLLM_SERVER_DEV_MODE"] == "1"
    plain = render(manifest(tmp_path, ""), HOST)
    assert "--enable-sleep-mode" not in plain.argv
    assert "VLLM_SERVER_DEV_MODE" not in read_env_values(plain.env_file.text)


@pytest.mark.parametrize("extra, field, words", [
    ("sleep:\n  level: 3\n", "sleep.level", "1 or 2"),
    ("sleep: {level: 1}\n", "sleep", "serving.host 127.0.0.1"),
])
def test_bad_sleep_sections_are_refused_with_the_field(tmp_path, extra, field, words):
    text = extra
    if "serving.host" in words:      # the same manifest listening on every address
        base = (shipped_dir("models") / "tiny-llama-a.yaml").read_text().replace("host: 127.0.0.1", "host: 0.0.0.0")
        path = tmp_path / "tiny-llama-a.yaml"
        path.write_text(base + text)
        with pytest.raises(ConfigError) as e:
            load_manifest(path)
    else:
        with pytest.raises(ConfigError) as e:
            manifest(tmp_path, text)
    assert field in str(e.value) and words in str(e.value)


def test_dev_mode_and_the_flag_only_through_the_sleep_section(tmp_path):
    text = (shipped_dir("models") / "tiny-llama-a.yaml").read_text().replace(
        'env:\n', 'env:\n  VLLM_SERVER_DEV_MODE: "1"\n')
    path = tmp_path / "tiny-llama-a.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="env.VLLM_SERVER_DEV_MODE: .*written by vllm-orch"):
        load_manifest(path)
    text = (shipped_dir("models") / "tiny-llama-a.yaml").read_text().replace(
        'extra_args: ["--enforce-eager"]', 'extra_args: ["--enforce-eager", "--enable_sleep_mode"]')
    path = tmp_path / "tiny-llama-a.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"extra_args\[1\].*sleep section"):
        load_manifest(path)


def test_a_multi_node_service_has_no_sleep_mode(tmp_path):
    with pytest.raises(ConfigError, match="sleep: sleep mode is for a service on one host"):
        manifest(tmp_path, "sleep: {level: 1}\n", base="kimi-k25-int4-2node")
