"""Side-by-side comparison of synchronous and asynchronous RL on the same config and seeds.

Used by ``deltaloop bench rollout`` (its ``async`` record): two runs of the ``rl-train`` flow that
differ only in ``loop.mode``, reporting steps per minute (RL-loop time only: provisioning and evals
excluded), the final held-out eval, and the largest staleness seen against the bound.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from flows.rl_train import rl_train


def _loop_minutes(summary: dict[str, Any]) -> float:
    steps = [h for h in summary["history"] if h["kind"] == "step"]
    return sum(h["step_seconds"] for h in steps) / 60.0


def compare(quick: bool = False, config: str = "configs/demo.yaml", extra: list[str] | None = None) -> dict[str, Any]:
    """Run sync then async; return the comparison record."""
    steps = 6 if quick else 30
    base = [f"trainer.steps={steps}", "promote.enabled=false", *(extra or [])]
    if quick:
        base += ["warmstart.steps=40", "env.eval_problems=40"]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="deltaloop-async-") as tmp:
        for mode in ("sync", "async"):
            res = rl_train(config=config, overrides=[*base, f"loop.mode={mode}", f"run_root={Path(tmp) / mode}"])
            summary = json.loads(Path(res["summary_path"]).read_text())
            n = summary["steps"]
            out[f"{mode}_steps_per_min"] = n / max(_loop_minutes(summary), 1e-9)
            out[f"{mode}_eval"] = summary["eval_after"]
            out[f"{mode}_eval_before"] = summary["eval_before"]
            if mode == "async":
                out["max_staleness_seen"] = summary["max_staleness_seen"]
                out["staleness_bound"] = summary["staleness_bound"]
    out["speedup"] = out["async_steps_per_min"] / max(out["sync_steps_per_min"], 1e-9)
    out["steps"] = steps
    return out
