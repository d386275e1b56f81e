#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of kimi-k25-nvfp4 for a host without systemd.
# manifest sha256: 95c7dac133a977eb07ddbbf5f184b92fa9e92210070282b8ad5d91905d72b462
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-kimi-k25-nvfp4.env
set +a
cd /srv/models/kimi-k25-nvfp4 || exit 1
set -- /srv/venv/bin/vllm serve /srv/models/kimi-k25-nvfp4 --served-model-name kimi-k2.5-nvfp4 --host 0.0.0.0 --port 8000 --tensor-parallel-size 8 --max-model-len 131072 --gpu-memory-utilization 0.93 --kv-cache-dtype fp8 --attention-backend TRITON_MLA --moe-backend marlin --mm-encoder-tp-mode data --trust-remote-code --tool-call-parser kimi_k2 --enable-auto-tool-choice --reasoning-parser kimi_k2 --shutdown-timeout 30
# Run as the service user vllm (least privilege): root drops to it after reading the
# 0600 env file above; anyone else must be that user already.
if [ "$(id -un)" != vllm ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "vllm-orch: $(id -un) cannot start the service as vllm (only root can switch users)" >&2
        exit 1
    fi
    HOME=$(getent passwd vllm | cut -d: -f6)
    export HOME
    exec setpriv --reuid=vllm --regid="$(id -g vllm)" \
        --init-groups --no-new-privs -- "$@"
fi
exec "$@"
