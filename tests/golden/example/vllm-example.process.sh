#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of example for a host without systemd.
# manifest sha256: a0894ed621e2f89f848426447c81593dc5c330c87b9cbedf0172fd566d36254b
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-example.env
set +a
cd /srv/models/example || exit 1
exec /srv/venv/bin/vllm serve /srv/models/example --served-model-name qwen3-8b --host 0.0.0.0 --port 8001 --tensor-parallel-size 1 --max-model-len 32768 --gpu-memory-utilization 0.9 --kv-cache-dtype auto --tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser qwen3 --max-num-seqs 256 --enable-prefix-caching
