"""One exception root: every project exception is a ``DeltaloopError`` with an explicit
``retryable``; retries and the CLI's one-line errors are decided by that type alone."""

from __future__ import annotations

import ast
import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.errors import DeltaloopError, is_retryable

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("infra", "evals", "tasks", "flows", "bench", "deltaloop")
# runs inside the sandbox with no project on the path: not a project module
NOT_IMPORTED = {"infra/sandbox/runner.py"}


def _modules_defining_classes() -> list[str]:
    """Dotted names of project modules that define at least one class with a base."""
    names = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in NOT_IMPORTED:
                continue
            tree = ast.parse(path.read_text(), rel)
            if any(isinstance(n, ast.ClassDef) and n.bases for n in tree.body):
                names.append(rel[:-3].replace("/", ".").removesuffix(".__init__"))
    return names


@functools.lru_cache(maxsize=1)
def project_exceptions() -> tuple[type[BaseException], ...]:
    """Every exception class defined in a project module."""
    found: list[type[BaseException]] = []
    for name in _modules_defining_classes():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    return tuple(found)


def test_every_project_exception_is_a_deltaloop_error() -> None:
    found = project_exceptions()
    names = {cls.__name__ for cls in found}
    assert {"StorageError", "WeightSyncError", "ConfigError", "SandboxError", "ServiceDied"} <= names
    assert [cls.__qualname__ for cls in found if not issubclass(cls, DeltaloopError)] == []


def test_retryable_is_a_bool_stated_by_every_class_where_it_is_true() -> None:
    for cls in project_exceptions():
        assert isinstance(cls.retryable, bool), cls  # type: ignore[attr-defined]
        if cls.retryable:  # type: ignore[attr-defined]
            assert "retryable" in vars(cls), f"{cls.__qualname__} inherits retryable=True without stating it"


def test_retryable_values() -> None:
    from infra.cluster.base import ClusterError
    from infra.cluster.health import HealthCheckFailed
    from infra.config import ConfigError
    from infra.rpc import RemoteError, ServiceDied
    from infra.sandbox.types import SandboxError, SandboxUnusable
    from infra.storage import BucketNotFound, ObjectNotFound, StorageError
    from infra.weightsync.errors import CorruptData, VersionNotFound

    retry = [StorageError, VersionNotFound, ClusterError, ServiceDied, SandboxError]
    no_retry = [ObjectNotFound, BucketNotFound, CorruptData, HealthCheckFailed, ConfigError, SandboxUnusable]
    assert all(cls.retryable for cls in retry) and not any(cls.retryable for cls in no_retry)
    assert is_retryable(ServiceDied("x")) and not is_retryable(ObjectNotFound("x"))
    assert is_retryable(RemoteError("op", "m", "tb", True)) and not is_retryable(RemoteError("op", "m", "tb", False))
    assert issubclass(ObjectNotFound, KeyError) and issubclass(ConfigError, ValueError)  # kept for callers


def test_only_deltaloop_errors_are_retried() -> None:
    from tasks.common import retry_if_retryable

    class LooksRetryable(RuntimeError):
        retryable = True  # duck typing does not count: a bug is never retried

    def state(exc: BaseException) -> SimpleNamespace:
        return SimpleNamespace(result=lambda raise_on_failure: exc)

    from infra.rpc import ServiceDied
    from infra.storage import ObjectNotFound

    assert retry_if_retryable(None, None, state(ServiceDied("gone")))
    assert not retry_if_retryable(None, None, state(ObjectNotFound("k")))
    assert not retry_if_retryable(None, None, state(LooksRetryable("x")))
    assert not is_retryable(None) and not is_retryable("text")


RAISER = """
import sys
from deltaloop import cli

@cli.app.command("raise")
def raise_(kind: str) -> None:
    import importlib
    if kind == "bug":
        1 / 0
    module, name = kind.split(":")
    raise getattr(importlib.import_module(module), name)("the message of " + name)

cli.main()
"""


def _cli(args: list[str], cwd: Path, script: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DELTALOOP_DEBUG", None)
    head = [sys.executable, str(script)] if script else [sys.executable, "-m", "deltaloop.cli"]
    return subprocess.run([*head, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind", ["infra.rpc:ServiceDied", "infra.sandbox.types:SandboxError",
                                  "infra.train.checkpoint:CheckpointError", "infra.errors:DeltaloopError"])
def test_cli_prints_one_line_for_a_deltaloop_error(tmp_path: Path, kind: str) -> None:
    script = tmp_path / "cli_raise.py"
    script.write_text(RAISER)
    res = _cli(["raise", kind], tmp_path, script)
    name = kind.split(":")[1]
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == f"error: the message of {name}", res.stderr


def test_cli_real_command_user_error_is_one_line(tmp_path: Path) -> None:
    res = _cli(["sync", "fetch", "--store", f"file://{tmp_path / 'nothing'}", "--out", str(tmp_path / "o")], tmp_path)
    assert res.returncode == 1 and res.stderr.startswith("error: ") and "Traceback" not in res.stderr, res.stderr


def test_cli_keeps_the_traceback_of_a_bug(tmp_path: Path) -> None:
    script = tmp_path / "cli_raise.py"
    script.write_text(RAISER)
    res = _cli(["raise", "bug"], tmp_path, script)
    assert res.returncode != 0
    assert "Traceback" in res.stderr and "ZeroDivisionError" in res.stderr and "error: " not in res.stderr
