"""Per-run secrets: one random key per run, kept on the flow's host and never in the object store.

Whoever can write the run's object store (a shared bucket, a mounted folder) must not be able to
make the trainer load a checkpoint, drive a service or move a rollout worker to other weights. Each
of those proves "this came from this run" with a key derived from one run secret
(:func:`derive_key`, HMAC-SHA256 of the secret and a purpose string), so a leak of one derived key
(say the rollout worker's control token) does not give the others:

- ``"checkpoint"``: the MAC over every checkpoint manifest (``infra.train.checkpoint``);
- ``"rpc"``: the trainer control channel's handshake and per-message MAC (``infra.rpc``);
- ``"rollout-control"``: the rollout worker's control-endpoint token (``infra.rollout``).

The secret lives at ``<run_dir>/run.key`` (created on first use, mode 0600, atomically: two
processes racing to create it agree on one key), so a resumed run (a new flow process on the same
``run_dir``) finds the same key and can verify its own checkpoints. Processes that do not share
``run_dir`` (ranks on other hosts, service workers) get it in their environment as
:data:`SECRET_ENV` (hex) from the process that launched them; the environment of a process is
readable only by its user and root, unlike its command line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from infra.atomicio import fsync_dir
from infra.errors import DeltaloopError

SECRET_ENV = "DELTALOOP_RUN_SECRET"
KEY_FILE = "run.key"
SECRET_BYTES = 32


class SecretError(DeltaloopError):
    """The run secret is missing or malformed (the message says where it was looked for)."""

    retryable = False


def _parse(text: str, where: str) -> bytes:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise SecretError(f"{where}: the run secret is not hex") from None
    if len(raw) < 16:
        raise SecretError(f"{where}: the run secret has {len(raw)} bytes, at least 16 are needed")
    return raw


def run_secret(run_dir: str | Path | None = None) -> bytes:
    """This run's secret: :data:`SECRET_ENV` if set, else ``<run_dir>/run.key`` (created if absent).

    Raises :class:`SecretError` when neither is available or the value is malformed; a process
    without the secret must fail, never fall back to an unauthenticated mode.
    """
    env = os.environ.get(SECRET_ENV)
    if env:
        return _parse(env, SECRET_ENV)
    if run_dir is None:
        raise SecretError(f"no run secret: {SECRET_ENV} is not set and no run folder was given")
    path = Path(run_dir) / KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_bytes(SECRET_BYTES).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process created it first: theirs wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        fsync_dir(path.parent)  # the key's name is on disk before anything is signed with it
    return _parse(path.read_text(), str(path))


def secret_env(secret: bytes) -> dict[str, str]:
    """The environment entry that hands ``secret`` to a child process."""
    return {SECRET_ENV: secret.hex()}


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A key for one ``purpose`` (``"checkpoint"``, ``"rpc"``, ``"rollout-control"``...)."""
    return hmac.new(secret, b"deltaloop/" + purpose.encode(), hashlib.sha256).digest()


def mac(key: bytes, data: bytes) -> str:
    """Hex HMAC-SHA256 of ``data`` under ``key``."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def mac_ok(key: bytes, data: bytes, tag: object) -> bool:
    """Whether ``tag`` is ``data``'s MAC under ``key`` (constant-time; anything but an ASCII string,
    e.g. a header an attacker filled with other characters, is simply wrong)."""
    return isinstance(tag, str) and tag.isascii() and hmac.compare_digest(mac(key, data), tag)
