"""GRPO: group-normalised advantages and the clipped policy-gradient loss.

For each prompt the policy samples a group of G completions; a completion's advantage is its
reward minus the group mean, divided by the group std (+eps) — no value network. The loss is the
PPO clipped surrogate on per-token importance ratios ``exp(logp_new - logp_old)``, where the old
log-probs are those the rollout engine recorded while sampling (so staleness and engine/trainer
numerical drift are corrected by the ratio), plus an optional k3 KL estimate to a frozen reference.

Normalisation is a token-level mean over completion tokens (every token weighs the same, as in
DAPO/Dr. GRPO), made explicit for data parallelism: each rank computes ``sum over its tokens /
total_tokens`` where ``total_tokens`` counts completion tokens over the *global* batch (all ranks,
all micro-batches). Summing the ranks' gradients (all-reduce SUM, not mean) then gives exactly the
gradient of the global token mean, however the batch was split.

**Masked samples** (:attr:`evals.env.Score.masked`: the sandbox infrastructure could not score them)
are not zeros: :func:`plan_batch` computes each group's mean and std over its unmasked samples only
(exactly the advantages of the group without them), drops a group left with fewer than
``min_group_samples`` scored samples, and marks what trains; :func:`select_rows` keeps masked and
dropped samples out of the batch and :func:`loss_tokens` out of the token normaliser, so the loss is
the loss of the batch that never had them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from infra.rollout.engine import Completion


def group_advantages(
    rewards: "torch.Tensor | list[float]", group_size: int, eps: float = 1e-4, norm: str = "std",
    masked: "Sequence[bool] | None" = None,
) -> "torch.Tensor":
    """(r - group mean) / (group std + eps) for consecutive groups of ``group_size`` rewards;
    with ``norm="none"`` just r - group mean (Dr. GRPO).

    Groups whose rewards are all equal get advantage 0 (no signal, no gradient). ``masked`` (one bool
    per reward): those samples get advantage 0 and are left out of their group's mean and std, so the
    others' advantages are exactly those of the group without them."""
    import torch

    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    if norm not in ("std", "none"):
        raise ValueError(f"advantage norm {norm!r}: expected 'std' or 'none'")
    if masked is None or not any(masked):
        return _normalise(r.view(-1, group_size), eps, norm).flatten()
    if len(masked) != r.numel():
        raise ValueError(f"{len(masked)} masked flags for {r.numel()} rewards")
    adv = torch.zeros_like(r)
    for start in range(0, r.numel(), group_size):
        scored = [i for i in range(start, start + group_size) if not masked[i]]
        if scored:  # each group through the same arithmetic as an unmasked batch of its scored samples
            adv[scored] = _normalise(r[scored].view(1, -1), eps, norm).flatten()
    return adv


