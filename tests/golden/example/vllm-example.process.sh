#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of example for a host without systemd.
# manifest sha256: 1adf08d79a5ce33fad215109c1740d14556b5a81cc58c5b2df23072ec9ff3a86
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-example.env
set +a
cd /srv/models/example || exit 1
exec /srv/venv/bin/vllm serve /srv/models/example --served-model-name qwen3-8b --host 0.0.0.0 --port 8001 --tensor-parallel-size 1 --max-model-len 32768 --gpu-memory-utilization 0.9 --kv-cache-dtype auto --tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser qwen3 --max-num-seqs 256 --enable-prefix-caching --shutdown-timeout 30
