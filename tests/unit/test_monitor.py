"""`vllm-orch monitor`'s files checked by the real promtool (Debian's `prometheus` package, which
`./dev test` installs): the rules load, every alert fires on its input and stays quiet on the near
miss (`promtool test rules` on the cases monitor writes), the config loads, `status --prometheus`
is valid exposition text; the vLLM series the rules read are in vLLM 0.33's own /metrics (recorded
from its metrics code: tests/fixtures/vllm-metrics); by default no file holds a key and the scrape
carries none (vLLM 0.33 leaves /metrics outside --api-key's guarded prefixes); a scrape credential is
the operator's own file, referenced, over https unless forced, never the service's API key."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import RefusedError
from orchestrator.ops import monitor, monitor_rules
from orchestrator.ops.monitor_rules import Target, Timing
from orchestrator.ops.status import HostStatus, ServiceStatus
from orchestrator.probe import metrics
from orchestrator.secret import Secret

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-metrics"
KEY = "sk-monitor-test-5d1f"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install Debian's `prometheus` package (`./dev test` installs it)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def fleet() -> list[Target]:
    return [Target("gpu1", "kimi-k25-int4", "kimi-k25-int4", "kimi-k2.5", (0, 1, 2, 3, 4, 5, 6, 7), "single",
                   "0.33.0", "10.0.0.1:8000", keyed=False),
            Target("gpu2", "minimax-m25", "minimax-m25", "minimax-m2.5", (0, 1, 2, 3), "single", "0.33.0",
                   "10.0.0.2:8001", keyed=True, slo_ttft_p95_s=2.0),
            Target("gpu2", "small", "minimax-m25", "small", (4, 5, 6, 7), "head", "0.33.0",
                   "10.0.0.2:8002", keyed=False, slo_ttft_p95_s=0.5)]


@pytest.mark.parametrize("timing", [Timing(), Timing(interval_s=1, for_s=3)], ids=["defaults", "drill"])
def test_rules_load_and_every_alert_fires_and_stays_quiet_as_its_tests_say(tmp_path, timing):
    monitor.write(tmp_path, fleet(), [], timing)
    rules = tmp_path / "rules" / "vllm-orch.rules.yml"
    checked = run_promtool("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run_promtool("test", "rules", str(tmp_path / "rules" / "vllm-orch.rules.test.yml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = yaml.safe_load((tmp_path / "rules" / "vllm-orch.rules.test.yml").read_text())["tests"]
    alerts = [r for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"] if "alert" in r]
    tested_alerts = [c["alert_rule_test"][0] for c in cases if "alert_rule_test" in c]
    tested_records = {t["expr"] for c in cases for t in c.get("promql_expr_test", [])}
    assert tested_records == set(monitor_rules.recorded(timing)), "every recording rule has a case"
    for name in {a["alert"] for a in alerts}:
        fired = [t for t in tested_alerts if t["alertname"] == name and t["exp_alerts"]]
        quiet = [t for t in tested_alerts if t["alertname"] == name and not t["exp_alerts"]]
        assert fired and quiet, f"{name}: a firing and a quiet case each"
    # one TTFT objective per service that states one, at its own threshold
    slos = [a["expr"] for a in alerts if a["alert"] == "VllmTtftSlo"]
    assert len(slos) == 2 and any('service="minimax-m25"} > 2' in e for e in slos), slos
    if timing.for_s is not None:
        assert {a["for"] for a in alerts} == {"3s"}


def promtool_test_with(tmp_path, rule: str, old: str, new: str) -> subprocess.CompletedProcess:
    """`promtool test rules` on monitor's files with one rule's expression changed."""
    monitor.write(tmp_path, fleet(), [], Timing())
    rules = tmp_path / "rules" / "vllm-orch.rules.yml"
    doc = yaml.safe_load(rules.read_text())
    [target] = [r for g in doc["groups"] for r in g["rules"] if rule in (r.get("alert"), r.get("record"))]
    assert old in target["expr"]
    target["expr"] = target["expr"].replace(old, new)
    rules.write_text(yaml.safe_dump(doc))
    return run_promtool("test", "rules", str(tmp_path / "rules" / "vllm-orch.rules.test.yml"))


def test_a_hostile_service_name_from_a_host_stays_a_label_value(tmp_path):
    """Service names come from a host's records: quotes, backslashes and newlines in one are escaped
    in every expression (the rules still load and their tests pass), never PromQL."""
    name = 'x"} or vector(1) or up{a="\\\n'
    hostile = [Target("gpu1", name, "m", "m", (0,), "single", "0.33.0", "10.0.0.1:8000", keyed=False,
                      slo_ttft_p95_s=1.0)]
    monitor.write(tmp_path, hostile, [], Timing())
    checked = run_promtool("check", "rules", str(tmp_path / "rules" / "vllm-orch.rules.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run_promtool("test", "rules", str(tmp_path / "rules" / "vllm-orch.rules.test.yml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "or vector(1)" not in "".join(e.replace(monitor_rules.q(name), "") for _, e in
                                         monitor_rules.panel_expressions(monitor_rules.dashboard(hostile)))


def test_a_broken_rule_fails_its_promtool_test(tmp_path):
    """The cases are not vacuous: an alert whose expression never holds fails them."""
    tested = promtool_test_with(tmp_path, "VllmServiceHung", "== 0", "< 0")
    assert tested.returncode != 0 and "VllmServiceHung" in tested.stdout + tested.stderr


def test_kv_usage_summed_over_engines_fails_the_recording_case(tmp_path):
    """The DP2 case pins the aggregation: a sum over engines (0.2 + 0.8) is not the usage."""
    tested = promtool_test_with(tmp_path, "vllm_orch:kv_cache_usage:mean", "avg by", "sum by")
    assert tested.returncode != 0 and "vllm_orch:kv_cache_usage:mean" in tested.stdout + tested.stderr


def test_config_loads_and_by_default_no_file_holds_a_key_and_no_scrape_sends_one(tmp_path):
    """The keyed service (minimax-m25) is scraped like the others: no authorization block, no key
    file, nothing under OUT holds the key vllm-orch was given."""
    written = monitor.write(tmp_path, fleet(), [monitor_rules.Exporter("gpu1", "dcgm", "10.0.0.1:9400")],
                            Timing(), state_target="10.0.0.9:9100", service_key=Secret(KEY))
    checked = run_promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not (tmp_path / "secrets").exists()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert sorted(files) == sorted(written)
    assert [p for p in files if KEY in p.read_text() or "authorization" in p.read_text()] == []
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    assert [j["job_name"] for j in config["scrape_configs"]] == ["vllm", "node", "dcgm", "vllm-orch", "gateway"]
    assert all("scheme" not in j for j in config["scrape_configs"])
    plain = json.loads((tmp_path / "targets" / "vllm.json").read_text())
    assert [g["targets"] for g in plain] == [["10.0.0.1:8000"], ["10.0.0.2:8001"], ["10.0.0.2:8002"]]
    assert json.loads((tmp_path / "targets" / "vllm-keyed.json").read_text()) == []
    assert plain[0]["labels"] == {"host": "gpu1", "service": "kimi-k25-int4", "model": "kimi-k25-int4",
                                  "served_name": "kimi-k2.5", "gpus": "0,1,2,3,4,5,6,7", "node_role": "single",
                                  "vllm_version": "0.33.0"}
    assert json.loads((tmp_path / "targets" / "dcgm.json").read_text()) == [
        {"targets": ["10.0.0.1:9400"], "labels": {"host": "gpu1"}}]
    assert json.loads((tmp_path / "targets" / "vllm-orch.json").read_text()) == [{"targets": ["10.0.0.9:9100"]}]


def scrape_key(tmp_path, text: str = "sk-scrape-only-31c0"):
    path = tmp_path / "scrape.key"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_scrape_key_file_is_opt_in_referenced_not_copied_and_over_https(tmp_path):
    key_file = scrape_key(tmp_path)
    monitor.write(tmp_path / "out", fleet(), [], Timing(), scrape_key_file=str(key_file), scheme="https",
                  service_key=Secret(KEY))
    out = tmp_path / "out"
    checked = run_promtool("check", "config", str(out / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not (out / "secrets").exists()
    assert [p for p in out.rglob("*") if p.is_file() and ("sk-scrape-only" in p.read_text() or
                                                          KEY in p.read_text())] == []
    config = yaml.safe_load((out / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["vllm-keyed"]["authorization"] == {"type": "Bearer", "credentials_file": str(key_file)}
    assert jobs["vllm-keyed"]["scheme"] == jobs["vllm"]["scheme"] == "https"
    assert "authorization" not in jobs["vllm"]
    assert [g["targets"] for g in json.loads((out / "targets" / "vllm-keyed.json").read_text())] == \
        [["10.0.0.2:8001"]]


def test_a_keyed_scrape_over_plain_http_is_refused_unless_forced(tmp_path):
    key_file = scrape_key(tmp_path)
    with pytest.raises(RefusedError) as err:
        monitor.write(tmp_path / "out", fleet(), [], Timing(), scrape_key_file=str(key_file))
    assert err.value.exit_code == 3 and "plain http" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    monitor.write(tmp_path / "out", fleet(), [], Timing(), scrape_key_file=str(key_file), key_over_http=True)
    config = yaml.safe_load((tmp_path / "out" / "prometheus.yml").read_text())
    keyed = next(j for j in config["scrape_configs"] if j["job_name"] == "vllm-keyed")
    assert keyed["authorization"]["credentials_file"] == str(key_file) and "scheme" not in keyed


def test_a_scrape_key_file_holding_the_services_api_key_is_refused(tmp_path):
    """The scrape credential is the operator's own (for a proxy that guards /metrics), never the
    service's full-access key."""
    key_file = scrape_key(tmp_path, KEY + "\n")
    with pytest.raises(RefusedError) as err:
        monitor.write(tmp_path / "out", fleet(), [], Timing(), scrape_key_file=str(key_file), scheme="https",
                      service_key=Secret(KEY))
    assert err.value.exit_code == 3 and str(key_file) in str(err.value) and KEY not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_series_the_rules_read_are_vllm_0_33s_own():
    """Contract with vLLM 0.33's metrics code (the recorded DP8 /metrics): every vllm: metric a rule
    or panel reads exists there, per engine, with the type the expression assumes."""
    text = gzip.decompress((FIXTURES / "dp8-multiproc.prom.gz").read_bytes()).decode()
    samples = metrics.parse(text)
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    for name, kind in ((metrics.RUNNING, "gauge"), (metrics.WAITING, "gauge"), (metrics.KV_CACHE, "gauge"),
                       (metrics.SLEEP_STATE, "gauge"), (metrics.GENERATION_TOKENS, "counter"),
                       (metrics.PROMPT_TOKENS, "counter"), (metrics.TTFT, "histogram"), (metrics.TPOT, "histogram")):
        assert types.get(name) == kind, name
        sample = name + ("_bucket" if kind == "histogram" else "")
        engines = {labels["engine"] for labels, _ in samples.by_name[sample]}
        assert engines == {str(i) for i in range(8)}, name
    assert any(labels.get("sleep_state") == "awake" for labels, _ in samples.by_name[metrics.SLEEP_STATE])
    expressions = [r["expr"] for g in monitor_rules.rules(fleet(), Timing())["groups"] for r in g["rules"]]
    expressions += [e for _, e in monitor_rules.panel_expressions(monitor_rules.dashboard(fleet()))]
    used = {w for e in expressions for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e) if w.startswith("vllm:")}
    assert used <= {metrics.GENERATION_TOKENS, metrics.PROMPT_TOKENS, metrics.RUNNING, metrics.WAITING,
                    metrics.KV_CACHE, metrics.SLEEP_STATE,
                    metrics.TTFT + "_bucket", metrics.TPOT + "_bucket"}, used


