"""The run's plots, drawn from its history (``RunContext.history``), both logged to MLflow ``plots/``.

- :func:`plot_curves`: reward per step and held-out eval per evaluation, two panels; written as
  ``curves.png`` next to ``summary.json`` (``infra/stages/summary.py``).
- :func:`plot_operations`: the four views an operator checks first (reward ± std, KL, held-out
  eval, weight-sync bytes against a full snapshot); ``operations.png``, logged by the report task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _xy(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _split(history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The history's step rows and eval rows."""
    return [h for h in history if h.get("kind") == "step"], [h for h in history if h.get("kind") == "eval"]


def _save(plt: Any, fig: Any, axes: Any, path: str | Path, dpi: int) -> Path:
    """Label every panel's x axis as the step, lay out, write ``path`` and free the figure."""
    for a in axes:
        a.set_xlabel("step"); a.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def plot_curves(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Write a 1x2 PNG (reward per step; eval score and all-tests-pass per evaluation) to ``path``."""
    plt = _pyplot()
    steps, evals = _split(history)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    x, y = _xy(steps, "reward_mean")
    ax[0].plot(x, y, marker=".", label="train reward")
    ax[0].set_ylabel("mean reward"); ax[0].set_title("rollout reward")
    _eval_panel(ax[1], evals)
    return _save(plt, fig, ax, path, dpi=110)


def _eval_panel(ax: Any, evals: list[dict[str, Any]]) -> None:
    """Held-out score and all-tests-pass accuracy per evaluation."""
    x, y = _xy(evals, "score")
    ax.plot(x, y, marker="o", label="score")
    x, y = _xy(evals, "accuracy")
    ax.plot(x, y, marker="s", label="all tests pass")
    ax.set_title("held-out eval"); ax.legend()


def plot_operations(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Write a 2x2 PNG (reward ± std, KL, eval score/accuracy, sync bytes vs full) to ``path``."""
    plt = _pyplot()
    steps, evals = _split(history)
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
    _eval_panel(ax[1, 0], evals)
    x, y = _xy(steps, "sync_bytes")
    xr, yr = _xy(steps, "sync_raw_bytes")
    ax[1, 1].bar(x, y, color="tab:green", label="delta written")
    if yr:
        ax[1, 1].plot(xr, yr, color="gray", linestyle="--", label="full bf16 snapshot")
        ax[1, 1].set_yscale("log")
    ax[1, 1].set_title("weight sync bytes"); ax[1, 1].legend()
    return _save(plt, fig, ax.flat, path, dpi=100)
