"""Two services on one real-systemd host (systemd-nspawn, reached over SSH): minimax-m25 on GPUs
0-3 and a second service placed on GPUs 4-7 by the command line, each its own unit; swapping the
second with --replace leaves the first answering throughout (a probe loop over its own SSH
connection sees no failed request), and stopping it leaves the first unit active."""

from __future__ import annotations

import pytest

from orchestrator.host.connect import open_host
from orchestrator.host.state import read_records
from orchestrator.ops.status import host_status
from orchestrator.ops.stop import stop_model
from orchestrator.probe.api import Endpoint, health

from .deployhelp import deploy, swap
from .test_services_sim import MM, ProbeLoop, copy_of, placed

pytestmark = pytest.mark.systemd


def test_two_services_on_a_systemd_host_swap_one_the_other_keeps_answering(clean_systemd_sim):
    _home, e = clean_systemd_sim
    a, b, c = copy_of(MM, MM, 8000), copy_of(MM, "mm-b", 8001), copy_of(MM, "mm-c", 8001)
    manifests = {m.name: m for m in (a, b, c)}
    assert deploy(e, a).ok
    res = deploy(e, b, request=placed([4, 5, 6, 7], 8001))
    assert res.ok, res.error
    st = host_status(e)
    assert sorted(s.name for s in st.services) == sorted(["mm-b", MM])
    assert all(s.state == "ready" and s.unit_state and s.unit_state.startswith("active") for s in st.services), \
        [(s.name, s.state, s.unit_state) for s in st.services]

    with open_host(e) as probe_host:
        loop = ProbeLoop(Endpoint(probe_host, a.serving.port), a.served_name)
        loop.start()
        try:
            swapped = swap(e, c, manifests, replace="mm-b")
        finally:
            loop.stop()
    assert swapped.ok, swapped.error
    assert loop.ok > 5 and loop.failed == [], loop.failed[:3]
    with open_host(e) as host:
        records = {n: r.shown() for n, r in read_records(host, e).items()}
        assert sorted(records) == sorted(["mm-c", MM]) and records["mm-c"]["gpus"] == [4, 5, 6, 7]
        assert host.run(["systemctl", "is-active", "vllm-mm-b.service"]).stdout.strip() != "active"
        assert host.run(["systemctl", "is-active", "vllm-mm-c.service"]).stdout.strip() == "active"
        pid_a = host.run(["systemctl", "show", "-p", "MainPID", "--value", f"vllm-{MM}.service"]).stdout.strip()
        res = stop_model(host, e, "mm-c", release_timeout=30, poll=0.2)
        assert res.ok and res.gpus == [4, 5, 6, 7], res
        assert host.run(["systemctl", "is-active", f"vllm-{MM}.service"]).stdout.strip() == "active"
        assert host.run(["systemctl", "show", "-p", "MainPID", "--value", f"vllm-{MM}.service"]).stdout.strip() == pid_a
        assert health(Endpoint(host, a.serving.port)) == 200
        stop_model(host, e, MM, release_timeout=30, poll=0.2)
