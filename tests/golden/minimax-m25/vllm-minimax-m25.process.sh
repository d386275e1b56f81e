#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of minimax-m25 for a host without systemd.
# manifest sha256: 31e1ac3aee26cc7d127a338030c965d775154e921d82dfc44d6e011bc626738b
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
set -a
. /srv/vllm-orch/units/vllm-minimax-m25.env
set +a
cd /srv/models/minimax-m25 || exit 1
set -- /srv/venv/bin/vllm serve /srv/models/minimax-m25 --served-model-name minimax-m2.5 --host 0.0.0.0 --port 8000 --tensor-parallel-size 4 --max-model-len 196608 --gpu-memory-utilization 0.9 --trust-remote-code --tool-call-parser minimax_m2 --enable-auto-tool-choice --reasoning-parser minimax_m2 --shutdown-timeout 30 --compilation-config '{"cudagraph_mode":"PIECEWISE"}'
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
