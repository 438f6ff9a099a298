"""env.type python: the user's own environment from a module outside the repo (examples/my_env copied to
a temporary folder), built, checked and scored through evals.registry; bad entry points are one line."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest

from evals.env import Environment, Item
from evals.registry import build_environment, check_environment
from infra.config import PythonEnvConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_env"


@pytest.fixture()
def outside(tmp_path: Path) -> Iterator[Path]:
    """examples/my_env copied out of the repository, under a module name no other test imports."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    shutil.copy(EXAMPLE / "my_env.py", folder / "tmp_reverse_env.py")
    yield folder
    sys.modules.pop("tmp_reverse_env", None)
    while str(folder) in sys.path:
        sys.path.remove(str(folder))


def test_entry_point_outside_the_repo_builds_checks_and_scores(outside: Path) -> None:
    cfg = PythonEnvConfig(entry="tmp_reverse_env:make", paths=[str(outside)], eval_problems=50,
                          options={"min_len": 4, "max_len": 5})
    assert check_environment(cfg) == []
    env = build_environment(cfg)
    assert isinstance(env, Environment) and not env.needs_sandbox
    held = env.heldout_items(50)
    assert len(held) == 50 and len({it.id for it in held}) == 50
    assert all(4 <= len(it.id) <= 5 for it in held)
    assert env.heldout_items(10) == held[:10]
    train = [it for step in range(20) for it in env.train_items(step, 16)]
    assert env.train_items(3, 16) == env.train_items(3, 16) != env.train_items(4, 16)
    assert not {it.id for it in held} & {it.id for it in train}

    items = held[:4]
    completions = [items[0].id[::-1], f"{items[1].id[::-1]}.", items[2].id, ""]
    scores = env.score(items, completions, None)
    assert [s.reward for s in scores] == [1.0, 1.0, 0.0, 0.0]
    assert [s.reason for s in scores] == ["ok", "ok", "wrong", "no_answer"]


def test_items_round_trip_as_json(outside: Path) -> None:
    env = build_environment(PythonEnvConfig(entry="tmp_reverse_env:make", paths=[str(outside)]))
    item = env.train_items(0, 1)[0]
    back = Item.from_json(item.to_json())
    assert back == item and env.score([back], [item.answer], None)[0].correct


def test_entry_point_that_does_not_import_is_one_clear_line(tmp_path: Path) -> None:
    problems = check_environment(PythonEnvConfig(entry="no_such_user_module:make", paths=[str(tmp_path)]))
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith("env (python): ") and "'no_such_user_module' does not import" in problems[0]


def test_missing_factory_broken_module_and_missing_folder_are_one_line_each(outside: Path, tmp_path: Path) -> None:
    (outside / "tmp_broken_env.py").write_text("import json\ndef make(cfg):\n    return json.missing_name\n")
    cases = {
        "tmp_reverse_env:nothing": ("has no attribute 'nothing'", [str(outside)]),
        "tmp_broken_env:make": ("has no attribute 'missing_name'", [str(outside)]),
        "tmp_reverse_env:make": ("is not a folder", [str(tmp_path / "absent")]),
    }
    try:
        for entry, (message, paths) in cases.items():
            problems = check_environment(PythonEnvConfig(entry=entry, paths=paths))
            assert len(problems) == 1 and "\n" not in problems[0] and message in problems[0], (entry, problems)
    finally:
        sys.modules.pop("tmp_broken_env", None)


def test_factory_returning_something_else_names_the_missing_members(outside: Path) -> None:
    (outside / "tmp_not_env.py").write_text("def make(cfg):\n    return object()\n")
    try:
        problems = check_environment(PythonEnvConfig(entry="tmp_not_env:make", paths=[str(outside)]))
    finally:
        sys.modules.pop("tmp_not_env", None)
    assert len(problems) == 1 and "lacks name, stop, system_prompt" in problems[0]


def test_reward_of_your_own_wraps_a_builtin_environment(tmp_path: Path) -> None:
    folder = tmp_path / "reward_code"
    folder.mkdir()
    shutil.copy(EXAMPLE / "my_reward.py", folder / "tmp_short_reward.py")
    inner = {"type": "reasoning_gym",
             "tasks": [{"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                        "max_digits": 1}}]}
    cfg = PythonEnvConfig(entry="tmp_short_reward:make", paths=[str(folder)], eval_problems=20,
                          options={"max_chars": 40, "inner": inner})
    try:
        assert check_environment(cfg) == []
        env = build_environment(cfg)
    finally:
        sys.modules.pop("tmp_short_reward", None)
        while str(folder) in sys.path:
            sys.path.remove(str(folder))
    item = env.heldout_items(1)[0]
    right = f"<answer>{item.answer}</answer>"
    padded = "Let me think about this carefully. " * 3 + right
    scores = env.score([item] * 3, [right, padded, "<answer>nonsense</answer>"], None)
    assert scores[0].reward == 1.0 and scores[0].correct
    assert scores[1].correct and scores[1].reward == pytest.approx(40 / len(padded))
    assert scores[2].reward == 0.0 and not scores[2].correct
    assert {it.id for it in env.heldout_items(20)}.isdisjoint({it.id for it in env.train_items(0, 20)})
