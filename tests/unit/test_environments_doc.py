"""docs/environments.md: every run config in it validates, and every environment it names builds and
draws items (with the data files the page tells the reader to make, and examples/my_env)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest

from evals.registry import check_environment
from infra.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "environments.md"


def blocks(lang: str) -> list[str]:
    """The page's fenced blocks of one language, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)


def run_configs() -> list[str]:
    return [b for b in blocks("yaml") if re.search(r"^name: ", b, re.MULTILINE)]


@pytest.fixture()
def reader_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory set up as the page says: its data files made, examples/my_env copied, cwd there."""
    monkeypatch.chdir(tmp_path)
    make_sums = next(b for b in blocks("python") if "sums.jsonl" in b)
    exec(compile(make_sums, "docs/environments.md", "exec"), {})
    (tmp_path / "code.jsonl").write_text(next(b for b in blocks("json") if '"id": "add"' in b), encoding="utf-8")
    (tmp_path / "code_heldout.jsonl").write_text(next(b for b in blocks("json") if '"id": "mul"' in b),
                                                 encoding="utf-8")
    shutil.copytree(ROOT / "examples" / "my_env", tmp_path / "examples" / "my_env")
    yield tmp_path
    for name in ("my_env", "my_reward"):
        sys.modules.pop(name, None)
    while str(Path("examples/my_env")) in sys.path:
        sys.path.remove(str(Path("examples/my_env")))


def test_the_page_has_a_config_for_each_way_in() -> None:
    text = "\n".join(run_configs())
    for needle in ("type: dataset", "scorer: math", "scorer: python_tests", "entry: my_reward:make",
                   "entry: my_env:make", "type: reasoning_gym", "type: humaneval"):
        assert needle in text, needle
    assert all(json.loads(line) for b in blocks("json") for line in b.splitlines() if line.strip())


@pytest.mark.parametrize("index", range(len(run_configs())))
def test_every_config_validates_and_its_environments_build(reader_dir: Path, index: int) -> None:
    block = run_configs()[index]
    path = reader_dir / f"config{index}.yaml"
    path.write_text(block, encoding="utf-8")
    cfg = load_config(path)
    problems = check_environment(cfg.env)
    for suite in cfg.eval.suites:
        if suite.env is not None:
            problems += check_environment(suite.env, prefix=f"eval.suites[{suite.name}].env")
    assert problems == [], block
