"""Hostile input, refused at the door: every case below is a manifest or an inventory that a
careless or malicious author could write. Each must end `vllm-orch deploy` with exit 2 and ONE clear
line naming the file (and line) and the field, with no traceback, and before anything is written on
the host (the host here is this machine, `address: local`, with every folder inside tmp_path).

The table of inputs and results in docs/security.md is this list.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main

MODEL = {
    "description": "a small model",
    "source": {"repo": "vllm-orch-sim/tiny-random-3shard", "revision": "main"},
    "serving": {"port": 8123, "gpus": 1},
    "vllm": {"tensor_parallel_size": 1},
    "env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
}


def host(root: Path) -> dict:
    return {"address": "local", "service_manager": "process", "models_root": str(root / "models"),
            "units_dir": str(root / "units"), "state_dir": str(root / "state"),
            "vllm": str(root / "bin" / "vllm"), "python": "python3", "service_user": "root"}


def deep_merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for k, v in change.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# (id, what is changed, the text the one error line must contain)
# what is changed: a dict merged into the manifest ("m") or the host entry ("h"), or raw YAML bytes
# for the whole manifest ("m-raw") or inventory ("h-raw") file.
HOSTILE = [
    # -- manifest: variables vllm-orch sets and relies on ---------------------------------------
    ("env-cuda-visible-devices", "m", {"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, "env.CUDA_VISIBLE_DEVICES"),
    ("env-hf-hub-offline", "m", {"env": {"HF_HUB_OFFLINE": "0"}}, "env.HF_HUB_OFFLINE"),
    ("env-ready-timeout", "m", {"env": {"VLLM_ENGINE_READY_TIMEOUT_S": "1"}}, "env.VLLM_ENGINE_READY_TIMEOUT_S"),
    ("env-ld-preload", "m", {"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "env.LD_PRELOAD"),
    ("env-path", "m", {"env": {"PATH": "/tmp/evil:/usr/bin"}}, "env.PATH"),
    # -- manifest: loader and interpreter variables (whoever reads the env file would run them) ----
    ("env-pythonpath", "m", {"env": {"PYTHONPATH": "/var/lib/vllm-orch/models/tiny"}}, "env.PYTHONPATH"),
    ("env-pythonstartup", "m", {"env": {"PYTHONSTARTUP": "/tmp/x.py"}}, "env.PYTHONSTARTUP"),
    ("env-ld-library-path", "m", {"env": {"LD_LIBRARY_PATH": "/var/lib/vllm-orch/models/tiny"}},
     "env.LD_LIBRARY_PATH"),
    ("env-ld-audit", "m", {"env": {"LD_AUDIT": "/tmp/a.so"}}, "env.LD_AUDIT"),
    ("env-gconv-path", "m", {"env": {"GCONV_PATH": "/tmp"}}, "env.GCONV_PATH"),
    ("env-bash-env", "m", {"env": {"BASH_ENV": "/tmp/x.sh"}}, "env.BASH_ENV"),
    ("hardware-env-pythonpath", "m", {"requires": {"hardware": {"ampere": {"env": {"PYTHONPATH": "/tmp"}}}}},
     "requires.hardware.ampere.env.PYTHONPATH"),
    ("secret-env-pythonpath", "m", {"serving": {"secret_env": ["PYTHONPATH"]}}, "serving.secret_env[0]"),
    ("service-env-ld-audit", "h", {"service_env": {"LD_AUDIT": "/tmp/a.so"}}, "hosts.h.service_env.LD_AUDIT"),
    ("override-service-env-pythonhome", "h", {"overrides": {"tiny": {"service_env": {"PYTHONHOME": "/tmp"}}}},
     "hosts.h.overrides.tiny.service_env.PYTHONHOME"),
    ("secret-env-path", "m", {"serving": {"secret_env": ["PATH"]}}, "serving.secret_env"),
    ("env-newline-unit-line", "m", {"env": {"NCCL_DEBUG": "INFO\nExecStartPre=/bin/sh -c id"}}, "env.NCCL_DEBUG"),
    ("env-secret-name", "m", {"env": {"HF_TOKEN": "hf_abc"}}, "env.HF_TOKEN"),
    ("env-name-with-space", "m", {"env": {"MY VAR": "1"}}, "env.MY VAR: 'MY VAR' is not an environment variable"),
    ("env-name-with-at", "m", {"env": {"A@B": "1"}}, "env.A@B: 'A@B' is not an environment variable"),
    ("hardware-unknown-field-space", "m", {"requires": {"hardware": {"ampere": {"vllm": {"max seqs": 1}}}}},
     "requires.hardware.ampere.vllm.max seqs: unknown field"),
    # -- manifest: secrets where they would leak (unit, records, ps) ----------------------------
    ("extra-args-api-key", "m", {"vllm": {"extra_args": ["--api-key", "sk-123"]}}, "vllm.extra_args[0]"),
    ("extra-args-api-key-eq", "m", {"vllm": {"extra_args": ["--seed", "0", "--api-key=sk-123"]}},
     "vllm.extra_args[2]"),
    ("extra-args-hf-token", "m", {"vllm": {"extra_args": ["--hf-token", "hf_abc"]}}, "vllm.extra_args[0]"),
    ("extra-args-newline", "m", {"vllm": {"extra_args": ["--seed\nExecStartPre=/bin/id"]}}, "vllm.extra_args[0]"),
    # -- manifest: flags spelled as vLLM reads them too (`_` is `-`, argparse takes unique prefixes) --
    ("extra-args-api-key-underscore", "m", {"vllm": {"extra_args": ["--api_key", "sk-123"]}}, "vllm.extra_args[0]"),
    ("extra-args-api-key-prefix", "m", {"vllm": {"extra_args": ["--api-k=sk-123"]}}, "vllm.extra_args[0]"),
    ("extra-args-trust-remote-code-underscore", "m", {"vllm": {"extra_args": ["--seed", "0", "--trust_remote_code"]}},
     "vllm.extra_args[2]"),
    ("extra-args-tp-underscore", "m", {"vllm": {"extra_args": ["--tensor_parallel_size", "2"]}}, "vllm.extra_args[0]"),
    ("extra-args-dcp-short", "m", {"vllm": {"extra_args": ["-dcp", "8"]}}, "vllm.extra_args[0]"),
    ("extra-args-port-prefix", "m", {"vllm": {"extra_args": ["--por", "9000"]}}, "vllm.extra_args[0]"),
    # -- manifest: a file of further options vLLM reads past every check above ---------------------
    ("extra-args-config", "m", {"vllm": {"extra_args": ["--config", "/tmp/x.yaml"]}},
     "vllm.extra_args[0]: extra_args sets --config"),
    ("extra-args-config-eq", "m", {"vllm": {"extra_args": ["--seed", "0", "--config=/tmp/x.yaml"]}},
     "vllm.extra_args[2]: extra_args sets --config"),
    ("extra-args-config-dotted", "m", {"vllm": {"extra_args": ["--config_format", "auto", "--config.x=1"]}},
     "vllm.extra_args[2]: extra_args sets --config (as --config.x)"),
    ("extra-args-config-prefix", "m", {"vllm": {"extra_args": ["--confi", "/tmp/x.yaml"]}}, "vllm.extra_args[0]"),
    # -- manifest: numbers that are not numbers --------------------------------------------------
    ("port-true", "m", {"serving": {"port": True}}, "serving.port"),
    ("gpus-true", "m", {"serving": {"gpus": True}}, "serving.gpus"),
    ("gpu-ids-bool", "m", {"serving": {"gpu_ids": [True]}}, "serving.gpu_ids"),
    ("reserve-inf", "m-raw", None, "requires.disk_reserve_gib"),
    ("gpu-util-nan", "m-raw", None, "vllm.gpu_memory_utilization"),
    ("budget-true", "m", {"startup": {"budget_seconds": True}}, "startup.budget_seconds"),
    # -- manifest: markup and odd text -------------------------------------------------------------
    ("served-name-markup", "m", {"serving": {"served_model_name": "[/x]"}}, "serving.served_model_name"),
    ("repo-dotdot", "m", {"source": {"repo": "../../etc"}}, "source.repo"),
    # -- manifest: YAML itself ---------------------------------------------------------------------
    ("yaml-not-utf8", "m-raw", b"description: caf\xe9\nsource: {repo: a/b}\n", ":1"),
    ("yaml-nul", "m-raw", b"description: ok\nsource: {repo: a/b\x00}\n", ":2"),
    ("yaml-control-char", "m-raw", b"description: ok\n\nsource: {repo: a/b\x1b[31m}\n", ":3"),
    ("yaml-unhashable-key", "m-raw", b"source: {repo: a/b}\nenv:\n  ? [a, b]\n  : x\n", ":3"),
    ("yaml-deep-nesting", "m-raw", b"source: {repo: a/b}\nvllm:\n  compilation_config: " + b"[" * 5000
     + b"]" * 5000 + b"\n", ":3"),
    ("yaml-alias-bomb", "m-raw", None, "expanding aliases"),
    ("yaml-too-big", "m-raw", b"source: {repo: a/b}\n" + b"# padding\n" * 200_000, "larger than"),
    ("yaml-duplicate-key", "m-raw", b"source: {repo: a/b}\nserving: {port: 1}\nserving: {port: 2}\n", ":3"),
    # -- inventory: what reaches a unit file or a command -----------------------------------------
    ("service-user-newline", "h", {"service_user": "root\nExecStartPre=/bin/sh -c id"}, "service_user"),
    ("service-user-space", "h", {"service_user": "bad user"}, "service_user"),
    ("service-user-percent", "h", {"service_user": "a%n"}, "service_user"),
    ("vllm-plus-prefix", "h", {"vllm": "+/opt/vllm/bin/vllm"}, "vllm"),
    ("vllm-minus-prefix", "h", {"vllm": "-/opt/vllm/bin/vllm"}, "vllm"),
    ("vllm-at-prefix", "h", {"vllm": "@/opt/vllm/bin/vllm"}, "vllm"),
    ("vllm-bang-prefix", "h", {"vllm": "!!/opt/vllm/bin/vllm"}, "vllm"),
    ("vllm-colon-prefix", "h", {"vllm": ":/opt/vllm/bin/vllm"}, "vllm"),
    ("python-newline", "h", {"python": "python3\nrm -rf /"}, "python"),
    ("python-plus-prefix", "h", {"python": "+/usr/bin/python3"}, "hosts.h.python: '+/usr/bin/python3'"),
    ("python-minus-prefix", "h", {"python": "-/usr/bin/python3"}, "hosts.h.python"),
    ("nvidia-smi-bang-prefix", "h", {"nvidia_smi": "!/usr/bin/nvidia-smi"}, "hosts.h.nvidia_smi"),
    ("user-newline", "h", {"user": "root\nProxyCommand x"}, "user"),
    ("identity-file-escape", "h", {"identity_file": "~/.ssh/id\x1b[2J"}, "identity_file"),
    ("known-hosts-newline", "h", {"known_hosts_file": "/tmp/kh\n"}, "known_hosts_file"),
    ("env-dir-control", "h", {"env_dir": "/etc/vllm-orch\r"}, "env_dir"),
    ("log-dir-newline", "h", {"log_dir": "/var/log\nx"}, "log_dir"),
    ("models-root-dotdot", "h", {"models_root": "/data/models/../../etc"}, "models_root"),
    ("models-root-slash", "h", {"models_root": "/"}, "models_root"),
    ("gateway-run-dir-newline", "h", {"gateway": {"run_dir": "/run/gw\nExecStartPre=/bin/sh"}}, "run_dir"),
    ("gateway-run-dir-dotdot", "h", {"gateway": {"run_dir": "/run/../etc"}}, "run_dir"),
    ("gateway-listen-name", "h", {"gateway": {"listen": ["example.com"]}}, "listen"),
    ("gateway-keys-env", "h", {"gateway": {"keys_env": "A B"}}, "keys_env"),
    ("models-root-etc", "h", {"models_root": "/etc"}, "models_root"),
    ("models-root-inside-etc", "h", {"models_root": "/etc/vllm-models"}, "models_root"),
    ("models-root-var-lib", "h", {"models_root": "/var/lib"}, "models_root"),
    ("models-root-boot", "h", {"models_root": "/boot/"}, "models_root"),
    ("models-root-home", "h", {"models_root": "/home/alice"}, "models_root"),
    ("models-root-root-home", "h", {"models_root": "/root"}, "models_root"),
    ("models-root-double-slash", "h", {"models_root": "//usr"}, "models_root"),
    ("state-dir-dotdot", "h", {"state_dir": "/var/lib/vllm-orch/../../../etc"}, "state_dir"),
    ("units-dir-relative", "h", {"units_dir": "etc/systemd/system"}, "units_dir"),
    ("inventory-env-hf-token", "h", {"env": {"HF_TOKEN": "hf_abc"}}, "env.HF_TOKEN"),
    ("inventory-env-api-key", "h", {"env": {"OPENAI_API_KEY": "sk-1"}}, "env.OPENAI_API_KEY"),
    ("inventory-port-true", "h", {"port": True}, "port"),
    ("connect-timeout-nan", "h-raw", None, "connect_timeout"),
    ("disk-reserve-inf", "h-raw", None, "disk_reserve_gib"),
    ("inventory-yaml-nul", "h-raw", b"hosts:\n  h: {address: local\x00}\n", ":2"),
    ("inventory-alias-bomb", "h-raw", None, "expanding aliases"),
    # -- manifest: engine (each value reaches a requirements file that root's uv reads) -------------
    ("engine-vllm-shell", "m", {"engine": {"vllm": "0.33.0; rm -rf /"}}, "engine.vllm"),
    ("engine-vllm-option", "m", {"engine": {"vllm": "--index-url=https://evil.example/simple"}}, "engine.vllm"),
    ("engine-vllm-http-wheel", "m", {"engine": {"vllm": "http://evil.example/vllm-0.33.0-py3-none-any.whl"}},
     "engine.vllm"),
    ("engine-vllm-url-credentials", "m",
     {"engine": {"vllm": "https://u:p@evil.example/vllm-0.33.0-py3-none-any.whl"}}, "engine.vllm"),
    ("engine-vllm-url-query", "m",
     {"engine": {"vllm": "https://evil.example/vllm-0.33.0-py3-none-any.whl?x=--pre"}}, "engine.vllm"),
    ("engine-torch-newline", "m", {"engine": {"vllm": "0.33.0", "torch": "2.10.0\n--extra-index-url x"}},
     "engine.torch"),
    ("engine-flashinfer-range", "m", {"engine": {"vllm": "0.33.0", "flashinfer": ">=0.6"}}, "engine.flashinfer"),
    ("engine-package-name-option", "m",
     {"engine": {"vllm": "0.33.0", "packages": {"--extra-index-url https://evil": "1"}}}, "engine.packages"),
    ("engine-package-unpinned", "m", {"engine": {"vllm": "0.33.0", "packages": {"transformers": ">=4"}}},
     "engine.packages.transformers"),
    ("engine-package-twice", "m", {"engine": {"vllm": "0.33.0", "packages": {"flashinfer_python": "0.6.1"}}},
     "engine.packages.flashinfer_python"),
    ("engine-python-words", "m", {"engine": {"vllm": "0.33.0", "python": "3.12 --system"}}, "engine.python"),
    ("engine-below-min-vllm", "m", {"engine": {"vllm": "0.20.0"}, "requires": {"min_vllm_version": "0.25.0"}},
     "engine.vllm"),
    ("engine-unknown-key", "m", {"engine": {"vllm": "0.33.0", "index_url": "https://evil.example"}},
     "engine.index_url"),
    # -- inventory: where engines are built, and by what -----------------------------------------
    ("engines-root-slash", "h", {"engines_root": "/"}, "engines_root"),
    ("engines-root-system", "h", {"engines_root": "/usr/lib"}, "engines_root"),
    ("uv-plus-prefix", "h", {"uv": "+/usr/bin/uv"}, "uv"),
    ("wheel-url-prefix-http", "h", {"wheel_url_prefixes": ["http://wheels.example/vllm/"]}, "wheel_url_prefixes.0"),
    ("wheel-url-prefix-no-slash", "h", {"wheel_url_prefixes": ["https://wheels.example/vllm"]},
     "wheel_url_prefixes.0"),
    ("wheel-url-prefix-host-only", "h", {"wheel_url_prefixes": ["https://wheels.example"]}, "wheel_url_prefixes.0"),
    ("wheel-url-prefix-newline", "h", {"wheel_url_prefixes": ["https://ok.example/\nx/"]}, "wheel_url_prefixes.0"),
    ("wheel-url-prefix-credentials", "h", {"wheel_url_prefixes": ["https://u:p@wheels.example/"]},
     "wheel_url_prefixes.0"),
    ("wheel-url-prefix-dotdot", "h", {"wheel_url_prefixes": ["https://ok.example/vllm/%2e%2e/"]},
     "wheel_url_prefixes.0"),
]

RAW = {
    "reserve-inf": lambda: yaml.safe_dump(deep_merge(MODEL, {"requires": {"disk_reserve_gib": 1}}))
    .replace("disk_reserve_gib: 1", "disk_reserve_gib: .inf").encode(),
    "gpu-util-nan": lambda: yaml.safe_dump(deep_merge(MODEL, {"vllm": {"gpu_memory_utilization": 0.5}}))
    .replace("gpu_memory_utilization: 0.5", "gpu_memory_utilization: .nan").encode(),
    "yaml-alias-bomb": lambda: ("source: {repo: a/b}\nx0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                                + "".join(f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
                                          for i in range(1, 10))).encode(),
}


def hosts_raw(name: str, root: Path) -> bytes:
    entry = yaml.safe_dump({"hosts": {"h": host(root)}})
    if name == "connect-timeout-nan":
        return (entry + "    connect_timeout: .nan\n").encode()
    if name == "disk-reserve-inf":
        return (entry + "    disk_reserve_gib: .inf\n").encode()
    if name == "inventory-alias-bomb":
        return (entry + "x0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                + "".join(f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 10))).encode()
    raise KeyError(name)


def snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*")}


@pytest.fixture
def place(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "controller-state"))
    monkeypatch.delenv("VLLM_ORCH_MODELS", raising=False)
    monkeypatch.delenv("VLLM_ORCH_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "host"
    for sub in ("models", "units", "state", "bin"):
        (root / sub).mkdir(parents=True)
    (tmp_path / "models").mkdir()
    return tmp_path, root


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """vllm-orch in this process: (exit code, stdout + stderr)."""
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_input_is_refused_with_exit_2_and_one_clear_line(case, place, capsys):
    name, kind, change, expect = case
    tmp, root = place
    manifest_path = tmp / "models" / "tiny.yaml"
    inventory_path = tmp / "hosts.yaml"
    manifest, entry = dict(MODEL), host(root)
    if kind == "m":
        manifest = deep_merge(MODEL, change)
    if kind == "h":
        entry = {**entry, **change}
    if kind == "m-raw":
        manifest_path.write_bytes(change if change is not None else RAW[name]())
    else:
        manifest_path.write_text(yaml.safe_dump(manifest))
    if kind == "h-raw":
        inventory_path.write_bytes(change if change is not None else hosts_raw(name, root))
    else:
        inventory_path.write_text(yaml.safe_dump({"hosts": {"h": entry}}))
    before = snapshot(root)

    code, output = run_cli(["--models", str(tmp / "models"), "--inventory", str(inventory_path),
                            "deploy", "tiny", "--host", "h"], capsys)

    assert code == 2, output
    assert "Traceback" not in output and "internal error" not in output, output
    first = output.splitlines()[0]
    file = "tiny.yaml" if kind.startswith("m") else "hosts.yaml"
    assert first.startswith("error: ") and file in first and expect in first, output
    assert "\x1f" not in output and not re.search(r": @.*@ ", first), "an internal path marker reached the message"
    assert snapshot(root) == before                     # nothing written on the host
    assert not (tmp / "controller-state").exists() or not any((tmp / "controller-state").rglob("*.lock"))


def test_at_least_thirty_hostile_inputs_cover_both_files():
    assert len(HOSTILE) >= 30
    assert sum(1 for c in HOSTILE if c[1].startswith("m")) >= 15
    assert sum(1 for c in HOSTILE if c[1].startswith("h")) >= 15


def test_user_text_is_never_read_as_markup(place, capsys):
    """A description, a label or a config error holding rich markup is printed as it is."""
    tmp, root = place
    (tmp / "models" / "tiny.yaml").write_text(yaml.safe_dump({**MODEL, "description": "[/x] [bold]not bold[/bold] [/]"}))
    (tmp / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"h": {**host(root), "label": "[/y]"}}}))
    argv = ["--models", str(tmp / "models"), "--inventory", str(tmp / "hosts.yaml")]
    code, output = run_cli([*argv, "models"], capsys)
    assert code == 0 and "[/x] [bold]not bold[/bold] [/]" in output, output
    code, output = run_cli([*argv, "hosts"], capsys)
    assert code == 0 and "[/y]" in output, output
    code, output = run_cli([*argv, "render", "tiny", "--host", "h"], capsys)
    assert code == 0 and "Traceback" not in output, output
    bad = tmp / "models" / "bad.yaml"
    bad.write_text(yaml.safe_dump({**MODEL, "serving": {"gpus": 1, "served_model_name": "[/x]"}}))
    code, output = run_cli([*argv, "validate", str(bad)], capsys)
    assert code == 2 and "'[/x]'" in output and "Traceback" not in output, output
    code, output = run_cli([*argv, "render", "bad"], capsys)
    assert code == 2 and "'[/x]'" in output, output


def test_the_size_limit_does_not_read_the_whole_file(place, capsys):
    """A huge (here: sparse) file is refused by its size, not read into memory first."""
    tmp, root = place
    huge = tmp / "models" / "huge.yaml"
    with open(huge, "wb") as f:
        f.truncate(8 << 30)                  # 8 GiB, sparse
    code, output = run_cli(["--models", str(tmp / "models"), "validate", str(huge)], capsys)
    assert code == 2 and "larger than" in output, output
    assert os.path.getsize(huge) == 8 << 30


@pytest.mark.parametrize("gpus,says", [("0-99999", "at most 64"), (",".join(str(i) for i in range(5000)), "at most 64"),
                                       ("0-3,0-99999999999", "not a GPU index")])
def test_a_huge_gpu_list_on_the_command_line_is_refused_at_once_in_one_short_line(gpus, says, place, capsys):
    """`render --gpus 0-99999` took 29 s (a quadratic duplicate check) and printed a 600 KB line."""
    tmp, root = place
    (tmp / "models" / "tiny.yaml").write_text(yaml.safe_dump(MODEL))
    (tmp / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"h": host(root)}}))
    code, output = run_cli(["--models", str(tmp / "models"), "--inventory", str(tmp / "hosts.yaml"),
                            "render", "tiny", "--host", "h", "--gpus", gpus], capsys)
    assert code == 2 and output.startswith("error: --gpus ") and len(output) < 400, output[:400]
    assert says in output


@pytest.mark.parametrize("command", ["deploy", "swap"])
def test_a_secret_the_manifest_needs_and_is_not_given_is_refused_before_any_host(command, place, capsys,
                                                                                 monkeypatch):
    """A secret_env name missing from vllm-orch's environment became a comment in the env file, and
    vLLM served on 0.0.0.0 without an API key. Refused (exit 2) unless serving.optional_secrets
    lists it."""
    tmp, root = place
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    (tmp / "models" / "tiny.yaml").write_text(yaml.safe_dump(deep_merge(MODEL, {"serving": {
        "secret_env": ["VLLM_API_KEY"]}})))
    (tmp / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"h": host(root)}}))
    before = snapshot(root)
    code, output = run_cli(["--models", str(tmp / "models"), "--inventory", str(tmp / "hosts.yaml"),
                            command, "tiny", "--host", "h"], capsys)
    first = output.splitlines()[0]
    assert code == 2 and first.startswith("error: VLLM_API_KEY is not set") and "without an API key" in first, output
    assert "serving.optional_secrets" in output and snapshot(root) == before


def test_an_optional_secret_may_be_missing_and_a_secret_with_a_newline_is_refused(monkeypatch):
    from orchestrator.config.manifest import Manifest
    from orchestrator.errors import ConfigError
    from orchestrator.render.artifacts import secrets_from_environ

    m = Manifest.model_validate(deep_merge({**MODEL, "name": "tiny"}, {"serving": {
        "secret_env": ["HF_TOKEN", "VLLM_API_KEY"], "optional_secrets": ["HF_TOKEN"]}}))
    assert list(secrets_from_environ(m, {"VLLM_API_KEY": "k"})) == ["VLLM_API_KEY"]
    with pytest.raises(ConfigError, match="VLLM_API_KEY is not set"):
        secrets_from_environ(m, {"HF_TOKEN": "t"})
    with pytest.raises(ConfigError, match="VLLM_API_KEY .from the environment of vllm-orch.: .* one line") as info:
        secrets_from_environ(m, {"VLLM_API_KEY": "a\nb"})
    assert info.value.exit_code == 2
    assert secrets_from_environ(m, {}, installed={"VLLM_API_KEY": "old"})["VLLM_API_KEY"].reveal() == "old"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a folder only root can change, and one it cannot")
@pytest.mark.parametrize("where", ["env_dir", "models_root", "units_dir"])
def test_a_folder_under_a_world_writable_parent_is_refused_on_the_host_with_exit_3(where, place, capsys):
    """`env_dir: /tmp/x`, `models_root: /tmp/models` and their like validate (the inventory cannot
    know the host's modes): the host's preflight reads the owner and mode of every part and refuses
    (exit 3) before anything is downloaded or installed: a folder root has not made yet under /tmp
    could be made by anyone first, and lined with links."""
    tmp, root = place
    shared = "/tmp/vllm-orch-hostile-" + os.urandom(4).hex()
    entry = {**host(root), where: shared if where != "models_root" else shared + "/models"}
    (tmp / "models" / "tiny.yaml").write_text(yaml.safe_dump(MODEL))
    (tmp / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"h": entry}}))
    argv = ["--models", str(tmp / "models"), "--inventory", str(tmp / "hosts.yaml")]
    code, output = run_cli([*argv, "check", "tiny", "--host", "h"], capsys)
    assert code == 3 and f"FAIL    root-folders: another user could change one of the folders vllm-orch writes as root: " \
        f"{shared} does not exist yet, and /tmp lets anyone make it first" in output, output
    code, output = run_cli([*argv, "deploy", "tiny", "--host", "h"], capsys)      # refused at its preflight
    assert code == 3 and "root-folders" in output and not os.path.exists(shared), output


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a folder only root can change, and one it cannot")
def test_the_lock_refuses_a_state_dir_another_user_can_change(place, capsys, tmp_path_factory):
    """The lock comes before the facts: `state_dir: /tmp` (or a folder another user made first)
    would have root create and flock `deploy.lock` where that user may have planted a link."""
    import pwd

    tmp, root = place
    squatted = tmp_path_factory.mktemp("squat")
    os.chown(squatted, pwd.getpwnam("nobody").pw_uid, -1)
    (tmp / "models" / "tiny.yaml").write_text(yaml.safe_dump(MODEL))
    for state_dir in ("/tmp", str(squatted)):
        (tmp / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"h": {**host(root), "state_dir": state_dir}}}))
        code, output = run_cli(["--models", str(tmp / "models"), "--inventory", str(tmp / "hosts.yaml"),
                                "deploy", "tiny", "--host", "h"], capsys)
        assert code == 3 and f"state_dir {state_dir} is not root's alone" in output, output
        assert not os.path.exists(os.path.join(state_dir, "deploy.lock"))


def test_pythons_harmless_switches_are_allowed_in_a_services_environment():
    from orchestrator.config.manifest import Manifest, denied_env

    m = Manifest.model_validate({**MODEL, "name": "tiny", "env": {"PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"}})
    assert m.env["PYTHONUNBUFFERED"] == "1"
    assert denied_env("TMPDIR") is None and denied_env("NCCL_DEBUG") is None
    assert denied_env("PYTHONPATH") and denied_env("LD_LIBRARY_PATH") and denied_env("GLIBC_TUNABLES")
