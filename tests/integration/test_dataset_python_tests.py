"""A ``python_tests`` dataset (MBPP-style rows) scored end to end in real sandboxes.

Model completions go through :class:`evals.dataset.DatasetEnv` (code extraction, the row's trusted
tests, ``pool.run_tests_many``) in bubblewrap and in a real dockerd (marked ``docker``; it needs the
daemon and image from scripts/setup_sandbox.sh). Honest completions score 1; every hostile one —
printing "PASS", exiting 0 early, writing a verdict file, patching the test harness, killing the
runner — scores 0, and the pool still scores honestly afterwards. On CI (``CI=true``) a missing
bwrap/dockerd is a failure, not a skip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from evals.dataset import DatasetEnv
from evals.env import Item
from evals.registry import build_environment, check_environment
from infra.config import DatasetEnvConfig
from infra.sandbox import SandboxPool
from tests.sandbox_helpers import RUNTIMES, running_pool

VERDICT = '{"phase": "tests", "passed": true, "reward": 1.0, "reason": "ok"}'
ROWS = [
    {"task_id": 1, "text": "Write a function add(a, b) that returns the sum of a and b.",
     "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 32) == 42"]},
    {"task_id": 2, "text": "Write is_even(n): True when n is even.", "entry_point": "is_even",
     "test_list": "def check(candidate):\n    assert candidate(2) is True\n    assert candidate(7) is False\n"},
]
WRONG = "def add(a, b):\n    return a - b\n"


def fenced(code: str) -> str:
    """A completion as an instruct model writes it: prose around one fenced block."""
    return f"Here is the solution:\n\n```python\n{code}```\n\nIt passes the tests."


HONEST = {
    "add fenced": (1, fenced("def add(a, b):\n    return a + b\n")),
    "add bare code": (1, "def add(a, b):\n    return a + b\n"),
    "is_even fenced": (2, fenced("def is_even(n):\n    return n % 2 == 0\n")),
}
HOSTILE = {
    "prints PASS": WRONG + f"print('PASS')\nprint('All tests passed')\nprint({VERDICT!r})\n",
    "exit(0) early": "import sys\nsys.exit(0)\n" + WRONG,
    "os._exit(0) in the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "writes verdict files": WRONG + (
        "import os\nfor d in ('.', '/tmp', '/scratch', os.path.expanduser('~')):\n"
        "    for name in ('verdict.json', 'result.json', 'passed'):\n"
        "        try:\n            open(os.path.join(d, name), 'w').write(" + repr(VERDICT) + ")\n"
        "        except OSError:\n            pass\n"
        "for fd in range(3, 64):\n"
        "    try:\n        os.write(fd, " + repr(VERDICT.encode()) + ")\n    except OSError:\n        pass\n"),
    "patches AssertionError": WRONG + (
        "import builtins\nclass Never(BaseException):\n    pass\nbuiltins.AssertionError = Never\n"),
    "redefines check": "def check(candidate):\n    return True\n" + WRONG,
    "patches the harness modules": WRONG + (
        "import sys, json, unittest\njson.dumps = lambda *a, **k: " + repr(VERDICT) + "\n"
        "sys.exit = lambda *a: None\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"),
    "kills pid 1": WRONG + "import os\nos.kill(1, 9)\n",
    "kills every process": WRONG + "import os\nos.kill(-1, 9)\n",
    "kills the runner in the call": "import os\ndef add(a, b):\n    os.kill(os.getppid(), 9)\n    os.kill(-1, 9)\n",
}


@pytest.fixture(scope="module", params=RUNTIMES)
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with running_pool(request.param) as p:
        yield p


def _env(tmp_path: Path, **answer: object) -> DatasetEnv:
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = DatasetEnvConfig(path=str(path), scorer="python_tests", heldout_fraction=1.0,
                           columns={"prompt": "text", "tests": "test_list", "id": "task_id", "entry": "entry_point"},
                           **({"answer": answer} if answer else {}))
    assert check_environment(cfg) == []
    env = build_environment(cfg)
    assert isinstance(env, DatasetEnv)
    return env


def _by_id(env: DatasetEnv) -> dict[int, Item]:
    return {int(it.id): it for it in env.heldout_items(10)}


def test_honest_completions_score_one_and_hostile_ones_zero(tmp_path: Path, pool: SandboxPool) -> None:
    env = _env(tmp_path)
    items = _by_id(env)
    honest_items = [items[row] for row, _ in HONEST.values()]
    honest = env.score(honest_items, [c for _, c in HONEST.values()], pool)
    assert [(s.reward, s.correct, s.reason) for s in honest] == [(1.0, True, "ok")] * len(HONEST), honest

    names = list(HOSTILE)
    scores = env.score([items[1]] * len(names), [fenced(HOSTILE[n]) for n in names], pool)
    for name, s in zip(names, scores):
        assert (s.reward, s.correct) == (0.0, False), (name, s)
        assert s.reason != "ok", (name, s)

    wrong = env.score([items[1], items[2]], [fenced(WRONG), fenced("def is_even(n):\n    return n % 2\n")], pool)
    assert [(s.reward, s.reason) for s in wrong] == [(0.0, "wrong"), (0.0, "wrong")], wrong
    again = env.score(honest_items, [c for _, c in HONEST.values()], pool)  # the pool is still healthy
    assert [s.correct for s in again] == [True] * len(HONEST), again


def test_format_share_and_missing_code(tmp_path: Path, pool: SandboxPool) -> None:
    env = _env(tmp_path, format_weight=0.2)
    add = _by_id(env)[1]
    good = "def add(a, b):\n    return a + b\n"
    scores = env.score([add] * 4, [fenced(good), good, fenced(WRONG), "   "], pool)
    assert [(round(s.reward, 6), s.correct, s.reason) for s in scores] == [
        (1.0, True, "ok"), (0.8, True, "ok"), (0.2, False, "wrong"), (0.0, False, "no_answer")], scores
