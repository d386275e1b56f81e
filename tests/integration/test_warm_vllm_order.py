"""The warm-up reads in vLLM's own load order: the host script's order of a model folder equals
what vLLM 0.33's loader computes for it (its weight_utils functions, run in the real vLLM venv)."""

from __future__ import annotations

import json
import subprocess
import sys

from orchestrator.paths import package_file

VLLM_ORDER = """
import glob, json, os, sys
from vllm.model_executor.model_loader.weight_utils import _natural_sort_key, filter_duplicate_safetensors_files
folder = sys.argv[1]
files = glob.glob(os.path.join(folder, "*.safetensors"))
files = filter_duplicate_safetensors_files(files, folder, "model.safetensors.index.json")
print(json.dumps([os.path.basename(f) for f in sorted(files, key=_natural_sort_key)]))
"""


def test_warm_order_is_vllm_0_33_load_order(tmp_path, vllm_parser_python):
    indexed = ["model-10.safetensors", "model-9.safetensors", "model-00002-of-000064.safetensors",
               "model-00001-of-000064.safetensors", "model-00064-of-000064.safetensors", "b-1.safetensors"]
    for name in indexed + ["consolidated.safetensors"]:
        (tmp_path / name).write_bytes(b"x" * 64)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"layer.{i}": n for i, n in enumerate(indexed)}}))
    vllm = subprocess.run([str(vllm_parser_python), "-c", VLLM_ORDER, str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert vllm.returncode == 0, vllm.stderr[-2000:]
    ours = subprocess.run([sys.executable, "-", "--dir", str(tmp_path), "--plan-only"],
                          input=package_file("host", "remote", "warm.py").read_text(), capture_output=True,
                          text=True, timeout=60)
    plan = json.loads(ours.stdout.splitlines()[0])
    assert [f[0] for f in plan["files"]] == json.loads(vllm.stdout.splitlines()[-1])
    assert "consolidated.safetensors" not in [f[0] for f in plan["files"]]
