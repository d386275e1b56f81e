"""Where each rendered value comes from: the manifest, the hardware class its host's GPUs picked, or
the host's settings. Pure: (rendered files, effective manifest) -> lines for `vllm-orch render`."""

from __future__ import annotations

from orchestrator.config.effective import MANIFEST, Effective
from orchestrator.render.artifacts import Rendered, node_env

# Where a multi-node service's per-node tokens come from (render/artifacts.py's provenance names).
NODE_ORIGINS = {"(node rank)": "this node's rank (its place in --host, the head first)",
                "(head cluster address)": "the head's cluster address (hosts.yaml cluster.address, or its address)",
                "(head ray address)": "the head's cluster address, manifest multinode.ray_port",
                "host.cluster.address": "this host's cluster address (hosts.yaml cluster.address, or its address)",
                "(this node's GPUs)": "Ray's ports, pinned per service from this node's first GPU index "
                                      "(docs/multi-node.md, Ports)"}


def _flags(r: Rendered) -> list[tuple[str, str]]:
    """(field, its argv tokens) in argv order, one row per manifest field."""
    rows: dict[str, list[str]] = {}
    for token, fld in r.provenance:
        if fld.startswith(("vllm.", "serving.", "multinode.")) or (r.role is not None and fld in NODE_ORIGINS):
            rows.setdefault(fld.split("[")[0], []).append(token)
    return [(f, " ".join(t)) for f, t in rows.items()]


def _origin(eff: Effective, fld: str) -> str:
    if fld in NODE_ORIGINS:
        return NODE_ORIGINS[fld]
    return eff.origin(fld) if eff.origin(fld) != MANIFEST else f"{MANIFEST} {fld}"


def source_lines(r: Rendered, eff: Effective) -> list[str]:
    """One line per flag and environment variable: `value  <- origin`. Origins other than the
    manifest come first in the reader's eye: they are marked with `*`."""
    rows: list[tuple[str, str]] = []
    for fld, tokens in _flags(r):
        rows.append((tokens, _origin(eff, fld)))
    gpus = ",".join(str(i) for i in r.manifest.serving.visible_devices)
    rows.append((f"CUDA_VISIBLE_DEVICES={gpus}", eff.origin("serving.gpu_ids") if
                 eff.origin("serving.gpu_ids") != MANIFEST else f"{MANIFEST} serving.gpu_ids"))
    for name, value in node_env(r.manifest, r.host, r.role):
        origin = "this host's cluster address" if name == "VLLM_HOST_IP" else "hosts.yaml cluster.interface"
        rows.append((f"{name}={value}", origin))
    for name, value in r.manifest.env.items():
        origin = eff.origin(f"env.{name}")
        rows.append((f"{name}={value}", origin if origin != MANIFEST else f"{MANIFEST} env.{name}"))
    for path in ("startup.budget_seconds", "startup.no_progress_seconds", "requires.min_vllm_version"):
        if eff.origin(path) != MANIFEST:
            section, _, name = path.partition(".")
            rows.append((f"{path}: {getattr(getattr(r.manifest, section), name)}", eff.origin(path)))
    perf = r.manifest.performance
    if perf.expects:
        figures = ", ".join(f"{k} {v:g}" for k, v in (("single_stream_tok_s", perf.single_stream_tok_s),
                                                      ("concurrency", perf.concurrency),
                                                      ("concurrency_tok_s", perf.concurrency_tok_s)) if v)
        origin = eff.origin("performance")
        rows.append((f"performance: {figures}", origin if origin != MANIFEST else f"{MANIFEST} performance"))
    width = min(max((len(v) for v, _ in rows), default=0), 60)
    head = [eff.hardware_note() or "hardware class: not known (a remote host is not contacted: give --hardware CLASS to see one)"]
    if eff.hardware_problem:
        head.append(f"  refused there: {eff.hardware_problem}")
    return head + [f"{'*' if not o.startswith(MANIFEST) else ' '} {v:<{width}}  <- {o}" for v, o in rows]
