"""The run's timeline picture: one lane per resource, the whole run and one zoomed step.

Lanes are the segments of :func:`infra.ops.utilisation.lane_segments` (trainer ranks, rollout
worker, orchestrator), coloured by bucket; the sandbox lane shows when scoring jobs were in flight
(score stages and evaluations) — the pool's seconds themselves are totals, in the breakdown table.
Written as ``timeline.png`` beside ``summary.json`` and logged to MLflow ``plots/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.ops.plots import _pyplot
from infra.ops.utilisation import Span, lane_segments

COLOURS = {
    "train": "tab:blue", "warmstart": "tab:cyan", "generate": "tab:green", "load_weights": "tab:olive",
    "eval_generate": "mediumseagreen", "scoring": "tab:purple", "orchestration": "tab:pink", "jobs": "tab:purple",
    "waiting_for_rollouts": "lightcoral", "waiting_for_weights": "navajowhite", "waiting_for_services": "lightgray",
    "scoring_queue_wait": "tab:red", "evaluation": "khaki", "startup": "silver", "teardown": "dimgray",
    "warm_or_empty": "whitesmoke",
}
LANE_ORDER = ("trainer", "rollout", "sandboxes", "orchestrator")


def sandbox_lane(history: list[dict[str, Any]], start: float, end: float) -> list[Span]:
    """When scoring jobs were in flight: score stages (``jobs``) and evaluations; else ``warm_or_empty``."""
    busy = sorted([(h["spans"]["score"][0], h["spans"]["score"][1]) for h in history
                   if h.get("kind") == "step" and "score" in (h.get("spans") or {})] +
                  [(h["t0"], h["t1"]) for h in history if h.get("kind") == "phase" and h["phase"] in ("eval", "promote")])
    out: list[Span] = []
    t = start
    for a, b in busy:
        a, b = max(a, t), min(b, end)
        if b <= a:
            continue
        if a > t:
            out.append((t, a, "warm_or_empty"))
        out.append((a, b, "jobs"))
        t = b
    if t < end:
        out.append((t, end, "warm_or_empty"))
    return out


def zoom_window(history: list[dict[str, Any]]) -> tuple[float, float, int] | None:
    """(t0, t1, step) of the middle step that ran all its stages, padded by 5% each side."""
    steps = [h for h in history if h.get("kind") == "step" and len(h.get("spans") or {}) == 4]
    if not steps:
        return None
    h = steps[len(steps) // 2]
    t0 = min(s[0] for s in h["spans"].values())
    t1 = max(s[1] for s in h["spans"].values())
    pad = 0.05 * (t1 - t0)
    return t0 - pad, t1 + pad, int(h["step"])


def _draw(ax: Any, lanes: dict[str, list[Span]], origin: float, lo: float, hi: float) -> set[str]:
    used: set[str] = set()
    for y, name in enumerate(LANE_ORDER):
        for t0, t1, lab in lanes[name]:
            if t1 < lo or t0 > hi:
                continue
            ax.broken_barh([(t0 - origin, t1 - t0)], (y - 0.4, 0.8), color=COLOURS.get(lab, "black"))
            used.add(lab)
    ax.set_yticks(range(len(LANE_ORDER)), LANE_ORDER)
    ax.set_ylim(-0.6, len(LANE_ORDER) - 0.4)
    ax.set_xlim(lo - origin, hi - origin)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    return used


def plot_timeline(summary: dict[str, Any], path: str | Path) -> Path:
    """Write the timeline PNG of a run summary (with ``utilisation_window`` and ``history``) to ``path``."""
    plt = _pyplot()
    start, end = summary["utilisation_window"]
    history = summary["history"]
    concurrency = int(summary["utilisation"]["sandboxes"].get("concurrency", 1))
    colocated = summary["utilisation"]["rollout"]["count"] == 0  # generation on the trainer ranks
    lanes: dict[str, list[Span]] = {**lane_segments(history, start, end, concurrency, colocated),
                                    "sandboxes": sandbox_lane(history, start, end)}
    zoom = zoom_window(history)
    fig, axes = plt.subplots(2 if zoom else 1, 1, figsize=(12, 6.4 if zoom else 3.4), squeeze=False)
    used = _draw(axes[0, 0], lanes, start, start, end)
    axes[0, 0].set_title(f"run {summary.get('run_id', '')}: {end - start:.0f} s wall")
    if zoom:
        used |= _draw(axes[1, 0], lanes, start, zoom[0], zoom[1])
        axes[1, 0].set_title(f"step {zoom[2]} (zoomed)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in COLOURS if k in used]
    fig.legend(handles, [k for k in COLOURS if k in used], loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
