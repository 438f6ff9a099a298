"""``deltaloop bench train``: trainer throughput per engine and rank count, and orchestration overhead.

1. **Throughput.** For the torch engine (DDP-style all-reduce) and DeepSpeed ZeRO-1/2/3, on 1 and 2
   ranks: a real trainer group (torchrun, gloo, the demo policy: a ~1M-parameter Llama built by
   ``model.type: tiny``) trains GRPO steps on a demo-shaped scored batch (16 prompts x 8 samples,
   ~20-token completions) put in a local object store. ``tokens_per_s`` = completion tokens of the
   batch / seconds of forward+backward+optimizer step inside the trainer (``train_seconds``; the
   publish that follows is excluded), median over the timed steps after one warm-up step.
2. **Orchestration overhead.** A short real run of the demo config through the CLI (Prefect flow,
   rollout worker, sandboxes); ``orchestration_overhead_fraction`` is the mean over steps of
   (step wall time - time spent inside the stages' services) / step wall time, as recorded by the
   flow in ``summary.json``. Target: <= 5%.

Every record has ``ranks``, ``zero_stage`` (0 for the torch engine), ``tokens_per_s`` and
``orchestration_overhead_fraction`` (None on throughput records). ``quick`` times 1 step, measures
2 ranks only and runs a 2-step flow on a smaller model (~2 minutes on 2 idle cores).
"""

from __future__ import annotations

from bench.machine import cpu_model, load_avg

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from infra.atomicio import write_json_atomic

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
         "model.tiny.num_heads=2"]


def _batch(store: Any, run_id: str, steps: int, prompts: int = 16, group: int = 8) -> None:
    """Demo-shaped scored batches for ``steps`` steps (funcfit prompts, expression completions)."""
    import random

    from evals.funcfit import train_batch
    from infra.model import build_tokenizer
    from infra.storage import put_json, run_key

    tok = build_tokenizer()
    rnd = random.Random(0)
    atoms = ["x", "x*x", "2*x", "3", "x+1", "(x-1)", "x**3", "7"]
    for step in range(1, steps + 1):
        problems = train_batch(11, step, prompts, 6)
        samples, rewards = [], []
        for pi in range(prompts):
            for _ in range(group):
                text = "+".join(rnd.choice(atoms) for _ in range(rnd.randint(2, 5))) + "\n"
                ids = tok(text, add_special_tokens=False)["input_ids"]
                samples.append({"prompt_index": pi, "text": text, "token_ids": ids,
                                "logprobs": [-1.5] * len(ids), "finish_reason": "stop", "version": step})
                rewards.append(rnd.choice([0.0, 0.0, 0.5, 1.0]))
        put_json(store, run_key(run_id, step, "rollouts.json"),
                 {"version": step, "group_size": group, "prompts": [p.prompt for p in problems], "samples": samples})
        put_json(store, run_key(run_id, step, "scores.json"), {"rewards": rewards})


def throughput(engine: str, stage: int, ranks: int, steps: int, tmp: Path) -> dict[str, Any]:
    """Tokens/s of one engine on ``ranks`` ranks (median over ``steps`` timed steps)."""
    from infra.config import load_config
    from infra.storage import open_store, run_key
    from infra.train.service import TrainerService

    overrides = [f"run_root={tmp}", f"cluster.ranks={ranks}", f"trainer.engine={engine}",
                 f"trainer.zero_stage={stage if engine == 'deepspeed' else 1}", "warmstart.steps=0",
                 f"trainer.checkpoint_every={10**6}", f"trainer.steps={10**6}"]
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides)
    store = open_store(cfg.resolved_storage_root())
    run_id = f"bench-{engine}-{stage}-{ranks}"
    _batch(store, run_id, steps + 1)
    started = time.perf_counter()
    rates, walls, inside = [], [], []
    with TrainerService(cfg, run_id, store, tmp / run_id) as svc:
        init = svc.call("init")
        svc.call("publish")
        start_s = time.perf_counter() - started
        for step in range(1, steps + 2):
            t0 = time.perf_counter()
            res = svc.call("train_step", step=step, rollouts_key=run_key(run_id, step, "rollouts.json"),
                           scores_key=run_key(run_id, step, "scores.json"))
            wall = time.perf_counter() - t0
            if step == 1:
                continue  # warm-up
            m = res["metrics"]
            rates.append(m["train_tokens_per_s"])
            walls.append(wall)
            inside.append(m["train_seconds"] + res["publish"]["seconds"])
    return {"kind": "throughput", "engine": engine, "ranks": ranks, "zero_stage": stage if engine == "deepspeed" else 0,
            "tokens_per_s": statistics.median(rates), "step_seconds": statistics.median(walls),
            "rpc_overhead_fraction": statistics.median((w - i) / w for w, i in zip(walls, inside)),
            "params": init["params"], "group_start_seconds": start_s, "orchestration_overhead_fraction": None}


