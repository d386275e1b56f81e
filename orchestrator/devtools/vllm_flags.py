"""Writes orchestrator/config/vllm_serve_flags.txt from the REAL vLLM parser (the cached venv of
devtools/vllm_parser_venv.py): one line per `vllm serve` option, its option strings separated by
spaces, the one vLLM stores it under (its dest) first. config/vllmflags.py reads it to compare
extra_args as vLLM's parser reads them; tests/integration/test_vllm_flags_contract.py checks the
shipped file against the parser.

    python -m orchestrator.devtools.vllm_flags            # rewrite the shipped file
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from orchestrator.paths import package_file

TARGET = package_file("config", "vllm_serve_flags.txt")

# Run by the parser venv's python: every action of `vllm serve`'s parser, long names first.
SCRIPT = r"""
import os
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import vllm
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
# every spelling the parser registered (an enable/disable option hides its --no- form from
# option_strings, and still accepts it)
by_action = {}
for name, action in parser._option_string_actions.items():
    by_action.setdefault(id(action), (action, set()))[1].add(name)
lines = set()
for action, names in by_action.values():
    names = sorted(names, key=lambda s: (s[2:].replace("-", "_") != action.dest, not s.startswith("--"),
                                         s.startswith("--no-"), s))
    lines.add(" ".join(names))
print("# vLLM %s `vllm serve` options (orchestrator/devtools/vllm_flags.py): one option a line, its" % vllm.__version__)
print("# spellings separated by spaces, the one named after its dest first. Do not edit: regenerate.")
for line in sorted(lines):
    print(line)
"""


def generate(python: str | Path) -> str:
    r = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"the parser venv could not list its flags: {r.stderr[-2000:]}")
    return r.stdout


def main() -> None:
    from orchestrator.devtools import vllm_parser_venv

    TARGET.write_text(generate(vllm_parser_venv.ensure_venv().python))
    print(f"wrote {TARGET}", file=sys.stderr)


if __name__ == "__main__":
    main()
