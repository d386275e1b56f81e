"""What the state-machine test (test_state_machine.py) found, each as the sequence it shrank to,
replayed on the fake host with the invariants checked after every step. Each failed before its fix."""

from __future__ import annotations

import pytest

from tests.unit.test_state_machine import Operations, Unit, fake_world  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("fake_world")


def replay(*steps) -> Operations:
    m = Operations()
    for rule, kw in steps:
        getattr(m, rule)(**kw)
        m.no_two_running_services_share_a_gpu_or_a_port()
        m.records_and_units_agree()
    return m


def deploy(model, name=None, gpus=None, port=None, failure=None):
    return "deploy", dict(model=model, name=name, gpus=gpus, port=port, failure=failure)


def swap(model, name=None, replace=None, failure=None):
    return "swap", dict(model=model, name=name, replace=replace, failure=failure)


def regen(restart=False, change=None):
    return "regen", dict(restart=restart, change=change)


def test_regen_restart_records_where_the_service_now_runs():
    """A manifest moved tiny-llama-a's port; regen --restart restarted it there, but its record kept
    the old port (only the hashes were updated): status probed, and the overlap check trusted,
    the wrong port."""
    m = replay(deploy("tiny-llama-a"), regen(restart=True, change="port"))
    assert m.host.units["tiny-llama-a"].port == 8102


def test_a_service_name_that_serves_another_model_is_refused():
    """`deploy minimax-m25 --name svc-c` (or a swap) while svc-c serves tiny-llama-a replaced it in
    place: a swap found nothing to roll back to (the same name) and a failed start left nothing
    serving, with the record of one model and the files of the other."""
    m = replay(deploy("tiny-llama-a", name="svc-c"))
    before = m.host.snapshot()
    replay_on(m, deploy("minimax-m25", name="svc-c"), swap("minimax-m25", name="svc-c", failure="fail"))
    assert m.host.snapshot() == before and m.host.units["svc-c"].active


def test_a_swap_from_a_service_that_does_not_run_stops_a_failed_new_one():
    """The old service was recorded but not running: the swap had no rollback, so a new service
    that failed its gates kept running, unrecorded, on its GPUs."""
    m = replay(deploy("tiny-llama-b"))
    m.host.units["tiny-llama-b"].active = False                     # stopped under vllm-orch (a crash)
    replay_on(m, swap("tiny-llama-a", failure="fail"))
    assert not m.host.units["tiny-llama-a"].active


def test_a_redeploy_restarts_a_service_that_runs_older_files_than_installed():
    """regen without --restart installed tiny-llama-b on GPU 7 while it ran on GPU 0; a swap or
    deploy to it saw its files unchanged, did not restart it and recorded GPU 7 while it ran on 0."""
    m = replay(swap("tiny-llama-b"), regen(change="gpus"), swap("tiny-llama-b"))
    assert m.host.units["tiny-llama-b"].gpus == (7,)
    m = replay(deploy("tiny-llama-b"), regen(change="gpus"), regen(restart=True))
    assert m.host.units["tiny-llama-b"].gpus == (7,)                # regen --restart restarts it too


def test_a_rollback_records_where_the_old_service_runs_now():
    """The old service's installed files were newer than those it ran (regen without --restart);
    the rollback started it from them and its record kept the place it ran before."""
    replay(swap("tiny-llama-b"), regen(change="gpus"), swap("tiny-llama-a", failure="fail"))


def test_a_service_takes_where_its_installed_files_would_start_it():
    """tiny-llama-b ran on GPU 0 with files for GPU 7 installed (regen without --restart); svc-b
    was let onto GPU 7, and the next start of tiny-llama-b (here a swap's rollback) put both there."""
    m = replay(deploy("tiny-llama-b"), regen(change="gpus"))
    before = m.host.snapshot()
    replay_on(m, deploy("tiny-llama-b", name="svc-b", port=8102))
    assert m.host.snapshot() == before                              # refused: GPU 7 is tiny-llama-b's
    replay_on(m, swap("tiny-llama-a", replace=0, failure="fail"))


def replay_on(m: Operations, *steps) -> None:
    for rule, kw in steps:
        getattr(m, rule)(**kw)
        m.no_two_running_services_share_a_gpu_or_a_port()
        m.records_and_units_agree()


@pytest.mark.parametrize("unit", [Unit()])
def test_the_fake_host_starts_nothing_without_installed_files(unit):
    assert not unit.active


def test_a_failed_regen_restart_puts_the_installed_record_back_with_the_unit():
    """regen --restart installs the new unit and its installed record; the restart fails its gates
    and the recovery puts the previous unit back. The installed record stayed the new one: the host
    then said it had installed what it does not run (the engine an upgrade names, the ports)."""
    from tests.unit.test_state_machine import ENTRY

    m = replay(deploy("tiny-llama-a"))
    path = f"{ENTRY.state_dir}/installed/tiny-llama-a.json"
    before, port = m.host.files[path], m.host.units["tiny-llama-a"].port
    m.host.fail_ready = "tiny-llama-a"
    replay_on(m, regen(restart=True, change="port"))
    assert m.host.units["tiny-llama-a"].active and m.host.units["tiny-llama-a"].port == port
    assert m.host.files[path] == before
