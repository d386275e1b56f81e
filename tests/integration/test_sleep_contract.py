"""The simulated sleep mode is vLLM 0.33.0's, read from its source in the cached parser venv: the
development routes and their methods, /sleep's parameters and the three answers, the pause modes,
the API key's guarded prefixes, VLLM_SERVER_DEV_MODE, and every log line the simulator prints.

The real server cannot be asked: vLLM's CPU build (what tests/integration/test_real_vllm*.py run)
has no sleep mode. `Platform.is_sleep_mode_available` is true for CUDA, ROCm and XPU only, and
ModelConfig refuses --enable-sleep-mode elsewhere ("Sleep mode is not supported on current
platform."); the last test pins that too, so the source is the contract."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.sim import vllm_server as sim


@pytest.fixture(scope="module")
def vllm_src(vllm_parser_python) -> Path:
    found = sorted(Path(vllm_parser_python).parent.parent.glob("lib/python3*/site-packages/vllm"))
    assert found, f"no vllm package beside {vllm_parser_python}"
    return found[0]


def routes(path: Path) -> set:
    return {(p, m.upper()) for m, p in re.findall(r'@router\.(post|get)\("([^"]+)"\)', path.read_text())}


def test_the_dev_routes_are_vllms(vllm_src):
    real: set = set()
    for f in [*(vllm_src / "entrypoints/serve/dev").glob("*/api_router.py"),
              vllm_src / "entrypoints/rl/online/api_router.py"]:
        real |= routes(f)
    assert real == set(sim.DEV_ROUTES)
    # and they are registered only with VLLM_SERVER_DEV_MODE, parsed as bool(int(...))
    registry = (vllm_src / "entrypoints/launchers/api_server/routers.py").read_text()
    assert "if envs.VLLM_SERVER_DEV_MODE:\n        from vllm.entrypoints.serve import register_vllm_dev_api_routers" in registry
    assert '"VLLM_SERVER_DEV_MODE": lambda: bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0")))' in (
        vllm_src / "envs.py").read_text()


def test_the_sleep_endpoints_parameters_and_answers(vllm_src):
    src = (vllm_src / "entrypoints/serve/dev/sleep/api_router.py").read_text()
    assert "level: Annotated[int, Query(ge=0, le=2)] = 1," in src
    assert 'mode: Annotated[PauseMode, Query()] = "abort",' in src
    assert 'return JSONResponse(content={"status": "sleeping", "level": level})' in src
    assert 'tags = raw_request.query_params.getlist("tags")' in src
    assert 'content={"status": "awake" if fully_awake else "sleeping", "tags": tags}' in src
    assert 'return JSONResponse(content={"is_sleeping": is_sleeping})' in src
    modes = re.search(r"PauseMode = Literal\[(.*)\]", (vllm_src / "v1/engine/__init__.py").read_text())
    assert modes and tuple(re.findall(r'"(\w+)"', modes.group(1))) == sim.PAUSE_MODES
    assert 'SLEEP_TAGS = frozenset(("weights", "kv_cache"))' in (vllm_src / "v1/executor/abstract.py").read_text()


def test_a_level_2_wake_is_restored_as_vllm_restores_it(vllm_src):
    """What the simulator and vllm-orch's api.wake do after level 2, pinned to vLLM 0.33's source:
    its own restore wakes the weights, reloads them, then wakes the KV cache; a wake restores only
    the buffers and parameters it saved (the weights' memory comes back unfilled); /collective_rpc
    takes {"method": ...} and answers {"results": [...]} (one per worker), 400 without a method."""
    restore = (vllm_src / "snapshot/server.py").read_text()
    assert ('    await engine.wake_up(tags=["weights"])\n    await engine.collective_rpc("reload_weights")\n'
            '    await engine.wake_up(tags=["kv_cache"])') in restore
    assert "    await engine.sleep(level=2)" in restore
    worker = (vllm_src / "v1/worker/gpu_worker.py").read_text()
    assert "    def reload_weights(self, *args, **kwargs) -> None:" in worker
    assert "        # Restore the buffers after level 2 sleep" in worker
    rpc = (vllm_src / "entrypoints/serve/dev/rpc/api_router.py").read_text()
    assert '@router.post("/collective_rpc")' in rpc
    assert 'method = body.get("method")' in rpc and "Missing 'method' in request body" in rpc
    assert 'return JSONResponse(content={"results": response})' in rpc
    # vllm:engine_sleep_state: awake 0 from the sleep on, weights_offloaded (1) or discard_all (2);
    # awake 1 again only after a wake that left no tag asleep (the simulator's Engine.sleep_state)
    loggers = (vllm_src / "v1/metrics/loggers.py").read_text()
    assert ("        if sleep == 1:\n            awake = 0\n            if level == 1:\n                weights_offloaded = 1\n"
            "            elif level == 2:\n                discard_all = 1\n") in loggers
    async_llm = (vllm_src / "v1/engine/async_llm.py").read_text()
    assert ("        if self.logger_manager is not None and fully_awake:\n"
            "            self.logger_manager.record_sleep_state(0, 0)") in async_llm
    assert "            self.logger_manager.record_sleep_state(1, level)" in async_llm
    core = (vllm_src / "v1/engine/core.py").read_text()
    assert "        fully_awake = not self.model_executor.is_sleeping\n        if fully_awake:\n" in core


def test_the_api_key_guards_only_these_prefixes(vllm_src):
    src = (vllm_src / "entrypoints/serve/middleware/authenticate.py").read_text()
    m = re.search(r"GUARDED_PREFIX = (\(.*\))", src)
    assert m and eval(m.group(1)) == sim.GUARDED_PREFIX           # noqa: S307 (a literal tuple)
    assert not any(p.startswith(sim.GUARDED_PREFIX) for p, _ in sim.DEV_ROUTES)


@pytest.mark.parametrize("where", sorted(sim.SLEEP_LOG_SOURCES))
def test_every_sleep_log_line_is_at_its_place_in_the_source(vllm_src, where):
    rel, fmt = sim.SLEEP_LOG_SOURCES[where]
    line = int(where.rsplit(":", 1)[1])
    lines = (vllm_src / rel).read_text().splitlines()
    assert Path(rel).name == where.rsplit(":", 1)[0]
    near = "\n".join(lines[line - 1:line + 3])
    assert fmt in near, f"{rel}:{line}: {fmt!r} not in\n{near}"


def test_the_cpu_build_has_no_sleep_mode(vllm_src):
    src = (vllm_src / "platforms/interface.py").read_text()
    assert "return self._enum in (PlatformEnum.CUDA, PlatformEnum.ROCM, PlatformEnum.XPU)" in src
    assert '"Sleep mode is not supported on current platform."' in (vllm_src / "config/model.py").read_text()
    assert "def is_sleep_mode_available" not in (vllm_src / "platforms/cpu.py").read_text()
