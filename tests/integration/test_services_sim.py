"""Several services on one SIMULATED host, on disjoint GPUs and ports: deploy both, status has a
row each, swap one with --replace while a probe loop against the other sees no failed request,
stop one while the other still serves; a host from before services/NAME.json (one active.json)
keeps working and is upgraded in place."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Request
from orchestrator.host.state import read_history, read_records
from orchestrator.ops.status import host_status
from orchestrator.ops.stop import stop_model
from orchestrator.probe.api import Endpoint, health, served_models

from .deployhelp import SHIPPED, cli_env, deploy, entry, free_port, swap, write_models

MM = "minimax-m25"             # TP4: GPUs 0-3 by its manifest


def copy_of(name: str, as_name: str, port: int) -> Manifest:
    """Another service of the same weights under its own name (its own unit, records, folder)."""
    data = SHIPPED[name].model_dump()
    data["name"], data["serving"]["port"], data["serving"]["served_model_name"] = as_name, port, as_name
    return Manifest.model_validate(data)


def placed(gpus: list[int], port: int, name: str | None = None) -> Request:
    """`deploy M --gpus ... --port ... [--name NAME]`."""
    return Request(name, tuple(gpus), port)


class ProbeLoop(threading.Thread):
    """/health and /v1/models of one service, as fast as they answer, until stopped."""

    def __init__(self, ep: Endpoint, served: str):
        super().__init__(daemon=True)
        self.ep, self.served, self.ok, self.failed = ep, served, 0, []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                good = health(self.ep, timeout=5) == 200 and self.served in served_models(self.ep, timeout=5)
            except Exception as exc:            # any failure is what this loop is here to see
                good, exc_text = False, repr(exc)
            else:
                exc_text = "health or model list wrong"
            if good:
                self.ok += 1
            else:
                self.failed.append((time.time(), exc_text))
            time.sleep(0.05)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


@pytest.fixture
def two(sim_host):
    """minimax-m25 on GPUs 0-3, and the same model again as the service mm-b on GPUs 4-7
    (`deploy minimax-m25 --name mm-b --gpus 4-7 --port PB`): one weights folder, two services."""
    e = entry(sim_host)
    a = copy_of(MM, MM, free_port())
    assert deploy(e, a).ok
    pb = free_port()
    res = deploy(e, a, request=placed([4, 5, 6, 7], pb, "mm-b"))
    assert res.ok, res.error
    assert [d.name for d in (sim_host.dir / "models").iterdir()] == [MM]      # one folder for both
    return e, a, "mm-b", pb


def test_two_services_deploy_show_swap_and_stop_independently(sim_host, two):
    e, a, b, pb = two
    records = {n: r.shown() for n, r in read_records(sim_host.host, e).items()}
    assert sorted(records) == sorted(["mm-b", MM])
    assert records["mm-b"]["gpus"] == [4, 5, 6, 7] and records["mm-b"]["port"] == pb
    assert records["mm-b"]["model"] == MM and records["mm-b"]["service"] == "mm-b"
    assert records[MM]["gpus"] == [0, 1, 2, 3]
    installed = json.loads((Path(e.state_dir) / "installed" / "mm-b.json").read_text())
    assert installed["model"] == MM and (installed["gpus_from"], installed["port_from"]) == ("command line",) * 2

    st = host_status(e)
    rows = {s.name: s for s in st.services}
    assert sorted(rows) == sorted(["mm-b", MM]) and all(s.state == "ready" for s in rows.values()), \
        [(s.name, s.state, s.state_reason) for s in st.services]
    assert rows["mm-b"].port == pb and rows["mm-b"].gpus == [4, 5, 6, 7]

    # Per-service commands ask which service on a host with several (exit 2, naming them).
    env = cli_env(sim_host, write_models(sim_host.dir.parent / "models-cli", [a]))
    for args in (["stop", "--host", "sim", "--dry-run"], ["logs", "--host", "sim", "-n", "1"],
                 ["history", "--host", "sim"], ["bench", "--host", "sim", "--duration", "1"]):
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "(minimax-m25, mm-b)" in r.stderr, (args, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "history", "mm-b", "--host", "sim", "--json"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and {rec["service"] for rec in json.loads(r.stdout)} == {"mm-b"}, r.stderr
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "status", "--host", "sim"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "mm-b" in r.stdout and "GPUs 4-7" in r.stdout, r.stdout + r.stderr

    # A third placement on a taken GPU is refused before anything, naming the service.
    c = copy_of(MM, "mm-c", free_port())
    refused = deploy(e, c, request=placed([2, 3, 4, 5], free_port()))
    assert not refused.ok and refused.error.exit_code == 3 and "takes GPU" in refused.error.message
    assert "mm-c" not in read_records(sim_host.host, e)

    # Swap mm-b for mm-c (another model: it takes mm-b's GPUs and port) while a probe loop hits
    # minimax-m25; mm-b's record is rebuilt from its model's manifest and its recorded placement.
    loop = ProbeLoop(Endpoint(sim_host.host, a.serving.port), a.served_name)
    loop.start()
    try:
        time.sleep(0.3)
        res = swap(e, c, {a.name: a, c.name: c}, replace="mm-b")
        time.sleep(0.3)
    finally:
        loop.stop()
    assert res.ok, res.error
    assert loop.ok > 5 and loop.failed == [], loop.failed[:3]
    records = {n: r.shown() for n, r in read_records(sim_host.host, e).items()}
    assert sorted(records) == sorted(["mm-c", MM])
    assert records["mm-c"]["gpus"] == [4, 5, 6, 7] and records["mm-c"]["port"] == pb
    assert health(Endpoint(sim_host.host, pb)) == 200
    last = read_history(sim_host.host, e)[-1].shown()
    assert last["operation"] == "swap" and last["from"] == "mm-b" and last["service"] == "mm-c"

    # Without --replace on a host with several services: asked for it, nothing touched.
    with pytest.raises(Exception) as err:
        swap(e, a, {a.name: a, c.name: c}, request=Request(b))
    assert getattr(err.value, "exit_code", None) == 2 and "--replace" in str(err.value)

    # Stop one: the other still serves, and its processes were not touched.
    before = {p["pid"] for p in host_status(e).gpu_processes if p["owner"] == MM}
    stopped = stop_model(sim_host.host, e, "mm-c", release_timeout=30, poll=0.1)
    assert stopped.ok and stopped.gpus == [4, 5, 6, 7]
    st = host_status(e)
    assert [s.name for s in st.services] == [MM] and st.state == "ready"
    assert {p["pid"] for p in st.gpu_processes if p["owner"] == MM} == before
    assert health(Endpoint(sim_host.host, a.serving.port)) == 200


def test_a_host_with_the_previous_layout_keeps_working_and_is_upgraded(sim_host):
    e = entry(sim_host)
    a = copy_of(MM, MM, free_port())
    assert deploy(e, a).ok
    root = Path(e.state_dir)
    # Put the host back as the previous version left it: one active.json, no services/ folder.
    record = json.loads((root / "services" / f"{MM}.json").read_text())
    (root / "services" / f"{MM}.json").unlink()
    (root / "services").rmdir()
    (root / "active.json").write_text(json.dumps(record))

    st = host_status(e)                             # read as before, nothing written
    assert (st.state, st.active_model, st.port) == ("ready", MM, a.serving.port)
    assert [s.name for s in st.services] == [MM] and (root / "active.json").exists()

    # A swap without --replace on a one-service host behaves as before, and upgrades the record.
    n = copy_of(MM, "mm-n", a.serving.port)
    res = swap(e, n, {a.name: a, n.name: n})
    assert res.ok, res.error
    assert not (root / "active.json").exists()
    assert sorted(read_records(sim_host.host, e)) == ["mm-n"]
    stopped = stop_model(sim_host.host, e, "mm-n", release_timeout=30, poll=0.1)
    assert stopped.ok and stopped.cleared_active and read_records(sim_host.host, e) == {}


def test_check_refuses_the_placement_deploy_refuses(sim_host, tmp_path):
    # `check` exited 0 for a model whose deploy is refused at once because another service holds
    # its GPUs: a passing check must mean the deploy is not refused there.
    from .deployhelp import SHIPPED, cli_env, deploy, entry, write_models

    old, new = SHIPPED["kimi-k25-int4"], SHIPPED["kimi-k25-nvfp4"]
    assert deploy(entry(sim_host), old).ok
    env = cli_env(sim_host, write_models(tmp_path / "models", [old, new]))
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "check", new.name, "--host", "sim"],
                         env=dict(env, COLUMNS="200"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "placement: kimi-k25-int4 already takes GPUs" in run.stdout, run.stdout
    again = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "check", old.name, "--host", "sim"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr          # its own placement is no clash
