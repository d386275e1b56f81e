"""The `vllm serve` flag list vllm-orch checks extra_args against (orchestrator/config/
vllm_serve_flags.txt, read by config/vllmflags.py) is vLLM 0.33.0's, and vllm-orch reads a token
as the REAL parser does: `_` as `-`, a unique prefix as the option it starts, a short alias as its
option (cached venv of the real parser, CPU torch)."""

from __future__ import annotations

import json
import subprocess

import pytest

from orchestrator.config.vllmflags import resolve
from orchestrator.devtools.vllm_flags import TARGET, generate

pytestmark = pytest.mark.vllm_parser

# Run by the parser venv: which option (dest) each argv token sets in `vllm serve MODEL TOKEN [VALUE]`.
DESTS = r"""
import json, os, sys
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
defaults = vars(parser.parse_args(["m"]))
out = {}
for argv in json.loads(sys.argv[1]):
    try:
        got = vars(parser.parse_args(["m", *argv]))
    except SystemExit:
        out[argv[0]] = None
        continue
    out[argv[0]] = sorted(k for k in got if got[k] != defaults.get(k))
print(json.dumps(out))
"""


def test_the_shipped_flag_list_is_the_real_parsers(vllm_parser_python):
    assert TARGET.read_text() == generate(vllm_parser_python), \
        "vLLM's flags changed: run `python -m orchestrator.devtools.vllm_flags` and review the diff"


def test_tokens_resolve_to_the_option_the_real_parser_sets(vllm_parser_python):
    cases = [["--api_key", "sk"], ["--api-k=sk"], ["--api-ke", "sk"], ["--trust_remote_code"],
             ["--tensor_parallel_size", "2"], ["--tensor-parallel", "2"], ["-tp=2"], ["-dcp", "2"],
             ["--no-trust-remote-code"], ["--served_model_name", "x"], ["--max_num_seqs", "7"], ["--hf_token", "x"]]
    r = subprocess.run([str(vllm_parser_python), "-c", DESTS, json.dumps(cases)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    real = json.loads(r.stdout.splitlines()[-1])
    for argv in cases:
        option, _ = resolve(argv[0])
        assert option is not None, argv
        dest = option.lstrip("-").replace("-", "_")
        expected = [] if argv[0].startswith("--no-") else [dest]     # --no-X sets X to its default, False
        assert real[argv[0]] == expected, (argv, real[argv[0]], option)
