"""The dev-mode endpoints of a sleep-capable service answer root and the service's user only. vLLM
0.33's --api-key guards /v1, /v2, /inference and /cohere (entrypoints/serve/middleware/authenticate.py);
with VLLM_SERVER_DEV_MODE=1 /sleep, /wake_up and /collective_rpc answer anyone who reaches the port,
and loopback (config/manifest.py) still lets in every local user. Here a sleep-capable service is
deployed on the SIMULATED process host (its start script, run as root, as on a real host), in the
network namespace of this test's worker (tests/plugins/netns-python), and user nobody calls /sleep:
the connection is reset (ECONNRESET or ECONNREFUSED, as a TCP reset to a SYN reads) while root
puts the service to sleep and wakes it. The stop deletes the service's nftables table and nothing
else. Needs root, setpriv and nft, as the real host does."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess

import pytest

from orchestrator.host.services import Service
from orchestrator.render.artifacts import dev_guard_table

from .deployhelp import deploy, entry
from .test_sleep_endpoints_private import post
from .test_sleep_swap import sleepy

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("nft"),
                                reason="needs root, setpriv and nft (./dev test installs nftables)")

STRANGER = """
import sys, urllib.request
try:
    r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="POST", data=b""), timeout=10)
    print("answered", r.status)
except OSError as e:
    print("refused", type(getattr(e, "reason", e)).__name__)
"""


def as_nobody(url: str) -> str:
    nobody = pwd.getpwnam("nobody")
    out = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                          "/usr/bin/python3", "-c", STRANGER, url],
                         capture_output=True, text=True, timeout=60, cwd="/")
    return out.stdout.strip() or out.stderr


def tables() -> list[str]:
    out = subprocess.run(["nft", "-j", "list", "tables"], capture_output=True, text=True, timeout=30, check=True)
    return [f"{t['table']['family']} {t['table']['name']}" for t in json.loads(out.stdout)["nftables"]
            if "table" in t]


def test_another_local_user_is_reset_by_the_dev_endpoints_root_is_answered(sim_host):
    m = sleepy("kimi-k25-int4")
    e = entry(sim_host)
    # Another table of this namespace is never touched by the guard's start or stop.
    subprocess.run(["nft", "add table inet bystander"], check=True, timeout=30)
    try:
        result = deploy(e, m)
        assert result.ok, result.error
        base = f"http://127.0.0.1:{m.serving.port}"
        verdict = as_nobody(f"{base}/sleep?level=1")
        assert verdict in ("refused ConnectionResetError", "refused ConnectionRefusedError"), \
            f"user nobody called /sleep of a sleep-capable service: {verdict}"
        assert as_nobody(f"{base}/collective_rpc").startswith("refused")
        # root (vllm-orch's gateway, bench and probes) and the service's user (here the sim's: root) are answered
        assert post(f"{base}/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
        assert post(f"{base}/wake_up")[0] == 200
        table = f"inet {dev_guard_table(m.name)}"
        rule = subprocess.run(["nft", "list", "table", *table.split()], capture_output=True, text=True,
                              timeout=30, check=True).stdout
        uid = pwd.getpwnam(e.service_user).pw_uid
        assert f'oif "lo" tcp dport {m.serving.port} meta skuid != {{ 0' in rule and str(uid) in rule, rule
        svc = Service.for_host(sim_host.host, e, m.name)
        svc.run_all(svc.stop_commands(), "stop")
        assert table not in tables() and "inet bystander" in tables(), tables()
    finally:
        subprocess.run(["nft", "delete table inet bystander"], timeout=30)
