"""The ``dataset`` environment: reading each format, splits, scoring, and one clear line per bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from evals.dataset import DatasetEnv
from evals.registry import build_environment, check_environment
from infra.config import DatasetEnvConfig, load_config


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets' Arrow cache of each test in its own folder (hermetic; nothing left in the state dir)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _math_rows(n: int = 60) -> list[dict[str, Any]]:
    return [{"qid": f"q{i}", "question": f"What is {i} divided by 4?", "solution": f"\\frac{{{i}}}{{4}}"}
            for i in range(n)]


def _math_cfg(path: str, **kw: Any) -> DatasetEnvConfig:
    base: dict[str, Any] = dict(path=path, scorer="math", columns={"prompt": "question", "answer": "solution",
                                                                      "id": "qid"},
                                answer={"extract": "boxed"}, heldout_fraction=0.25, seed=5)
    base.update(kw)
    return DatasetEnvConfig(**base)


def _one_line(problems: list[str], *texts: str) -> str:
    assert len(problems) == 1, problems
    line = problems[0]
    assert "\n" not in line
    for t in texts:
        assert t in line, (t, line)
    return line


def test_math_dataset_end_to_end(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "math.jsonl", _math_rows())
    cfg = _math_cfg(path, answer={"extract": "boxed", "format_weight": 0.2})
    assert check_environment(cfg) == []
    env = build_environment(cfg)
    assert isinstance(env, DatasetEnv) and not env.needs_sandbox and env.stop == ()
    assert env.system_prompt is not None and "\\boxed{}" in env.system_prompt
    held = env.heldout_items(1000)
    train_ids = {it.id for step in range(20) for it in env.train_items(step, 9)}
    assert held and not {it.id for it in held} & train_ids
    assert {it.id for it in held} | train_ids == {f"q{i}" for i in range(60)}

    items = held[:4]
    number = [int(it.id[1:]) for it in items]
    right = [f"It is \\boxed{{{k / 4}}}." for k in number[:2]] + [f"\\boxed{{\\frac{{{2 * number[2]}}}{{8}}}}",
                                                                   f"\\boxed{{{number[3]}/4}}"]
    assert [s.correct for s in env.score(items, right, None)] == [True] * 4
    assert [s.reward for s in env.score(items, right, None)] == [1.0] * 4
    wrong = env.score(items[:2], [f"\\boxed{{{number[0] + 1}/4}}", f"the answer is {number[1] / 4}"], None)
    assert [(s.reward, s.correct, s.reason) for s in wrong] == [(pytest.approx(0.2), False, "wrong"),
                                                                  (0.0, False, "no_answer")]
    with pytest.raises(ValueError, match="2 items but 1 completions"):
        env.score(items[:2], ["x"], None)


def test_splits_are_deterministic_prefixes_and_walk_epochs(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "math.jsonl", _math_rows())
    a, b = build_environment(_math_cfg(path)), build_environment(_math_cfg(path))
    assert [it.id for it in a.heldout_items(5)] == [it.id for it in b.heldout_items(100)][:5]
    assert a.train_items(3, 7) == b.train_items(3, 7) and a.train_items(3, 7) != a.train_items(4, 7)
    train_size = 60 - len(a.heldout_items(1000))
    epoch = [it.id for step in range(train_size) for it in a.train_items(step, 1)]
    assert sorted(epoch) == sorted(set(epoch)) and len(epoch) == train_size  # each train row once per epoch
    other = build_environment(_math_cfg(path, seed=6))
    assert {it.id for it in other.heldout_items(100)} != {it.id for it in a.heldout_items(100)}
    # rows added to the file leave earlier rows on their side of the split (the split hashes ids)
    bigger = build_environment(_math_cfg(_jsonl(tmp_path / "more.jsonl", _math_rows(90))))
    assert {it.id for it in a.heldout_items(100)} <= {it.id for it in bigger.heldout_items(100)}


def test_repeated_prompts_never_reach_training(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i % 10}", "answer": str(i % 10)} for i in range(200)]
    env = build_environment(DatasetEnvConfig(path=_jsonl(tmp_path / "d.jsonl", rows), heldout_fraction=0.2))
    held = {it.prompt for it in env.heldout_items(1000)}
    trained = {it.prompt for step in range(50) for it in env.train_items(step, 4)}
    assert held and trained and not held & trained
    assert env.dropped > 0


def test_heldout_file_template_chat_and_eval_only(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1", "answer": i + 1} for i in range(8)])
    chat = [{"role": "user", "content": "3+4"}]
    held = _jsonl(tmp_path / "test.jsonl", [{"prompt": chat, "answer": 7}, {"prompt": "5+5", "answer": 10}])
    cfg = DatasetEnvConfig(path=train, heldout_path=held, scorer="numeric", answer={"extract": "last_number"},
                           prompt_template="Compute {prompt}.")
    env = build_environment(cfg)
    assert check_environment(cfg) == []
    items = env.heldout_items(10)
    assert {json.dumps(it.prompt) for it in items} == {json.dumps(chat), json.dumps("Compute 5+5.")}
    assert all(it.id.startswith("heldout-") for it in items)
    assert {it.prompt for it in env.train_items(0, 8)} == {f"Compute {i}+1." for i in range(8)}
    assert [s.correct for s in env.score(items, [f"= {it.answer}.0" for it in items], None)] == [True, True]

    only = DatasetEnvConfig(path=held, heldout_fraction=1.0, scorer="numeric")
    eval_env = build_environment(only)
    assert check_environment(only) == [] and not eval_env.has_train_split and len(eval_env.heldout_items(9)) == 2
    with pytest.raises(ValueError, match="no train split"):
        eval_env.train_items(0, 1)


def test_exact_and_regex_scorers(tmp_path: Path) -> None:
    rows = [{"prompt": f"capital {i}", "answer": "Paris", "pattern": r"Par(is|ee)"} for i in range(10)]
    path = _jsonl(tmp_path / "c.jsonl", rows)
    exact = build_environment(DatasetEnvConfig(path=path, heldout_fraction=0.5, answer={"extract": "answer_tag"}))
    items = exact.heldout_items(2)
    assert [s.reason for s in exact.score(items, ["<answer> paris </answer>", "<answer>Lyon</answer>"])] == \
        ["ok", "wrong"]
    regex = build_environment(DatasetEnvConfig(path=path, heldout_fraction=0.5, scorer="regex",
                                               columns={"answer": "pattern"}))
    items = regex.heldout_items(2)
    assert items[0].answer == r"Par(is|ee)"
    assert [s.correct for s in regex.score(items, ["Paree", "Paris, France"])] == [True, False]


def test_csv_parquet_and_saved_folders(tmp_path: Path) -> None:
    import datasets

    rows = [{"prompt": f"{i}*2", "answer": str(2 * i)} for i in range(20)]
    (tmp_path / "d.csv").write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:15]),
                          "test": datasets.Dataset.from_list(rows[15:])}).save_to_disk(str(tmp_path / "dict"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "one"))
    for name, n in [("d.csv", 20), ("d.parquet", 20), ("saved", 20), ("dict", 15), ("one", 20)]:
        cfg = DatasetEnvConfig(path=str(tmp_path / name), scorer="numeric", heldout_fraction=0.3)
        assert check_environment(cfg) == [], name
        env = build_environment(cfg)
        held = env.heldout_items(100)
        assert len(held) + len({it.id for s in range(40) for it in env.train_items(s, 5)}) == n, name
        assert all(s.correct for s in env.score(held, [it.answer for it in held])), name
    assert "split 'train'" in build_environment(DatasetEnvConfig(path=str(tmp_path / "dict"))).source
    test_split = DatasetEnvConfig(path=str(tmp_path / "dict"), heldout_path=str(tmp_path / "dict" / "test"))
    assert len(build_environment(test_split).heldout_items(100)) == 5


def test_python_tests_rows_carry_their_tests(tmp_path: Path) -> None:
    rows = [{"task_id": i, "text": f"Write add{i}(a, b).", "test_list": [f"assert add{i}(1, 2) == 3"],
             "fn": f"add{i}"} for i in range(10)]
    cfg = DatasetEnvConfig(path=_jsonl(tmp_path / "mbpp.jsonl", rows), scorer="python_tests", heldout_fraction=0.5,
                           columns={"prompt": "text", "tests": "test_list", "id": "task_id", "entry": "fn"})
    assert cfg.answer.extract == "code_block"  # python_tests defaults to fenced code
    assert check_environment(cfg) == []
    env = build_environment(cfg)
    assert env.needs_sandbox and env.system_prompt is not None and "```python" in env.system_prompt
    it = env.heldout_items(1)[0]
    assert it.data == {"tests": f"assert add{it.id}(1, 2) == 3", "entry": f"add{it.id}"}
    assert env.program_of("```python\ndef f(): pass\n```") == ("def f(): pass\n", True)
    assert env.program_of("def f(): pass") == ("def f(): pass", False)  # bare code runs, without format share
    assert env.program_of("  ") == (None, False)
    with pytest.raises(ValueError, match="needs a sandbox pool"):
        env.score([it], ["def f(): pass"], None)
    text_rule = DatasetEnvConfig(**{**cfg.model_dump(), "answer": {"extract": "text"}})
    assert text_rule.answer.extract == "text"


def _bad(tmp_path: Path) -> dict[str, tuple[dict[str, Any], tuple[str, ...]]]:
    good = _jsonl(tmp_path / "good.jsonl", [{"q": f"{i}", "a": f"{i}", "k": i % 3} for i in range(9)])
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "binary.parquet").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "binary.csv").write_bytes(b"prompt,answer\n" + bytes(range(128, 256)) * 4)
    (tmp_path / "badline.jsonl").write_text('{"q": "1", "a": "1"}\n\n{"q": "2", "a": "2"\n{"q": "3"}\n')
    (tmp_path / "badarray.json").write_text('[\n  {"q": "1", "a": "1"},\n  {"q": "2" "a": "2"}\n]\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.csv").write_text("\n\n")
    (tmp_path / "header.csv").write_text("q,a\n")
    (tmp_path / "data.txt").write_text("q a\n")
    (tmp_path / "folder").mkdir()
    other = _jsonl(tmp_path / "other.jsonl", [{"prompt": "1", "answer": "1"}])
    cols = {"prompt": "q", "answer": "a"}
    return {
        "missing file": ({"path": str(tmp_path / "nope.jsonl")}, ("nope.jsonl", "no such file")),
        "binary jsonl": ({"path": str(tmp_path / "binary.jsonl")}, ("binary.jsonl", "line 2 is not UTF-8 text (byte 128)")),
        "binary parquet": ({"path": str(tmp_path / "binary.parquet")}, ("binary.parquet", "not a readable parquet")),
        "binary csv": ({"path": str(tmp_path / "binary.csv")}, ("binary.csv", "line 2 is not UTF-8")),
        "bad json line": ({"path": str(tmp_path / "badline.jsonl")}, ("badline.jsonl", "line 3 is not valid JSON")),
        "bad json array": ({"path": str(tmp_path / "badarray.json")}, ("badarray.json", "line 3 is not valid JSON")),
        "empty file": ({"path": str(tmp_path / "empty.jsonl")}, ("empty.jsonl", "is empty")),
        "blank csv": ({"path": str(tmp_path / "blank.csv")}, ("blank.csv", "is empty")),
        "header only": ({"path": str(tmp_path / "header.csv")}, ("header.csv", "a header line and no rows")),
        "unknown type": ({"path": str(tmp_path / "data.txt")}, ("data.txt", "unknown file type '.txt'")),
        "not a dataset folder": ({"path": str(tmp_path / "folder")}, ("folder", "not a dataset saved")),
        "missing column": ({"path": good, "columns": {"prompt": "question", "answer": "a"}},
                           ("good.jsonl", "no column 'question' (env.columns.prompt)", "its columns: q, a, k")),
        "duplicate ids": ({"path": good, "columns": {**cols, "id": "k"}},
                          ("good.jsonl", "column 'k'", "duplicate ids", "3 in all")),
        "heldout without columns": ({"path": good, "heldout_path": other},
                                    ("other.jsonl", "no column 'q' (env.columns.prompt)", "its columns: prompt, answer")),
        "tests column missing": ({"path": good, "scorer": "python_tests", "columns": {**cols, "tests": "tests"}},
                                 ("good.jsonl", "no column 'tests' (env.columns.tests)")),
        "empty answer cell": ({"path": _jsonl(tmp_path / "cells.jsonl", [{"q": "1", "a": "1"}, {"q": "2", "a": " "}])},
                              ("cells.jsonl, row 1", "column 'a' (env.columns.answer) is empty")),
        "prompt not text": ({"path": _jsonl(tmp_path / "p.jsonl", [{"q": {"text": "1"}, "a": "1"}])},
                            ("p.jsonl, row 0, column 'q'", "neither text nor a list of chat messages")),
        "all rows held out by accident": ({"path": _jsonl(tmp_path / "two.jsonl", [{"q": "1", "a": "1"}]),
                                           "columns": cols, "heldout_fraction": 0.99}, ("two.jsonl", "train split")),
    }


def test_bad_input_is_one_line_each(tmp_path: Path) -> None:
    for fields, texts in _bad(tmp_path).values():
        cfg = DatasetEnvConfig(**{"columns": {"prompt": "q", "answer": "a"}, **fields})
        _one_line(check_environment(cfg), "env (dataset)", *texts)


def test_bad_input_through_load_config(tmp_path: Path) -> None:
    import yaml

    cfg_path = tmp_path / "run.yaml"
    for fields, texts in _bad(tmp_path).values():
        cfg_path.write_text(yaml.safe_dump({"env": {"type": "dataset", "columns": {"prompt": "q", "answer": "a"},
                                                    **fields}}))
        _one_line(check_environment(load_config(cfg_path).env), *texts)
    train = _jsonl(tmp_path / "h.jsonl", [{"q": "x", "a": "1", "k": 1}])
    held = _jsonl(tmp_path / "g2.jsonl", [{"q": "y", "a": "2", "k": 1}, {"q": "z", "a": "3", "k": 2}])
    cfg_path.write_text(yaml.safe_dump({"env": {"type": "dataset", "path": train, "heldout_path": held,
                                                "columns": {"prompt": "q", "answer": "a", "id": "k"}}}))
    _one_line(check_environment(load_config(cfg_path).env), "h.jsonl and", "g2.jsonl share ids in column 'k'", "'1'")
