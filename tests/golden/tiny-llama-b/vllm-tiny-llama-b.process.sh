#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of tiny-llama-b for a host without systemd.
# manifest sha256: 37f254fdd737f2a3cf342fba820d55f1cf2dbd669c72ff995469ab67b5be49a3
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-tiny-llama-b.env
set +a
cd /srv/models/tiny-llama-b || exit 1
exec /srv/venv/bin/vllm serve /srv/models/tiny-llama-b --served-model-name tiny-llama-b --host 127.0.0.1 --port 8101 --tensor-parallel-size 1 --max-model-len 1024 --gpu-memory-utilization 0.1 --shutdown-timeout 30 --enforce-eager
