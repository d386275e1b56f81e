"""Preflight's parser check (argcheck.py, which imports vLLM: seconds on a CPU build, tens on a GPU
host) reuses the answer an engine venv kept for the same command line and venv, on a SIMULATED host
with venvs the REAL uv builds from simulated wheels (orchestrator/sim/engines.py). Each argcheck run
imports the simulated vllm as `python - '<request>'`, which logs it (logs/sim-vllm-imports.jsonl):
the tests count those runs. A second deploy runs none; a changed flag, a reinstalled vLLM, a garbled
or copied answer file and --verify-engine run it again; a venv removed and rebuilt at the same path
never trusts an answer its predecessor kept."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.errors import RefusedError
from orchestrator.host import engine as host_engine
from orchestrator.host.remote import engine as remote_engine
from orchestrator.plan.preflight import REUSED
from orchestrator.sim import engines as sim_engines

from .deployhelp import deploy, statuses
from .test_engines_sim import UV, venv_of, with_engine
from .test_engines_sim import host_entry as engines_entry

pytestmark = pytest.mark.skipif(UV is None, reason="uv is in the dev extra: ./dev test installs it")
KEPT = remote_engine.ARGCHECK


@pytest.fixture
def house(tmp_path) -> Path:
    """The controller's wheelhouse: a simulated vLLM 0.33.0, torch, flashinfer 0.6.14."""
    return sim_engines.wheelhouse(tmp_path / "wheelhouse", ("0.33.0",))


def host_entry(sim_host, wheels: Path):
    """The engines' host, with the parser checks on: the simulated venvs answer argcheck.py (a
    simulated host skips them by default: its own Python has no vLLM to parse with)."""
    e = engines_entry(sim_host, wheels)
    return e.model_copy(update={"skip_checks": [c for c in e.skip_checks if c not in ("flags", "env")]})


def argcheck_runs(sim_host) -> int:
    """argcheck.py runs in the host's simulated venvs: `python -` with the request as its argument."""
    path = sim_host.dir / "logs" / sim_engines.IMPORTS
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sum(1 for x in lines if x["argv"][:1] == ["-"])


def flags_line(res) -> str:
    return next(line for line in res.plan.text().splitlines() if "flags" in line)


def test_a_redeploy_reuses_the_parser_answer_and_a_change_of_flag_venv_or_file_asks_again(sim_host, house):
    e = host_entry(sim_host, house)
    m = with_engine("0.33.0")
    res = deploy(e, m)
    assert res.ok, res.error
    assert argcheck_runs(sim_host) == 1                   # the engine step asked the venv it built
    venv = venv_of(sim_host, m)
    assert (venv / KEPT).stat().st_mode & 0o777 == 0o644

    def redeploy(m, ran: int, **kw):
        before = argcheck_runs(sim_host)
        res = deploy(e, m, **kw)
        assert argcheck_runs(sim_host) == before + ran, res.plan.text() if res.plan else res.error
        return res

    res = redeploy(m, 0)                                  # the second deploy imports vLLM for no parser check
    assert res.ok and statuses(res)["engine"] == "skipped", res.error
    assert REUSED in flags_line(res), res.plan.text()
    assert REUSED in redeploy(m, 0, dry_run=True).plan.text()

    # a changed flag: asked again, and kept for next time
    moved = m.model_copy(deep=True)
    moved.vllm.max_num_seqs = (m.vllm.max_num_seqs or 128) + 1
    res = redeploy(moved, 1, dry_run=True)
    assert res.ok and REUSED not in flags_line(res), res.error
    assert REUSED in flags_line(redeploy(moved, 0, dry_run=True))

    # a flag vLLM 0.33 removed (--swap-space, gone since 0.18): asked, refused exactly (exit 3, naming
    # it), and a refused answer is never kept
    removed = m.model_copy(deep=True)
    removed.vllm.extra_args = [*m.vllm.extra_args, "--swap-space", "4"]
    for _ in range(2):
        res = redeploy(removed, 1)
        assert not res.ok and isinstance(res.error, RefusedError) and res.error.exit_code == 3, res.error
        assert "vLLM 0.33.0 rejects it: unrecognized arguments: --swap-space 4" in flags_line(res), res.plan.text()

    # --verify-engine asks the parser too (and keeps its answer)
    assert redeploy(m, 1, dry_run=True, verify_engine=True).ok
    assert REUSED in flags_line(redeploy(m, 0, dry_run=True))

    # a garbled or foreign answer file is an answer not found: asked again, never an error
    (venv / KEPT).write_text('{"answers": {"x": ')
    assert redeploy(m, 1, dry_run=True).ok
    os.chmod(venv / KEPT, 0o666)                          # writable by others: not ours to trust
    assert redeploy(m, 1, dry_run=True).ok
    assert REUSED in flags_line(redeploy(m, 0, dry_run=True))

    # vLLM reinstalled in the venv by the real uv: a changed fingerprint asks again
    subprocess.run([UV, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--reinstall-package",
                    "vllm", "--offline", "--no-index", "--find-links", str(house), "vllm==0.33.0"], check=True,
                   env=dict(os.environ, UV_CACHE_DIR=str(sim_host.dir / "engines" / ".uv-cache"), UV_NO_CONFIG="1"))
    res = redeploy(m, 1, dry_run=True)
    assert res.ok and REUSED not in flags_line(res)
    assert REUSED in flags_line(redeploy(m, 0, dry_run=True))


