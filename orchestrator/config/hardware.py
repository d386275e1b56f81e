"""Hardware classes: which family a host's GPUs belong to, so one manifest can say what it needs on
each (`requires.hardware: {rtx-pro-6000: {...}, b200: {...}}`) without a second file.

A class is recognised from nvidia-smi's GPU name. The table is small on purpose: a class is worth
naming when the same model needs different flags on it (attention/MoE backends differ by compute
capability; NCCL behaves differently over PCIe than over NVLink). Pure data and functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareClass:
    key: str                    # the name manifests use under requires.hardware
    pattern: str                # regular expression matched against nvidia-smi's GPU name
    arch: str                   # CUDA compute capability family
    interconnect: str           # how its GPUs usually talk to each other in an 8-GPU host
    description: str

    def matches(self, gpu_name: str) -> bool:
        return re.search(self.pattern, gpu_name or "", re.I) is not None


# nvidia-smi names, e.g. "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA B200",
# "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GB200". `\b` keeps B200 from matching GB200.
CLASSES: tuple[HardwareClass, ...] = (
    HardwareClass("rtx-pro-6000", r"RTX PRO 6000", "SM120", "PCIe",
                  "RTX PRO 6000 Blackwell (Server, Workstation, Max-Q), 96 GB, no NVLink"),
    HardwareClass("b300", r"\bB300\b", "SM103", "NVLink", "B300 (HGX), NVLink"),
    HardwareClass("b200", r"\bB200\b", "SM100", "NVLink", "B200 (HGX), 180 GB, NVLink"),
    HardwareClass("gb200", r"\bGB200\b", "SM100", "NVLink", "GB200 (Grace Blackwell), NVLink"),
    HardwareClass("h200", r"\bH200\b", "SM90", "NVLink", "H200 (HGX), 141 GB, NVLink"),
    HardwareClass("h100", r"\bH100\b", "SM90", "NVLink or PCIe", "H100 (SXM with NVLink, or PCIe), 80/94 GB"),
)
CLASS_KEYS: tuple[str, ...] = tuple(c.key for c in CLASSES)


def by_key(key: str) -> HardwareClass | None:
    return next((c for c in CLASSES if c.key == key), None)


def class_of(gpu_name: str) -> HardwareClass | None:
    """The class of one GPU by its nvidia-smi name; None when it is none of the known ones."""
    return next((c for c in CLASSES if c.matches(gpu_name)), None)


def classify(gpu_names: Iterable[str]) -> tuple[str | None, str | None]:
    """(class key, problem) for the GPUs a service will use: all must be of one known class.
    (None, None) when there are no names to look at (nvidia-smi failed: the gpus check says so)."""
    names = [n for n in gpu_names]
    if not names:
        return None, None
    found = {n: class_of(n) for n in names}
    unknown = sorted({n for n, c in found.items() if c is None})
    if unknown:
        return None, (f"{unknown[0]} is of no known hardware class "
                      f"(known: {', '.join(CLASS_KEYS)})")
    keys = sorted({c.key for c in found.values() if c is not None})
    if len(keys) > 1:
        return None, f"the chosen GPUs are of different classes ({', '.join(keys)})"
    return keys[0], None
