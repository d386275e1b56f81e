#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of tiny-llama-b for a host without systemd.
# manifest sha256: 8217266e109fce74cb4beb354228061509aa5cad811e1a37b1bc7fdf8f716a3b
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-tiny-llama-b.env
set +a
cd /srv/models/tiny-llama-b || exit 1
exec /srv/venv/bin/vllm serve /srv/models/tiny-llama-b --served-model-name tiny-llama-b --host 127.0.0.1 --port 8101 --tensor-parallel-size 1 --max-model-len 1024 --gpu-memory-utilization 0.1 --enforce-eager
