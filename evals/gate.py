"""The promotion gate: should a candidate policy replace the champion?

Pure functions, no I/O. With per-problem rewards of both models on the *same* suite, the decision
uses a paired bootstrap of the mean improvement: promote only if the lower end of the confidence
interval lies above ``margin``. Without paired data (no champion report on this suite) it falls back
to comparing means. No champion at all: promote.

Guard suites (:func:`decide_with_guards`) protect what the main suite can hide: a candidate whose
overall score rises while one slice of the work collapses is rejected. A guard fails when the
candidate's mean on it is lower than the champion's by more than the guard's tolerance (a point
estimate, deliberately strict: a guard is a veto, not a test of significance). Slices come from the
suite itself (:func:`slices_by_prefix`, e.g. one guard per funcfit family) or from separate suites.

Extra evaluation suites (``eval.suites``) can veto too (:func:`check_suite_regressions`,
``promote.no_regression``): a suite regresses when the paired-bootstrap interval of the candidate's
per-problem rewards minus the champion's lies entirely below zero — a significant drop, not noise.

Floors (:func:`check_floors`, ``promote.floors``) are absolute: a candidate whose mean on a suite is
below that suite's configured minimum is never promoted, with or without a champion — "better than
nothing" is not a reason to serve a model that scores 0. A floor whose suite has no result fails
too (fail closed: the floor cannot be verified).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


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
    confidence: float = 0.95
    margin: float = 0.0
    guards: list["GuardCheck"] = field(default_factory=list)
    suites: list["SuiteCheck"] = field(default_factory=list)
    floors: list["FloorCheck"] = field(default_factory=list)


@dataclass
class GuardCheck:
    """One guard suite: the candidate may not fall below the champion by more than ``tolerance``."""

    suite: str
    n: int
    candidate: float
    champion: float
    delta: float
    tolerance: float
    ok: bool


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
        return GateDecision(ok, why, cand, champ, imp, lo, hi, method="paired_bootstrap",
                            confidence=confidence, margin=margin)
    assert champion_score is not None
    imp = cand - champion_score
    ok = imp > margin
    why = f"score {cand:.4f} vs champion {champion_score:.4f}: {imp:+.4f} {'>' if ok else '<='} margin {margin:+.4f}"
    return GateDecision(ok, why, cand, champion_score, imp, method="mean", confidence=confidence, margin=margin)


def check_guards(
    candidate: dict[str, list[float]],
    champion: dict[str, list[float]],
    tolerance: float | dict[str, float],
) -> list[GuardCheck]:
    """Compare each guard suite present in both; ``tolerance`` is one value or one per suite."""
    out: list[GuardCheck] = []
    for name in sorted(set(candidate) & set(champion)):
        cand, champ = candidate[name], champion[name]
        if not cand or len(cand) != len(champ):
            raise ValueError(f"guard {name!r} needs equal non-empty suites: {len(cand)} vs {len(champ)} problems")
        tol = tolerance.get(name, 0.0) if isinstance(tolerance, dict) else tolerance
        c, h = sum(cand) / len(cand), sum(champ) / len(champ)
        out.append(GuardCheck(name, len(cand), c, h, c - h, tol, c - h >= -tol - 1e-12))
    return out


def decide_with_guards(
    candidate: list[float],
    champion: list[float] | None,
    margin: float,
    guards_candidate: dict[str, list[float]] | None = None,
    guards_champion: dict[str, list[float]] | None = None,
    tolerance: float | dict[str, float] = 0.05,
    champion_score: float | None = None,
    confidence: float = 0.95,
) -> GateDecision:
    """:func:`decide` on the main suite, then veto if any guard suite regresses beyond tolerance."""
    decision = decide(candidate, champion, margin, champion_score=champion_score, confidence=confidence)
    if champion is None or not guards_candidate or not guards_champion:
        return decision
    decision.guards = check_guards(guards_candidate, guards_champion, tolerance)
    failed = [g for g in decision.guards if not g.ok]
    if failed and decision.promote:
        worst = min(failed, key=lambda g: g.delta)
        decision.promote = False
        decision.reason = (f"{decision.reason}, but guard {worst.suite!r} regressed {worst.delta:+.4f} "
                           f"(tolerance {worst.tolerance:.4f}; {len(failed)} guard(s) failed)")
    elif failed:
        decision.reason += f"; guard(s) {', '.join(repr(g.suite) for g in failed)} also regressed beyond tolerance"
    elif decision.guards:
        decision.reason += f"; {len(decision.guards)}/{len(decision.guards)} guards within tolerance"
    return decision


@dataclass
class SuiteCheck:
    """One extra eval suite under ``promote.no_regression``: the paired interval of candidate minus
    champion; the suite regressed when the whole interval lies below 0."""

    suite: str
    n: int
    candidate: float
    champion: float
    ci_low: float
    ci_high: float
    ok: bool


def check_suite_regressions(candidate: dict[str, list[float]], champion: dict[str, list[float]],
                            confidence: float = 0.95) -> list[SuiteCheck]:
    """Paired bootstrap per suite present in both (same problems, same order)."""
    out: list[SuiteCheck] = []
    for name in sorted(set(candidate) & set(champion)):
        cand, champ = candidate[name], champion[name]
        if not cand or len(cand) != len(champ):
            raise ValueError(f"suite {name!r} needs equal non-empty reports: {len(cand)} vs {len(champ)} problems")
        lo, hi = paired_bootstrap([c - h for c, h in zip(cand, champ)], confidence=confidence)
        out.append(SuiteCheck(name, len(cand), sum(cand) / len(cand), sum(champ) / len(champ), lo, hi, hi >= 0.0))
    return out


def suite_rewards(reports: dict[str, dict]) -> dict[str, list[float]]:
    """Per-problem rewards of each guard suite report (``{"suite", "rewards", "guard"}``) keyed by the
    suite's cache name, so that only identical suites (same env, split, size, decoding) are paired."""
    return {r["suite"]: [float(x) for x in r["rewards"]] for r in reports.values() if r.get("guard", True)}


