#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of minimax-m25-ep for a host without systemd.
# manifest sha256: 6bcb880dade011cb924c036678905afc3213217dad1466c2a106b6f181aa104f
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-minimax-m25-ep.env
set +a
cd /srv/models/minimax-m25-ep || exit 1
exec /srv/venv/bin/vllm serve /srv/models/minimax-m25-ep --served-model-name minimax-m2.5 --host 0.0.0.0 --port 8000 --tensor-parallel-size 1 --data-parallel-size 8 --enable-expert-parallel --max-model-len 196608 --gpu-memory-utilization 0.9 --trust-remote-code --tool-call-parser minimax_m2 --enable-auto-tool-choice --reasoning-parser minimax_m2 --compilation-config '{"cudagraph_mode":"PIECEWISE"}'
