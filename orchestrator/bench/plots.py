"""PNG plots of a sweep (matplotlib, Agg backend, imported only here).

matplotlib is an extra (`pip install 'vllm-orch[plots]'`): a controller that only deploys does not
need it, and a report written without it says the plots were skipped and how to get them.
"""

from __future__ import annotations

from pathlib import Path

INSTALL_HINT = "PNG plots need matplotlib: pip install 'vllm-orch[plots]'"


class PlotsUnavailable(ImportError):
    """matplotlib is not installed; str() is the one-line message for the user."""


def _plt():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable(INSTALL_HINT) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _x(L: dict) -> float | None:
    """The load of a level on the x axis: concurrency (closed loop) or offered rate (open loop)."""
    if L.get("mode", "closed") == "closed":
        return L["concurrency"]
    return None if L.get("rate") in (None, "inf") else float(L["rate"])


def write_plots(levels: list[dict], out_dir: Path, title: str) -> dict[str, Path]:
    """throughput.png, latency.png, per_user.png; returns {name: path}. Open-loop runs are plotted
    against the offered rate (a rate-inf burst has no place on that axis and is left out)."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [L for L in levels if L["requests"]["ok"] and _x(L) is not None]
    if not levels:
        return {}
    cs = [_x(L) for L in levels]
    xlabel = "concurrency" if levels[0].get("mode", "closed") == "closed" else "offered rate (requests/s)"
    ticks = [f"{c:g}" for c in cs]
    paths: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    tps = [L["throughput"]["output_tok_s"] for L in levels]
    se = [L["throughput"]["output_tok_s_se"] for L in levels]
    ax.errorbar(cs, tps, yerr=se, marker="o", capsize=3, label="output tok/s (steady window)")
    ax2 = ax.twinx()
    ax2.plot(cs, [L["throughput"]["requests_per_s"] for L in levels], "s--", color="tab:orange",
             label="requests/s")
    if any(L.get("slo") for L in levels):
        ax.plot(cs, [(L.get("slo") or {}).get("goodput_tok_s") for L in levels], "D:", color="tab:green",
                label="goodput tok/s (within SLO)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tokens/s")
    ax2.set_ylabel("requests/s")
    ax.set_title(f"Throughput vs {xlabel.split(' (')[0]} - {title}")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    paths["throughput"] = _save(fig, out_dir / "throughput.png", plt)

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=110)
    for ax, metric, name in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "E2E")):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p95", "v-."), ("p99", "^:")):
            ax.plot(cs, [L["latency_ms"][metric].get(stat) for L in levels], style, label=stat)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, ticks)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    paths["latency"] = _save(fig, out_dir / "latency.png", plt)

    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
    xs = [L["throughput"]["output_tok_s"] for L in levels]
    ys = [L["per_user"]["tok_s_user_median"] or 0 for L in levels]
    ax.plot(xs, ys, "o-")
    for x, y, L in zip(xs, ys, levels):
        ax.annotate(L.get("level") or f"C={L['concurrency']}", (x, y), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.set_xlabel("aggregate output tok/s")
    ax.set_ylabel("tok/s per user (median 1/TPOT)")
    ax.set_title(f"Per-user speed vs aggregate throughput - {title}")
    ax.grid(alpha=0.3)
    paths["per_user"] = _save(fig, out_dir / "per_user.png", plt)
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
