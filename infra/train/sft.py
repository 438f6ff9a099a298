"""Supervised warm-start: a short SFT phase on the environment's reference solutions.

A randomly initialised policy earns reward 0 on every sample, so GRPO's group advantages are all
zero and nothing is learned. A few hundred SFT steps on (prompt, reference solution) pairs bring it
to a partial success rate (the demo stops at ~15-25%, docs/learning.md), where groups of samples disagree and RL has
a signal — and room to improve. Loss is next-token cross-entropy on the target tokens only; fp32
AdamW with a short linear warm-up. Each step draws fresh examples from the *train* split.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from infra.config import EnvConfig, WarmstartConfig


def sft_batch(tokenizer: "PreTrainedTokenizerBase", pairs: list[tuple[str, str]]) -> dict[str, "torch.Tensor"]:
    """Right-padded ``input_ids``/``attention_mask`` and ``labels`` (-100 outside the targets)."""
    import torch

    pr = tokenizer([p for p, _ in pairs], add_special_tokens=True)["input_ids"]
    tg = tokenizer([t for _, t in pairs], add_special_tokens=False)["input_ids"]
    seqs = [a + b for a, b in zip(pr, tg)]
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, (a, s) in enumerate(zip(pr, seqs)):
        ids[r, : len(s)] = torch.tensor(s)
        attn[r, : len(s)] = 1
        labels[r, len(a) : len(s)] = ids[r, len(a) : len(s)]
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def sft_batches(
    tokenizer: "PreTrainedTokenizerBase",
    env_cfg: "EnvConfig | None",
    seed: int,
    steps: int,
    batch_size: int,
    rank: int = 0,
    world: int = 1,
) -> Iterator[dict[str, "torch.Tensor"]]:
    """``steps`` SFT batches; step s draws ``batch_size`` fresh train-split examples from
    ``seed`` and this rank keeps its ``rank::world`` slice (data parallel, disjoint shards)."""
    from evals.funcfit import sft_examples

    hidden = env_cfg.hidden_tests if env_cfg is not None else 6
    for step in range(1, steps + 1):
        pairs = sft_examples(seed * 1_000_003 + step, batch_size, hidden,
                             env_cfg.families if env_cfg is not None else None)
        yield sft_batch(tokenizer, pairs[rank::world])


def sft_loss(model: "torch.nn.Module", batch: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """Mean cross-entropy over target tokens."""
    import torch

    dev = next(model.parameters()).device
    ids, attn, labels = (batch[k].to(dev) for k in ("input_ids", "attention_mask", "labels"))
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def warmstart(
    model: "torch.nn.Module",
    tokenizer: "PreTrainedTokenizerBase",
    cfg: "WarmstartConfig",
    env_seed: int,
    examples: Callable[[int, int], list[tuple[str, str]]] | None = None,
    probe: Callable[["torch.nn.Module"], float] | None = None,
    log: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place for ``cfg.steps`` SFT steps; returns summary metrics.

    ``examples(seed, n)`` yields (prompt, target) pairs (default: funcfit's ``sft_examples``; the
    batches equal :func:`sft_batches` with ``world=1``).
    ``probe(model)`` — e.g. sandbox-scored greedy accuracy — is called every ``cfg.probe_every``
    steps when ``cfg.target_accuracy`` is set, and training stops once it reaches the target.
    """
    import torch

    if examples is None:
        from evals.funcfit import sft_examples as examples
    t0 = time.perf_counter()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, min(cfg.warmup_steps, cfg.steps))
    losses: list[float] = []
    probe_value = float("nan")
    step = 0
    for step in range(1, cfg.steps + 1):
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, step / warm)
        batch = sft_batch(tokenizer, examples(env_seed * 1_000_003 + step, cfg.batch_size))
        loss = sft_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.item()))
        if log is not None and (step % 25 == 0 or step == cfg.steps):
            log({"sft_step": step, "sft_loss": sum(losses[-25:]) / len(losses[-25:])})
        if probe is not None and cfg.target_accuracy is not None and step % cfg.probe_every == 0:
            model.eval()
            probe_value = probe(model)
            model.train()
            if probe_value >= cfg.target_accuracy:
                break
    model.eval()
    tail = losses[-20:] or [float("nan")]
    return {
        "sft_steps": float(step),
        "sft_loss": sum(tail) / len(tail),
        "sft_seconds": time.perf_counter() - t0,
        "sft_probe": probe_value,
    }
