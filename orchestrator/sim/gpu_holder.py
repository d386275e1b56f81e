#!/usr/bin/env python3
"""SIMULATED GPU-holding vLLM process (an EngineCore, a Worker_TP<n>, an API server), started by the
simulated vLLM server (vllm_server.py, beside this file) as `[TITLE, this file]` with
VLLM_SIM_HOLDER_TITLE=TITLE and VLLM_SIM_HOST_DIR in its environment.

It takes its title (argv[0] and PR_SET_NAME, as vLLM's workers call setproctitle before they touch a
GPU), then waits. SIGTERM: it removes its GPU registry entries (gpu-procs/<pid>-*.json) and exits.
A holder outlives a killed parent, as real orphaned workers do, unless VLLM_SIM_EXIT_WITH_PARENT=1
(an engine core or API server without GPU memory). Self-contained, stdlib only: it starts in a few
milliseconds, and a deploy starts eight or more.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

HOST_DIR = Path(os.environ.get("VLLM_SIM_HOST_DIR") or Path(__file__).resolve().parent.parent)


def holder_main() -> None:
    """A GPU-holding worker: renames itself, then waits. SIGTERM: unregister and exit."""
    title = os.environ.get("VLLM_SIM_HOLDER_TITLE", "VLLM::Worker")
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError, TypeError):
        pass

    def stop(*_):
        for f in (HOST_DIR / "gpu-procs").glob(f"{os.getpid()}-*.json"):
            try:
                f.unlink()
            except OSError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The spawner's PID, from the spawner: reading getppid() here would race with a parent killed
    # before this interpreter got this far (then the holder never notices it is orphaned).
    parent = int(os.environ.get("VLLM_SIM_PARENT_PID") or os.getppid())
    exit_with_parent = os.environ.get("VLLM_SIM_EXIT_WITH_PARENT") == "1"
    while True:   # GPU holders outlive a killed parent (like real orphaned workers); an engine
        time.sleep(0.5 if exit_with_parent else 3600)   # core without GPU memory does not
        if exit_with_parent and os.getppid() != parent:
            stop()


if __name__ == "__main__":
    holder_main()
