"""``deltaloop bench chaos``: a demo-sized run with real faults injected, against an undisturbed run.

For each loop mode (sync, async) the bench runs the demo config twice with the same seed:

1. **baseline** — undisturbed, on the file store;
2. **chaos** — on the S3 store (a journaled moto server the bench starts, :mod:`bench.chaos_s3`),
   with faults injected at seeded random steps (:mod:`bench.chaos_driver`, :mod:`bench.chaos_inject`):

   ============== ===================================================================================
   kind           what is done, when
   ============== ===================================================================================
   sandbox_bwrap  kill -9 of one bwrap sandbox's process group (and everything in it), during scoring
   sandbox_docker ``docker kill`` of one sandbox container, during scoring (docker segment of the run)
   rollout_worker kill -9 of the rollout worker, during a step's rollout
   trainer_rank   kill -9 of one trainer rank, once the step's scores are written (training)
   flow           kill -9 of the flow process at a seeded phase; then ``deltaloop run --resume RUN``
   s3_restart     kill -9 of the S3 server, restarted on the same port 1-3 s later (no data lost)
   corrupt_weight one byte flipped in the weight version just published (a frame or its manifest)
   ============== ===================================================================================

   Each kind is injected twice (once with ``--quick``). The run starts on bwrap sandboxes; each
   flow kill switches the resumed run's ``sandbox.runtime`` (bwrap -> docker -> bwrap), and the
   sandbox kills are planned in the matching segment.

Then it compares the chaos run with its baseline from the stores (:mod:`bench.chaos_measure`). The
JSON (a list, one record per mode) has ``faults`` ([{kind, step, action}]), ``steps_configured``,
``steps_completed``, ``fake_zero_rewards``, ``masked_samples``, ``prompt_ids_match``,
``version_regressions``, ``eval_after``, ``baseline_eval_after``, ``mode``, and the detail behind
them (flow failures and resumes, orphaned service processes, the eval difference's 95% interval).

Every run's folder, flow logs (``flow-N.log``: one per start or resume), S3 journal and server logs
stay under ``runs/bench-chaos-<time>/<mode>/`` (``work_dir`` in the JSON).

The harness measures what the code does and assumes no fix: a flow that dies from a fault is
resumed (at most 3 times) and each such death is listed under ``flow_failures``.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from bench.chaos_driver import TRIGGER_ORDER, ChaosRun, Fault, FlowLog
from bench.chaos_s3 import DurableS3
from bench.machine import cpu_model, load_avg
from infra.atomicio import write_json_atomic

KINDS = ("sandbox_bwrap", "sandbox_docker", "rollout_worker", "trainer_rank", "flow", "s3_restart",
         "corrupt_weight")
REPO = Path(__file__).resolve().parents[1]


def settings(quick: bool, seed: int) -> dict[str, Any]:
    """Steps, faults per kind, time budget and config overrides of a full or ``--quick`` bench."""
    if quick:
        steps, per_kind, budget = 6, 1, 1200.0
        sets = ["env.eval_problems=40", "warmstart.steps=100"]
    else:
        steps, per_kind, budget = 16, 2, 3600.0
        sets = ["env.eval_problems=100", "warmstart.steps=100"]
    sets += [f"trainer.steps={steps}", f"seed={seed}", "promote.enabled=false"]
    return {"steps": steps, "per_kind": per_kind, "budget_s": budget, "sets": sets}


def _phase_steps(steps: int, flow_steps: list[int]) -> tuple[list[int], list[int]]:
    """Steps planned on bwrap and on docker: docker between the first and second flow kill."""
    first = flow_steps[0]
    second = flow_steps[1] if len(flow_steps) > 1 else steps + 1
    docker = list(range(first + 1, second))
    bwrap = [s for s in range(1, steps + 1) if s < first or s > second]
    return bwrap, docker


def plan_faults(seed: int, steps: int, per_kind: int) -> list[Fault]:
    """The seeded schedule: ``per_kind`` faults of every kind, sorted by step then trigger.

    Flow kills fall in the first and third quarter-ish of the run (so the docker segment between
    them and the bwrap segments around them each have room for the sandbox kills); every other
    fault at a random step, trigger and delay."""
    rng = random.Random(seed)
    if per_kind == 1:
        flows = [max(2, steps // 2)]
    else:
        first = rng.randrange(max(2, steps // 4), max(3, steps // 2))
        flows = [first, rng.randrange(first + 3, max(first + 4, 3 * steps // 4 + 1))]
    bwrap, docker = _phase_steps(steps, flows)
    plan: list[Fault] = []
    for kind in KINDS:
        for i in range(per_kind):
            if kind == "flow":
                step, trigger = flows[i], rng.choice(["prompts", "rollouts", "scores"])
            elif kind in ("sandbox_bwrap", "sandbox_docker"):
                pool = docker if kind == "sandbox_docker" else bwrap
                step, trigger = rng.choice(pool or list(range(1, steps + 1))), "rollouts"
            elif kind == "rollout_worker":
                step, trigger = rng.randint(1, steps), "prompts"
            elif kind == "trainer_rank":
                step, trigger = rng.randint(1, steps - 1), "scores"
            elif kind == "s3_restart":
                step, trigger = rng.randint(1, steps), rng.choice(["prompts", "rollouts", "scores"])
            else:
                step, trigger = rng.randint(1, steps - 1), "manifest"
            delay = 0.0 if trigger == "manifest" else rng.uniform(0.0, 0.1) if kind.startswith("sandbox") \
                else rng.uniform(0.05, 0.4)
            plan.append(Fault(kind, step, trigger, delay, rng.randrange(1 << 30)))
    return sorted(plan, key=lambda f: (f.step, TRIGGER_ORDER[f.trigger], KINDS.index(f.kind)))


def baseline(folder: Path, sets: list[str], mode: str, budget_s: float) -> dict[str, Any]:
    """The undisturbed run (file store); its run id, folder, store URI and summary."""
    import subprocess
    import sys

    from bench.chaos_measure import read_summary

    root = folder / "runs"
    cmd = [str(Path(sys.executable).parent / "deltaloop"), "run", "configs/demo.yaml"]
    for s in sets + [f"run_root={root}", f"loop.mode={mode}"]:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(folder / "flow.log", "ab") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=log, timeout=budget_s)
    run_id = next(d.name for d in root.iterdir() if (d / "config.yaml").is_file())
    return {"run_id": run_id, "dir": root / run_id, "store": f"file://{root / 'store'}", "exit": proc.returncode,
            "seconds": time.perf_counter() - t0, "summary": read_summary(root / run_id)}


def measure(chaos: ChaosRun, base: dict[str, Any], steps: int) -> dict[str, Any]:
    """The comparison fields of the record (see :mod:`bench.chaos_measure`)."""
    from bench import chaos_measure as m
    from infra.storage import open_store

    base_store = open_store(base["store"])
    run_id = chaos.run_id or ""
    summary = m.read_summary(chaos.run_root / run_id) if run_id else None
    fault_steps = {f["step"] + d for f in chaos.log.faults if f.get("step") for d in (0, 1)}
    out: dict[str, Any] = {"steps_completed": m.steps_completed(chaos.store, run_id, steps, summary)}
    out.update(m.compare_rewards(chaos.store, run_id, base_store, base["run_id"], steps, fault_steps))
    out.update(m.compare_prompts(chaos.store, run_id, base_store, base["run_id"], steps))
    out.update(m.version_regressions(chaos.store, run_id, steps))
    out["eval_after"] = summary.get("eval_after") if summary else None
    out["baseline_eval_after"] = (base["summary"] or {}).get("eval_after")
    out["eval_diff_ci95"] = m.eval_difference(chaos.store, run_id, summary, base_store, base["run_id"],
                                              base["summary"])
    return out


REQUIRED = {"mode": str, "faults": list, "steps_configured": int, "steps_completed": int, "fake_zero_rewards": int,
            "masked_samples": int, "prompt_ids_match": bool, "version_regressions": int,
            "eval_after": (float, type(None)), "baseline_eval_after": (float, type(None))}
"""The fields the issue asks of every record, with their JSON types (None: that run did not finish)."""


def build_record(mode: str, seed: int, steps: int, log: FlowLog, measured: dict[str, Any],
                 extra: dict[str, Any]) -> dict[str, Any]:
    """One mode's JSON record from the run's log and measurements; raises ``ValueError`` if a field of
    :data:`REQUIRED` is missing or of the wrong type."""
    record = {"mode": mode, "seed": seed, "steps_configured": steps,
              "faults": [{"kind": f["kind"], "step": f["step"], "action": f["action"], "t": f.get("t")}
                         for f in log.faults],
              "injected_by_kind": {k: sum(1 for f in log.faults if f["kind"] == k and not f["action"].startswith(
                  ("not injected", "no "))) for k in KINDS},
              **measured,
              "completed": log.finished, "timed_out": log.timed_out, "flow_failures": log.failures,
              "planned_resumes": log.resumes, "unplanned_resumes": log.unplanned_resumes,
              "orphaned_services": log.orphans, **extra}
    bad = [f"{k} ({type(record.get(k)).__name__})" for k, t in REQUIRED.items()
           if k not in record or not isinstance(record[k], t) or (t is int and isinstance(record[k], bool))]
    if bad:
        raise ValueError(f"chaos record for mode {mode!r} lacks or mistypes: {', '.join(bad)}")
    return record


def run_mode(work: Path, mode: str, cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """Baseline and chaos run of one loop mode; the mode's JSON record."""
    (work / f"baseline-{mode}").mkdir(parents=True, exist_ok=True)
    base = baseline(work / f"baseline-{mode}", cfg["sets"], mode, cfg["budget_s"])
    plan = plan_faults(seed, cfg["steps"], cfg["per_kind"])
    folder = work / f"chaos-{mode}"
    folder.mkdir(parents=True, exist_ok=True)
    s3 = DurableS3(folder)
    s3.start()
    try:
        s3.create_bucket("chaos")
        chaos = ChaosRun(folder, cfg["sets"], mode, s3, cfg["budget_s"])
        t0 = time.perf_counter()
        log = chaos.run(plan)
        seconds = time.perf_counter() - t0
        measured = measure(chaos, base, cfg["steps"])
    finally:
        s3.stop()
    return build_record(mode, seed, cfg["steps"], log, measured, {
        "s3_restarts": s3.starts - 1, "chaos_seconds": seconds, "baseline_seconds": base["seconds"],
        "baseline_exit": base["exit"], "chaos_run": chaos.run_id, "baseline_run": base["run_id"],
        "work_dir": str(work)})