def flow_overhead(quick: bool, tmp: Path) -> dict[str, Any]:
    """A short real run of the demo config; overhead as the flow records it per step."""
    root = tmp / "runs"
    steps = 2 if quick else 6
    sets = [f"run_root={root}", f"trainer.steps={steps}", "env.eval_problems=10",
            f"warmstart.steps={30 if quick else 100}", "promote.enabled=false"] + (SMALL if quick else [])
    cmd = [str(Path(sys.executable).parent / "deltaloop"), "run", "configs/demo.yaml"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"bench flow failed:\n{proc.stderr[-3000:]}")
    summary = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    rows = [h for h in summary["history"] if h["kind"] == "step"]
    fr = [h["orchestration_overhead_fraction"] for h in rows if h.get("orchestration_overhead_fraction") is not None]
    tps = [h["train_tokens_per_s"] for h in rows if h.get("train_tokens_per_s")]
    return {"kind": "flow", "engine": "torch", "ranks": 2, "zero_stage": 0,
            "tokens_per_s": statistics.mean(tps) if tps else None,
            "orchestration_overhead_fraction": statistics.mean(fr) if fr else None,
            "orchestration_overhead_fraction_max": max(fr) if fr else None,
            "step_seconds": statistics.mean(h["step_seconds"] for h in rows), "steps": len(rows),
            "model": "demo-small" if quick else "demo"}


def hardware() -> str:
    """One line describing this machine."""
    import torch

    cpu = cpu_model()
    return f"{cpu}, {os.cpu_count()} cores, load avg {load_avg():.1f}, torch {torch.__version__}, gloo on CPU"


def run(json_path: Path, quick: bool) -> list[dict[str, Any]]:
    """Run the benchmark, print a table, write the records to ``json_path``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    steps = 1 if quick else 4
    plan = [("torch", 0, 2)] if quick else [("torch", 0, 1), ("torch", 0, 2)]
    for stage in (1, 2, 3):
        plan += [("deepspeed", stage, 2)] if quick else [("deepspeed", stage, 1), ("deepspeed", stage, 2)]
    records: list[dict[str, Any]] = []
    hw = hardware()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        for engine, stage, ranks in plan:
            records.append(throughput(engine, stage, ranks, steps, Path(tmp) / f"{engine}{stage}-{ranks}"))
        records.append(flow_overhead(quick, Path(tmp) / "flow"))
    for r in records:
        r["hardware"] = hw
    write_json_atomic(json_path, records, indent=2)
    print(f"hardware: {hw}")
    print(f"{'kind':>10} {'engine':>9} {'zero':>4} {'ranks':>5} {'tokens/s':>10} {'step s':>8} {'overhead':>9}")
    for r in records:
        ov = r["orchestration_overhead_fraction"] if r["kind"] == "flow" else r.get("rpc_overhead_fraction")
        print(f"{r['kind']:>10} {r['engine']:>9} {r['zero_stage']:>4} {r['ranks']:>5} {r['tokens_per_s'] or 0:>10.0f} "
              f"{r['step_seconds']:>8.3f} {ov * 100 if ov is not None else float('nan'):>8.2f}%")
    print("overhead: flow row = Prefect orchestration (step wall - stage time) / step wall; "
          "throughput rows = trainer RPC (call wall - in-trainer time) / call wall")
    return records


if __name__ == "__main__":  # pragma: no cover
    run(Path("bench-train.json"), quick=True)
