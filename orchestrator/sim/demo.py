"""`./dev demo`: the main job, end to end, on the built-in SIMULATED GPU host.

Runs the real CLI, step by step: start a simulated 8x RTX PRO 6000 host named `sim` (fake vLLM,
nvidia-smi and Hugging Face Hub mirror), print the deploy plan, deploy kimi-k25-int4, deploy it again
(nothing to do), and show the host's status. The simulated host is left running so you can explore;
stop it with `vllm-orch sim down`.

The demo never stops, removes or deletes anything you made: a `sim` host that is already up is used
as it is (its speed, models and records kept). When that host already serves another model, whose
GPUs the demo's deploy would need, the demo says so and stops (exit 3) before changing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time

MODEL = os.environ.get("VLLM_ORCH_DEMO_MODEL", "kimi-k25-int4")
SPEED = os.environ.get("VLLM_ORCH_DEMO_SPEED", "200")    # Kimi's 36-minute load takes ~11 s
HOST = "sim"

NEXT = ("vllm-orch swap kimi-k25-nvfp4 --host sim",
        "vllm-orch bench --host sim -c 1,8 --max-tokens 128 --duration 5",
        "vllm-orch sim down      # stops the simulated hosts and deletes their models and records")

DESCRIPTION = (f"Deploy {MODEL} onto the built-in SIMULATED GPU host `sim`, showing every step: the plan "
               "(dry run), the deploy, a second deploy with nothing to do, the status. Nothing of yours is "
               "stopped, removed or deleted: a `sim` host already up is used as it is, and the host is left "
               "running for you to explore.")

EPILOG = """\
environment:
  VLLM_ORCH_DEMO_MODEL  the manifest to deploy (default kimi-k25-int4; `vllm-orch models` lists them)
  VLLM_ORCH_DEMO_SPEED  how many times faster than the field's 253 MB/s the simulated weights load
                        (default 200: Kimi's 36-minute load takes ~11 s; a host already up keeps its speed)

exit codes: 0 ok, 3 the host `sim` already serves another model (nothing was changed),
            else the exit code of the vllm-orch step that failed.

afterwards:
""" + "".join(f"  {line}\n" for line in NEXT)


def step(title: str, *args: str, ok_codes: tuple[int, ...] = (0,)) -> None:
    cmd = [sys.executable, "-m", "orchestrator.cli.main", *args]
    print(f"\n\033[1m=== {title}\033[0m\n$ vllm-orch {' '.join(shlex.quote(a) for a in args)}", flush=True)
    t0 = time.monotonic()
    code = subprocess.call(cmd)
    if code not in ok_codes:
        print(f"demo: `vllm-orch {' '.join(args)}` exited {code}", file=sys.stderr)
        sys.exit(code)
    print(f"({time.monotonic() - t0:.1f}s)", flush=True)


def others_in_the_way(model: str) -> list[str]:
    """The services host `sim` already runs other than MODEL's (awake or asleep), as `vllm-orch
    status` reports them: the demo's deploy would need their GPUs, and it stops nothing of the user's."""
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "status", "--host", HOST, "--json"],
                         capture_output=True, text=True)
    try:
        rows = json.loads(out.stdout) if out.returncode == 0 else []
    except ValueError:
        rows = []
    return sorted(f"{s['name']} (port {s.get('port')}, {'asleep' if s.get('asleep') else s.get('state')})"
                  for row in rows for s in row.get("services") or [] if s.get("model") != model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="./dev demo", description=textwrap.fill(DESCRIPTION, 100),
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    step("Start a SIMULATED GPU host (kept as it is if already up)", "sim", "up", "--speed", SPEED)
    others = others_in_the_way(MODEL)
    if others:
        print(f"demo: the SIMULATED host {HOST} already serves {', '.join(others)}; the demo deploys "
              f"{MODEL} on the same GPUs and stops nothing of yours, so it stops here (nothing changed).\n"
              f"demo: stop it first (`vllm-orch stop NAME --host {HOST}`), or start over with "
              "`vllm-orch sim down` (deletes the simulated hosts' models and records).", file=sys.stderr)
        sys.exit(3)
    step("The models vllm-orch ships", "models")
    step(f"What deploying {MODEL} would do (dry run: nothing changes)", "deploy", MODEL, "--host", HOST,
         "--dry-run")
    step(f"Deploy {MODEL}: download + verify, free GPUs, install, start, readiness gates", "deploy", MODEL,
         "--host", HOST)
    step("Deploy again: nothing changed, so nothing to do", "deploy", MODEL, "--host", HOST)
    step("Status of the host", "status", "--host", HOST)
    print("\nNext: " + ", ".join(f"`{line.split('  #')[0].strip()}`" for line in NEXT)
          + ".\n(run them as .venv/bin/vllm-orch, or activate .venv first)")


if __name__ == "__main__":
    main()
