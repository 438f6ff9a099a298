"""Environment scorers on real sandboxes whose infrastructure fails (issue #16).

A sample whose sandbox is killed from outside on every attempt, or whose runtime cannot start a
sandbox at all, must come out of the environment's scorer as a masked Score (reason ``infra``), never
as reward 0; a job that kills its own sandbox, or is simply wrong, keeps its real score. The faults
are real: ``kill -9`` of the bwrap process group / ``docker kill`` of the container running the job
(found from the host, ``tests/sandbox_helpers.py``), and a sandbox interpreter that exits at once.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from evals.funcfit import FuncfitEnv
from evals.registry import build_environment
from infra.config import DatasetEnvConfig
from evals.multiturn import run_tool
from tests.sandbox_helpers import RUNTIMES, kill_sandbox, own_sandboxes, running_pool

FAST_BACKOFF = {"infra_backoff_s": 0.05}


class _Killer(threading.Thread):
    """Kills, once, the sandbox of this process that has been running one job for ``after_s``."""

    def __init__(self, runtime: str, after_s: float = 0.8) -> None:
        super().__init__(daemon=True)
        self.runtime, self.after_s = runtime, after_s
        self.killed: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        busy_since: dict[str, float] = {}
        while not self._halt.is_set() and not self.killed:
            now = time.monotonic()
            for box in own_sandboxes(self.runtime):
                if not box.busy:
                    busy_since.pop(box.target, None)  # a fast job ended: only a long one is the target
                elif now - busy_since.setdefault(box.target, now) >= self.after_s:
                    kill_sandbox(box)
                    self.killed.append(box.target)
                    break
            self._halt.wait(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sandbox_killed_from_outside_is_masked_by_the_scorer(runtime: str) -> None:
    """Replays issue #16, "a sandbox killed from outside during a job" with no retry left
    (``infra_retries: 0``): funcfit's scorer used to give that sample reward 0 with reason
    ``killed``. It is masked now, while the batch's honest, wrong and self-killing samples keep their
    real scores in the same call."""
    env = FuncfitEnv()
    items = env.heldout_items(4)
    slow = f"(__import__('time').sleep(3), {items[0].answer})[1]"
    completions = [slow, items[1].answer, "0", "__import__('os').kill(-1, 9)"]
    with running_pool(runtime, concurrency=1, min_warm=1, max_warm=2, infra_retries=0, **FAST_BACKOFF) as pool:
        killer = _Killer(runtime)
        killer.start()
        scores = env.score(items, completions, pool)
        killer.stop()
    assert len(killer.killed) == 1, "the test must have killed the slow job's sandbox"
    got = [(s.reward, s.reason, s.masked) for s in scores]
    assert got[0] == (0.0, "infra", True)
    assert got[1] == (1.0, "ok", False)
    assert got[2][2] is False and got[2][1] != "infra" and got[2][0] < 1.0
    assert got[3] == (0.0, "killed", False)


@pytest.mark.timeout(300)
def test_runtime_that_cannot_start_masks_every_sandboxed_sample(tmp_path: Path) -> None:
    """Replays issue #16, "no sandbox can be started" (a broken runtime: the sandbox's interpreter
    exits at once): funcfit, a python_tests dataset and the multi-turn tool get masked Scores / an
    ``infra`` tool reason for what needed a sandbox; a dataset sample with no code is still scored
    (``no_answer``) since it never needed one."""
    fit = FuncfitEnv()
    items = fit.heldout_items(2)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "Write add(a, b).", "tests": "assert add(1, 2) == 3\n"}) + "\n")
    data = build_environment(DatasetEnvConfig(path=str(path), scorer="python_tests", heldout_fraction=1.0,
                                              columns={"tests": "tests", "answer": None}))
    rows = data.heldout_items(1) * 2
    with running_pool("bwrap", concurrency=1, min_warm=0, max_warm=1, infra_retries=1, python="/usr/bin/false",
                      **FAST_BACKOFF) as pool:
        fit_scores = fit.score(items, [it.answer for it in items], pool)
        data_scores = data.score(rows, ["```python\ndef add(a, b):\n    return a + b\n```", "   "], pool)
        tool = run_tool(pool, "2*x+3")
        m = pool.metrics()
    assert [(s.reward, s.correct, s.reason, s.masked) for s in fit_scores] == [(0.0, False, "infra", True)] * 2
    assert (data_scores[0].reason, data_scores[0].masked) == ("infra", True)
    assert (data_scores[1].reason, data_scores[1].masked) == ("no_answer", False)
    assert tool == ("error: the tool is unavailable", "infra")
    assert m["infra_unscored"] == 4, m
