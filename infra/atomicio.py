"""Durable, atomic file writes: the one way deltaloop replaces a file on local disk.

A file rewritten in place (``open(path, "w")``) is empty or half-written for as long as the write
runs, and after a crash or power loss it may stay that way; a reader in between sees a truncated
document. Every file deltaloop rewrites — file-store objects (:class:`infra.storage.FileStore`),
``summary.json``, ``serve.json``, service specs and readiness files, the sync marker of a fetched
folder — goes through :func:`write_atomic` instead:

1. the bytes go to a temporary file in the target's own folder (same file system, so the rename
   below is atomic), named ``.tmp-<name>.<pid>.<random>`` (:data:`TMP_PREFIX`, :func:`is_temp_name`);
2. the file is flushed and ``fsync``-ed, so its data is on disk before its name is;
3. it is renamed over the target (``os.replace``: a reader sees the old file or the new one);
4. the folder is ``fsync``-ed, so the rename itself survives a power loss.

A writer killed between 1 and 3 leaves its temporary file behind and the old target intact.
:func:`remove_stale_temps` deletes such leftovers once they are older than :data:`STALE_TEMP_S`
(a minute: a live writer in another process keeps writing its file, so its modification time stays
recent); :class:`~infra.storage.FileStore` calls it when it opens. The temporary file is created
with the permissions a plain create would give (``0o666`` less the umask) or the ``mode`` asked for.

This is a leaf module (standard library only): the file store, the service-process helpers and the
specs under it in the layers all use it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

#: Name prefix of every temporary file; such names are never objects, documents or listings.
TMP_PREFIX = ".tmp-"
#: Age (seconds since last modification) after which a temporary file is a dead writer's leftover.
STALE_TEMP_S = 60.0


def is_temp_name(name: str) -> bool:
    """Whether a file name (one path segment) is a temporary file of :func:`write_atomic`."""
    return name.startswith(TMP_PREFIX)


def fsync_dir(folder: str | Path) -> None:
    """``fsync`` a folder, so the names created or renamed in it are on disk (file systems that
    cannot sync a folder, EINVAL, are skipped: there the rename is as durable as it gets)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes | str, *, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` atomically and durably (temporary file in the same folder,
    fsync, rename, fsync of the folder); the folder is created if missing. ``mode``: permission bits
    of the new file, less the umask. On any failure the target is unchanged and no temporary file
    is left."""
    target = Path(path)
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    tmp = folder / f"{TMP_PREFIX}{target.name[:100]}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = None, mode: int = 0o666,
                      default: Any = None) -> None:
    """Serialise ``obj`` as JSON (compact unless ``indent``; ``default`` as for :func:`json.dumps`)
    and write it with :func:`write_atomic`. A value that does not serialise raises before anything
    is written."""
    separators = (",", ":") if indent is None else None
    text = json.dumps(obj, indent=indent, separators=separators, default=default)
    write_atomic(path, text, mode=mode)


def remove_stale_temps(root: str | Path, older_than_s: float = STALE_TEMP_S) -> int:
    """Delete temporary files of :func:`write_atomic` under ``root`` (recursively) last modified
    more than ``older_than_s`` seconds ago: leftovers of writers that were killed. Returns how many
    were removed. A file that disappears meanwhile (its writer renamed it) is skipped."""
    cutoff = time.time() - older_than_s
    removed = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if not is_temp_name(name):
                continue
            p = os.path.join(dirpath, name)
            try:
                if os.stat(p, follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(p)
                    removed += 1
            except FileNotFoundError:
                continue
    return removed
