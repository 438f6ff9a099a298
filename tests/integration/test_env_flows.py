"""Every environment type through the whole rl-train flow (tiny model, one step, a few problems).

Real components as in test_flow.py: torchrun rank, rollout worker, bubblewrap sandboxes, object
store, MLflow, Prefect's test harness. What is checked is the plumbing each type needs: its items
reach the rollout worker and back, its scorer (trusted or sandboxed) grades every sample, the
evaluation report carries its groups, and summary.json has the gain interval.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "trainer.steps=1", "trainer.prompts_per_step=3", "trainer.group_size=2", "warmstart.steps=0",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
    "model.tiny.num_heads=2", "cluster.ranks=1", "sandbox.runtime=bwrap", "rollout.max_new_tokens=8",
    "eval.max_new_tokens=8", "promote.enabled=false",
]


@pytest.fixture(scope="module")
def harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _math_rows(path: Path) -> Path:
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(12) for b in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tests_rows(path: Path) -> Path:
    rows = [{"prompt": f"Write add{k}(a, b) returning a + b + {k}.", "tests": f"assert add{k}(1, 2) == {3 + k}\n"}
            for k in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cases(tmp: Path) -> dict[str, list[str]]:
    example = tmp / "my_env"
    shutil.copytree(ROOT / "examples" / "my_env", example)
    return {
        "funcfit": ["env.type=funcfit", "env.eval_problems=6"],
        "reasoning_gym": ["env.type=reasoning_gym", "env.eval_problems=6",
                          "env.tasks=[{name: chain_sum, config: {min_terms: 2, max_terms: 2, max_digits: 1}},"
                          " {name: gcd}]", "env.answer.extract=last_number"],
        "dataset_math": ["env.type=dataset", f"env.path={_math_rows(tmp / 'math.jsonl')}", "env.scorer=math",
                         "env.columns.prompt=question", "env.eval_problems=6", "env.answer.extract=last_number"],
        "dataset_python_tests": ["env.type=dataset", f"env.path={_tests_rows(tmp / 'tests.jsonl')}",
                                 "env.scorer=python_tests", "env.columns.tests=tests", "env.columns.answer=null",
                                 "env.eval_problems=4", "env.answer.extract=text"],
        "humaneval": ["env.type=humaneval", "env.heldout_fraction=0.5", "env.eval_problems=4",
                      "model.tiny.max_position=2048"],  # HumanEval prompts run to ~1,400 characters
        "python": ["env.type=python", "env.entry=my_env:make", f"env.paths=[{example}]", "env.eval_problems=6"],
    }


@pytest.mark.parametrize("case", ["funcfit", "reasoning_gym", "dataset_math", "dataset_python_tests", "humaneval",
                                  "python"])
def test_environment_type_runs_through_the_flow(harness: None, tmp_path: Path, case: str) -> None:
    from flows.rl_train import rl_train
    from infra.storage import get_json, open_store

    root = tmp_path / "runs"
    out = rl_train(config="configs/demo.yaml", overrides=[*TINY, *_cases(tmp_path)[case], f"run_root={root}"])
    summary = json.loads(Path(out["summary_path"]).read_text())
    assert summary["steps"] == 1 and summary["eval_n"] >= 2
    low, high = summary["eval_gain_ci95"]
    assert low <= summary["eval_after"] - summary["eval_before"] <= high
    store = open_store(f"file://{root}/store")
    run = summary["run_id"]
    prompts = get_json(store, f"runs/{run}/step-000001/prompts.json")
    rollouts = get_json(store, f"runs/{run}/step-000001/rollouts.json")
    scores = get_json(store, f"runs/{run}/step-000001/scores.json")
    assert len(prompts["items"]) == 3 and len(rollouts["prompt_ids"]) == 3
    assert len(scores["rewards"]) == len(rollouts["samples"]) == 6
    assert all(0.0 <= r <= 1.0 for r in scores["rewards"])
    assert sum(scores["summary"]["reasons"].values()) == 6
    assert scores["summary"]["score_seconds"] >= 0.0
    final = get_json(store, _eval_key(store, run))
    assert len(final["problem_ids"]) == summary["eval_n"] and len(final["completions"]) == summary["eval_n"]


def _eval_key(store: object, run: str) -> str:
    keys = [k for k in store.list(f"runs/{run}/eval/") if k.endswith(".json") and "/v" in k  # type: ignore[attr-defined]
            and "completions" not in k]
    return sorted(keys)[-1]
