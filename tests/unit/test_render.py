"""Rendering: golden files for every shipped manifest (reviewed by eye), systemd-analyze verify,
escaping and secret masking."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all, load_manifest
from orchestrator.paths import shipped_dir
from orchestrator.render.artifacts import env_value, read_env_values, render, systemd_quote
from orchestrator.secret import Secret
from orchestrator.sim import unitcheck

GOLDEN = Path(__file__).parent.parent / "golden"
MODELS, _ = load_all(shipped_dir("models"))
SYSTEMD_HOST = HostEntry(name="gpu1", address="gpu1.example")
PROCESS_HOST = HostEntry(name="box", address="local", service_manager="process",
                         models_root="/srv/models", vllm="/srv/venv/bin/vllm", units_dir="/srv/vllm-orch/units",
                         state_dir="/srv/vllm-orch/state")


def reference(model: str, host: HostEntry):
    """The manifest as its first hardware class (the one its figures were measured on) gets it."""
    m = MODELS[model]
    return effective(m, host, hardware=next(iter(m.requires.hardware), None)).manifest


def _golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        if os.environ.get("UPDATE_GOLDEN") != "1":
            pytest.fail(f"golden file {name} was missing and has been written: review it and re-run")
    assert actual == path.read_text(), f"{name} differs; review and re-run with UPDATE_GOLDEN=1 if intended"


SINGLE = sorted(m for m in MODELS if MODELS[m].multinode is None)
MULTI = sorted(m for m in MODELS if MODELS[m].multinode is not None)
# The nodes of a multi-node model: the first reached by its IP address, the others by a DNS name
# with their cluster address (and NIC) in the inventory.
NODE_HOSTS = [HostEntry(name="gpu1", address="10.0.0.1", cluster={"interface": "ens1f0"}),
              *(HostEntry(name=f"gpu{i}", address=f"gpu{i}.example", cluster={"address": f"10.0.0.{i}",
                                                                                 "interface": "ens1f0"})
                for i in range(2, 5))]


def node_renders(model: str, process: bool = False):
    """Every node of a multi-node model, as rendered on its host."""
    from orchestrator.config.placement import node_roles

    n = MODELS[model].multinode.nodes
    hosts = [h.model_copy(update=dict(service_manager="process", models_root="/srv/models",
                                      vllm="/srv/venv/bin/vllm", units_dir="/srv/vllm-orch/units",
                                      state_dir="/srv/vllm-orch/state", env_dir="/srv/vllm-orch/units",
                                      python="/srv/venv/bin/python"))
             if process else h for h in NODE_HOSTS[:n]]
    m = reference(model, hosts[0])
    return [render(m, h, role=r) for h, r in zip(hosts, node_roles(m, hosts))]


@pytest.mark.parametrize("model", SINGLE)
def test_golden_systemd(model):
    r = render(reference(model, SYSTEMD_HOST), SYSTEMD_HOST)
    _golden(f"{model}/vllm-{model}.service", r.unit.text)
    _golden(f"{model}/{model}.env", r.env_file.text)
    _golden(f"{model}/argv.json", json.dumps(r.argv, indent=1) + "\n")
    assert r.unit.path == f"/etc/systemd/system/vllm-{model}.service"
    assert r.env_file.path == f"/etc/vllm-orch/{model}.env" and r.env_file.mode == 0o600


@pytest.mark.parametrize("model", MULTI)
def test_golden_systemd_every_node(model):
    for r in node_renders(model):
        node = f"{model}/node{r.role.rank}"
        _golden(f"{node}/vllm-{model}.service", r.unit.text)
        _golden(f"{node}/{model}.env", r.env_file.text)
        _golden(f"{node}/argv.json", json.dumps(r.argv, indent=1) + "\n")
        for f in r.extra:                   # the head's health units, a headless node's head watch
            if f.path.endswith((".service", ".timer")):
                _golden(f"{node}/{Path(f.path).name}", f.text)
        assert r.unit.path == f"/etc/systemd/system/vllm-{model}.service"


@pytest.mark.parametrize("model", SINGLE)
def test_golden_process_host(model):
    r = render(reference(model, PROCESS_HOST), PROCESS_HOST)
    _golden(f"{model}/vllm-{model}.process.sh", r.unit.text)
    assert r.unit.mode == 0o755 and r.unit.path == f"/srv/vllm-orch/units/vllm-{model}.sh"


@pytest.mark.parametrize("model", MULTI)
def test_golden_process_host_every_node(model):
    for r in node_renders(model, process=True):
        _golden(f"{model}/node{r.role.rank}/vllm-{model}.process.sh", r.unit.text)
        assert r.unit.mode == 0o755 and r.unit.path == f"/srv/vllm-orch/units/vllm-{model}.sh"


def _verify(r, text: str | None = None, which: int = 0) -> tuple[bool, str]:
    """systemd-analyze verify of one rendered unit (0: the service, 1: its health check, 2: its
    timer) in a throwaway root holding the others, the env file and stubs for the binaries."""
    units = [r.unit, *r.extra[:2]]
    target = units[which]
    others = {f.path: f.text for f in [r.env_file, *units] if f is not target}
    binaries = [r.argv[0], SYSTEMD_HOST.python or "python3", "/usr/bin/install", "/usr/sbin/nft"]
    return unitcheck.verify_unit(text if text is not None else target.text, binaries,
                                 unit_name=target.path.rsplit("/", 1)[1], extra_files=others)


@pytest.mark.skipif(bool(unitcheck.available()), reason=str(unitcheck.available()))
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("which", [0, 1, 2], ids=["service", "health-check", "health-timer"])
def test_systemd_analyze_verify_is_clean(model, which):
    ok, err = _verify(render(reference(model, SYSTEMD_HOST), SYSTEMD_HOST), which=which)
    assert ok, err


@pytest.mark.skipif(bool(unitcheck.available()), reason=str(unitcheck.available()))
@pytest.mark.parametrize("model", MULTI)
def test_systemd_analyze_verify_every_node(model):
    """The head has the service, its health check and timer; a worker node the service only."""
    for r in node_renders(model):
        for which in range(1 + len([f for f in r.extra if f.path.endswith((".service", ".timer"))])):
            ok, err = _verify(r, which=which)
            assert ok, (r.role, which, err)


@pytest.mark.skipif(bool(unitcheck.available()), reason=str(unitcheck.available()))
def test_verify_catches_a_bad_unit():
    """The check above is not vacuous: a bad key shows up on stderr."""
    r = render(MODELS["minimax-m25"], SYSTEMD_HOST)
    ok, err = _verify(r, r.unit.text.replace("KillMode=mixed", "KillMode=bogus"))
    assert not ok and "Failed to parse kill mode" in err


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.replace("\\\n", " ").splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_the_unit_is_active_only_when_the_model_serves():
    """Type=exec alone makes `active` mean "exec'd": the ExecStartPost= probe keeps the unit
    activating until vLLM answers, and TimeoutStartSec (the manifest's budget) bounds both."""
    m = MODELS["kimi-k25-int4"]
    r = render(m, SYSTEMD_HOST)
    d = _directives(r.unit.text)
    assert d["Type"] == ["exec"] and d["TimeoutStartSec"] == [str(m.startup.budget_seconds)]
    post = d["ExecStartPost"][0].split()
    assert post[:4] == ["/opt/vllm/bin/python", "-I", "/var/lib/vllm-orch/bin/vllm-orch-probe.py", "ready"]
    assert post[post.index("--port") + 1] == str(m.serving.port)
    assert post[post.index("--served-name") + 1] == m.served_name
    probe = next(f for f in r.extra if f.path.endswith("vllm-orch-probe.py"))
    assert probe.mode == 0o755 and "def cmd_ready" in probe.text


def test_restart_policy_is_sized_to_the_load_time():
    """systemd refuses a start once StartLimitBurst starts fell within StartLimitIntervalSec. Each
    attempt of a load that fails at its very end takes budget + stop + RestartSec, so the window
    must hold that many attempts, or a late failure restarts forever (3 x 36 min > 1 h)."""
    for m in MODELS.values():
        d = _directives(render(m, SYSTEMD_HOST).unit.text)
        burst, window = int(d["StartLimitBurst"][0]), int(d["StartLimitIntervalSec"][0])
        attempt = int(d["TimeoutStartSec"][0]) + int(d["TimeoutStopSec"][0]) + int(d["RestartSec"][0])
        starts = [i * attempt for i in range(burst + 1)]        # every attempt fails as late as it can
        refused = [t for i, t in enumerate(starts) if i >= burst and t - starts[i - burst] <= window]
        assert refused == [starts[burst]], (m.name, burst, window, attempt)
        assert d["Restart"] == ["on-failure"] and burst == m.startup.start_attempts


def test_graceful_stop_caches_device_order_and_persistenced():
    m = MODELS["kimi-k25-int4"]
    r = render(m, SYSTEMD_HOST)
    d = _directives(r.unit.text)
    assert r.argv[r.argv.index("--shutdown-timeout") + 1] == str(m.vllm.shutdown_timeout)
    assert d["KillMode"] == ["mixed"] and d["SendSIGKILL"] == ["yes"]
    assert int(d["TimeoutStopSec"][0]) > m.vllm.shutdown_timeout + 30      # the drain, then the teardown
    assert "nvidia-persistenced.service" in d["Wants"][0] and "nvidia-persistenced.service" in d["After"][0]
    assert d["CacheDirectory"] == ["vllm-orch"]
    env = " ".join(d["Environment"])
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        assert f"{var}=%C/vllm-orch" in env
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in r.env_file.text.splitlines()
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in render(m, PROCESS_HOST).env_file.text.splitlines()


def test_health_timer_and_check_are_rendered_with_the_service():
    m = MODELS["minimax-m25"]
    r = render(m, SYSTEMD_HOST)
    paths = [f.path for f in r.files]
    service = "/etc/systemd/system/vllm-minimax-m25-health.service"
    timer = "/etc/systemd/system/vllm-minimax-m25-health.timer"
    assert service in paths and timer in paths
    assert "vllm-minimax-m25-health.timer" in _directives(r.unit.text)["Wants"][0]
    t = _directives(next(f for f in r.extra if f.path == timer).text)
    assert t["PartOf"] == [m.unit_name] and t["OnUnitActiveSec"] == [str(m.probes.health_interval_seconds)]
    c = _directives(next(f for f in r.extra if f.path == service).text)
    words = c["ExecStart"][0].split()
    assert words[1:4] == ["-I", "/var/lib/vllm-orch/bin/vllm-orch-probe.py", "check"]
    assert words[words.index("--failures") + 1] == str(m.probes.health_failures)
    # the service user's, without the service's environment: the API key comes as a credential
    assert c["User"] == ["vllm"] and "EnvironmentFile" not in c
    assert c["LoadCredential"] == [f"service-env:{r.env_file.path}"]
    assert c["ExecStopPost"][0].startswith("+/opt/vllm/bin/python -I -S /var/lib/vllm-orch/bin/vllm-orch-probe.py "
                                           "restart ")
    assert render(m, PROCESS_HOST).extra == []                # no units without systemd


def test_shutdown_timeout_needs_a_vllm_that_has_it(tmp_path):
    from orchestrator.errors import ConfigError

    f = tmp_path / "old.yaml"
    f.write_text('source: {repo: a/b}\nserving: {gpus: 1}\nrequires: {min_vllm_version: "0.17.1"}\n')
    with pytest.raises(ConfigError, match="shutdown-timeout needs vLLM >= 0.18.0"):
        load_manifest(f)
    f.write_text('source: {repo: a/b}\nserving: {gpus: 1}\nvllm: {shutdown_timeout: 0}\n'
                 'requires: {min_vllm_version: "0.17.1"}\n')
    assert "--shutdown-timeout" not in render(load_manifest(f), SYSTEMD_HOST).argv


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
    assert env_value("it's") == '"it\'s"' and env_value("it's $X") == '"it\'s \\$X"'
    with pytest.raises(ValueError):
        env_value("a\nb")


@pytest.mark.parametrize("value", ["it's", "a'b\"c", "$HOME 'x' `id` \\n", "plain", "with space"])
def test_a_secret_with_quotes_is_written_so_sh_reads_it_back_exactly(value):
    """A secret holding `'` made render raise ValueError: exit 1, "internal error". It is written in
    double quotes with sh's (and systemd's env-file parser's) four escapes; sh and read_env_values
    (regen's reader of an installed env file) read the exact value back."""
    import subprocess

    m = MODELS["example"]
    r = render(m, SYSTEMD_HOST, secrets={"HF_TOKEN": Secret(value)})
    text = r.env_file.data().decode()
    assert read_env_values(text)["HF_TOKEN"] == value
    out = subprocess.run(["sh", "-c", '. /dev/stdin; printf %s "$HF_TOKEN"'], input=text, capture_output=True,
                         text=True, check=True).stdout
    assert out == value


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
    # the only specifier left is the template's own %C (the cache folder systemd makes), never a value
    assert not [l for l in unit.splitlines() if not l.startswith("#") and "%" in l.replace("%%", "").replace("%C/", "")]


def test_percent_in_inventory_paths_reaches_no_unit_of_the_service_as_a_specifier():
    """The health unit's EnvironmentFile= lacked the `%` doubling the service's unit had; every
    unit of a service (the health check with its credential and state folder, the head watch)
    names the folders that were written."""
    from orchestrator.config.placement import node_roles

    host = HostEntry(name="gpu1", address="10.0.0.1", env_dir="/etc/v%n", state_dir="/var/lib/o%i/state")
    r = render(MODELS["example"], host)
    health = next(f for f in r.extra if f.path.endswith("-health.service")).text
    assert "LoadCredential=service-env:/etc/v%%n/example.env" in health
    assert "/var/lib/o%%i/state/health" in health and "/var/lib/o%%i/bin/vllm-orch-probe.py" in health
    m = MODELS["kimi-k25-int4-2node"]
    hosts = [host, HostEntry(name="gpu2", address="10.0.0.2", env_dir="/etc/v%n", state_dir="/var/lib/o%i/state")]
    watch = render(m, hosts[1], role=node_roles(m, hosts)[1]).extra[0].text
    for text in (health, watch, r.unit.text):
        assert not [l for l in text.splitlines() if not l.startswith("#")
                    and "%" in l.replace("%%", "").replace("%C/", "")], text


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_process_hosts_start_script_reads_the_env_file_only_after_dropping_to_the_service_user(tmp_path):
    """The start script sourced the env file as root, then dropped to the service user: what the file
    makes a shell do (LD_AUDIT / LD_LIBRARY_PATH for root's setpriv, any expansion) ran as root. Now
    root only opens it; the service user's shell reads it."""
    import pwd
    import subprocess
    import tempfile

    (tmp_path / "models" / "example").mkdir(parents=True)
    shared = Path(tempfile.mkdtemp(prefix="vllm-orch-who-", dir="/tmp"))     # tmp_path is root's 0700
    shared.chmod(0o755)
    out = shared / "who"
    out.touch()
    out.chmod(0o666)
    host = HostEntry(name="p", address="local", service_manager="process", models_root=str(tmp_path / "models"),
                     units_dir=str(tmp_path / "units"), state_dir=str(tmp_path / "state"), vllm="/bin/true",
                     service_user="nobody")
    r = render(MODELS["example"], host)
    (tmp_path / "units").mkdir()
    env = tmp_path / "units" / "vllm-example.env"
    env.write_bytes(r.env_file.data() + f"id -u >> {out}\n".encode())    # what the file makes a shell do
    env.chmod(0o600)
    script = tmp_path / "units" / "start.sh"
    script.write_text(r.unit.text)
    try:
        subprocess.run(["sh", str(script)], check=True, timeout=30)
        assert out.read_text().split() == [str(pwd.getpwnam("nobody").pw_uid)]
    finally:
        shutil.rmtree(shared)
    assert env.stat().st_uid == 0 and env.stat().st_mode & 0o777 == 0o600      # still root's, 0600


def _sleepy(host: HostEntry):
    data = MODELS["tiny-llama-a"].model_dump()
    data["sleep"] = {"level": 1}
    return render(type(MODELS["tiny-llama-a"]).model_validate(data), host)


def test_a_sleep_capable_unit_guards_its_dev_endpoints_as_root_and_unguards_at_stop():
    """VLLM_SERVER_DEV_MODE=1 opens /sleep, /wake_up, /collective_rpc outside --api-key: the unit's
    root part (+) installs the service's own nftables table before vLLM starts (a failure fails the
    start) and deletes it after every stop (`-`: none left is fine). A service without sleep has none."""
    r = _sleepy(SYSTEMD_HOST)
    lines = r.unit.text.splitlines()
    pre = [l for l in lines if l.startswith("ExecStartPre=")]
    post = [l for l in lines if l.startswith("ExecStopPost=")]
    assert len(pre) == 1 and pre[0].startswith("ExecStartPre=+nft ") and "ExecStartPre=+-" not in pre[0]
    words = shlex.split(pre[0].split("=", 1)[1][1:])
    assert words[0] == "nft" and len(words) == 2
    port = r.manifest.serving.port
    assert f"oif lo tcp dport {port} meta skuid != {{ 0, \"vllm\" }} reject with tcp reset" in words[1], words
    assert words[1].count("table inet vllm_orch_tiny_llama_a") == 3 and "flush" not in words[1]
    assert post == ["ExecStopPost=+-nft \"delete table inet vllm_orch_tiny_llama_a\""], post
    plain = render(MODELS["tiny-llama-a"], SYSTEMD_HOST).unit.text
    assert "nft" not in plain
    if not unitcheck.available():
        ok, err = _verify(r)
        assert ok, err
    if os.geteuid() == 0 and shutil.which("nft") and shutil.which("unshare"):
        # the rendered rules load with the real nft (in a network namespace of their own), twice (a restart)
        out = subprocess.run(["unshare", "--net", "sh", "-c", 'nft "$1" && nft "$1" && nft list ruleset', "sh",
                              words[1].replace('"vllm"', '"nobody"')], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("reject with tcp reset") == 1, out.stdout


def test_a_sleep_capable_process_script_refuses_without_root_or_nft():
    text = _sleepy(PROCESS_HOST).unit.text
    assert 'if [ "$(id -u)" != 0 ]; then' in text and "exit 3" in text
    assert "command -v nft" in text and "\"$uid\"" in text
    assert "nft" not in render(MODELS["tiny-llama-a"], PROCESS_HOST).unit.text


def test_a_host_with_dev_guard_off_renders_no_guard():
    """inventory dev_guard: false (a SIMULATED host of a non-root user: nft needs root) renders
    neither the unit's nft lines nor the process script's root-only guard; preflight says so."""
    off = SYSTEMD_HOST.model_copy(update={"dev_guard": False})
    assert "nft" not in _sleepy(off).unit.text
    proc = HostEntry(name="p", address="127.0.0.1", service_manager="process", dev_guard=False)
    assert "nft" not in _sleepy(proc).unit.text
    assert "nft" in _sleepy(HostEntry(name="p", address="127.0.0.1", service_manager="process")).unit.text
