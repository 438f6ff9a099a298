"""The environment interface: config union, splits, reasoning_gym scoring, prompt rendering, suites."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from evals.env import Environment, Item, Score, sft_examples_of
from evals.funcfit import FuncfitEnv
from evals.gate import GateDecision, check_suite_regressions, veto_regressions
from evals.registry import build_environment, check_environment, check_run_environments
from evals.rgym import ReasoningGymEnv, make_dataset
from infra.config import ConfigError, load_config
from infra.model import build_tokenizer, render_prompts
from infra.stages.evaluate import Suite, evaluate_suite, paired_gain, pass_at_k_means, prompt_batch, run_suites

ROOT = Path(__file__).resolve().parents[2]
RG = ["env.type=reasoning_gym", "env.eval_problems=40",
      "env.tasks=[{name: chain_sum, config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}},"
      " {name: gcd, weight: 3}]"]


def test_env_without_type_is_funcfit_and_types_take_only_their_keys() -> None:
    cfg = load_config(None, ["env.eval_problems=10"])
    assert cfg.env.type == "funcfit" and cfg.env.eval_problems == 10
    with pytest.raises(ConfigError, match="tasks"):
        load_config(None, ["env.type=reasoning_gym"])
    with pytest.raises(ConfigError, match="hidden_tests"):
        load_config(None, ["env.type=reasoning_gym", "env.tasks=[{name: gcd}]", "env.hidden_tests=3"])
    with pytest.raises(ConfigError, match="python_tests"):
        load_config(None, ["env.type=dataset", "env.path=x.jsonl", "env.scorer=python_tests"])


def test_suite_config_rules() -> None:
    with pytest.raises(ConfigError, match="samples"):
        load_config(None, ["eval.suites=[{name: a, samples: 2, temperature: 0.8, k: [1, 5]}]"])
    with pytest.raises(ConfigError, match="temperature"):
        load_config(None, ["eval.suites=[{name: a, samples: 4}]"])
    with pytest.raises(ConfigError, match="repeated or reserved"):
        load_config(None, ["eval.suites=[{name: main}]"])
    cfg = load_config(None, RG + ["eval.suites=[{name: train-fit, split: train, size: 7},"
                                  " {name: other, env: {type: reasoning_gym, tasks: [{name: gcd}]}}]"])
    names = [(s.name, s.env.type, s.split, s.size) for s in run_suites(cfg)]
    assert names == [("main", "reasoning_gym", "heldout", 40), ("train-fit", "reasoning_gym", "train", 7),
                     ("other", "reasoning_gym", "heldout", 300)]


def test_item_json_round_trip_and_score_bounds() -> None:
    it = Item("a|1", [{"role": "user", "content": "hi"}], "x", "a", {"k": [1, 2]})
    assert Item.from_json(it.to_json()) == it
    with pytest.raises(ValueError):
        Score(1.5, True, "ok")


def test_funcfit_env_splits_are_disjoint_deterministic_and_need_a_sandbox() -> None:
    env = FuncfitEnv(seed=3)
    assert isinstance(env, Environment)
    held = {it.id for it in env.heldout_items(200)}
    train = [it.id for s in range(1, 6) for it in env.train_items(s, 32)]
    assert not held & set(train)
    assert [it.id for it in env.train_items(2, 8)] == [it.id for it in FuncfitEnv(seed=3).train_items(2, 8)]
    assert env.heldout_items(5) == env.heldout_items(9)[:5]
    with pytest.raises(ValueError, match="sandbox"):
        env.score(env.heldout_items(1), ["x"], None)
    assert len(sft_examples_of(env, 0, 4)) == 4


def test_reasoning_gym_splits_mix_and_disjointness() -> None:
    env = build_environment(load_config(None, RG).env)
    held = env.heldout_items(40)
    assert [i.id for i in held] == [i.id for i in build_environment(load_config(None, RG).env).heldout_items(40)]
    assert sum(1 for i in held if i.group == "gcd") == 30  # weights 1:3
    assert env.heldout_items(8) == held[:8]
    assert len({i.prompt for i in held}) == 40  # distinct held-out questions, even for a task this small
    # one-digit two-term sums have few distinct questions: the train split must still avoid all held-out ones
    held_q = {i.prompt for i in held}
    train = [i for s in range(1, 30) for i in env.train_items(s, 16)]
    assert not held_q & {i.prompt for i in train}
    assert [i.id for i in env.train_items(4, 5)] == [i.id for i in env.train_items(4, 5)]
    assert env.train_items(4, 5) != env.train_items(5, 5)


def _shipped_rg_tasks() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        env = (yaml.safe_load(path.read_text()) or {}).get("env") or {}
        if env.get("type") == "reasoning_gym":
            out += [(t["name"], t.get("config") or {}) for t in env["tasks"]]
    return out or [("chain_sum", {}), ("gcd", {})]


@pytest.mark.parametrize("task,config", _shipped_rg_tasks())
def test_reasoning_gym_scores_equal_the_packages_own(task: str, config: dict) -> None:
    env = ReasoningGymEnv([(task, 1.0, config)], seed=11, heldout_size=25, extract="answer_tag")
    pkg = make_dataset(task, 0, 25, config)  # the package's dataset object grades with its own rule
    items = env.heldout_items(25)
    for it in items:
        entry = env.entry(it)
        for cand in (entry["answer"], str(entry["answer"]) + "0", "-1", f" {entry['answer']} "):
            ours = env.score([it], [f"I think <answer>{cand}</answer>"], None)[0]
            theirs = float(pkg.score_answer(answer=cand.strip(), entry=entry))
            assert ours.reward == pytest.approx(min(1.0, max(0.0, theirs))), (task, cand)
            assert ours.correct == (theirs >= 1.0)
    assert env.score(items[:1], ["no tags here"], None)[0].reason == "no_answer"


def test_bad_input_is_one_line_each() -> None:
    cases = {
        "env.tasks=[{name: chain_summ}]": "unknown reasoning_gym task 'chain_summ'",
        "env.tasks=[{name: gcd, config: {no_such_key: 1}}]": "no_such_key",
    }
    for override, text in cases.items():
        problems = check_environment(load_config(None, ["env.type=reasoning_gym", override]).env)
        assert len(problems) == 1 and text in problems[0] and "\n" not in problems[0]
    cfg = load_config(None, ["env.type=python", "env.entry=no_such_module_xyz:make", "warmstart.steps=0"])
    problems = check_run_environments(cfg)
    assert len(problems) == 1 and "no_such_module_xyz" in problems[0]
    cfg = load_config(None, RG + ["warmstart.steps=5"])
    assert any("warm start" in p for p in check_run_environments(cfg))


def test_render_plain_and_chat_template() -> None:
    tok = build_tokenizer()
    assert render_prompts(tok, ["1,2="], "auto", "sys") == [tok("1,2=", add_special_tokens=True)["input_ids"]]
    with pytest.raises(ValueError, match="no chat template"):
        render_prompts(tok, ["x"], "on")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    ids = render_prompts(tok, ["2+2?"], "auto", "Be brief.")[0]
    assert tok.decode(ids) == "<bos>[system]Be brief.\n[user]2+2?\n[assistant]"
    assert ids.count(tok.bos_token_id) == 1  # the template's own special tokens, none added twice
    msgs = [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]
    assert tok.decode(render_prompts(tok, [msgs], "on", "ignored")[0]) == "<bos>[system]mine\n[user]q\n[assistant]"
    assert render_prompts(tok, ["q"], "off", "s") == [tok("q", add_special_tokens=True)["input_ids"]]


def test_evaluate_suite_reports_groups_accuracy_and_pass_at_k() -> None:
    cfg = load_config(None, RG)
    env = build_environment(cfg.env)

    def generate(batch: dict, n: int, temperature: float, max_new_tokens: int) -> tuple[list[str], float]:
        # an oracle on gcd that answers right on every other sample; wrong on chain_sum
        out = []
        for d in batch["items"]:
            for j in range(n):
                right = d["group"] == "gcd" and j % 2 == 0
                out.append(f"<answer>{d['answer'] if right else 'nope'}</answer>")
        return out, 0.0

    batch = prompt_batch(cfg.env, env, env.heldout_items(3))
    assert batch["render"]["system_prompt"] == env.system_prompt and batch["stop"] == []
    rep = evaluate_suite(Suite("s", cfg.env, size=40, temperature=0.8, samples=4, ks=(1, 2)), generate, None)
    assert rep["n"] == 40 and rep["per_group"] == {"chain_sum": 0.0, "gcd": 0.5}
    assert rep["accuracy"] == pytest.approx(30 * 0.5 / 40) and rep["score"] == pytest.approx(30 * 0.5 / 40)
    # gcd problems: 2 of 4 samples right -> pass@1 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 5/6
    assert pass_at_k_means(rep) == {1: pytest.approx(30 * 0.5 / 40), 2: pytest.approx(30 * 5 / 6 / 40)}
    greedy = evaluate_suite(Suite("s", cfg.env, size=40), generate, None)
    assert greedy["accuracy"] == pytest.approx(0.75) and "pass_at_k" not in greedy
    lo, hi = paired_gain({"problem_ids": greedy["problem_ids"], "rewards": [0.0] * 40}, greedy)
    assert 0.5 < lo <= 0.75 <= hi


def test_suite_regression_veto() -> None:
    checks = check_suite_regressions({"a": [0.0] * 50, "b": [1.0] * 50}, {"a": [1.0] * 50, "b": [1.0] * 50})
    assert [c.ok for c in checks] == [False, True]
    d = veto_regressions(GateDecision(True, "improvement +0.1", 0.6, 0.5), checks)
    assert not d.promote and "suite 'a' regressed" in d.reason
    ok = veto_regressions(GateDecision(True, "x", 0.6, 0.5), checks[1:])
    assert ok.promote and "no regression on 1 suite" in ok.reason
