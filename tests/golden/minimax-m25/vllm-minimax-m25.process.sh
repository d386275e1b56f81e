#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of minimax-m25 for a host without systemd.
# manifest sha256: 8945ebecbf722f8fc3837815cbbfdc77a985b10d636ed10e3771f521d3a4e973
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-minimax-m25.env
set +a
cd /srv/models/minimax-m25 || exit 1
exec /srv/venv/bin/vllm serve /srv/models/minimax-m25 --served-model-name minimax-m2.5 --host 0.0.0.0 --port 8000 --tensor-parallel-size 4 --max-model-len 196608 --gpu-memory-utilization 0.9 --trust-remote-code --tool-call-parser minimax_m2 --enable-auto-tool-choice --reasoning-parser minimax_m2 --compilation-config '{"cudagraph_mode":"PIECEWISE"}'
