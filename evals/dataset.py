"""dataset: rows of a local file or a saved Hugging Face dataset, scored by a chosen rule.

**Reading.** ``env.path`` is a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, read with
``datasets.load_dataset(<format>, data_files=path, split="train")``, or a folder written by
``save_to_disk``, read with ``datasets.load_from_disk`` (a ``DatasetDict``: its ``train`` split, else
its only split; the split used is logged and kept in :attr:`DatasetEnv.source`). Reading is offline
(``HF_DATASETS_OFFLINE=1``) and ``datasets``' cache lives under the state folder
(``$HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``, else ``<state>/hf/datasets``), never ``$HOME``.
Every problem with the input — a missing, unreadable or empty file, a bad JSON line, a missing
column, duplicate ids — raises one ``ValueError`` that names the file (and the line or column);
:func:`evals.registry.check_environment` shows it as one line of the config errors.

**Columns** (``env.columns``): ``prompt`` is a string (put into ``env.prompt_template`` at
``{prompt}``) or a list of chat messages (``{"role", "content"}``, used as they are); ``answer`` is the
reference (any JSON scalar, compared as text); ``tests`` is a string of Python test code or a list of
them (MBPP's ``test_list``: joined by newlines); ``entry`` names the function under test; ``id`` is a
unique row id (default: the row number).

**Splits.** With ``env.heldout_path`` the held-out split is that file's rows; otherwise a row is held
out when a hash of (seed, row id) falls below ``env.heldout_fraction`` — stable when rows are added or
reordered, and disjoint by construction. Train rows whose prompt text equals a held-out prompt are
dropped (a duplicated question must not leak into training), and with ``heldout_path`` an id in both
files is an error. ``heldout_items(n)`` is a prefix of one seeded order of the held-out rows;
``train_items(step, n)`` walks seeded per-epoch permutations of the train rows from position
``step * n``, so with a constant ``n`` every epoch visits each train row once.

**Scoring** (``env.scorer``), after ``extract_answer(text, env.answer.extract)``; the reward is
``shaped_reward(correct, well_formed, env.answer.format_weight)``, the reason ``ok``, ``wrong`` or
``no_answer`` (no answer of the configured shape). ``exact``, ``numeric``, ``math`` and ``regex``
compare on the trusted side (:mod:`evals.answers`; ``math`` in a bounded helper process).
``python_tests`` runs the program and the row's trusted tests in the sandbox pool
(``pool.run_tests_many``: separate processes, only the host reads the verdict); the reason is the
sandbox's. Its extraction rule defaults to ``code_block`` (when ``env.answer`` is not set), and a
completion without a fenced block is run as a whole (bare code still counts; the format share goes
only to fenced answers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from evals.answers import default_system_prompt, exact_match, extract_answer, numeric_match, regex_match, shaped_reward
from evals.env import Item, Prompt, Score, check_batch, infra_failed, need_pool, prompt_key, stable_hash, unscored

if TYPE_CHECKING:
    from infra.config import DatasetColumns, DatasetEnvConfig
    from infra.sandbox import SandboxPool

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SCORERS = ("exact", "numeric", "math", "regex", "python_tests")


@dataclass(frozen=True)
class Row:
    """One problem as read: its id, prompt (template applied), reference answer, tests and entry."""

    id: str
    prompt: Prompt
    answer: str = ""
    tests: str = ""
    entry: str | None = None


# ------------------------------------------------------------------------------------------ reading
def cache_dir() -> str:
    """Where ``datasets`` keeps its Arrow cache: ``$HF_DATASETS_CACHE``, ``$HF_HOME/datasets`` or
    ``<state>/hf/datasets`` (never under ``$HOME``)."""
    from infra.process_env import state_dir

    if os.environ.get("HF_DATASETS_CACHE"):
        return os.environ["HF_DATASETS_CACHE"]
    return str(Path(os.environ.get("HF_HOME") or state_dir() / "hf") / "datasets")


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets`` imported offline, with its progress bars and error logs off (our error says it)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        logger.setLevel(level)


def _root_cause(exc: BaseException) -> str:
    """The innermost exception of a chain, in one line (the library's outer ones are generic)."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def diagnose_text(path: Path) -> str | None:
    """Why a text file (json, jsonl, csv) does not read: the first non-UTF-8 byte or bad JSON line."""
    raw, suffix = path.read_bytes(), path.suffix.lower()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return f"line {line} is not UTF-8 text (byte {exc.start}); is it a {suffix} file?"
    if suffix == ".csv":
        return "it has a header line and no rows" if len([ln for ln in text.splitlines() if ln.strip()]) < 2 else None
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"line {exc.lineno} is not valid JSON ({exc.msg})"
        return "it holds an empty list (no rows)" if value == [] else None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {n} is not valid JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(value, dict):
            return f"line {n} is a JSON {type(value).__name__}, not an object of columns"
    return None


def _load_folder(path: Path) -> tuple[Any, str]:
    with _quiet_datasets() as datasets:
        try:
            data = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise ValueError(f"{path} is a folder but not a dataset saved with save_to_disk; give a "
                             f"{'/'.join(FORMATS)} file or a saved dataset folder") from None
    if isinstance(data, datasets.DatasetDict):
        splits = list(data)
        if "train" in data:
            split = "train"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise ValueError(f"{path} is a saved DatasetDict with splits {', '.join(splits)} and no 'train'; "
                             f"point the path at one split's folder (e.g. {path / splits[0]})")
        log.info("%s: using split %r of the saved DatasetDict (splits: %s)", path, split, ", ".join(splits))
        return data[split], f"{path} (split {split!r})"
    return data, str(path)


def _blank(path: Path, whitespace: bool) -> bool:
    """No bytes (or, for text formats, only whitespace); reads no further than the first other byte."""
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            if not whitespace or chunk.strip():
                return False
    return True


def _load_file(path: Path) -> Any:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: unknown file type {path.suffix!r}; use {', '.join(FORMATS)} or a saved dataset folder")
    if _blank(path, whitespace=fmt != "parquet"):
        raise ValueError(f"{path} is empty")
    with _quiet_datasets() as datasets:
        try:
            return datasets.load_dataset(fmt, data_files=str(path), split="train", cache_dir=cache_dir())
        except Exception as exc:  # the library's errors are generic: find the line, else give the root cause
            why = (diagnose_text(path) if fmt != "parquet" else None) or _root_cause(exc)
            raise ValueError(f"{path} is not a readable {fmt} file: {why}") from None


def read_table(path: str) -> tuple[Any, str]:
    """The ``datasets.Dataset`` at ``path`` (not empty) and a description of what was read."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{path}: no such file or folder")
    try:
        data, source = _load_folder(p) if p.is_dir() else (_load_file(p), str(p))
    except PermissionError as exc:
        raise ValueError(f"{path} is not readable ({exc.strerror})") from None
    if len(data) == 0:
        raise ValueError(f"{source} has no rows")
    return data, source


# ----------------------------------------------------------------------------------------- columns
def _prompt(value: Any, template: str, where: str) -> Prompt:
    if isinstance(value, str):
        return template.replace("{prompt}", value)
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(f"{where}: the prompt is neither text nor a list of chat messages "
                     f"({{'role', 'content'}}): {str(value)[:80]!r}")


def _text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _tests(value: Any, where: str) -> str:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return "\n".join(value)
    raise ValueError(f"{where}: the tests are neither Python code nor a list of it: {str(value)[:80]!r}")


def _check_columns(cols: "DatasetColumns", scorer: str, existing: list[str], source: str) -> None:
    needed = {"prompt": cols.prompt, "id": cols.id, "entry": cols.entry}
    if scorer == "python_tests":  # a reference solution is optional here (reports only): used when present
        needed["tests"] = cols.tests
    else:
        needed["answer"] = cols.answer
    for role, name in needed.items():
        if name is not None and name not in existing:
            raise ValueError(f"{source} has no column {name!r} (env.columns.{role}); its columns: {', '.join(existing)}")


def _row(rec: dict[str, Any], i: int, source: str, cols: "DatasetColumns", scorer: str, template: str,
         id_prefix: str) -> Row:
    """One record as a :class:`Row`; an unusable cell raises an error naming the row and column."""
    where = f"{source}, row {i}"
    if cols.id:
        if rec[cols.id] in (None, ""):
            raise ValueError(f"{where}: column {cols.id!r} (env.columns.id) is empty")
        where += f" (id {rec[cols.id]!r})"
    answer = rec.get(cols.answer) if cols.answer else None  # python_tests: optional, for reports
    if scorer != "python_tests" and (answer is None or _text(answer).strip() == ""):
        raise ValueError(f"{where}: column {cols.answer!r} (env.columns.answer) is empty")
    tests = ""
    if scorer == "python_tests" and cols.tests:
        tests = _tests(rec[cols.tests], f"{where}, column {cols.tests!r}")
    entry = rec.get(cols.entry) if cols.entry else None
    return Row(id=_text(rec[cols.id]) if cols.id else f"{id_prefix}{i}",
               prompt=_prompt(rec[cols.prompt], template, f"{where}, column {cols.prompt!r}"),
               answer="" if answer is None else _text(answer), tests=tests,
               entry=None if entry in (None, "") else str(entry))


def to_rows(records: list[dict[str, Any]], existing: list[str], source: str, cols: "DatasetColumns",
            scorer: str, template: str, id_prefix: str = "") -> list[Row]:
    """The environment's rows from a table's records; errors name ``source``, the row and the column.

    Rows without an id column are numbered from 0 (after ``id_prefix``: a held-out file's are
    ``heldout-0``...), so the ids of the two files never collide."""
    _check_columns(cols, scorer, existing, source)
    rows = [_row(rec, i, source, cols, scorer, template, id_prefix) for i, rec in enumerate(records)]
    if cols.id:
        dup = sorted(k for k, c in Counter(r.id for r in rows).items() if c > 1)
        if dup:
            raise ValueError(f"{source}: column {cols.id!r} (env.columns.id) has duplicate ids, e.g. "
                             f"{', '.join(map(repr, dup[:5]))} ({len(dup)} in all)")
    return rows


def split_rows(rows: Sequence[Row], seed: int, fraction: float) -> tuple[list[Row], list[Row]]:
    """(train, held-out): a row is held out when the hash of (seed, id) falls below ``fraction``."""
    cut = fraction * 2**64
    held = [stable_hash(seed, "heldout", r.id) < cut for r in rows]
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


# ------------------------------------------------------------------------------------- environment
class DatasetEnv:
    """Rows of a file as an :class:`~evals.env.Environment`; see the module docstring."""

    name = "dataset"

    def __init__(self, train: Sequence[Row], heldout: Sequence[Row], *, scorer: str = "exact", seed: int = 1234,
                 extract: str = "text", format_weight: float = 0.0, tolerance: float = 1e-6,
                 system_prompt: str | None = None, stop: tuple[str, ...] = (), source: str = "dataset") -> None:
        if scorer not in SCORERS:
            raise ValueError(f"unknown dataset scorer {scorer!r}; known: {', '.join(SCORERS)}")
        if not heldout:
            raise ValueError(f"{source}: the held-out split is empty ({len(train)} rows in all); "
                             "raise env.heldout_fraction or give env.heldout_path")
        held_prompts = {prompt_key(r.prompt) for r in heldout}
        self._train = [r for r in train if prompt_key(r.prompt) not in held_prompts]
        self.dropped = len(train) - len(self._train)  # train rows that repeat a held-out prompt
        self._heldout = sorted(heldout, key=lambda r: (stable_hash(seed, "order", r.id), r.id))
        self.scorer, self.seed, self.source = scorer, seed, source
        self.extract, self.format_weight, self.tolerance = extract, format_weight, tolerance
        self.system_prompt = default_system_prompt(extract) if system_prompt is None else system_prompt
        self.stop = tuple(stop)
        self.needs_sandbox = scorer == "python_tests"
        self.has_train_split = bool(self._train)
        self._perms: dict[int, list[int]] = {}
        if train and not self._train:
            raise ValueError(f"{source}: every train row repeats a held-out prompt; the train split is empty")
        if self.dropped:
            log.info("%s: %d train rows dropped (same prompt as a held-out row)", source, self.dropped)

    @classmethod
    def from_config(cls, cfg: "DatasetEnvConfig") -> "DatasetEnv":
        """From an ``env`` config section of type dataset (reads the file(s) now: errors name them)."""
        def rows_of(path: str, prefix: str) -> tuple[list[Row], str]:
            data, source = read_table(path)
            existing = list(data.column_names)
            _check_columns(cfg.columns, cfg.scorer, existing, source)
            c = cfg.columns
            used = [n for n in dict.fromkeys((c.prompt, c.answer, c.tests, c.id, c.entry)) if n and n in existing]
            records = data.select_columns(used).to_list()  # only the mapped columns become Python objects
            return to_rows(records, existing, source, c, cfg.scorer, cfg.prompt_template, prefix), source

        rows, source = rows_of(cfg.path, "")
        if cfg.heldout_path:
            heldout, held_source = rows_of(cfg.heldout_path, "heldout-")
            both = sorted({r.id for r in rows} & {r.id for r in heldout})
            if both:
                raise ValueError(f"{source} and {held_source} share ids in column {cfg.columns.id!r}, e.g. "
                                 f"{', '.join(map(repr, both[:5]))}; the held-out rows must not be trained on")
            train, source = rows, f"{source} + held-out {held_source}"
        else:
            train, heldout = split_rows(rows, cfg.seed, cfg.heldout_fraction)
            if not train and cfg.heldout_fraction < 1.0:
                raise ValueError(f"{source}: heldout_fraction {cfg.heldout_fraction} holds out all {len(rows)} rows; "
                                 "the train split is empty (lower it, or use more rows)")
        return cls(train, heldout, scorer=cfg.scorer, seed=cfg.seed, extract=cfg.answer.extract,
                   format_weight=cfg.answer.format_weight, tolerance=cfg.tolerance, system_prompt=cfg.system_prompt,
                   stop=tuple(cfg.stop) if cfg.stop is not None else (), source=source)

    # ------------------------------------------------------------------------------ splits
    def _item(self, row: Row) -> Item:
        data: dict[str, Any] = {"tests": row.tests, "entry": row.entry} if self.needs_sandbox else {}
        return Item(id=row.id, prompt=row.prompt, answer=row.answer, data=data)

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(len(self._train)))
            random.Random(stable_hash(self.seed, "epoch", epoch)).shuffle(order)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = order
        return self._perms[epoch]

    def heldout_items(self, n: int) -> list[Item]:
        """The first ``n`` held-out rows in the seeded order (all of them when ``n`` is larger)."""
        return [self._item(r) for r in self._heldout[: max(0, n)]]

    def train_items(self, step: int, n: int) -> list[Item]:
        """``n`` train rows for ``step``: positions ``step*n ..`` of the per-epoch seeded permutations."""
        if not self._train:
            raise ValueError(f"{self.source}: heldout_fraction 1.0 holds out every row; there is no train split")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        size = len(self._train)
        return [self._item(self._train[self._permutation(k // size)[k % size]])
                for k in range(step * n, step * n + n)]

    # ----------------------------------------------------------------------------- scoring
    def _verdicts(self, items: Sequence[Item], answers: list[str | None]) -> list[bool]:
        todo = [(a, it.answer) for it, a in zip(items, answers) if a is not None]
        if self.scorer == "math":
            from evals.mathcheck import math_match_many

            found = math_match_many(todo)
        elif self.scorer == "numeric":
            found = [numeric_match(a, r, self.tolerance) for a, r in todo]
        else:
            fn = regex_match if self.scorer == "regex" else exact_match
            found = [fn(a, r) for a, r in todo]
        it = iter(found)
        return [next(it) if a is not None else False for a in answers]

    def score(self, items: Sequence[Item], completions: Sequence[str],
              pool: "SandboxPool | None" = None) -> list[Score]:
        """Extract each answer and compare it with the row's reference, or run the row's tests."""
        check_batch(items, completions)
        if self.scorer == "python_tests":
            return self._score_tests(items, completions, need_pool(self.name, pool))
        answers = [extract_answer(c, self.extract) for c in completions]
        return [Score(shaped_reward(ok, a is not None, self.format_weight), ok,
                      "no_answer" if a is None else "ok" if ok else "wrong")
                for a, ok in zip(answers, self._verdicts(items, answers))]

    def program_of(self, completion: str) -> tuple[str | None, bool]:
        """(the code to run, whether it had the configured shape): with ``code_block`` a completion
        without a fence runs as a whole."""
        code = extract_answer(completion, self.extract)
        if code is None and self.extract == "code_block":
            return completion.strip() or None, False
        return code, code is not None

    def _score_tests(self, items: Sequence[Item], completions: Sequence[str], pool: "SandboxPool") -> list[Score]:
        from infra.sandbox import TestsRequest

        programs = [self.program_of(c) for c in completions]
        reqs = [TestsRequest(program=code, tests=str(it.data["tests"]), entry=it.data.get("entry"))
                for it, (code, _) in zip(items, programs) if code is not None]
        results = iter(pool.run_tests_many(reqs, dedupe=pool.cfg.dedupe) if reqs else [])
        out: list[Score] = []
        for code, shaped in programs:
            if code is None:
                out.append(Score(shaped_reward(False, False, self.format_weight), False, "no_answer"))
                continue
            r = next(results)
            out.append(unscored() if infra_failed(r) else
                       Score(shaped_reward(r.passed, shaped, self.format_weight), r.passed, r.reason))
        return out
