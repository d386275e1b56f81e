"""`./dev demo`: the main job, end to end, on a fresh SIMULATED GPU host.

Runs the real CLI, step by step: start a simulated 8x RTX PRO 6000 host (fake vLLM, nvidia-smi and
Hugging Face Hub mirror), print the deploy plan, deploy kimi-k25-int4, deploy it again (nothing to
do), and show the host's status. The simulated host is left running so you can explore; stop it
with `vllm-orch sim down`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

MODEL = os.environ.get("VLLM_ORCH_DEMO_MODEL", "kimi-k25-int4")
SPEED = os.environ.get("VLLM_ORCH_DEMO_SPEED", "200")    # Kimi's 36-minute load takes ~11 s


def step(title: str, *args: str, ok_codes: tuple[int, ...] = (0,)) -> None:
    cmd = [sys.executable, "-m", "orchestrator.cli.main", *args]
    print(f"\n\033[1m=== {title}\033[0m\n$ vllm-orch {' '.join(shlex.quote(a) for a in args)}", flush=True)
    t0 = time.monotonic()
    code = subprocess.call(cmd)
    if code not in ok_codes:
        print(f"demo: `vllm-orch {' '.join(args)}` exited {code}", file=sys.stderr)
        sys.exit(code)
    print(f"({time.monotonic() - t0:.1f}s)", flush=True)


def main() -> None:
    subprocess.call([sys.executable, "-m", "orchestrator.cli.main", "sim", "down"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    step("Start a SIMULATED GPU host", "sim", "up", "--speed", SPEED)
    step("The models vllm-orch ships", "models")
    step(f"What deploying {MODEL} would do (dry run: nothing changes)", "deploy", MODEL, "--host", "sim",
         "--dry-run")
    step(f"Deploy {MODEL}: download + verify, free GPUs, install, start, readiness gates", "deploy", MODEL,
         "--host", "sim")
    step("Deploy again: nothing changed, so nothing to do", "deploy", MODEL, "--host", "sim")
    step("Status of the host", "status", "--host", "sim")
    print("\nNext: `vllm-orch swap kimi-k25-nvfp4 --host sim`, `vllm-orch bench --host sim -c 1,8 "
          "--max-tokens 128 --duration 5`, `vllm-orch sim fault sim --list`, `vllm-orch sim down`.\n"
          "(run them as .venv/bin/vllm-orch, or activate .venv first)")


if __name__ == "__main__":
    main()