def _normalise(g: "torch.Tensor", eps: float, norm: str) -> "torch.Tensor":
    """Advantages of the groups in the rows of ``g`` [groups, size]."""
    adv = g - g.mean(dim=1, keepdim=True)
    if norm == "std":
        adv = adv / (g.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv


@dataclass(frozen=True)
class BatchPlan:
    """What a scored batch trains: per-sample ``advantages``, ``trainable`` (scored, in a kept group),
    and the counts behind them: ``masked`` samples and ``groups_dropped`` (too few scored samples)."""

    advantages: "torch.Tensor"
    trainable: list[bool]
    masked: int
    groups_dropped: int


def plan_batch(rewards: "torch.Tensor | list[float]", group_size: int, masked: "Sequence[bool] | None" = None,
               min_group_samples: int = 1, norm: str = "std", eps: float = 1e-4) -> BatchPlan:
    """Advantages over each group's scored samples (:func:`group_advantages` with ``masked``); a group
    with fewer than ``min_group_samples`` scored samples is dropped (advantage 0, nothing trains): with
    one sample left there is nothing to compare it with. A group with no masked sample is never dropped
    (``min_group_samples`` is at most the group size)."""
    n = len(rewards)
    flags = [False] * n if masked is None else [bool(m) for m in masked]
    if len(flags) != n:
        raise ValueError(f"{len(flags)} masked flags for {n} rewards")
    adv = group_advantages(rewards, group_size, eps=eps, norm=norm, masked=flags)
    trainable = [not m for m in flags]
    dropped = 0
    for start in range(0, n, group_size):
        group = range(start, start + group_size)
        if any(flags[i] for i in group) and sum(trainable[i] for i in group) < min_group_samples:
            dropped += 1
            for i in group:
                trainable[i] = False
                adv[i] = 0.0
    return BatchPlan(adv, trainable, sum(flags), dropped)


def select_rows(samples: "list[Completion] | list[dict[str, Any]]", advantages: "torch.Tensor",
                trainable: Sequence[bool], merge: bool = True, kl_coef: float = 0.0) -> tuple[list[int], list[int], int]:
    """The rows to compute, ``(keep, counts, skipped_zero_advantage)``: the ``trainable`` samples only
    (masked and dropped ones never enter the batch, also with a KL term), identical copies merged
    (:func:`merge_duplicates`, with ``merge``), zero-advantage rows skipped
    (:func:`drop_zero_advantage`). With nothing to train, one zero-weight row ``([0], [0], 0)``."""
    rows = [i for i, t in enumerate(trainable) if t]
    if merge:
        picked, counts = merge_duplicates([samples[i] for i in rows])
        keep = [rows[j] for j in picked]
    else:
        keep, counts = rows, [1] * len(rows)
    if not keep:
        return [0], [0], 0
    return drop_zero_advantage(keep, counts, advantages, kl_coef)


def loss_tokens(samples: "list[Completion] | list[dict[str, Any]]", trainable: Sequence[bool]) -> float:
    """The token normaliser of the global batch: completion tokens of the trainable samples (at least
    1 each, and 1 in all when nothing trains). Masked samples are not in it, so the loss is the token
    mean of the batch without them."""
    return float(max(1, sum(max(1, len(_field(s, "token_ids"))) for s, t in zip(samples, trainable) if t)))


def merge_duplicates(completions: "list[Completion] | list[dict[str, Any]]") -> tuple[list[int], list[int]]:
    """Indices of the distinct completions and how many times each occurs.

    A sharpening policy samples the same text many times per prompt. Copies with the same prompt
    and tokens have the same reward (hence the same group advantage) and the same rollout
    log-probs, so their loss terms are equal: training one copy with weight k gives the same loss
    and gradient as training k copies, for a fraction of the compute. Returns ``(keep, counts)``
    with ``keep`` in first-seen order."""
    first: dict[tuple[int, tuple[int, ...]], int] = {}
    keep: list[int] = []
    counts: list[int] = []
    for i, c in enumerate(completions):
        key = (int(_field(c, "prompt_index")), tuple(int(t) for t in _field(c, "token_ids")))
        slot = first.setdefault(key, len(keep))
        if slot == len(keep):
            keep.append(i)
            counts.append(0)
        counts[slot] += 1
    return keep, counts


def drop_zero_advantage(keep: list[int], counts: list[int], advantages: "torch.Tensor",
                        kl_coef: float) -> tuple[list[int], list[int], int]:
    """Rows of ``keep`` (with their ``counts``) whose advantage is non-zero, and how many were dropped.

    Without a KL term a zero-advantage token's loss is exactly 0 (``-min(r * 0, clip(r) * 0)``), so
    its row adds nothing to the gradient: skipping its forward and backward gives the same update for
    less compute — in GRPO every group whose samples all score alike (all right or all wrong, common
    early and late in a run) is such a group. The token normaliser is the whole batch's either way.
    With ``kl_coef > 0`` every row is kept (the KL penalty has a gradient). If no row is left, one row
    is kept with count 0 (a zero-weight row: every rank still runs its micro-batches)."""
    if kl_coef > 0:
        return keep, counts, 0
    nz = [j for j, k in enumerate(keep) if float(advantages[k]) != 0.0]
    if not nz:
        return keep[:1], [0], len(keep)
    return [keep[j] for j in nz], [counts[j] for j in nz], len(keep) - len(nz)


def _field(c: Any, name: str) -> Any:
    return c[name] if isinstance(c, dict) else getattr(c, name)


def build_batch(
    tokenizer: "PreTrainedTokenizerBase",
    prompts: list[str] | list[list[int]],
    completions: "list[Completion] | list[dict[str, Any]]",
    advantages: "torch.Tensor | list[float]",
    weights: "torch.Tensor | list[float] | None" = None,
    positional: bool = False,
) -> dict[str, "torch.Tensor"]:
    """Right-padded training tensors for completions (``Completion`` objects or their dicts).

    ``prompts`` are plain text (tokenized here, special tokens added) or token ids as the rollout
    worker rendered them (a chat template: the ids the policy was sampled from, used as they are).
    Completion k's prompt is ``prompts[completions[k].prompt_index]``, or ``prompts[k]`` with
    ``positional=True`` (one prompt per completion, e.g. a shard). The choice is the caller's: a rule
    guessed from the lengths would silently pair a shard with the wrong prompts whenever it happens to
    hold as many rows as the batch has prompts.

    Returns ``input_ids``/``attention_mask`` [B, L] (prompt + completion tokens), ``completion_mask``
    and ``old_logprobs`` [B, L] aligned with the token they score (position t holds the token
    at t, predicted from t-1), ``advantages`` [B] and ``weights`` [B] (how many samples each row
    stands for, see :func:`merge_duplicates`; default 1)."""
    import torch

    adv = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if adv.numel() != len(completions):
        raise ValueError(f"{adv.numel()} advantages for {len(completions)} completions")
    if prompts and not isinstance(prompts[0], str):
        enc = [list(p) for p in prompts]
    else:
        enc = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    if positional and len(prompts) != len(completions):
        raise ValueError(f"positional: {len(prompts)} prompts for {len(completions)} completions")
    pidx = [k if positional else int(_field(c, "prompt_index")) for k, c in enumerate(completions)]
    toks = [list(_field(c, "token_ids")) for c in completions]
    lps = [list(_field(c, "logprobs")) for c in completions]
    seqs = [enc[p] + t for p, t in zip(pidx, toks)]
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    b = len(seqs)
    input_ids = torch.full((b, width), pad, dtype=torch.int64)
    attn = torch.zeros((b, width), dtype=torch.int64)
    cmask = torch.zeros((b, width), dtype=torch.float32)
    old = torch.zeros((b, width), dtype=torch.float32)
    for r, s in enumerate(seqs):
        p = len(enc[pidx[r]])
        input_ids[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
        attn[r, : len(s)] = 1
        cmask[r, p : len(s)] = 1.0
        if len(lps[r]) != len(toks[r]):
            raise ValueError(f"completion {r}: {len(lps[r])} logprobs for {len(toks[r])} tokens")
        old[r, p : len(s)] = torch.tensor(lps[r], dtype=torch.float32)
    w = torch.ones(b) if weights is None else torch.as_tensor(weights, dtype=torch.float32).flatten()
    if w.numel() != b:
        raise ValueError(f"{w.numel()} weights for {b} completions")
    return {
        "input_ids": input_ids,
        "attention_mask": attn,
        "completion_mask": cmask,
        "old_logprobs": old,
        "advantages": adv,
        "weights": w,
    }


def token_logprobs(
    model: "torch.nn.Module", input_ids: "torch.Tensor", attention_mask: "torch.Tensor", temperature: float = 1.0
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Teacher-forced log p(token t | tokens < t) and entropy at each position, [B, L] each
    (position 0 is 0). ``temperature`` must match the sampler's."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, input_ids[:, 1:, None])[..., 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(lp[:, :1])
    return torch.cat([zero, lp], dim=1), torch.cat([zero, ent], dim=1)


def grpo_loss(
    model: "torch.nn.Module",
    batch: dict[str, "torch.Tensor"],
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_model: "torch.nn.Module | None" = None,
    total_tokens: float | None = None,
    temperature: float = 1.0,
    clip_eps_high: float | None = None,
) -> tuple["torch.Tensor", dict[str, float]]:
    """Clipped GRPO surrogate over this (micro-)batch, normalised by ``total_tokens``.

    ``total_tokens`` = completion tokens in the global batch (default: this batch's), so that
    summing gradients of all shards gives the global token mean. Metrics are for this shard:
    ``loss`` (its contribution), ``kl``, ``clip_frac``, ``ratio_mean``, ``entropy`` (token means),
    ``tokens``. ``clip_eps_high`` (default ``clip_eps``) is the upper clip of the ratio.
    """
    import torch

    high = clip_eps if clip_eps_high is None else clip_eps_high
    dev = next(model.parameters()).device
    ids = batch["input_ids"].to(dev)
    attn = batch["attention_mask"].to(dev)
    mask = batch["completion_mask"].to(dev)
    old = batch["old_logprobs"].to(dev)
    adv = batch["advantages"].to(dev)[:, None]
    # a merged row stands for several identical samples: it counts that many times in every sum
    wmask = mask * batch["weights"].to(dev)[:, None] if "weights" in batch else mask
    n_tok = float(wmask.sum().item())
    denom = float(total_tokens) if total_tokens is not None else max(n_tok, 1.0)

    logp, ent = token_logprobs(model, ids, attn, temperature)
    log_ratio = (logp - old) * mask
    ratio = torch.exp(log_ratio)
    surr = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv)
    per_tok = -surr
    kl = torch.zeros_like(logp)
    if kl_coef > 0:
        if ref_model is None:
            raise ValueError("kl_coef > 0 needs a ref_model")
        with torch.no_grad():
            ref_lp, _ = token_logprobs(ref_model, ids, attn, temperature)
        d = (ref_lp - logp) * mask
        kl = torch.exp(d) - d - 1  # k3: unbiased, non-negative estimate of KL(pi || ref)
        per_tok = per_tok + kl_coef * kl
    loss = (per_tok * wmask).sum() / denom

    with torch.no_grad():
        m = max(n_tok, 1.0)
        clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + high)).float() * wmask
        metrics = {
            "loss": float(loss.item()),
            "kl": float((kl * wmask).sum().item() / m),
            "clip_frac": float(clipped.sum().item() / m),
            "ratio_mean": float((ratio * wmask).sum().item() / m),
            "entropy": float((ent * wmask).sum().item() / m),
            "tokens": n_tok,
        }
    return loss, metrics