def test_dashboard_reads_only_recorded_series_and_has_a_row_per_service():
    board = monitor_rules.dashboard(fleet())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows[0] == "Fleet" and len(rows) == 1 + len(fleet())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()               # Grafana's 24-column grid: no panel outside it, none on another
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine
        assert p["type"] == "row" or p["datasource"]["uid"] == "${datasource}"
    recorded = set(monitor_rules.recorded(Timing()))
    for title, expr in monitor_rules.panel_expressions(board):
        names = {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", re.sub(r'"[^"]*"', "", expr)) if ":" in w}
        assert names <= recorded, (title, expr)
        assert "vllm:" not in expr and "rate(vllm" not in expr, (title, expr)


def status_of() -> list[HostStatus]:
    svc = ServiceStatus("minimax-m25", model="minimax-m25", served_name="minimax-m2.5", port=8001,
                        gpus=[0, 1, 2, 3], state="ready", restarts=2)
    history = [
        {"at": "2026-12-01T10:00:00+00:00", "operation": "deploy", "service": "minimax-m25", "ok": True},
        {"at": "2026-12-01T11:00:00+00:00", "operation": "swap", "service": "minimax-m25", "ok": True,
         "downtime_s": 41.5},
        {"at": "2026-12-01T12:00:00+00:00", "operation": "swap", "service": "minimax-m25", "ok": False,
         "downtime_s": 60.0},
        {"at": "2026-12-01T12:01:00+00:00", "operation": "rollback", "model": "minimax-m25", "ok": True},
        {"at": "2026-12-01T13:00:00+00:00", "operation": "health-restart", "model": "minimax-m25",
         "reason": 'a "quoted" reason'},
        {"at": "2026-12-01T14:00:00+00:00", "operation": "deploy", "service": "minimax-m25", "ok": False,
         "refused": "GPUs taken"},
        {"at": "2026-12-01T15:00:00+00:00", "operation": "gc", "ok": True},
    ]
    return [HostStatus("gpu2", services=[svc], history=history),
            HostStatus("gpu3", reachable=False, error="timed out")]


def test_state_metrics_are_valid_exposition_text_with_the_counts_of_history(tmp_path):
    text = monitor.state_metrics(status_of())
    (tmp_path / "state.prom").write_text(text)
    checked = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    s = metrics.parse(text)

    def value(name: str, **labels: str) -> float:
        [v] = [v for lab, v in s.by_name[name] if all(lab.get(k) == x for k, x in labels.items())]
        return v

    assert value("vllm_orch_host_up", host="gpu2") == 1 and value("vllm_orch_host_up", host="gpu3") == 0
    assert value("vllm_orch_operations_total", operation="swap", result="ok") == 1
    assert value("vllm_orch_operations_total", operation="swap", result="failed") == 1
    assert value("vllm_orch_operations_total", operation="deploy", result="refused") == 1
    assert value("vllm_orch_operations_total", operation="rollback", result="ok") == 1
    assert value("vllm_orch_operations_total", operation="health-restart") == 1
    assert value("vllm_orch_swap_downtime_seconds_total", service="minimax-m25") == 101.5
    assert value("vllm_orch_systemd_restarts_total", service="minimax-m25") == 2
    assert value("vllm_orch_service_ready", service="minimax-m25") == 1
    assert {lab["gpu"] for lab, _ in s.by_name["vllm_orch_service_gpu_info"]} == {"0", "1", "2", "3"}
    assert value("vllm_orch_last_success_timestamp_seconds", operation="deploy") == 1796119200.0
    assert not any(lab.get("operation") == "gc" for lab, _ in s.by_name["vllm_orch_operations_total"])
    assert {lab["operation"] for lab, _ in s.by_name["vllm_orch_last_success_timestamp_seconds"]} == {
        "deploy", "swap", "rollback"}       # a watcher's restart is not a success


def test_a_loopback_service_is_its_hosts_agents_target_unless_prometheus_is_on_that_host(tmp_path):
    """A service listening on 127.0.0.1 (every sleep-capable one) of a host reached over the
    network: not in the fleet's targets (its host's address refuses; 127.0.0.1 would be another
    machine's port), in agent/HOST/ at its loopback; on a host Prometheus runs on, an ordinary target."""
    from orchestrator.config.inventory import HostEntry

    def status(host: str) -> HostStatus:
        return HostStatus(host, services=[ServiceStatus("sleepy", model="sleepy", port=8001, gpus=[0]),
                                          ServiceStatus("open", model="open", port=8000, gpus=[1])])
    entries = {"gpu1": HostEntry(name="gpu1", address="10.0.0.5"), "here": HostEntry(name="here", address="local")}
    binds = {"sleepy": "127.0.0.1", "open": "0.0.0.0"}
    targets, _ = monitor.fleet([status("gpu1"), status("here")], entries,
                               lambda model: monitor.ServiceFacts(bind=binds[model]))
    at = {(t.host, t.service): (t.address, t.on_host) for t in targets}
    assert at == {("gpu1", "sleepy"): ("127.0.0.1:8001", True), ("gpu1", "open"): ("10.0.0.5:8000", False),
                  ("here", "sleepy"): ("127.0.0.1:8001", False), ("here", "open"): ("127.0.0.1:8000", False)}
    monitor.write(tmp_path, targets, [], Timing(), remote_write="http://prom.lan:9090/api/v1/write")
    fleet_targets = {g["targets"][0] for g in json.loads((tmp_path / "targets" / "vllm.json").read_text())}
    assert fleet_targets == {"10.0.0.5:8000", "127.0.0.1:8001", "127.0.0.1:8000"}    # here's at its own loopback
    [agent] = json.loads((tmp_path / "agent" / "gpu1" / "targets" / "vllm.json").read_text())
    assert agent["targets"] == ["127.0.0.1:8001"] and agent["labels"]["host"] == "gpu1"
    config = yaml.safe_load((tmp_path / "agent" / "gpu1" / "prometheus.yml").read_text())
    assert config["remote_write"] == [{"url": "http://prom.lan:9090/api/v1/write"}]
    assert not (tmp_path / "agent" / "here").exists()
    checked = run_promtool("check", "config", str(tmp_path / "agent" / "gpu1" / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_gateway_with_a_metrics_port_is_scraped_where_prometheus_reaches_it(tmp_path):
    from orchestrator.config.inventory import HostEntry

    entries = {"gpu1": HostEntry(name="gpu1", address="10.0.0.1"), "gpu2": HostEntry(name="gpu2", address="10.0.0.2"),
               "gpu3": HostEntry(name="gpu3", address="10.0.0.3")}
    results = [HostStatus("gpu1", gateway={"state": "serving", "metrics_port": 8405, "listen": ["10.0.0.1"]}),
               HostStatus("gpu2", gateway={"state": "serving", "metrics_port": 8405, "listen": ["127.0.0.1"]}),
               HostStatus("gpu3", gateway={"state": "serving", "metrics_port": None, "listen": ["0.0.0.0"]})]
    _, exporters = monitor.fleet(results, entries, lambda name: monitor.ServiceFacts())
    # gpu2's listens on its loopback only (a remote Prometheus cannot reach it), gpu3's has no metrics port
    assert exporters == [monitor_rules.Exporter("gpu1", "gateway", "10.0.0.1:8405")]
    assert monitor.gateway_reachable(["0.0.0.0"], "10.0.0.5") and monitor.gateway_reachable(["127.0.0.1"], "127.0.0.1")
    monitor.write(tmp_path, fleet(), exporters, Timing())
    assert json.loads((tmp_path / "targets" / "gateway.json").read_text()) == [
        {"targets": ["10.0.0.1:8405"], "labels": {"host": "gpu1"}}]
    job = next(j for j in yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"]
               if j["job_name"] == "gateway")
    assert job["metric_relabel_configs"][0]["regex"] == "svc_(.+)"        # backend svc_NAME -> service NAME
    board = json.loads((tmp_path / "grafana" / "vllm-orch-fleet.json").read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows[:2] == ["Fleet", "gateway on gpu1"]
    exprs = [e for t, e in monitor_rules.panel_expressions(board) if "(gateway" in t]
    assert len(exprs) == len(monitor_rules.GATEWAY_PANELS) and all('host="gpu1"' in e for e in exprs)
    used = {w for e in exprs for w in re.findall(r"haproxy_[a-z_]+", e)}
    assert used <= set(monitor_rules.GATEWAY_SERIES), used
