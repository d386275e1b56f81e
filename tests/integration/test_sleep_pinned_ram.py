"""A level-1 sleep pins more host RAM than the checkpoint's size, as vLLM 0.33 on PyTorch does: cumem
backs up each GPU allocation with its own pinned `torch.empty` (device_allocator/cumem.py sleep) and
PyTorch's pinned host allocator rounds each block up to a power of two and keeps freed blocks cached
(a wake gives none back). The SIMULATED host pins that way and its engine dies in the middle of the
sleep when host RAM runs short; vllm-orch budgets level 1 by what is pinned (estimated, then
measured at the first sleep), counts what an awake process keeps cached, and budgets the warm-up
net of the pinning."""

from __future__ import annotations

import json

import pytest

from orchestrator.host.facts import gather
from orchestrator.host.state import read_history, read_record
from orchestrator.sim import vllm_server
from orchestrator.sim.nvidia_smi import write_meminfo

from .deployhelp import deploy, entry, swap
from .test_sleep_swap import main_pid, sleepy

GIB = 2 ** 30


def test_the_simulated_pinned_backup_rounds_each_block_up_to_a_power_of_two():
    # Kimi-K2.5 at TP8: 547 GB over 8 ranks and 61 layers, fused experts of ~712 and ~356 MiB per rank
    per_rank = 547e9 / 8
    pinned = vllm_server.pinned_backup_bytes(per_rank, 61)
    assert pinned == 61 * (GIB + GIB // 2)
    assert 1.4 < pinned / per_rank < 1.5
    assert vllm_server.pinned_backup_bytes(6 * GIB, 1) == 6 * GIB       # 4 and 2 GiB blocks: as they are
    assert vllm_server.pinned_backup_bytes(4 * GIB, 1) == 6 * GIB       # 2.7 and 1.3 GiB: 4 and 2 GiB


@pytest.fixture
def pair(sim_host):
    old, new = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    e = entry(sim_host)
    assert deploy(e, old).ok
    return e, old, new, {old.name: old, new.name: new}


def available(sim_host, e) -> int:
    mem = gather(sim_host.host, e, []).memory
    assert mem is not None and mem.available is not None
    return mem.available


def set_available(sim_host, e, want: int) -> None:
    """sim.json's available_bytes (real bytes) such that MemAvailable, net of the awake workers, reads
    `want` (real bytes)."""
    scale = int(json.loads((sim_host.dir / "sim.json").read_text()).get("scale") or 1)
    cfg = json.loads((sim_host.dir / "sim.json").read_text())
    now = available(sim_host, e) * scale
    cfg["available_bytes"] = int(cfg.get("available_bytes") or 0) + (want - now)
    (sim_host.dir / "sim.json").write_text(json.dumps(cfg))
    write_meminfo(sim_host.dir)


def test_ram_for_the_weights_but_not_for_the_pinned_blocks_sleeps_at_level_2(sim_host, pair):
    """700 GiB available: the 547 GB (509 GiB) of weights fit above the floor (630 - 96 GiB for the new
    service's CPU side); the ~735 GiB the pinned allocator takes for them do not. Sized by the
    checkpoint, the sleep ran at level 1 and the engine died part-way ("out of memory")."""
    e, old, new, manifests = pair
    set_available(sim_host, e, 700 * GIB)
    dry = swap(e, new, manifests, dry_run=True, sleep_old=True)
    assert dry.plan.info["sleep_level"] == 2, dry.plan.warnings
    warned = " ".join(dry.plan.warnings)
    assert "would pin" in warned and "estimated" in warned and "level 2 instead" in warned, warned
    result = swap(e, new, manifests, sleep_old=True)
    assert result.ok, result.error
    assert read_record(sim_host.host, e, old.name).asleep.level == 2


def test_the_first_level_1_sleep_measures_its_pinning_and_an_awake_process_keeps_it_cached(sim_host, pair):
    e, old, new, manifests = pair
    scale = int(json.loads((sim_host.dir / "sim.json").read_text()).get("scale") or 1)
    before = available(sim_host, e)
    first = swap(e, new, manifests, sleep_old=True, warm=True)
    assert first.ok, first.error
    assert first.plan.info["sleep_level"] == 1
    warm = next(a for a in first.plan.actions if a.step == "warm")     # the warm-up is net of the pinning
    assert any("kimi-k25-int4's level-1 sleep pins" in d for d in warm.details), (warm.title, warm.details)
    rec = read_record(sim_host.host, e, old.name)
    weights = rec.asleep.weights_bytes
    assert rec.sleep_pinned_pid == main_pid(sim_host, e, old.name) and rec.sleep_pinned_bytes is not None
    assert 1.3 < rec.sleep_pinned_bytes / weights < 1.6, (rec.sleep_pinned_bytes, weights)   # not 1.0
    assert read_history(sim_host.host, e)[-1].shown()["sleep"]["slept"][old.name]["pinned_bytes"] \
        == rec.sleep_pinned_bytes

    back = swap(e, old, manifests, sleep_old=True)      # int4 wakes; its pinned blocks stay cached
    assert back.ok, back.error
    rec = read_record(sim_host.host, e, old.name)
    assert rec.asleep is None and rec.sleep_pinned_pid == main_pid(sim_host, e, old.name)
    # nvfp4's own level 1 does not fit beside int4's cached blocks: level 2, said with the figures
    assert back.plan.info["sleep_level"] == 2, back.plan.warnings
    held = before - available(sim_host, e)
    assert held * scale > 700 * GIB, f"int4's cached pinned blocks and nvfp4's workers: {held * scale / GIB:.0f} GiB"

    again = swap(e, new, manifests, sleep_old=True)      # int4 sleeps again: it pins nothing more
    assert again.ok, again.error
    assert again.plan.info["sleep_level"] == 1
    assert "pins nothing more" in again.plan.text(), again.plan.text()
