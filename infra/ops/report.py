"""Markdown reports people read in the Prefect UI: the run report and the eval-gate decision.

Plain strings (Prefect's markdown artifacts render them; the same text is logged to MLflow), built
from the run history (``RunContext.history``) and the gate's :class:`~evals.gate.GateDecision`.
"""

from __future__ import annotations

from typing import Any

MAX_STEP_ROWS = 60  # longer runs show the first and last steps; MLflow has every step


def _f(v: Any, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "–"


def step_table(history: list[dict[str, Any]]) -> str:
    """One row per training step: reward, solved, KL, loss, sync size, step time."""
    rows = [h for h in history if h.get("kind") == "step"]
    head = ("| step | version | reward | solved | KL | loss | sync kB | sync % of full | step s |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    shown = rows if len(rows) <= MAX_STEP_ROWS else rows[:10] + [{}] + rows[-(MAX_STEP_ROWS - 10):]
    lines = [head]
    for r in shown:
        if not r:
            lines.append(f"| … | | | | | | | | |  <!-- {len(rows) - MAX_STEP_ROWS} steps omitted -->")
            continue
        lines.append(
            f"| {r['step']} | {r.get('version', '–')} | {_f(r.get('reward_mean'))} ± {_f(r.get('reward_std'))} | "
            f"{_f(r.get('solved_fraction'), '.2f')} | {_f(r.get('kl'), '.4f')} | {_f(r.get('loss'), '.4f')} | "
            f"{_f((r.get('sync_bytes') or 0) / 1e3, '.1f')} | {_f((r.get('sync_fraction') or 0) * 100, '.2f')} | "
            f"{_f(r.get('step_seconds'), '.2f')} |")
    return "\n".join(lines)


def eval_table(history: list[dict[str, Any]]) -> str:
    """One row per held-out evaluation."""
    lines = ["| step | version | score | all tests pass |", "|---:|---:|---:|---:|"]
    for r in (h for h in history if h.get("kind") == "eval"):
        lines.append(f"| {r['step']} | {r.get('version', '–')} | {_f(r.get('score'), '.4f')} | {_f(r.get('accuracy'), '.4f')} |")
    return "\n".join(lines)


def run_report(summary: dict[str, Any], history: list[dict[str, Any]], run_link: str) -> str:
    """The per-run report: headline numbers, promotion, step and eval tables, link to MLflow."""
    s = summary
    gain = (s.get("eval_after") or 0.0) - (s.get("eval_before") or 0.0)
    promoted = "**promoted to champion**" if s.get("promoted") else "not promoted"
    return "\n".join([
        f"# deltaloop run `{s.get('run_id', '?')}`",
        "",
        f"- held-out eval: {_f(s.get('eval_before'), '.4f')} → {_f(s.get('eval_after'), '.4f')} ({gain:+.4f})",
        f"- steps: {s.get('steps')}, final weight version: {s.get('final_weight_version')}, "
        f"wall: {_f(s.get('wall_seconds'), '.0f')} s",
        f"- weight sync: {_f((s.get('sync_bytes_total') or 0) / 1e6, '.2f')} MB of deltas "
        f"({_f((s.get('sync_fraction_mean') or 0) * 100, '.2f')}% of a full snapshot on average)",
        f"- model version {s.get('model_version')}: {promoted} — {s.get('gate_reason', '')}",
        f"- {run_link}",
        "",
        "## Steps",
        "",
        step_table(history),
        "",
        "## Evaluations",
        "",
        eval_table(history),
        "",
    ])


def gate_report(decision: dict[str, Any], candidate: str, champion: str | None, run_link: str,
                suite: str | None = None) -> str:
    """The eval-gate decision: verdict, main-suite numbers with the CI, guard table, reason."""
    d = decision
    verdict = "PROMOTED" if d["promote"] else "REJECTED"
    conf = int(round(100 * d.get("confidence", 0.95)))
    ci = (f"[{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]" if d.get("ci_low") is not None else "–")
    lines = [
        f"# Eval gate: model version {candidate} — **{verdict}**",
        "",
        f"Champion at the gate: {champion or 'none'}" + (f"; suite `{suite}`" if suite else ""),
        "",
        "| | candidate | champion | improvement | CI" + str(conf) + " | margin | method |",
        "|---|---:|---:|---:|---|---:|---|",
        f"| main suite | {_f(d.get('candidate_score'), '.4f')} | {_f(d.get('champion_score'), '.4f')} | "
        f"{_f(d.get('improvement'), '+.4f')} | {ci} | {_f(d.get('margin'), '+.4f')} | {d.get('method')} |",
    ]
    if d.get("guards"):
        lines += ["", "## Guard suites", "", "| guard | n | candidate | champion | Δ | tolerance | ok |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for g in d["guards"]:
            lines.append(f"| {g['suite']} | {g['n']} | {g['candidate']:.4f} | {g['champion']:.4f} | "
                         f"{g['delta']:+.4f} | {g['tolerance']:.4f} | {'yes' if g['ok'] else '**no**'} |")
    lines += ["", f"**Reason:** {d['reason']}", "", f"- {run_link}", ""]
    return "\n".join(lines)
