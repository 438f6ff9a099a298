"""What the chaos bench measures, from ground truth: the stores of a chaos run and of the undisturbed
run with the same seed.

* ``fake_zero_rewards`` — unmasked samples of the chaos run whose score carries the ``infra``
  reason, or whose reward differs from the undisturbed run's reward for the same (step, prompt id,
  completion text). Scoring is deterministic, so for the same completion any difference is damage
  done by a fault (or by a timeout under load: the differences at steps without a fault are
  reported apart, as the noise floor).
* ``masked_samples`` — samples the chaos run's ``scores.json`` marks ``masked``.
* ``prompt_ids_match`` — the prompt ids trained at every step equal the undisturbed run's. The ids
  come from the step's training record (``train.json``: ``prompt_ids``) when the run writes one,
  else from the step's ``prompts.json``.
* ``version_regressions`` — steps whose rollouts came from an older weight version than an earlier
  step's (``rollouts.json`` records the version each batch was generated with, per sample too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infra.storage import ObjectNotFound, ObjectStore, get_json, run_key


def _doc(store: ObjectStore, key: str) -> Any:
    try:
        return get_json(store, key)
    except (ObjectNotFound, ValueError):
        return None


def trained_prompt_ids(store: ObjectStore, run_id: str, step: int) -> list[str] | None:
    """The prompt ids trained at ``step`` (None when the step has no prompts)."""
    train = _doc(store, run_key(run_id, step, "train.json"))
    if isinstance(train, dict):
        for field in ("prompt_ids", "trained_prompt_ids", "item_ids"):
            if isinstance(train.get(field), list):
                return [str(x) for x in train[field]]
    prompts = _doc(store, run_key(run_id, step, "prompts.json"))
    if isinstance(prompts, dict) and isinstance(prompts.get("items"), list):
        return [str(it.get("id")) for it in prompts["items"]]
    return None


def step_samples(store: ObjectStore, run_id: str, step: int) -> list[dict[str, Any]] | None:
    """Per sample of ``step``: prompt id, completion text, reward, reason, masked, version."""
    roll = _doc(store, run_key(run_id, step, "rollouts.json"))
    scores = _doc(store, run_key(run_id, step, "scores.json"))
    prompts = _doc(store, run_key(run_id, step, "prompts.json"))
    if not (isinstance(roll, dict) and isinstance(scores, dict) and isinstance(prompts, dict)):
        return None
    ids = [str(it.get("id")) for it in prompts.get("items", [])]
    samples = roll.get("samples", [])
    n = len(samples)
    masked = scores.get("masked") or [False] * n
    reasons = scores.get("reasons") or [""] * n
    return [{"prompt": ids[s["prompt_index"]] if s["prompt_index"] < len(ids) else str(s["prompt_index"]),
             "text": s["text"], "reward": float(scores["rewards"][i]), "reason": reasons[i],
             "masked": bool(masked[i]), "version": int(s.get("version", roll.get("version", -1)))}
            for i, s in enumerate(samples) if i < len(scores.get("rewards", []))]


def compare_rewards(chaos: ObjectStore, chaos_run: str, base: ObjectStore, base_run: str, steps: int,
                    fault_steps: set[int]) -> dict[str, Any]:
    """Fake zeros, masked samples and reward differences of the chaos run against the baseline."""
    fake = masked = compared = noise = 0
    fake_by_step: dict[int, int] = {}
    for step in range(1, steps + 1):
        mine = step_samples(chaos, chaos_run, step)
        theirs = step_samples(base, base_run, step)
        if mine is None:
            continue
        truth = {(s["prompt"], s["text"]): s["reward"] for s in theirs or []}
        for s in mine:
            if s["masked"]:
                masked += 1
                continue
            want = truth.get((s["prompt"], s["text"]))
            compared += want is not None
            differs = want is not None and abs(want - s["reward"]) > 1e-9
            if s["reason"] == "infra" or (differs and step in fault_steps):
                fake += 1
                fake_by_step[step] = fake_by_step.get(step, 0) + 1
            elif differs:
                noise += 1
    return {"fake_zero_rewards": fake, "fake_zero_by_step": fake_by_step, "masked_samples": masked,
            "samples_compared": compared, "reward_diffs_without_fault": noise}


def compare_prompts(chaos: ObjectStore, chaos_run: str, base: ObjectStore, base_run: str,
                    steps: int) -> dict[str, Any]:
    """``prompt_ids_match`` and the steps where the trained prompt ids differ (or are missing)."""
    bad = [step for step in range(1, steps + 1)
           if (ids := trained_prompt_ids(chaos, chaos_run, step)) is None
           or ids != trained_prompt_ids(base, base_run, step)]
    return {"prompt_ids_match": not bad, "prompt_id_mismatch_steps": bad}


def version_regressions(store: ObjectStore, run_id: str, steps: int) -> dict[str, Any]:
    """Times the rollouts of a step came from an older version than an earlier step's."""
    served: list[int] = []
    regressions = 0
    high = -1
    for step in range(1, steps + 1):
        roll = _doc(store, run_key(run_id, step, "rollouts.json"))
        if not isinstance(roll, dict):
            continue
        versions = [int(s.get("version", roll.get("version", -1))) for s in roll.get("samples", [])] or [
            int(roll.get("version", -1))]
        low = min(versions)
        served.append(int(roll.get("version", low)))
        if low < high:
            regressions += 1
        high = max(high, max(versions))
    return {"version_regressions": regressions, "served_versions": served}


def steps_completed(store: ObjectStore, run_id: str, steps: int, summary: dict[str, Any] | None) -> int:
    """Steps trained: the finished run's summary, else steps with a score and the version trained after."""
    if summary is not None:
        return int(summary.get("steps", 0))
    done = 0
    for step in range(1, steps + 1):
        published = store.list(f"runs/{run_id}/weights/v{step + 1:08d}/")
        if not store.exists(run_key(run_id, step, "scores.json")) or not published:
            break
        done = step
    return done


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """``summary.json`` of a finished run (None if the run did not finish)."""
    path = run_dir / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def eval_difference(chaos: ObjectStore, chaos_run: str, chaos_summary: dict[str, Any] | None, base: ObjectStore,
                    base_run: str, base_summary: dict[str, Any] | None) -> list[float] | None:
    """Paired-bootstrap 95% interval of (chaos - baseline) held-out reward on the same problems."""
    from infra.stages.evaluate import paired_gain

    if not chaos_summary or not base_summary:
        return None
    reports = []
    for store, run, summary in ((base, base_run, base_summary), (chaos, chaos_run, chaos_summary)):
        name = f"/v{int(summary['final_weight_version']):06d}.json"
        keys = sorted(k for k in store.list(f"runs/{run}/eval/") if k.endswith(name))
        found = [d for d in (_doc(store, k) for k in keys) if isinstance(d, dict)
                 and d.get("suite") == summary.get("eval_suite")]
        if not found:
            return None
        reports.append(found[0])
    ci = paired_gain(reports[0], reports[1])
    return list(ci) if ci else None
