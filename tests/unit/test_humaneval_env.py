"""humaneval environment without sandboxes: the wheel's problems, splits, prompts, and the programs built
from completions (run here on the trusted canonical solutions only; model output runs in sandboxes,
tests/integration/test_humaneval.py)."""

from __future__ import annotations

from typing import Any

import pytest

from evals.humaneval import BASE_STOP, HumanEvalEnv, defines_entry, load_problems, prompt_context, to_program
from evals.registry import build_environment, check_environment
from infra.config import HumanEvalEnvConfig, load_config


def run_trusted(problem: dict[str, Any], program: str) -> bool:
    """The check a sandbox runs, in this process: for the canonical solutions only (trusted code)."""
    prog_ns: dict[str, Any] = {}
    exec(compile(program, "program", "exec"), prog_ns)
    test_ns: dict[str, Any] = {}
    exec(compile(prompt_context(problem["prompt"], problem["entry_point"]), "context", "exec"), test_ns)
    # the entry point by its own name too: HumanEval/33's tests call sort_third besides candidate
    test_ns[problem["entry_point"]] = test_ns["candidate"] = prog_ns[problem["entry_point"]]
    exec(compile(problem["test"], "tests", "exec"), test_ns)
    try:
        test_ns["check"](test_ns["candidate"])
    except AssertionError:
        return False
    return True


def test_the_wheel_ships_164_problems_in_task_order() -> None:
    problems = load_problems()
    assert list(problems) == [f"HumanEval/{i}" for i in range(164)]
    assert all({"prompt", "entry_point", "canonical_solution", "test"} <= set(p) for p in problems.values())


def test_eval_suite_holds_out_everything_and_has_no_train_split() -> None:
    env = build_environment(HumanEvalEnvConfig())
    assert isinstance(env, HumanEvalEnv) and env.needs_sandbox and not env.has_train_split
    assert [it.id for it in env.heldout_items(200)] == list(load_problems())
    assert env.heldout_items(5) == env.heldout_items(164)[:5]
    with pytest.raises(ValueError, match="no train split"):
        env.train_items(0, 1)
    assert check_environment(HumanEvalEnvConfig()) == []


def test_fractional_split_is_seeded_disjoint_and_deterministic() -> None:
    env = HumanEvalEnv(seed=7, heldout_fraction=0.25)
    held = {it.id for it in env.heldout_items(164)}
    assert 20 <= len(held) <= 65 and env.has_train_split
    train = {it.id for step in range(40) for it in env.train_items(step, 8)}
    assert not held & train
    assert held | {it.id for it in env.train_items(0, 300)} == set(load_problems())  # n > split: cycles
    assert env.train_items(3, 8) == env.train_items(3, 8) != env.train_items(4, 8)
    assert len({it.id for it in env.train_items(0, 8)}) == 8
    assert {it.id for it in HumanEvalEnv(seed=8, heldout_fraction=0.25).heldout_items(164)} != held
    assert check_environment(HumanEvalEnvConfig(heldout_fraction=0.25)) == []


def test_prompts_chat_and_plain() -> None:
    chat = HumanEvalEnv().heldout_items(1)[0]
    problem = load_problems()["HumanEval/0"]
    assert isinstance(chat.prompt, list) and chat.prompt[0]["role"] == "user"
    assert problem["prompt"] in chat.prompt[0]["content"]
    assert chat.answer == problem["prompt"] + problem["canonical_solution"]
    plain_env = HumanEvalEnv(chat="off")
    assert plain_env.heldout_items(1)[0].prompt == problem["prompt"]
    assert plain_env.stop == BASE_STOP and HumanEvalEnv().stop == ()
    assert "code block" in HumanEvalEnv().system_prompt


def test_non_code_extraction_is_a_config_error() -> None:
    problems = check_environment(HumanEvalEnvConfig.model_validate({"answer": {"extract": "boxed"}}))
    assert len(problems) == 1 and "must be one of code_block, text" in problems[0]


def test_context_drops_only_the_entry_stub() -> None:
    p10 = load_problems()["HumanEval/10"]
    ctx = prompt_context(p10["prompt"], p10["entry_point"])
    assert "def is_palindrome(" in ctx and "def make_palindrome(" not in ctx
    p32 = load_problems()["HumanEval/32"]
    ctx = prompt_context(p32["prompt"], p32["entry_point"])
    assert ctx.startswith("import math") and "def poly(" in ctx and "def find_zero(" not in ctx


def test_function_or_body() -> None:
    assert defines_entry("import x\n\ndef add(a, b):\n    return a + b\n", "add")
    assert not defines_entry("    return a + b\n", "add")
    assert not defines_entry("def add_more(a):\n    pass\n", "add")
    assert not defines_entry("    def add(a):\n        pass\n", "add")  # nested: part of a body


@pytest.mark.parametrize("form", ["body", "function"])
def test_all_canonical_solutions_pass_in_both_forms(form: str) -> None:
    env = HumanEvalEnv()
    for task_id, p in load_problems().items():
        completion = (p["canonical_solution"] if form == "body"
                      else f"Here it is:\n```python\n{p['prompt']}{p['canonical_solution']}```\n")
        code, well_formed = env.code_of(completion)
        assert well_formed == (form == "function")
        assert run_trusted(p, to_program(p, code)), task_id


def test_empty_completion_fails_the_tests() -> None:
    env = HumanEvalEnv()
    failed = 0
    for p in load_problems().values():
        code, well_formed = env.code_of("")
        assert not well_formed
        try:
            failed += not run_trusted(p, to_program(p, code))
        except Exception:  # a stub returning None also fails by raising (e.g. len(None))
            failed += 1
    assert failed == 164


def test_shipped_suite_example_validates(tmp_path: Any) -> None:
    cfg_file = tmp_path / "suite.yaml"
    cfg_file.write_text("eval:\n  suites:\n    - {name: humaneval, env: {type: humaneval}, samples: 10, "
                        "temperature: 0.8, k: [1, 10]}\n")
    cfg = load_config(str(cfg_file))
    assert cfg.eval.suites[0].env is not None and cfg.eval.suites[0].env.type == "humaneval"
