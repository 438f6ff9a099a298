"""Supervised warm-start: the one SFT loop, on the environment's reference solutions.

A randomly initialised policy earns reward 0 on every sample, so GRPO's group advantages are all
zero and nothing is learned. A short SFT phase on (prompt, reference solution) pairs brings it to a
partial success rate (the demo stops at ~15-25%, docs/learning.md), where groups of samples disagree
and RL has a signal — and room to improve. Loss is next-token cross-entropy on the target tokens
only, with a linear learning-rate warm-up. Each step draws fresh examples from the *train* split.

:func:`sft_loop` runs on a trainer engine (:mod:`infra.train.engines`), so the warm start steps with
the same optimizer (:mod:`infra.train.optim`), gradient clipping and all-reduce as the RL updates.
The trainer ranks call it with their shard of every step's examples; :func:`warmstart` runs it in one
process (benchmarks, tests) on a one-rank torch engine.

This module does not import the environment: callers pass the examples in, either as a
``(seed, n) -> pairs`` function (e.g. ``evals.funcfit.sft_examples``, expanded per step by
:func:`sft_step_examples`) or, on the trainer ranks, as the per-step lists the provision stage
stored in the object store.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from infra.config import TrainerConfig, WarmstartConfig

Pair = Sequence[str]  # (prompt, target); a JSON round trip turns the tuple into a list
Examples = Callable[[int, int], list[tuple[str, str]]]  # (seed, n) -> n (prompt, target) pairs


def sft_batch(tokenizer: "PreTrainedTokenizerBase", pairs: Sequence[Pair]) -> dict[str, "torch.Tensor"]:
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


def sft_step_examples(examples: Examples, seed: int, steps: int, batch_size: int) -> list[list[tuple[str, str]]]:
    """The (prompt, target) pairs of every SFT step: step s (1-based) draws ``batch_size`` fresh pairs
    with seed ``seed * 1_000_003 + s``, so every rank and every rerun sees the same data."""
    return [examples(seed * 1_000_003 + step, batch_size) for step in range(1, steps + 1)]


def sft_batches(tokenizer: "PreTrainedTokenizerBase", steps: Iterable[Sequence[Pair]], rank: int = 0,
                world: int = 1) -> Iterator[dict[str, "torch.Tensor"]]:
    """One batch per step of ``steps``; this rank keeps its ``rank::world`` slice of each step's pairs
    (data parallel, disjoint shards)."""
    for pairs in steps:
        yield sft_batch(tokenizer, list(pairs)[rank::world])


def sft_loss(model: "torch.nn.Module", batch: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """Mean cross-entropy over target tokens."""
    import torch

    dev = next(model.parameters()).device
    ids, attn, labels = (batch[k].to(dev) for k in ("input_ids", "attention_mask", "labels"))
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def sft_loop(
    engine: Any,
    batches: Iterable[dict[str, "torch.Tensor"]],
    cfg: "WarmstartConfig",
    probe: Callable[["torch.nn.Module"], float] | None = None,
    log: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train ``engine.module`` on ``batches`` (one optimizer step each); returns summary metrics.

    ``engine`` is a :class:`~infra.train.engines.TrainEngine`: the learning rate ramps linearly to
    ``cfg.lr`` over ``cfg.warmup_steps`` steps; clipping and the gradient all-reduce are the
    engine's. Returns ``steps``, ``final_loss`` (mean of the last 10 step losses of this rank),
    ``seconds`` and ``probe`` (the last probe value, NaN if none ran).
    ``probe(module)`` — e.g. greedy accuracy — runs every ``cfg.probe_every`` steps when
    ``cfg.target_accuracy`` is set, and training stops once it reaches the target. The probe
    decides on one process only, so it is for single-process use (:func:`warmstart`).
    ``log`` receives the running loss every 25 steps and at the end.
    """
    started = time.perf_counter()
    warm = max(1, min(cfg.warmup_steps, cfg.steps))
    losses: list[float] = []
    probe_value = float("nan")
    for step, batch in enumerate(batches, start=1):
        engine.set_lr(cfg.lr * min(1.0, step / warm))
        with engine.autocast():
            loss = sft_loss(engine.module, batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if log is not None and (step % 25 == 0 or step == cfg.steps):
            log({"sft_step": step, "sft_loss": sum(losses[-25:]) / len(losses[-25:])})
        if probe is not None and cfg.target_accuracy is not None and step % cfg.probe_every == 0:
            engine.module.eval()
            probe_value = probe(engine.module)
            engine.module.train()
            if probe_value >= cfg.target_accuracy:
                break
    tail = losses[-10:]
    return {"steps": len(losses), "final_loss": sum(tail) / max(1, len(tail)),
            "seconds": time.perf_counter() - started, "probe": probe_value}


def warmstart(
    model: "torch.nn.Module",
    tokenizer: "PreTrainedTokenizerBase",
    cfg: "WarmstartConfig",
    examples: Examples,
    seed: int,
    trainer: "TrainerConfig | None" = None,
    probe: Callable[["torch.nn.Module"], float] | None = None,
    log: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """:func:`sft_loop` in this process: ``model`` trained in place on a one-rank torch engine.

    The optimizer and clipping are the trainer's (``trainer``, default :class:`TrainerConfig`), as on
    the trainer ranks; ``examples(seed, n)`` supplies the pairs (see :func:`sft_step_examples`).
    The model is left in eval mode. Returns :func:`sft_loop`'s metrics.
    """
    from infra.config import TrainerConfig
    from infra.train.engines import TorchEngine

    engine = TorchEngine(model, trainer or TrainerConfig(), world=1, rank=0)
    model.train()
    batches = sft_batches(tokenizer, sft_step_examples(examples, seed, cfg.steps, cfg.batch_size))
    out = sft_loop(engine, batches, cfg, probe=probe, log=log)
    model.eval()
    return out
