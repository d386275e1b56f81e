#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of tiny-llama-a for a host without systemd.
# manifest sha256: a91c30d4a1cadd15c2f6d368ab5224bf1cbdc4345af6b8249f37af494476c615
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-tiny-llama-a.env
set +a
cd /srv/models/tiny-llama-a || exit 1
exec /srv/venv/bin/vllm serve /srv/models/tiny-llama-a --served-model-name tiny-llama-a --host 127.0.0.1 --port 8101 --tensor-parallel-size 1 --max-model-len 1024 --gpu-memory-utilization 0.1 --shutdown-timeout 30 --enforce-eager
