"""A foreign process listening on a multi-node service's master port (a torchrun job's store), on
two SIMULATED process hosts through the CLI: the host's own facts script finds the listener, and the
deploy is refused before anything changes (exit 3, one line naming the host, the port and the
holder's PID), in --dry-run's plan as in a real run (issue 26, finding 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .test_multinode_sim import NAME, cli, cluster  # noqa: F401  (the fixture: sim, sim-2 and the 2-node manifest)

LISTEN = """
import socket, sys, time
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(600)
"""


def test_a_foreign_listener_on_the_master_port_is_refused_naming_it(cluster):  # noqa: F811
    env, entries, m = cluster
    port = m.multinode.master_port
    assert port
    holder = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "listening"
        dry = cli(env, "deploy", NAME, "--host", "sim,sim-2", "--dry-run")
        assert dry.returncode == 3, dry.stdout[-3000:] + dry.stderr[-3000:]
        assert f"REFUSED: sim: placement: port {port} on sim" in dry.stdout and f"PID {holder.pid}" in dry.stdout, \
            dry.stdout[-3000:]

        r = cli(env, "deploy", NAME, "--host", "sim,sim-2")
        assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
        line = r.stderr.strip().splitlines()[0]
        assert f"port {port}" in line and f"PID {holder.pid}" in line and "sim" in line, r.stderr
        for e in entries.values():          # nothing installed, nothing started, on either node
            installed = Path(e.state_dir) / "installed"
            assert not (installed.exists() and any(installed.iterdir())), list(installed.iterdir())
            assert not Path(f"{e.units_dir}/vllm-{NAME}.sh").exists()
        assert holder.poll() is None        # never killed
    finally:
        holder.kill()
        holder.wait()
