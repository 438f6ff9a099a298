"""funcfit environment: determinism, disjoint splits, extraction, reference solutions."""

from __future__ import annotations

import pytest

from evals import funcfit as ff


def test_train_batches_deterministic_and_fresh() -> None:
    a = ff.train_batch(0, 5, 32)
    b = ff.train_batch(0, 5, 32)
    c = ff.train_batch(0, 6, 32)
    assert [p.id for p in a] == [p.id for p in b]
    assert [p.id for p in a] != [p.id for p in c]


def test_splits_are_disjoint() -> None:
    evals = {p.prompt for p in ff.eval_set(0, 300)}
    train = {p.prompt for s in range(50) for p in ff.train_batch(0, s, 64)}
    assert len(evals) >= 250 and not evals & train
    assert {p.family for p in ff.eval_set(0, 300)} == set(ff.FAMILIES)
    assert len({p.prompt for p in ff.eval_set(0, 400)}) == 400  # a 400-problem eval has no repeats


def test_function_space_is_large() -> None:
    fns = ff.all_functions()
    held_out = [f for f in fns if ff.is_eval(*f)]
    assert len(fns) - len(held_out) >= 1000 and len(held_out) >= 300
    assert len({tuple(ff._value(*f, x) for x in ff.SHOWN_X) for f in fns}) == len(fns)  # no aliases



def test_reference_solutions_score_one_and_shown_points_match() -> None:
    for p in ff.train_batch(1, 0, 50) + ff.eval_set(1, 50):
        assert ff.score_locally(p, p.solution + "\n") == 1.0
        for x, y in p.shown:
            assert eval(p.solution, {}, {"x": x}) == y  # noqa: S307 - our own reference
        assert p.prompt == ",".join(str(y) for _, y in p.shown) + "="
        assert len(p.hidden) == 6 and all(x >= 6 for x, _ in p.hidden)


def test_extraction_and_scoring_edge_cases() -> None:
    p = ff.make_problem("a*x+b", 3, 4)
    assert ff.extract_expression("  3*x+4\nrubbish") == "3*x+4"
    assert ff.extract_expression("f(x)=3*x+4") == "3*x+4"
    assert ff.extract_expression("return 3*x+4") == "3*x+4"
    assert ff.extract_expression("") == ""
    assert ff.score_locally(p, "x*3+4") == 1.0
    assert ff.score_locally(p, "3*x+5") == 0.0
    assert ff.score_locally(p, "__import__('os')") == 0.0
    assert ff.score_locally(p, "x0+1") == 0.0
    assert ff.score_locally(p, "x//0") == 0.0
    q = ff.make_problem("x%a+b", 4, 1)
    assert ff.score_locally(q, "x%8+1") == 4 / 6  # partial credit: agrees on x = 8..11 only
    assert ff.to_program("2*x") == "def f(x):\n    return 2*x\n"
    assert ff.to_program("") == "def f(x):\n    return None\n"


def test_sft_examples_are_train_split() -> None:
    pairs = ff.sft_examples(3, 100)
    assert pairs == ff.sft_examples(3, 100)
    assert all(t.endswith("\n") for _, t in pairs)
    eval_prompts = {p.prompt for p in ff.eval_set(0, 395)}
    assert not {pr for pr, _ in pairs} & eval_prompts


def test_verify_request_shape() -> None:
    import pytest

    try:
        from infra.sandbox import TestCase, VerifyRequest  # noqa: F401
    except ImportError:
        pytest.skip("infra.sandbox not available yet")
    p = ff.make_problem("a*x+b", 2, 3)
    req = ff.to_verify_request(p, "2*x+3\n")
    assert req.entry == "f" and "return 2*x+3" in req.program
    assert [(t.args, t.expected) for t in req.tests] == [([x], y) for x, y in p.hidden]


def test_family_subset_restricts_every_split() -> None:
    fams = ("x+b", "x%a+b")
    assert {p.family for p in ff.train_batch(0, 1, 64, families=fams)} == set(fams)
    assert {p.family for p in ff.eval_set(0, 40, families=fams)} == set(fams)
    assert all(t.startswith("x*x+") for _, t in ff.sft_examples(0, 64, families=["x*x+b"]))
    with pytest.raises(ValueError, match="unknown function families"):
        ff.train_batch(0, 1, 4, families=["x+b", "sin(x)"])
    with pytest.raises(ValueError):
        ff.eval_set(0, 4, families=[])
