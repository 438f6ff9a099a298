"""pass@k: the chance that at least one of k samples solves a problem, estimated from n >= k samples.

Drawing only k samples per problem and checking whether any passes is a high-variance estimate; the
unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code") draws
n >= k samples, counts the c correct ones and averages, over problems,

    pass@k = 1 - C(n - c, k) / C(n, k)

the probability that a k-subset of the n samples, drawn without replacement, holds a correct one.
The binomials overflow floats for n in the hundreds, so :func:`pass_at_k` evaluates the ratio as the
product ``prod_{i = n-c+1}^{n} (1 - k / i)``, each factor in [0, 1]. The per-problem values are
returned too: the promotion gate's paired bootstrap resamples problems, not samples.
"""

from __future__ import annotations

import math
from typing import Any, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples.

    ``c == 0`` gives 0; fewer than ``k`` wrong samples (``n - c < k``, e.g. ``c == n``) gives 1, since
    every k-subset then holds a correct one. ``k > n`` is an error: n samples cannot estimate pass@k
    without bias (the config requires ``samples >= max(k)``)."""
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"correct count must be in [0, n={n}], got c={c}")
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if c == 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_report(item_ids: Sequence[str], n_correct_per_item: Sequence[int], n_samples: int | Sequence[int],
                     ks: Sequence[int]) -> dict[str, Any]:
    """pass@k of a suite for every ``k`` in ``ks``: the mean over problems and each problem's value.

    ``n_samples`` is the samples drawn per problem (one number, or one per problem). The result::

        {"problems": P, "samples": n, "k": [1, 10], "pass@1": 0.31, "pass@10": 0.62,
         "per_item": {"ids": [...], "correct": [...], "pass@1": [...], "pass@10": [...]}}

    where ``samples`` is the per-problem count (the smallest one when they differ) and the
    per-item lists follow ``item_ids``' order (what a paired bootstrap between two models needs)."""
    ids, correct = list(item_ids), [int(c) for c in n_correct_per_item]
    if len(ids) != len(correct):
        raise ValueError(f"{len(ids)} item ids but {len(correct)} correct counts")
    if not ids:
        raise ValueError("pass@k of an empty suite")
    ns = [int(n_samples)] * len(ids) if isinstance(n_samples, int) else [int(n) for n in n_samples]
    if len(ns) != len(ids):
        raise ValueError(f"{len(ids)} item ids but {len(ns)} sample counts")
    ks = sorted({int(k) for k in ks})
    if not ks:
        raise ValueError("no k given")
    per_item: dict[str, list[Any]] = {"ids": ids, "correct": correct}
    report: dict[str, Any] = {"problems": len(ids), "samples": min(ns), "k": ks}
    for k in ks:
        values = [pass_at_k(n, c, k) for n, c in zip(ns, correct)]
        per_item[f"pass@{k}"] = values
        report[f"pass@{k}"] = sum(values) / len(values)
    report["per_item"] = per_item
    return report
