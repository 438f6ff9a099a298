"""The per-run secret: one key per run folder, shared by the processes of a run, derived per purpose."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infra.secrets import SECRET_ENV, SecretError, derive_key, mac, mac_ok, run_secret, secret_env


def test_created_once_private_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with ThreadPoolExecutor(8) as ex:
        keys = set(ex.map(lambda _: run_secret(tmp_path), range(16)))
    assert len(keys) == 1 and len(next(iter(keys))) == 32
    assert stat.S_IMODE((tmp_path / "run.key").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.key"]
    assert run_secret(tmp_path) == next(iter(keys))


def test_environment_wins_and_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = bytes(range(32))
    monkeypatch.setenv(SECRET_ENV, secret_env(secret)[SECRET_ENV])
    assert run_secret(tmp_path) == secret and not (tmp_path / "run.key").exists()
    monkeypatch.setenv(SECRET_ENV, "zz")
    with pytest.raises(SecretError, match="not hex"):
        run_secret()
    monkeypatch.setenv(SECRET_ENV, "00" * 4)
    with pytest.raises(SecretError, match="at least 16"):
        run_secret()
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(SecretError, match="no run secret"):
        run_secret()


def test_purposes_get_different_keys_and_macs_verify() -> None:
    secret = b"s" * 32
    a, b = derive_key(secret, "checkpoint"), derive_key(secret, "rpc")
    assert a != b and derive_key(secret, "rpc") == b
    tag = mac(a, b"manifest")
    assert mac_ok(a, b"manifest", tag)
    assert not mac_ok(b, b"manifest", tag)
    assert not mac_ok(a, b"manifest!", tag)
    assert not mac_ok(a, b"manifest", None) and not mac_ok(a, b"manifest", 3)
    assert not mac_ok(a, b"manifest", "é" * len(tag))