def _table(records: list[dict[str, Any]]) -> None:
    cols = ["mode", "steps_configured", "steps_completed", "fake_zero_rewards", "masked_samples", "prompt_ids_match",
            "version_regressions", "eval_after", "baseline_eval_after", "unplanned_resumes"]
    print("  ".join(f"{c:>19}" for c in cols))
    for r in records:
        print("  ".join(f"{r[c]:>19.3f}" if isinstance(r[c], float) else f"{str(r[c]):>19}" for c in cols))
    for r in records:
        print(f"\n{r['mode']}: faults")
        for f in r["faults"]:
            print(f"  step {str(f['step']):>3}  {f['kind']:<15} {f['action']}")
        for fail in r["flow_failures"]:
            print(f"  flow failed at step {fail['step']} (exit {fail['exit']}): {fail['error']}")


def run(json_path: Path, quick: bool, seed: int = 0) -> list[dict[str, Any]]:
    """Both modes (sync, async); print the table, write the records to ``json_path``."""
    cfg = settings(quick, seed)
    work = REPO / "runs" / f"bench-chaos-{time.strftime('%Y%m%d-%H%M%S')}"  # kept: every run's logs and stores
    work.mkdir(parents=True, exist_ok=True)
    hardware = f"{cpu_model()}, {os.cpu_count()} cores, load avg {load_avg():.1f} at start"
    records = []
    for mode in ("sync", "async"):
        records.append({**run_mode(work / mode, mode, cfg, seed), "quick": quick, "hardware": hardware})
        write_json_atomic(json_path, records, indent=2, default=str)
    _table(records)
    return records


if __name__ == "__main__":  # pragma: no cover
    run(Path("bench-chaos.json"), quick=True)
