"""Model folders under models_root: which ones vllm-orch made, and the one way to delete one (how
one is named: config/checkpoints.py, one folder per repo@commit).

vllm-orch frees disk (deploy, swap, gc) by deleting whole model folders, as root. models_root may
hold folders that are not ours (someone's experiments, a copy made by hand), so a folder counts as
ours only when it carries our record: the download script writes `<folder>/.vllm-orch/verified.json`
as soon as it starts filling a folder (repo, revision, the files verified so far). Everything else is
never a candidate, whatever its age or size.

The delete itself re-checks everything on the host at the moment of deleting (the facts a plan was
built on may be a 28-minute download old): the resolved models_root is not `/`, a system folder or
a home folder itself (the same rule as the inventory's, config/inventory.py), the target is a real
folder (not a symlink) directly inside it, and it still carries our record.
"""

from __future__ import annotations

import re
import shlex

from orchestrator.config.checkpoints import is_ours  # noqa: F401  (here for its callers)
from orchestrator.config.inventory import HOME_PARENTS, SYSTEM_FOLDERS, SYSTEM_TREES, TREE_EXCEPTIONS
from orchestrator.errors import RefusedError
from orchestrator.host.base import Script

RECORD = ".vllm-orch/verified.json"
REFUSED_EXIT = 3


def _root_guard() -> str:
    """A shell `case` on $R (the resolved models_root) that exits 3 for a folder the inventory
    would refuse: the guard holds even when a symlink or a mount changed what the path means."""
    allowed = [f"{ok}/?*" for ok in TREE_EXCEPTIONS] + [f"{parent}/*/?*" for parent in HOME_PARENTS]
    refused = sorted(set(SYSTEM_FOLDERS) | set(SYSTEM_TREES)) + [f"{tree}/*" for tree in SYSTEM_TREES] + \
        [f"{parent}/*" for parent in HOME_PARENTS]
    return (f"case \"$R\" in {'|'.join(_pattern(p) for p in allowed)}) ;; "
            f"{'|'.join(_pattern(p) for p in refused)}) "
            f"echo \"models_root resolves to $R, a system or home folder\" >&2; exit {REFUSED_EXIT};; esac; ")


def _pattern(path: str) -> str:
    """A case pattern from our own constants: plain path characters and the shell's `*` / `?`."""
    if not re.match(r"^[/A-Za-z0-9_.?*-]+$", path):
        raise ValueError(f"not a plain folder pattern: {path!r}")
    return path


def delete_script(models_root: str, name: str) -> Script:
    """rm -rf of models_root/NAME only after resolving both on the host: the root must not be a
    system folder, the folder must be a real directory (not a symlink) whose resolved parent is the
    resolved root, and it must carry vllm-orch's record. Exit 3 = refused (message on stderr)."""
    if not name or "/" in name or name in (".", "..") or name.startswith("."):
        raise RefusedError(f"refusing to delete {name!r}: not a plain folder name", step="disk")
    q = shlex.quote
    root, target = q(models_root), q(f"{models_root}/{name}")
    return Script(
        f"R=$(realpath -e -- {root}) || exit {REFUSED_EXIT}; " + _root_guard() +
        f"[ -L {target} ] && {{ echo 'is a symlink' >&2; exit {REFUSED_EXIT}; }}; "
        f"T=$(realpath -e -- {target}) || exit 0; "
        f"[ -d \"$T\" ] || {{ echo 'not a directory' >&2; exit {REFUSED_EXIT}; }}; "
        f"[ \"$(dirname -- \"$T\")\" = \"$R\" ] && [ \"$T\" != \"$R\" ] || "
        f"{{ echo \"resolves to $T, outside $R\" >&2; exit {REFUSED_EXIT}; }}; "
        f"[ -f \"$T\"/{q(RECORD)} ] && [ ! -L \"$T\"/.vllm-orch ] || "
        f"{{ echo \"$T has no {RECORD}: not a folder vllm-orch made\" >&2; exit {REFUSED_EXIT}; }}; "
        f"rm -rf --one-file-system -- \"$T\"",
        display=f"rm -rf {q(models_root + '/' + name)}  (after checking on the host that it resolves to a "
                f"direct child of {q(models_root)} holding vllm-orch's record)")
