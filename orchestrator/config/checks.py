"""The preflight checks by name, for `--skip-check NAME` and a host's `skip_checks` setting.

Plain Python (no pydantic), so the command line can offer and complete the names without loading
the schemas. The checks themselves are in orchestrator.plan.preflight, whose CHECK_NAMES must list
the same names (tests/unit/test_inventory.py says so).
"""

from __future__ import annotations

from typing import Literal, get_args

CheckName = Literal["flags", "env", "service-user", "root-programs", "root-folders", "vllm-version", "version-traps",
                    "package-pairs", "torch-cuda", "required-packages", "gpus", "foreign-gpu-processes"]
CHECK_NAMES: tuple[str, ...] = get_args(CheckName)
