"""The vLLM side of ``deltaloop bench rollout``, run under vLLM's interpreter (``.venv-vllm``).

``python -m bench.vllm_rollout --folder F --prompts P --out O`` loads the Hugging Face folder ``F``
(written by the parent from the model it benchmarks), starts :func:`infra.rollout.vllm_engine.start_engine`
on it and measures, in this order:

1. ``start_seconds``: the first engine start (imports warm, vLLM's first profile run included);
2. tokens/s at each batch size over interleaving-free rounds of the same prompts and sampling
   settings as the local engine's records (temperature 1, top_p 1, stop at a newline, round 0 not
   counted);
3. sampled completions at temperature 0.8 (their per-token log-probs; the parent compares them with
   the trainer's teacher-forced pass of the same bf16 weights);
4. ``apply_version_seconds``: a new version (every weight moved, a harsher change than an RL step)
   published to a local store and applied in place, end to end (fetch, verify, reload, prefix
   cache reset), median of three;
5. ``reload_seconds``: the engine closed and a fresh one started on the same folder.

Writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.config import RolloutConfig
    from infra.model import publishable_state
    from infra.rollout.engine import SamplingParams
    from infra.rollout.vllm_engine import start_engine_sync
    from infra.storage import open_store
    from infra.weightsync import VersionPublisher

    prompts: list[str] = json.loads(open(args.prompts).read())
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.folder)
    cfg = RolloutConfig(type="vllm", vllm_dtype=args.dtype)

    def start() -> tuple[Any, float]:
        t0 = time.perf_counter()
        return start_engine_sync(model, tok, cfg), time.perf_counter() - t0

    out: dict[str, Any] = {"dtype": cfg.vllm_dtype}
    engine, out["start_seconds"] = start()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-store-") as root:
        store = open_store(root)
        pub = VersionPublisher(store, "weights")
        pub.publish(publishable_state(model))
        engine.attach({"uri": root}, "weights", 2, 1 << 34)
        engine.apply_version(1)
        out["throughput"] = []
        for batch, rounds in zip(args.batches, args.rounds):
            toks, secs, lengths = 0, 0.0, []
            for r in range(rounds + 1):
                group = [prompts[(r * batch + k) % len(prompts)] for k in range(batch)]
                params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, top_p=1.0, stop=["\n"], seed=r)
                t0 = time.perf_counter()
                comps = engine.generate(group, 1, params)
                if r:  # round 0 warms up
                    secs += time.perf_counter() - t0
                    toks += sum(len(c.token_ids) for c in comps)
                    lengths += [len(c.token_ids) for c in comps]
            out["throughput"].append({"batch": batch, "rounds": rounds, "tokens": toks,
                                      "tokens_per_s": round(toks / max(secs, 1e-9), 1),
                                      "mean_len": round(sum(lengths) / max(len(lengths), 1), 1)})
        lp_prompts = prompts[:32]
        params = SamplingParams(max_new_tokens=args.max_new, temperature=args.lp_temperature, top_p=1.0,
                                stop=["\n"], seed=11)
        out["logprob_prompts"] = lp_prompts
        out["logprob_temperature"] = args.lp_temperature
        out["samples"] = [{"prompt_index": c.prompt_index, "text": c.text, "token_ids": c.token_ids,
                           "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                          for c in engine.generate(lp_prompts, 2, params)]
        applies = []
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-3 * p.abs().mean())
            info = pub.publish(publishable_state(model))
            t0 = time.perf_counter()
            engine.apply_version(info.version)
            applies.append(time.perf_counter() - t0)
        out["apply_version_seconds"] = round(statistics.median(applies), 4)
        out["apply_version_all"] = [round(a, 4) for a in applies]
        pub.close()
    engine.close()
    fresh, out["reload_seconds"] = start()
    fresh.close()
    return out


def main() -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--max-new", type=int, default=24)
    parser.add_argument("--lp-temperature", type=float, default=0.8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    result = _measure(args)
    with open(args.out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
