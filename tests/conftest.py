"""Shared fixtures live in tests/plugins/*: one module per kind of test host, so they stay apart."""

pytest_plugins = [
    "tests.plugins.sim_hosts",      # the default simulated host (LocalHost + sim programs)
    "tests.plugins.remote_hosts",   # a real sshd on loopback; real-systemd hosts (nspawn)
    "tests.plugins.vllm_parser",    # the cached venv holding the real vLLM argument parser
    "tests.plugins.real_vllm",      # vLLM's CPU build: a real vLLM server, real-vLLM sim hosts
    "tests.plugins.tiers",          # each test's tier marker, and its group for parallel workers
    "tests.plugins.cpu_report",     # --cpu-report=FILE: each test's CPU, its processes included
    "tests.plugins.isolation",      # a test leaves its worker as it found it (signals, env, cwd, umask)
]
