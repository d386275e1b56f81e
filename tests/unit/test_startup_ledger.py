"""The per-phase start-up ledger: vLLM 0.33's own figures from its start-up lines (each pattern is
the source's format string with its numbers), and how `history` shows it."""

from __future__ import annotations

from orchestrator.cli.views import history_details, sleep_summary, startup_summary
from orchestrator.probe import logsig

LINES = [
    "(Worker_TP0 pid=11) INFO 12-01 10:00:00 [weight_utils.py:538] Time spent downloading weights for "
    "moonshotai/Kimi-K2.5: 12.500000 seconds",
    "(Worker_TP0 pid=11) INFO 12-01 10:00:30 [default_loader.py:507] Loading weights took 30.25 seconds",
    "(Worker_TP0 pid=11) INFO 12-01 10:00:31 [gpu_model_runner.py:5089] Model loading took 68.30 GiB memory and "
    "35.123456 seconds",
    "(Worker_TP0 pid=11) INFO 12-01 10:00:40 [monitor.py:62] torch.compile took 8.40 s in total",
    "(Worker_TP0 pid=11) INFO 12-01 10:00:50 [gpu_model_runner.py:6517] Graph capturing finished in 9 secs, "
    "took 0.52 GiB",
    "(EngineCore pid=10) INFO 12-01 10:00:51 [core.py:413] init engine (profile, create kv cache, warmup model) "
    "took 19.10 s",
    "(APIServer pid=9) INFO:     Application startup complete.",
]


def test_the_ledger_reads_vllms_own_figures():
    assert logsig.ledger(LINES) == {"download_s": 12.5, "weights_s": 30.25, "model_load_s": 35.123456,
                                    "compile_s": 8.4, "graphs_s": 9.0, "graphs_gib": 0.52, "init_engine_s": 19.1}
    assert logsig.phase_of(LINES[3]) == "compiling"          # 0.33's "took" (the simulator said "takes")


def test_history_shows_the_ledger_and_the_sleep_part():
    rec = {"operation": "swap", "ok": True, "downtime_s": 3.2,
           "startup": {"download_s": 1.0, "weights_s": 30.25, "compile_s": 8.4, "graphs_s": 9.0,
                       "api_up_s": 50.1, "first_token_s": 50.3, "ready_s": 51.0},
           "sleep": {"slept": {"a": {"level": 1, "seconds": 1.4, "gpu_mib": 530, "cycles": 3, "growth_mib": 2000}},
                     "woke": {"b": {"wake_s": 1.4, "canary": "match", "warmup_s": 0.2}}}}
    line = history_details(rec)
    assert "start-up download 1.0s, weights 30.2s, compile 8.4s, CUDA graphs 9.0s, API up at 50.1s, " \
           "first token at 50.3s, ready at 51.0s" in line
    assert "a slept (level 1, 1.4s, keeps 530 MiB/GPU, +2000 MiB over 3 cycles)" in line
    assert "b woke in 1.4s (canary match, warm-up 0.20s)" in line
    assert startup_summary({}) == "" and sleep_summary({"woke": {"c": {"cold": True, "reason": "r"}}}) == \
        "c restarted cold (r)"
