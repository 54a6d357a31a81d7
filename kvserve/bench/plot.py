"""Pictures of results files: a per-request timeline like the book's Figure 31.1 (one panel per
file, one row per request: arrival, wait, first token, each later emission) and CDFs of TTFT/TPOT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# Above this many rows or emissions a panel drops per-emission markers and labels, which would
# only smear; the wait and streaming bars still show every request.
MAX_LABELLED_ROWS = 12
MAX_EMISSION_MARKERS = 4000


def _timeline_panel(ax: Any, res: dict[str, Any], label: str) -> None:
    requests = sorted(res["requests"], key=lambda r: r["arrival"])
    few = len(requests) <= MAX_LABELLED_ROWS
    markers = sum(len(r["token_times"]) for r in requests) <= MAX_EMISSION_MARKERS
    for row, rec in enumerate(requests):
        y = len(requests) - 1 - row  # first arrival on top, as in the book's figure
        arrival = rec["arrival"] * 1000
        times = [t * 1000 for t in rec["token_times"]]
        ax.plot([arrival], [y], marker="o", mfc="white", mec="black", ms=7 if few else 3, zorder=3)
        if not times:
            ax.text(arrival, y + 0.15, f" failed: {rec['error']}", fontsize=7, color="crimson")
            continue
        ax.plot([arrival, times[0]], [y, y], color="0.7", lw=2, ls="--", zorder=1)  # waiting
        ax.plot([times[0], times[-1]], [y, y], color="tab:blue", lw=4 if few else 1.5, alpha=0.35, zorder=1)
        if markers:
            ax.plot(times[1:], [y] * (len(times) - 1), "|", color="tab:blue", ms=12 if few else 4, mew=2)
        ax.plot([times[0]], [y], marker="D", color="tab:orange", ms=8 if few else 3, zorder=3)
        if few:
            emissions = " → ".join(f"{t:.0f}" for t in times)
            ax.text(times[-1], y + 0.18, f"  {emissions}", fontsize=8, va="bottom")
    if few:
        ax.set_yticks(range(len(requests)), [r["id"] for r in reversed(requests)])
    else:
        ax.set_ylabel("requests (by arrival)")
        ax.set_yticks([])
    window = res.get("window") or {}
    drain_end = (min(r["arrival"] for r in requests) + res["duration"]) * 1000 if requests else 0.0
    ax.axvline(drain_end, color="tab:green", ls=":", lw=1.5)
    if window.get("kind") == "fixed":
        ax.axvspan(window["start_ms"], window["end_ms"], color="tab:purple", alpha=0.05)
        ax.axvline(window["end_ms"], color="tab:purple", ls=":", lw=1.5)
    rate = res.get("output_throughput")
    title = f"{label}: drain {res['duration'] * 1000:.0f} ms, {rate:.4g} output tok/s" if rate else label
    if window.get("kind") == "fixed":
        title += f"; fixed window {window['duration'] * 1000:.0f} ms: {window['output_throughput']:.4g} tok/s"
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_ylim(-0.6, len(requests) - 0.2)
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(results: list[dict[str, Any]], labels: list[str], path: str | Path) -> None:
    """One panel per results file, sharing the time axis (ms on the run's clock)."""
    rows = [min(len(r["requests"]), 40) for r in results]
    fig, axes = plt.subplots(
        len(results), 1, sharex=True, squeeze=False, figsize=(9, 1.2 + sum(0.45 * n + 0.8 for n in rows))
    )
    for ax, res, label in zip(axes[:, 0], results, labels, strict=True):
        _timeline_panel(ax, res, label)
    handles = [
        plt.Line2D([], [], marker="o", mfc="white", mec="black", ls="", label="arrival"),
        plt.Line2D([], [], color="0.7", ls="--", lw=2, label="waiting"),
        plt.Line2D([], [], marker="D", color="tab:orange", ls="", label="first token"),
        plt.Line2D([], [], marker="|", color="tab:blue", ls="", ms=10, mew=2, label="later emissions"),
    ]
    handles += [
        plt.Line2D([], [], color="tab:green", ls=":", label="drain window end"),
        plt.Line2D([], [], color="tab:purple", ls=":", label="fixed window end"),
    ]
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    fig.legend(handles=handles, loc="upper center", fontsize=8, ncols=len(handles), frameon=False)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cdfs(results: list[dict[str, Any]], labels: list[str], path: str | Path) -> None:
    """Empirical CDFs of TTFT and TPOT (missing TPOTs excluded and counted in the legend)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, name in zip(axes, ("ttfts", "tpots"), ("TTFT", "TPOT"), strict=True):
        for res, label in zip(results, labels, strict=True):
            values = np.sort([v * 1000 for v in res[key] if v is not None])
            missing = sum(1 for v in res[key] if v is None)
            if values.size:
                ax.step(
                    np.concatenate([[values[0]], values]),
                    np.concatenate([[0.0], np.arange(1, values.size + 1) / values.size]),
                    where="post",
                    label=f"{label} (n={values.size}" + (f", {missing} missing)" if missing else ")"),
                )
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
