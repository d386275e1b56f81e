"""A process host's stop command never signals a PID that cannot be a process group vllm-orch
started: a record naming 0 (`kill`/`pkill -g 0` is the caller's own group), 1 (init), -1 (`kill -1`:
every process), a negative number or garbage is refused with one line and removed, nothing signalled.

The real stop script (ProcessService.stop_commands) runs as root in a PID namespace of its own
(`unshare --pid --fork --mount-proc`), so whatever it would signal is the namespace's: its init (a
shell that traps TERM and reports it), a bystander `sleep` in the stop script's own process group,
and the stop script itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.host.services import ProcessService

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare(1) for a PID namespace")

# Runs as the namespace's PID 1: writes the record `PID BOOT_ID START_TIME` (the start time of PID 1
# when the record names 1, so the leader check passes as it would for init), runs the stop script,
# then reports whether init or the bystander got a signal.
HARNESS = r"""
trap 'echo INIT-SIGNALLED' TERM HUP INT
sleep 300 & S=$!
T1=$(sed 's/^.*) //' /proc/1/stat | cut -d' ' -f20)
mkdir -p "$RUN_DIR"
printf '%s %s %s\n' "$REC_P" "$(cat /proc/sys/kernel/random/boot_id)" "$T1" > "$PIDFILE"
sh -c "$STOP"; echo "stop-rc=$?"
kill -KILL $S; wait $S; echo "bystander=$?"
[ -e "$PIDFILE" ] && echo record-kept || echo record-removed
"""


@pytest.mark.parametrize("pid", ["0", "1", "-1", "-4242", "00", "+5", "12abc", "*", "99999999999999999999"])
def test_a_pid_record_that_is_no_group_of_ours_is_never_signalled(tmp_path, pid):
    entry = HostEntry.model_validate({"name": "h", "address": "local", "service_manager": "process",
                                      "service_user": "root", "models_root": str(tmp_path / "models"),
                                      "state_dir": str(tmp_path / "state"), "python": sys.executable})
    svc = ProcessService(None, entry, "tiny")
    (stop,) = svc.stop_commands(drain=False)
    env = dict(os.environ, STOP=stop.text, REC_P=pid, PIDFILE=svc.pidfile, RUN_DIR=os.path.dirname(svc.pidfile))
    (tmp_path / "1234").touch()            # `set -- $R` must not glob a `*` into this name
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", HARNESS], env=env,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = r.stdout.split()
    assert "INIT-SIGNALLED" not in out, (pid, r.stdout, r.stderr)
    assert "bystander=137" in out, (pid, r.stdout, r.stderr)      # our SIGKILL, not the stop script's
    assert "stop-rc=0" in out and "record-removed" in out, (pid, r.stdout, r.stderr)
    assert "not stopping process group" in r.stderr and "no process group vllm-orch started" in r.stderr, \
        (pid, r.stderr)
