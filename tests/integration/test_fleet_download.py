"""Download once per fleet (issue 43): `deploy --group` over three SIMULATED hosts fetches the
checkpoint from the Hub on one host only; the others copy it from that one over the LAN
(serve_weights.py on the holder, download.py --peer on the copier), each file checked against the
Hub's own sha256 while it streams. A holder whose file has other bytes than its record says (same
size, same mtime: the record trusts it) does not spread them: the copier refetches that one file
from the Hub. The holder serves nothing without its token and nothing outside its record."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.host.download import Serving
from orchestrator.host.local import LocalHost
from orchestrator.sim import manager
from tests.plugins.sim_hosts import TEST_SPEED

from .deployhelp import tuned, write_models

REPO = Path(__file__).resolve().parents[2]
MODEL = "minimax-m25"


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    """Three fresh SIMULATED hosts and an inventory whose group `fleet` names them."""
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(3, speed=TEST_SPEED, home=home)
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump({"groups": {"fleet": ["sim", "sim-2", "sim-3"], "pair": ["sim", "sim-2"]}}))
    models = write_models(tmp_path / "models", [tuned(MODEL)])          # a free port (sim hosts share this machine)
    env = dict(os.environ, VLLM_ORCH_STATE_HOME=str(tmp_path / "state"), VLLM_ORCH_MODELS=str(models))
    try:
        yield home, inv, env
    finally:
        manager.down(home)


def cli(env, inv, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "--inventory", str(inv), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))


def file_gets(home, host: str) -> list[str]:
    """The files (not the metadata) the host's simulated Hub served."""
    log = manager.host_dir(host, home) / "hub-requests.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return [r["path"].rsplit("/", 1)[-1] for r in lines if "/resolve/" in r["path"] and r["status"] in (200, 206)]


def weights(home, host: str) -> Path:
    return manager.host_dir(host, home) / "models" / MODEL


def record(home, host: str) -> dict:
    return json.loads((weights(home, host) / ".vllm-orch" / "verified.json").read_text())


def test_a_fleet_deploy_fetches_the_checkpoint_from_the_hub_once_and_the_others_copy_it(fleet):
    home, inv, env = fleet
    r = cli(env, inv, "deploy", MODEL, "--group", "fleet", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    gets = {h: file_gets(home, h) for h in ("sim", "sim-2", "sim-3")}
    fetched = [h for h, g in gets.items() if g]
    assert len(fetched) == 1, {h: len(g) for h, g in gets.items()}       # one host went to the Hub for the files
    files = record(home, fetched[0])["files"]
    assert sorted(set(gets[fetched[0]])) == sorted(Path(n).name for n in files)
    for h in gets:                                                       # every host holds the same verified bytes
        rec = record(home, h)
        assert rec["complete"] and {n: f["sha256"] for n, f in rec["files"].items()} == \
            {n: f["sha256"] for n, f in files.items()}
        for name, f in rec["files"].items():
            assert hashlib.sha256((weights(home, h) / name).read_bytes()).hexdigest() == f["sha256"]


def test_a_holder_with_other_bytes_than_its_record_does_not_spread_them(fleet):
    home, inv, env = fleet
    r = cli(env, inv, "deploy", MODEL, "--host", "sim")
    assert r.returncode == 0, r.stdout + r.stderr
    shard = sorted(p for p in weights(home, "sim").glob("*.safetensors"))[0]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))                     # same size, same mtime: sim's record still trusts it
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = cli(env, inv, "deploy", MODEL, "--group", "pair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert file_gets(home, "sim-2") == [shard.name]       # copied from sim, but that shard from the Hub
    good = record(home, "sim")["files"][shard.name]["sha256"]
    assert hashlib.sha256((weights(home, "sim-2") / shard.name).read_bytes()).hexdigest() == good


def test_the_holder_serves_only_its_records_files_and_only_with_its_token(fleet):
    home, inv, env = fleet
    r = cli(env, inv, "deploy", MODEL, "--host", "sim")
    assert r.returncode == 0, r.stdout + r.stderr
    entry = HostEntry.model_validate({**manager.inventory_hosts(home)["sim"], "name": "sim"})
    (weights(home, "sim") / "secret.txt").write_text("not in the record\n")
    serving = Serving(LocalHost("sim"), entry, str(weights(home, "sim")), "127.0.0.1")
    try:
        url, token = serving.peer.url, serving.peer.token.reveal()
        name = next(iter(record(home, "sim")["files"]))

        def get(path: str, auth: str | None) -> int:
            req = urllib.request.Request(f"{url}/{path}", headers={"Authorization": auth} if auth else {})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert get(name, f"Bearer {token}") == 200
        assert get(name, None) == 401 and get(name, "Bearer " + "x" * len(token)) == 401
        for path in ("secret.txt", ".vllm-orch/verified.json", "../../state/hosts.d/sim.yaml", "%2e%2e/sim.json"):
            assert get(path, f"Bearer {token}") == 404, path
        token_files = list((Path(entry.state_dir) / "secrets").glob("peer-token-*"))
        assert not token_files                         # read and removed by the server
    finally:
        serving.close()
