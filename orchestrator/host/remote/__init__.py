"""Scripts run ON THE HOST by its own Python (stdlib + what a vLLM venv has); read as text and sent
there by the controller, never imported by it. One is installed instead: unit_probe.py, the systemd
units' readiness probe and health check, which systemd runs with no vllm-orch connected (it is
rendered as a file of the unit, orchestrator/render/artifacts.py)."""
