"""On-demand wake (issue 41) on a SIMULATED process host with the real HAProxy and the real OpenAI
client: a request for a sleeping model of a wake group waits at the gateway while `vllm-orch gateway
waker` sleeps the awake one and wakes it (canary checked); two loads on one GPU set take turns at
most once per min_awake_seconds instead of thrashing; an idle model sleeps again after its ttl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import openai
import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.host.state import read_history, read_record

from .deployhelp import SHIPPED, cli_env, deploy, free_port, swap, write_models

REPO = Path(__file__).resolve().parents[2]
GW_KEY = "gw-client-key-0123456789"
MIN_AWAKE_S = 4
TTL_S = 6


def sleepy(name: str) -> Manifest:
    data = SHIPPED[name].model_dump()
    data["serving"].update(port=free_port(), host="127.0.0.1")
    data["sleep"] = {"level": 1}
    data["performance"]["max_tokens"] = 16
    return Manifest.model_validate(data)


def cli(env, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO))


@pytest.fixture
def group(sim_host, tmp_path):
    """kimi-k25-int4 asleep, kimi-k25-nvfp4 awake (both sleep-capable, GPUs 0-7, two ports), a
    gateway whose wake group is the two, and the CLI's environment."""
    a, b = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    models = write_models(tmp_path / "models", [a, b])
    run_dir = tempfile.mkdtemp(prefix="gw-", dir="/tmp")
    settings = {"port": free_port(), "hold_seconds": 60, "drain_seconds": 20, "run_dir": run_dir,
                "wake_groups": [{"services": [a.name, b.name], "min_awake_seconds": MIN_AWAKE_S,
                                 "ttl_seconds": TTL_S}]}
    entry = HostEntry.model_validate({**sim_host.entry, "name": sim_host.name, "gateway": settings})
    inventory = Path(os.environ["VLLM_ORCH_STATE_HOME"]) / "hosts.d" / "sim.yaml"     # what `sim up` wrote
    data = yaml.safe_load(inventory.read_text())
    data["hosts"]["sim"]["gateway"] = settings
    inventory.write_text(yaml.safe_dump(data))
    env = dict(cli_env(sim_host, models), VLLM_ORCH_GATEWAY_KEYS=GW_KEY)
    manifests = {a.name: a, b.name: b}
    assert deploy(entry, a).ok
    r = swap(entry, b, manifests, sleep_old=True)
    assert r.ok, r.error
    up = cli(env, "gateway", "up", "--host", "sim")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield entry, a, b, env, settings["port"]
    finally:
        cli(env, "gateway", "down", "--host", "sim")
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_request_wakes_its_model_and_two_loads_take_turns(sim_host, group, tmp_path):
    entry, a, b, env, port = group
    log = (tmp_path / "waker.log").open("w+")
    host = sim_host.host
    assert read_record(host, entry, a.name).asleep is not None
    # the waker, as a user runs it (its own process, a line per wake or sleep)
    waker = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "gateway", "waker", "--host", "sim",
                              "--poll", "0.1", "--for", "120"], env=env, cwd=str(REPO), text=True,
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=GW_KEY, timeout=90, max_retries=0)
        routes = {r["service"]: r for r in json.loads(cli(env, "gateway", "status", "--host", "sim", "--json").stdout)["routes"]}
        assert routes[a.name]["held"] and not routes[a.name]["up"] and routes[b.name]["up"], routes

        # 1. a request for the sleeping model: held at the gateway, answered once it woke
        t0 = time.monotonic()
        stream = c.chat.completions.create(model=a.served_name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8, stream=True)
        first = None
        chunks = []
        for ch in stream:
            first = first or time.monotonic() - t0
            chunks.append(ch)
        assert chunks[-1].choices[0].finish_reason == "length"
        # the answer comes once the canary matched (the release step); the swap's history line follows
        deadline = time.monotonic() + 30
        while read_history(host, entry)[-1].operation != "swap" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_record(host, entry, a.name).asleep is None
        assert read_record(host, entry, b.name).asleep is not None
        last = read_history(host, entry)[-1].shown()
        assert last["operation"] == "swap" and last["service"] == a.name and last["ok"]
        assert last["sleep"]["woke"][a.name]["canary"] == "match"       # the wake was checked
        downtime = last["downtime_s"]
        assert first is not None and first > 0.1

        # 2. two loads at once, one per model of the GPU set: they take turns, none fails
        stop = threading.Event()
        outcome: Counter = Counter()
        swaps_before = sum(1 for h in read_history(host, entry) if h.operation == "swap")

        def load(model: str) -> None:
            while not stop.is_set():
                try:
                    got = list(c.chat.completions.create(model=model, max_tokens=4, stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]))
                    outcome["whole" if got[-1].choices[0].finish_reason == "length" else "cut"] += 1
                except openai.APIError as exc:
                    outcome[type(exc).__name__] += 1

        threads = [threading.Thread(target=load, args=(m,)) for m in (a.served_name, b.served_name) for _ in range(2)]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(14)
        stop.set()
        for t in threads:
            t.join(90)
        elapsed = time.monotonic() - started
        swaps = sum(1 for h in read_history(host, entry) if h.operation == "swap") - swaps_before
        assert set(outcome) == {"whole"}, outcome
        assert outcome["whole"] >= 8
        # the anti-thrash bound: a turn lasts at least min_awake_seconds (plus its swap)
        assert 1 <= swaps <= elapsed / MIN_AWAKE_S + 1, (swaps, elapsed)

        # 3. idle past the ttl: the awake one sleeps again (drained first by the gateway). Both records
        # also say asleep for a moment inside a turn's swap (after its release, before its record
        # step): the ttl's sleep is the one its history line proves
        deadline = time.monotonic() + TTL_S + 30
        while time.monotonic() < deadline:
            if read_history(host, entry)[-1].operation == "sleep" and all(
                    read_record(host, entry, m.name).asleep is not None for m in (a, b)):
                break
            time.sleep(0.5)
        assert all(read_record(host, entry, m.name).asleep is not None for m in (a, b))
        assert read_history(host, entry)[-1].operation == "sleep"
    finally:
        waker.terminate()
        waker.wait(30)
        log.seek(0)
        out = log.read()
        print(out, outcome if "outcome" in locals() else "")
    assert f"woke {a.name}" in out and "wait for it" in out, out
    assert "put to sleep" in out and "ttl" in out, out
    print(f"first token after a wake: {first:.2f} s, the swap's downtime {downtime:.2f} s")
