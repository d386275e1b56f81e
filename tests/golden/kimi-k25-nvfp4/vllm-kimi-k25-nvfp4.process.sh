#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of kimi-k25-nvfp4 for a host without systemd.
# manifest sha256: 6b2f7df3c7877add1d6407a3aba5eec9da0b03da19fdfeecd81adbc5983f6bcc
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-kimi-k25-nvfp4.env
set +a
cd /srv/models/kimi-k25-nvfp4 || exit 1
exec /srv/venv/bin/vllm serve /srv/models/kimi-k25-nvfp4 --served-model-name kimi-k2.5-nvfp4 --host 0.0.0.0 --port 8000 --tensor-parallel-size 8 --max-model-len 131072 --gpu-memory-utilization 0.93 --kv-cache-dtype fp8 --attention-backend TRITON_MLA --moe-backend marlin --mm-encoder-tp-mode data --trust-remote-code --tool-call-parser kimi_k2 --enable-auto-tool-choice --reasoning-parser kimi_k2