def veto_regressions(decision: GateDecision, checks: list[SuiteCheck]) -> GateDecision:
    """Reject a promotion when any suite check failed; the reason names the worst one."""
    decision.suites = checks
    failed = [c for c in checks if not c.ok]
    if failed and decision.promote:
        worst = min(failed, key=lambda c: c.ci_high)
        decision.promote = False
        decision.reason += (f", but suite {worst.suite!r} regressed: {worst.candidate:.4f} vs {worst.champion:.4f} "
                            f"(CI [{worst.ci_low:+.4f}, {worst.ci_high:+.4f}])")
    elif checks and not failed:
        decision.reason += f"; no regression on {len(checks)} suite(s)"
    return decision


@dataclass
class FloorCheck:
    """One suite's absolute minimum: the candidate's mean ``score`` (None: no result) against ``floor``."""

    suite: str
    score: float | None
    floor: float
    ok: bool


def check_floors(scores: dict[str, float | None], floors: dict[str, float]) -> list[FloorCheck]:
    """Each floor against the candidate's mean score on its suite (missing or None: not met)."""
    out: list[FloorCheck] = []
    for name in sorted(floors):
        score = scores.get(name)
        out.append(FloorCheck(name, score, floors[name], score is not None and score >= floors[name] - 1e-12))
    return out


def veto_floors(decision: GateDecision, checks: list[FloorCheck]) -> GateDecision:
    """Reject a promotion when the candidate is below any suite's floor (even with no champion);
    the reason names every floor missed."""
    decision.floors = checks
    failed = [c for c in checks if not c.ok]
    if failed:
        missed = ", ".join(
            f"suite {c.suite!r} " + (f"scored {c.score:.4f} < floor {c.floor:.4f}" if c.score is not None
                                     else f"has no result for its floor {c.floor:.4f}")
            for c in failed)
        decision.reason += f"{', but' if decision.promote else ';'} below the production floor: {missed}"
        decision.promote = False
    elif checks:
        decision.reason += f"; {len(checks)} floor(s) met"
    return decision


def slices_by_prefix(problem_ids: list[str], rewards: list[float], sep: str = "|") -> dict[str, list[float]]:
    """Per-problem rewards grouped by the id's prefix before ``sep`` (funcfit: the family)."""
    if len(problem_ids) != len(rewards):
        raise ValueError(f"{len(problem_ids)} problem ids but {len(rewards)} rewards")
    out: dict[str, list[float]] = {}
    for pid, r in zip(problem_ids, rewards):
        out.setdefault(pid.split(sep, 1)[0], []).append(float(r))
    return out