def test_a_venv_rebuilt_at_the_same_path_never_trusts_the_answer_its_predecessor_kept(sim_host, house):
    e = host_entry(sim_host, house)
    m = with_engine("0.33.0")
    assert deploy(e, m).ok
    venv = venv_of(sim_host, m)
    kept = (venv / KEPT).read_bytes()
    verdict = (venv / remote_engine.VERDICT).read_bytes()
    assert host_engine.remove(sim_host.host, e, venv.name) is None      # gc's guarded removal
    assert not venv.exists()
    runs = argcheck_runs(sim_host)
    res = deploy(e, m)                                    # rebuilt at the same path
    assert res.ok and statuses(res)["engine"] == "done", res.error
    assert argcheck_runs(sim_host) == runs + 1
    # the old answer file put back beside a verdict that holds: its key names the old venv's fingerprint
    (venv / KEPT).write_bytes(kept)
    assert json.loads((venv / remote_engine.VERDICT).read_bytes())["fingerprint"] != json.loads(verdict)["fingerprint"]
    runs = argcheck_runs(sim_host)
    res = deploy(e, m, dry_run=True)
    assert res.ok and REUSED not in flags_line(res), res.plan.text()
    assert argcheck_runs(sim_host) == runs + 1


ASKED = [["serve", "org/model", "--max-num-seqs", "8"], ["serve", "org/model", "--swap-space", "4"],
         ["serve", "org/model", "--enable-reasoning"], ["serve", "org/model", "--max_num_seqs", "8", "-tp", "2"]]


@pytest.mark.vllm_parser
def test_a_simulated_engine_venv_answers_argcheck_as_the_real_parser_does(vllm_parser_python, tmp_path):
    """Contract: argcheck.py in a simulated vLLM 0.33.0 (its wheel's files on the path) answers as
    in the real vLLM 0.33.0 (the cached parser venv): accepted, or a removed flag refused with the same
    message. (The simulated parser knows which flags exist, not their values' types: a bad value
    passes it.)"""
    import zipfile

    from orchestrator.host import scripts
    from orchestrator.host.local import LocalHost

    wheel = sim_engines.vllm_wheel(tmp_path / "wheels", "0.33.0")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    request = json.dumps({"batch": [{"argv": a, "env": {}} for a in ASKED]})
    host = LocalHost("controller")

    def answers(python: str, **env: str) -> list[tuple]:
        cmd = scripts.command(python, "argcheck.py", [request])
        result = host.run(cmd, input=scripts.source("argcheck.py"), timeout=300, env=env)
        out = json.loads(result.stdout.strip().splitlines()[-1])
        return [(r["ok"], r["error"], r.get("error_line"), r["bad_args"]) for r in out["results"]]

    real = answers(str(vllm_parser_python))
    sim = answers(os.sys.executable, PYTHONPATH=str(tmp_path / "site"), VLLM_SIM_HOST_DIR=str(tmp_path))
    assert real[0][0] is True and real[1][2] == "vllm: error: unrecognized arguments: --swap-space 4", real
    assert sim == real
