"""The promotion gate: should a candidate policy replace the champion?

Pure functions, no I/O. With per-problem rewards of both models on the *same* suite, the decision
uses a paired bootstrap of the mean improvement: promote only if the lower end of the confidence
interval lies above ``margin``. Without paired data (no champion report on this suite) it falls back
to comparing means. No champion at all: promote.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class GateDecision:
    """Outcome of the gate, with the numbers behind it."""

    promote: bool
    reason: str
    candidate_score: float
    champion_score: float | None
    improvement: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    method: str = "none"


def paired_bootstrap(diffs: list[float], iters: int = 2000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of paired differences."""
    if not diffs:
        raise ValueError("paired_bootstrap needs at least one difference")
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    lo = means[int((1 - confidence) / 2 * iters)]
    hi = means[min(iters - 1, int((1 + confidence) / 2 * iters))]
    return lo, hi


def decide(
    candidate: list[float],
    champion: list[float] | None,
    margin: float,
    champion_score: float | None = None,
    confidence: float = 0.95,
) -> GateDecision:
    """Gate a candidate against the champion.

    ``candidate``/``champion``: per-problem rewards on the same ordered suite (``champion`` None when
    unavailable; then ``champion_score`` — the champion's recorded mean — is used if given).
    """
    if not candidate:
        raise ValueError("candidate has no eval results")
    cand = sum(candidate) / len(candidate)
    if champion is None and champion_score is None:
        return GateDecision(True, "no current champion", cand, None, method="none")
    if champion is not None:
        if len(champion) != len(candidate):
            raise ValueError(f"paired gate needs equal suites: {len(candidate)} vs {len(champion)} problems")
        champ = sum(champion) / len(champion)
        diffs = [c - h for c, h in zip(candidate, champion)]
        lo, hi = paired_bootstrap(diffs, confidence=confidence)
        imp = cand - champ
        ok = lo > margin
        why = (f"improvement {imp:+.4f} (CI{int(confidence*100)} [{lo:+.4f}, {hi:+.4f}]) "
               f"{'clears' if ok else 'does not clear'} margin {margin:+.4f}")
        return GateDecision(ok, why, cand, champ, imp, lo, hi, method="paired_bootstrap")
    assert champion_score is not None
    imp = cand - champion_score
    ok = imp > margin
    why = f"score {cand:.4f} vs champion {champion_score:.4f}: {imp:+.4f} {'>' if ok else '<='} margin {margin:+.4f}"
    return GateDecision(ok, why, cand, champion_score, imp, method="mean")
