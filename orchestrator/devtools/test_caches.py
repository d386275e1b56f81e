"""Build the test suite's one-time caches before the tests run, all at once, and say what each cost.

    python -m orchestrator.devtools.test_caches            # what the whole suite needs
    python -m orchestrator.devtools.test_caches parser     # only some: parser, vllm, ray, tree

Why here and not in a test fixture: `./dev test` runs the tests in parallel workers, each in its own
network namespace with nothing but a loopback (tests/plugins/netns-python), so no worker can reach a
package index; and four builders running in four workers' first tests would fight over two cores
while the rest of the suite waits behind them. Built here, in parallel threads (each build is pip or
debootstrap in a subprocess), once per machine and recipe; afterwards every line says "cached".

    parser   vLLM 0.33.0's argument parser (devtools/vllm_parser_venv.py)      ~1.5 min, 2.5 GiB
    vllm     vLLM's CPU build, a real server (devtools/real_vllm_venv.py)     ~2.5 min, 3.2 GiB
    ray      a real Ray (devtools/ray_venv.py)                                ~0.5 min, 0.4 GiB
    tree     the Debian tree real-systemd test hosts boot (sim/nspawn_tree.py; root only) ~1 min

Exit 1 when a build fails in CI (CI=true), where a missing cache must fail the run instead of
turning tests into skips; elsewhere a build that cannot reach a package index is reported and the
tests that need it skip, saying why.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator.devtools import cached_venv

NAMES = ("parser", "vllm", "ray", "tree")


def _parser() -> str:
    from orchestrator.devtools import vllm_parser_venv
    return _venv_line(vllm_parser_venv.ensure_venv())


def _vllm() -> str:
    from orchestrator.devtools import real_vllm_venv
    return _venv_line(real_vllm_venv.ensure_venv())


def _ray() -> str:
    from orchestrator.devtools import ray_venv
    return _venv_line(ray_venv.ensure_venv())


def _tree() -> str:
    from orchestrator.sim import nspawn_tree
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        return "not needed here (real-systemd hosts need root and debootstrap)"
    cache = Path(os.environ.get("VLLM_ORCH_NSPAWN_CACHE", nspawn_tree.DEFAULT_CACHE_DIR))
    t0 = time.monotonic()
    tree = nspawn_tree.ensure_tree(cache, log=lambda _msg: None)
    seconds = time.monotonic() - t0
    return f"built in {seconds:.0f} s: {tree}" if seconds > 5 else f"cached: {tree}"


def _venv_line(info: cached_venv.BuildInfo) -> str:
    size = f"{info.size_bytes / (1 << 30):.2f} GiB"
    if info.built_now:
        return f"built in {info.seconds:.0f} s ({size}): {info.python.parent.parent}"
    return f"cached ({size}, built in {info.seconds:.0f} s once): {info.python.parent.parent}"


BUILDERS: dict[str, Callable[[], str]] = {"parser": _parser, "vllm": _vllm, "ray": _ray, "tree": _tree}


def build(names: list[str], out=sys.stderr) -> bool:
    """Build the named caches in parallel; one line each; False when one failed."""
    t0 = time.monotonic()
    ok = True

    def one(name: str) -> tuple[str, str, bool]:
        started = time.monotonic()
        try:
            return name, BUILDERS[name](), True
        except cached_venv.BuildError as exc:
            where = " (no package index reachable: the tests that need it skip)" if exc.offline else ""
            return name, f"FAILED after {time.monotonic() - started:.0f} s{where}: {exc}\n{exc.log[-3000:]}", False
        except Exception as exc:           # debootstrap and friends: say it, never hide it
            return name, f"FAILED after {time.monotonic() - started:.0f} s: {type(exc).__name__}: {exc}", False

    with ThreadPoolExecutor(max_workers=len(names) or 1) as pool:
        for name, line, good in pool.map(one, names):
            print(f"test caches: {name}: {line}", file=out)
            ok = ok and good
    print(f"test caches: ready in {time.monotonic() - t0:.0f} s", file=out)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.devtools.test_caches",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"which caches ({', '.join(NAMES)}; default: all)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        ap.error(f"unknown cache {unknown[0]!r}: choose from {', '.join(NAMES)}")
    ok = build(list(args.names or NAMES))
    return 0 if ok or not cached_venv.in_ci() else 1


if __name__ == "__main__":
    sys.exit(main())
