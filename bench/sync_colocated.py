"""Colocated placement vs today's separate placement on the demo (records for ``deltaloop bench sync``).

For each seed, the demo run (``configs/demo.yaml``: ~1M-parameter Llama, warm start, GRPO on
funcfit, 2 trainer ranks) runs twice through the real CLI (Prefect flow, torchrun ranks, bubblewrap
sandboxes), one placement after the other in the same bench run: ``weight_sync.placement:
colocated`` (the trainer ranks generate with the parameters they train) and ``object_store``
(the separate rollout worker pulling each version from the store). Promotion is off (no registry).

- ``steps_per_min`` / ``separate_steps_per_min``: 60 x steps / the sum of the steps' wall seconds
  (``step_seconds`` in the run's history: rollout, scoring, train and sync, orchestration
  included; provision, warm start and evaluation excluded); ``median_steps_per_min`` / ``separate_...``:
  60 / the median step's seconds (robust to the bursts of other jobs on a shared host);
- ``placement_stage_seconds_per_step`` / ``separate_...`` and ``placement_stage_speedup``: the wall
  seconds per step of the stages the placement changes (rollout, train with its publish, sync);
  scoring in the sandboxes does not depend on it and, on a shared host, carries most of the noise;
- ``p50_seconds`` / ``p99_seconds``: the sync stage per version (colocated: checking the version
  the trainer holds; nothing moves) and ``separate_sync_p50_seconds`` (publish + the worker's load);
- ``heldout_gain`` / ``separate_heldout_gain``: held-out score after - before (with the paired
  bootstrap 95% interval of each run, ``*_gain_ci95``), the noise the comparison is judged against.

One record per seed and one ``seed: "all"`` record (steps/min over all seeds' steps, gains by seed).
``quick``: one seed, 12 steps, 16 prompts x 8 samples, 100 held-out problems. Run directly:
``python -m bench.sync_colocated [--quick] [--steps N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PLACEMENT_STAGES = ("rollout", "train", "sync")  # the stages a placement changes (scoring does not)
QUICK = ["trainer.steps=12", "trainer.prompts_per_step=16", "trainer.group_size=8", "env.eval_problems=100"]


def run_demo(root: Path, placement: str, seed: int, extra: list[str]) -> dict[str, Any]:
    """One demo run through the CLI under ``root``; its ``summary.json``."""
    sets = [f"seed={seed}", f"weight_sync.placement={placement}", f"run_root={root}", "promote.enabled=false", *extra]
    argv = [str(Path(sys.executable).parent / "deltaloop"), "run", "configs/demo.yaml",
            *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"demo run ({placement}, seed {seed}) failed: {proc.stderr[-3000:]}")
    paths = glob.glob(str(root / "*" / "summary.json"))
    if len(paths) != 1:
        raise RuntimeError(f"expected one summary.json under {root}, found {paths}")
    return json.loads(Path(paths[0]).read_text())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else 0.0


def measure(summary: dict[str, Any]) -> dict[str, Any]:
    """Steps, their wall seconds, sync seconds per version and the held-out gain of one run."""
    steps = [h for h in summary["history"] if h.get("kind") == "step"]
    sync = [h["spans"]["sync"][1] - h["spans"]["sync"][0] for h in steps if "sync" in (h.get("spans") or {})]
    pub_load = [float(h.get("sync_publish_seconds") or 0.0) + float(h.get("sync_load_seconds") or 0.0) for h in steps]
    wall = sum(float(h["step_seconds"]) for h in steps)
    changed = sum(h["spans"][k][1] - h["spans"][k][0] for h in steps for k in PLACEMENT_STAGES
                  if k in (h.get("spans") or {}))
    return {"steps": len(steps), "step_wall_seconds": wall, "steps_per_min": 60.0 * len(steps) / wall,
            "placement_stage_seconds": changed, "step_seconds": [float(h["step_seconds"]) for h in steps],
            "sync": sync, "publish_load": pub_load, "gain": summary["eval_after"] - summary["eval_before"],
            "gain_ci95": summary.get("eval_gain_ci95"), "eval_before": summary["eval_before"],
            "eval_after": summary["eval_after"], "wall_seconds": summary["wall_seconds"]}


def record(seed: Any, colo: list[dict[str, Any]], sep: list[dict[str, Any]], lr: float) -> dict[str, Any]:
    """The bench sync record of ``colo`` vs ``sep`` runs (one seed, or all of them)."""
    def rate(runs: list[dict[str, Any]]) -> float:
        return 60.0 * sum(r["steps"] for r in runs) / sum(r["step_wall_seconds"] for r in runs)

    def median_rate(runs: list[dict[str, Any]]) -> float:
        return 60.0 / statistics.median(x for r in runs for x in r["step_seconds"])

    def stage(runs: list[dict[str, Any]]) -> float:
        return sum(r["placement_stage_seconds"] for r in runs) / sum(r["steps"] for r in runs)

    sync = [x for r in colo for x in r["sync"]]
    sep_sync = [x for r in sep for x in r["publish_load"]]
    one = len(colo) == 1
    rec: dict[str, Any] = {
        "placement": "colocated", "seed": seed, "readers": 0, "rtt_ms": 0, "link_mbps": None, "lr": lr,
        "versions": sum(r["steps"] for r in colo), "p50_seconds": _pct(sync, 0.5), "p99_seconds": _pct(sync, 0.99),
        "amortized_fraction": 0.0, "full_seconds": None, "floor_seconds": 0.0,
        "steps_per_min": rate(colo), "separate_steps_per_min": rate(sep), "speedup": rate(colo) / rate(sep),
        "median_steps_per_min": median_rate(colo), "separate_median_steps_per_min": median_rate(sep),
        "separate_sync_p50_seconds": _pct(sep_sync, 0.5),
        "placement_stage_seconds_per_step": stage(colo), "separate_placement_stage_seconds_per_step": stage(sep),
        "placement_stage_speedup": stage(sep) / stage(colo),
        "heldout_gain": colo[0]["gain"] if one else [r["gain"] for r in colo],
        "separate_heldout_gain": sep[0]["gain"] if one else [r["gain"] for r in sep],
    }
    if one:
        rec.update({"heldout_gain_ci95": colo[0]["gain_ci95"], "separate_heldout_gain_ci95": sep[0]["gain_ci95"],
                    "eval_before": colo[0]["eval_before"], "separate_eval_before": sep[0]["eval_before"],
                    "wall_seconds": colo[0]["wall_seconds"], "separate_wall_seconds": sep[0]["wall_seconds"]})
    else:
        rec["heldout_gain_mean"] = statistics.fmean(r["gain"] for r in colo)
        rec["separate_heldout_gain_mean"] = statistics.fmean(r["gain"] for r in sep)
    return rec


def records(quick: bool, steps: int | None = None, log: Any = print) -> list[dict[str, Any]]:
    """Colocated vs separate on the demo, side by side: one record per seed, then ``seed: "all"``."""
    from infra.config import load_config

    extra = list(QUICK) if quick else []
    if steps is not None:
        extra.append(f"trainer.steps={steps}")
    seeds = [0] if quick else [0, 1]
    lr = load_config(REPO / "configs" / "demo.yaml", extra).trainer.lr
    colo: list[dict[str, Any]] = []
    sep: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-colocated-") as tmp:
        for seed in seeds:
            for placement, runs in (("colocated", colo), ("object_store", sep)):
                m = measure(run_demo(Path(tmp) / f"{placement}-{seed}", placement, seed, extra))
                log(f"seed {seed} {placement}: {m['steps']} steps, {m['steps_per_min']:.1f} steps/min, "
                    f"held-out {m['eval_before']:.3f} -> {m['eval_after']:.3f}")
                runs.append(m)
            out.append(record(seed, colo[-1:], sep[-1:], lr))
    if len(seeds) > 1:
        out.append(record("all", colo, sep, lr))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the demo's, 12 quick)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args()
    recs = records(args.quick, args.steps)
    text = json.dumps(recs, indent=2)
    print(text)
    if args.json:
        from infra.atomicio import write_json_atomic

        write_json_atomic(args.json, recs, indent=2)


if __name__ == "__main__":
    main()
