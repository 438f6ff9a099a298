"""Learning probe: does GRPO really improve the demo policy? (single process, no services)

SFT warm-start → greedy eval → N GRPO steps → greedy eval, on the funcfit environment with the
tiny model, scoring in-process with ``score_locally`` (this script only; the pipeline scores in
sandboxes). Prints timings and the eval curve; used to choose the demo defaults in
``infra/config.py``. Controls for honesty: ``--lr 0`` (no learning: does the eval move anyway?).

    .venv/bin/python -m bench.learn_probe --seed 0 --rl-steps 150 --json /tmp/probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def evaluate(engine: Any, problems: list, max_new_tokens: int) -> dict[str, float]:
    """Greedy mean reward and exact-solve rate on ``problems``."""
    from evals.funcfit import score_locally

    texts = engine.greedy([p.prompt for p in problems], max_new_tokens)
    rewards = [score_locally(p, t) for p, t in zip(problems, texts)]
    fams: dict[str, list[float]] = {}
    for p, r in zip(problems, rewards):
        fams.setdefault(p.family, []).append(r)
    return {"reward": sum(rewards) / len(rewards), "solved": sum(r == 1.0 for r in rewards) / len(rewards),
            "families": {f: round(sum(v) / len(v), 3) for f, v in fams.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from evals.funcfit import eval_set, score_locally, train_batch
    from infra.config import ModelConfig, RolloutConfig, TinyModelConfig, TrainerConfig, WarmstartConfig
    from infra.model import build_tiny_model, build_tokenizer, count_parameters
    from infra.rollout.engine import SamplingParams
    from infra.rollout.local import LocalEngine
    from infra.train.grpo import build_batch, group_advantages, grpo_loss
    from infra.train.sft import warmstart

    torch.set_num_threads(args.threads)
    tcfg = TrainerConfig()
    rcfg = RolloutConfig()
    wcfg = WarmstartConfig()
    tiny = ModelConfig().tiny
    lr = tcfg.lr if args.lr is None else args.lr
    steps = tcfg.steps if args.rl_steps is None else args.rl_steps
    n_prompts = args.prompts or tcfg.prompts_per_step
    group = args.group or tcfg.group_size
    temp = rcfg.temperature if args.temperature is None else args.temperature
    kl_coef = tcfg.kl_coef if args.kl is None else args.kl
    inner_epochs = args.inner_epochs or tcfg.inner_epochs
    wcfg = WarmstartConfig(
        steps=wcfg.steps if args.sft_steps is None else args.sft_steps,
        batch_size=args.sft_batch or wcfg.batch_size,
        lr=args.sft_lr or wcfg.lr,
    )
    tiny = TinyModelConfig(
        hidden_size=args.hidden or tiny.hidden_size,
        num_layers=args.layers or tiny.num_layers,
        num_heads=tiny.num_heads,
        intermediate_size=(args.hidden or tiny.hidden_size) * 4,
    )

    tok = build_tokenizer()
    model = build_tiny_model(tiny, tok, args.seed)
    print(f"model: {count_parameters(model) / 1e6:.2f}M params, hidden {tiny.hidden_size}, layers {tiny.num_layers}")
    evals = eval_set(args.seed, args.eval_n)
    engine = LocalEngine(model, tok)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    cache = None
    if args.sft_cache:
        tag = f"s{args.seed}-h{tiny.hidden_size}-l{tiny.num_layers}-n{wcfg.steps}-b{wcfg.batch_size}-lr{wcfg.lr}"
        cache = Path(args.sft_cache) / f"{tag}.pt"
    if cache is not None and cache.exists():
        saved = torch.load(cache)
        model.load_state_dict(saved["state"])
        sft = saved["sft"]
        model.eval()
    else:
        sft = warmstart(model, tok, wcfg, env_seed=args.seed,
                        log=(lambda m: print(f"  sft {m}")) if args.verbose else None)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"state": model.state_dict(), "sft": sft}, cache)
    timings["sft_s"] = sft["sft_seconds"]
    print(f"SFT: {wcfg.steps} steps x {wcfg.batch_size} at lr {wcfg.lr}: {timings['sft_s']:.1f}s, loss {sft['sft_loss']:.3f}")

    t = time.perf_counter()
    before = evaluate(engine, evals, rcfg.max_new_tokens)
    timings["eval_s"] = time.perf_counter() - t
    print(f"eval before RL: reward {before['reward']:.3f} solved {before['solved']:.3f} ({timings['eval_s']:.1f}s, n={len(evals)})")

    ref = None
    if kl_coef > 0:
        import copy

        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.99))
    curve = [{"step": 0, **before}]
    roll_s = train_s = 0.0
    history: list[dict[str, float]] = []
    t_rl = time.perf_counter()
    for step in range(1, steps + 1):
        probs = train_batch(args.seed, step, n_prompts)
        prompts = [p.prompt for p in probs]
        t = time.perf_counter()
        model.eval()
        comps = engine.generate(prompts, group, SamplingParams(
            max_new_tokens=rcfg.max_new_tokens, temperature=temp, top_p=rcfg.top_p, stop=["\n"],
            seed=args.seed * 100_000 + step))
        roll_s += time.perf_counter() - t
        rewards = [score_locally(probs[c.prompt_index], c.text) for c in comps]
        adv = group_advantages(rewards, group, norm=args.adv_norm)
        t = time.perf_counter()
        model.train()
        batch = build_batch(tok, prompts, comps, adv)
        total = float(batch["completion_mask"].sum())
        metrics: dict[str, float] = {}
        for _epoch in range(inner_epochs):  # as the trainer: one optimizer step per pass
            opt.zero_grad(set_to_none=True)
            for i in range(0, len(comps), tcfg.micro_batch):
                sl = {k: v[i : i + tcfg.micro_batch] for k, v in batch.items()}
                loss, m = grpo_loss(model, sl, clip_eps=tcfg.clip_eps, clip_eps_high=args.clip_high, kl_coef=kl_coef, ref_model=ref,
                                    total_tokens=total, temperature=temp if temp > 0 else 1.0)
                loss.backward()
                metrics = m
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            opt.step()
        train_s += time.perf_counter() - t
        r = torch.tensor(rewards).view(-1, group)
        varied = float((r.std(dim=1) > 0).float().mean())
        history.append({"step": step, "reward": float(r.mean()), "varied_groups": varied,
                        "grad_norm": float(gn), **{k: metrics[k] for k in ("kl", "clip_frac", "entropy")}})
        if step % args.log_every == 0:
            recent = history[-args.log_every :]
            print(f"  step {step:4d} train reward {sum(h['reward'] for h in recent) / len(recent):.3f} "
                  f"varied {sum(h['varied_groups'] for h in recent) / len(recent):.2f} "
                  f"ent {metrics['entropy']:.3f} gn {float(gn):.3f}  "
                  f"({(time.perf_counter() - t_rl) / step:.2f}s/step)")
        if args.eval_every and step % args.eval_every == 0 and step != steps:
            e = evaluate(engine, evals, rcfg.max_new_tokens)
            curve.append({"step": step, **e})
            print(f"  eval @ {step}: reward {e['reward']:.3f} solved {e['solved']:.3f}")
    timings["rl_s"] = time.perf_counter() - t_rl
    timings["rollout_s_per_step"] = roll_s / max(steps, 1)
    timings["train_s_per_step"] = train_s / max(steps, 1)
    after = evaluate(engine, evals, rcfg.max_new_tokens)
    curve.append({"step": steps, **after})
    gain = after["reward"] - before["reward"]
    print(f"eval after RL:  reward {after['reward']:.3f} solved {after['solved']:.3f}  gain {gain:+.3f}")
    print(f"per family before {before['families']}\n           after  {after['families']}")
    print(f"timings: SFT {timings['sft_s']:.1f}s, RL {timings['rl_s']:.1f}s for {steps} steps "
          f"({timings['rl_s'] / max(steps, 1):.2f}s/step: rollout {timings['rollout_s_per_step']:.2f}s, "
          f"train {timings['train_s_per_step']:.2f}s), eval {timings['eval_s']:.1f}s")
    result = {
        "args": vars(args), "lr": lr, "inner_epochs": inner_epochs, "steps": steps, "temperature": temp, "kl_coef": kl_coef,
        "sft": sft, "before": before, "after": after, "gain": gain, "curve": curve,
        "timings": timings, "history": history,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--sft-batch", type=int, default=None)
    ap.add_argument("--sft-lr", type=float, default=None)
    ap.add_argument("--rl-steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="RL learning rate (0 = control run)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--kl", type=float, default=None)
    ap.add_argument("--clip-high", type=float, default=None, help="upper ratio clip (DAPO clip-higher)")
    ap.add_argument("--adv-norm", choices=("std", "none"), default="std")
    ap.add_argument("--inner-epochs", type=int, default=None)
    ap.add_argument("--eval-n", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sft-cache", default=None, help="folder caching SFT'd weights between probe runs")
    ap.add_argument("--verbose", action="store_true")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
