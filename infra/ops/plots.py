"""Training plots logged to MLflow: reward, KL, held-out eval and weight-sync bytes per step.

Complements ``infra/stages/summary.py``'s two-panel curves (written next to ``summary.json``)
with the four views an operator checks first, as one PNG under the run's ``plots/`` artifacts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _xy(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def plot_operations(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Write a 2x2 PNG (reward ± std, KL, eval score/accuracy, sync bytes vs full) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h for h in history if h.get("kind") == "step"]
    evals = [h for h in history if h.get("kind") == "eval"]
    fig, ax = plt.subplots(2, 2, figsize=(10, 6.4))
    x, y = _xy(steps, "reward_mean")
    _, sd = _xy(steps, "reward_std")
    ax[0, 0].plot(x, y, marker=".", label="mean")
    if len(sd) == len(y):
        ax[0, 0].fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], alpha=0.2, label="± std")
    ax[0, 0].set_title("rollout reward"); ax[0, 0].legend()
    x, y = _xy(steps, "kl")
    ax[0, 1].plot(x, y, marker=".", color="tab:red")
    ax[0, 1].set_title("KL to reference")
    x, y = _xy(evals, "score")
    ax[1, 0].plot(x, y, marker="o", label="score")
    x, y = _xy(evals, "accuracy")
    ax[1, 0].plot(x, y, marker="s", label="all tests pass")
    ax[1, 0].set_title("held-out eval"); ax[1, 0].legend()
    x, y = _xy(steps, "sync_bytes")
    xr, yr = _xy(steps, "sync_raw_bytes")
    ax[1, 1].bar(x, y, color="tab:green", label="delta written")
    if yr:
        ax[1, 1].plot(xr, yr, color="gray", linestyle="--", label="full bf16 snapshot")
        ax[1, 1].set_yscale("log")
    ax[1, 1].set_title("weight sync bytes"); ax[1, 1].legend()
    for a in ax.flat:
        a.set_xlabel("step"); a.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
