"""A service's log reaches the operator's terminal without its escape sequences: `vllm-orch logs` on
the SIMULATED host prints a log that a service (or anything running as its user) wrote with an
OSC 52 clipboard write, cursor moves, an 8-bit CSI and a carriage return forging "ok deployed".
All pass through the one sanitiser (orchestrator/fmt.py `printable`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .deployhelp import cli_env, deploy, entry, on_port, write_models

REPO = Path(__file__).resolve().parents[2]

HOSTILE = [
    "INFO clipboard \x1b]52;c;ZWNobyBwd25lZA==\x07written",            # OSC 52, BEL-terminated
    "INFO title \x1b]0;root@gpu1\x1b\\set",                              # OSC, ST-terminated
    "INFO up\x1b[2A\x1b[2K\x1b[1G moved",                                # CSI cursor moves, erase line
    "INFO eight-bit \x9b2J\x9b1;1H csi",                                 # 8-bit CSI (U+009B)
    "ERROR the download failed\r[ok] deployed in 3.0s",                  # a bare CR overwrites the line
    "INFO dcs \x1bP1$r0m\x1b\\ and apc \x1b_x\x1b\\ done",               # DCS and APC strings
]


def test_logs_never_send_a_services_escape_sequences_to_the_terminal(sim_host, tmp_path):
    e = entry(sim_host)
    m = on_port("minimax-m25")
    assert deploy(e, m).ok
    log = sim_host.dir / "logs" / f"vllm-{m.name}.log"
    with open(log, "a") as f:
        f.write("\n".join(HOSTILE) + "\n")
    env = cli_env(sim_host, write_models(tmp_path / "models", [m]))
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "logs", m.name, "--host", "sim",
                        "-n", str(len(HOSTILE))], env=env, capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for c in ("\x1b", "\x07", "\x9b", "\r"):
        assert c not in out, (c, out)
    lines = out.splitlines()
    assert len(lines) == len(HOSTILE), lines
    assert lines[0] == "INFO clipboard written" and lines[1] == "INFO title set"
    assert lines[2] == "INFO up moved" and lines[3] == "INFO eight-bit  csi"
    # The forged line stays visibly part of the failure it tried to hide.
    assert lines[4] == "ERROR the download failed\\x0d[ok] deployed in 3.0s"
    assert lines[5] == "INFO dcs  and apc  done"
