"""humaneval scored in real sandboxes: all 164 canonical solutions pass (as a body continuing the prompt
and as a complete function in a fenced block), empty completions fail, forged verdicts fail; one
problem in Docker. Needs bubblewrap (and dockerd for the ``docker`` case); on CI a missing runtime is
a failure, not a skip."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from evals.env import Item
from evals.humaneval import HumanEvalEnv
from evals.registry import build_environment
from infra.config import HumanEvalEnvConfig
from infra.sandbox import SandboxPool
from tests.sandbox_helpers import open_pool, running_pool


# The shared settings (HumanEval's own harness allows 3 s per problem; the shared 20 s leaves room for a
# loaded 2-core CI machine) with more memory and a longer idle timeout.
POOL: dict[str, object] = dict(memory_mb=512, idle_timeout_s=120)


@pytest.fixture(scope="module")
def env() -> HumanEvalEnv:
    built = build_environment(HumanEvalEnvConfig())
    assert isinstance(built, HumanEvalEnv)
    return built


@pytest.fixture(scope="module")
def bwrap_pool() -> Iterator[SandboxPool]:
    with running_pool("bwrap", **POOL) as pool:
        yield pool


def _canonical(env: HumanEvalEnv, item: Item) -> dict[str, str]:
    p = env.problem(item.id)
    return {"body": p["canonical_solution"],
            "function": f"Here is the function:\n\n```python\n{p['prompt']}{p['canonical_solution']}```\n"}


@pytest.mark.parametrize("form", ["body", "function"])
def test_all_164_canonical_solutions_score_one(env: HumanEvalEnv, bwrap_pool: SandboxPool, form: str) -> None:
    items = env.heldout_items(164)
    assert len(items) == 164
    scores = env.score(items, [_canonical(env, it)[form] for it in items], bwrap_pool)
    failed = {it.id: s.reason for it, s in zip(items, scores) if not (s.correct and s.reward == 1.0)}
    assert not failed, failed


def test_164_empty_completions_score_zero(env: HumanEvalEnv, bwrap_pool: SandboxPool) -> None:
    items = env.heldout_items(164)
    scores = env.score(items, [""] * len(items), bwrap_pool)
    passed = [it.id for it, s in zip(items, scores) if s.correct or s.reward != 0.0]
    assert not passed, passed


def test_forged_verdicts_score_zero(env: HumanEvalEnv, bwrap_pool: SandboxPool) -> None:
    item = env.heldout_items(1)[0]  # HumanEval/0: has_close_elements
    head = "def has_close_elements(numbers, threshold):\n"
    forged = {
        "print_pass_and_exit": "```python\nimport sys\nprint('PASS')\nsys.exit(0)\n```",
        "always_equal": "```python\nclass Yes:\n    def __eq__(self, other):\n        return True\n"
                        f"{head}    return Yes()\n```",
        "exit_inside_call": f"```python\n{head}    import os\n    os._exit(0)\n```",
        "patch_assert_builtins": f"```python\nimport builtins\nbuiltins.AssertionError = SystemExit\n{head}"
                                 "    return None\n```",
    }
    scores = env.score([item] * len(forged), list(forged.values()), bwrap_pool)
    got = {name: (s.reward, s.correct) for name, s in zip(forged, scores)}
    assert got == {name: (0.0, False) for name in forged}
    honest = env.score([item], [_canonical(env, item)["function"]], bwrap_pool)[0]
    assert honest.correct and honest.reward == 1.0 and honest.reason == "ok"


def test_format_weight_rewards_a_fenced_block(bwrap_pool: SandboxPool) -> None:
    env = HumanEvalEnv(format_weight=0.2)
    item = env.heldout_items(1)[0]
    p = env.problem(item.id)
    scores = env.score([item] * 3, [f"```python\n{p['prompt']}    return None\n```", p["canonical_solution"], "no"],
                       bwrap_pool)
    assert [(s.reward, s.correct) for s in scores] == [(pytest.approx(0.2), False), (pytest.approx(0.8), True),
                                                       (0.0, False)]


@pytest.mark.docker
def test_one_problem_in_docker(env: HumanEvalEnv) -> None:
    # Closed without assert_no_sandbox_left: the module's bwrap pool still runs sandboxes as that uid.
    pool = open_pool("docker", **POOL)
    try:
        item = env.problem("HumanEval/32")  # find_zero: the tests call the prompt's helper poly()
        it = next(i for i in env.heldout_items(164) if i.id == item["task_id"])
        scores = env.score([it, it], [item["canonical_solution"], ""], pool)
    finally:
        pool.close()
    assert [(s.reward, s.correct) for s in scores] == [(1.0, True), (0.0, False)]
