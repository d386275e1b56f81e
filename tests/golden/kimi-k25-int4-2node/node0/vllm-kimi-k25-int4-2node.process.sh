#!/bin/sh
# Managed by vllm-orch 0.1.0: start script of kimi-k25-int4-2node for a host without systemd.
# manifest sha256: ac39f85abd78cfc3c88ad22095aa80d08d93f67be65c1eb58e8a0578d6eee501
# vllm-orch runs it as: setsid <this script> >> <log> 2>&1 &   and records the PID.
cd /srv/models/kimi-k25-int4-2node || exit 1
set -- /srv/venv/bin/vllm serve /srv/models/kimi-k25-int4-2node --served-model-name kimi-k2.5 --host 0.0.0.0 --port 8000 --tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29501 --distributed-timeout-seconds 600 --max-model-len 262144 --gpu-memory-utilization 0.93 --kv-cache-dtype fp8 --attention-backend TRITON_MLA --mm-encoder-tp-mode data --trust-remote-code --tool-call-parser kimi_k2 --enable-auto-tool-choice --reasoning-parser kimi_k2 --max-num-batched-tokens 4096 --enable-prefix-caching --shutdown-timeout 30
# The service's environment is read by the service user vllm only, never by root: root
# opens the 0600 env file (fd 3) and drops privileges first (no new privileges); the shell that
# then reads it runs as vllm and execs vLLM. Anyone but root must be that user already.
exec 3< /srv/vllm-orch/units/vllm-kimi-k25-int4-2node.env || exit 1
run='set -a; eval "$(cat <&3)"; set +a; exec 3<&-; exec "$@"'
# Nothing of the caller's environment reaches vLLM (an operator's HF_TOKEN, VLLM_API_KEY or cloud
# credentials, an SSH session's variables): like a systemd unit, it gets a fixed PATH, the locale,
# its user's HOME, USER and LOGNAME, and what the env file sets.
base="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8"
if [ "$(id -un)" != vllm ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "vllm-orch: $(id -un) cannot start the service as vllm (only root can switch users)" >&2
        exit 1
    fi
    home=$(getent passwd vllm | cut -d: -f6)
    exec setpriv --reuid=vllm --regid="$(id -g vllm)" \
        --init-groups --no-new-privs -- env -i $base HOME="$home" USER=vllm \
        LOGNAME=vllm /bin/sh -c "$run" sh "$@"
fi
exec env -i $base HOME="$HOME" USER="$(id -un)" LOGNAME="$(id -un)" /bin/sh -c "$run" sh "$@"
