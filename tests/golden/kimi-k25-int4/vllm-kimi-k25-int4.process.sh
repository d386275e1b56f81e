#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of kimi-k25-int4 for a host without systemd.
# manifest sha256: cef1dea98000faa15f5a242d069d26b6d9d9472020dcaf0dea3222352ad3e4b0
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-kimi-k25-int4.env
set +a
cd /srv/models/kimi-k25-int4 || exit 1
exec /srv/venv/bin/vllm serve /srv/models/kimi-k25-int4 --served-model-name kimi-k2.5 --host 0.0.0.0 --port 8000 --tensor-parallel-size 8 --decode-context-parallel-size 8 --max-model-len 262144 --gpu-memory-utilization 0.93 --kv-cache-dtype fp8 --attention-backend TRITON_MLA --mm-encoder-tp-mode data --trust-remote-code --tool-call-parser kimi_k2 --enable-auto-tool-choice --reasoning-parser kimi_k2 --max-num-batched-tokens 4096 --enable-prefix-caching
