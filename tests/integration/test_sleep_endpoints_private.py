"""The development endpoints sleep mode needs never reach a network client. vLLM 0.33's API key
guards only /v1, /v2, /inference and /cohere (entrypoints/serve/middleware/authenticate.py), so
with VLLM_SERVER_DEV_MODE=1 anyone who reaches the port can call /sleep, /collective_rpc or
/update_weights. A manifest with `sleep` must listen on loopback (config/manifest.py); here the
SIMULATED vLLM runs in a network namespace of its own (another host) with the argv and env file
vllm-orch renders, and this test, a client on the network, tries the endpoints at the host's
address: the connection is refused. The control run listens on 0.0.0.0 as vLLM does by default:
the same client puts it to sleep without a key."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_manifest
from orchestrator.paths import shipped_dir
from orchestrator.render.artifacts import read_env_values, render
from tests.plugins.remote_hosts import routed_namespaces
from tests.plugins.sim_hosts import SimServer, make_model

pytestmark = pytest.mark.xdist_group("sleep-netns")


class NsServer(SimServer):
    """The simulated `vllm serve ARGV` run inside network namespace `ns` (argv as rendered)."""

    def __init__(self, sim, ns: str, argv: list, env: dict, port: int):
        self.sim, self.port = sim, port
        self.log_path = sim.dir / "logs" / f"vllm-{ns}-{port}.log"
        self.err_path = sim.dir / "logs" / f"vllm-{ns}-{port}.err"
        with open(self.log_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(["ip", "netns", "exec", ns, str(sim.dir / "bin" / "vllm"), *argv],
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **sim.entry["env"], **env})


def post(url: str):
    req = urllib.request.Request(url, method="POST", data=b"")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def rendered(sim_host, tmp_path, host_addr: str):
    text = (shipped_dir("models") / "tiny-llama-a.yaml").read_text()
    path = tmp_path / "tiny-llama-a.yaml"
    path.write_text(text.replace("host: 127.0.0.1", f"host: {host_addr}")
                    + ("sleep: {level: 1}\n" if host_addr == "127.0.0.1" else ""))
    m = load_manifest(path)
    make_model(sim_host.dir, "tiny-llama-a", "meta-llama/Llama-3.1-8B-Instruct", shards=1,
               total_size=2e9, custom_code=False)
    entry = HostEntry(name="gpu1", address="gpu1.example", models_root=str(sim_host.dir / "models"),
                      vllm="vllm")
    r = render(m, entry)
    env = read_env_values(r.env_file.text)
    env["VLLM_SERVER_DEV_MODE"] = "1"           # the control run too: only the address differs
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return r.argv[1:], {**env, "VLLM_API_KEY": "sekrit"}, m.serving.port


def test_the_dev_endpoints_are_refused_to_a_client_on_another_host(sim_host, tmp_path):
    with routed_namespaces(1, "sl") as [(ns, address)]:
        argv, env, port = rendered(sim_host, tmp_path, "127.0.0.1")
        assert "--enable-sleep-mode" in argv and argv[argv.index("--host") + 1] == "127.0.0.1"
        with NsServer(sim_host, ns, argv, env, port) as srv:
            srv.wait_ready(60)
            for path in ("/sleep?level=1", "/collective_rpc", "/update_weights", "/wake_up"):
                with pytest.raises(urllib.error.URLError) as e:
                    post(f"http://{address}:{port}{path}")
                assert isinstance(e.value.reason, ConnectionRefusedError), e.value
            # on the host itself (vllm-orch reaches it over SSH) the endpoint answers
            out = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c",
                                  "import urllib.request;print(urllib.request.urlopen(urllib.request.Request("
                                  f"'http://127.0.0.1:{port}/is_sleeping')).read().decode())"],
                                 capture_output=True, text=True, timeout=60)
            assert json.loads(out.stdout) == {"is_sleeping": False}, out.stderr

        # the control: the same server on every address (vLLM's default) is put to sleep by anyone
        argv, env, port = rendered(sim_host, tmp_path, "0.0.0.0")
        with NsServer(sim_host, ns, [*argv, "--enable-sleep-mode"], env, port) as srv:
            srv.wait_ready(60)
            assert post(f"http://{address}:{port}/v1/models")[0] in (401, 405)
            assert post(f"http://{address}:{port}/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
