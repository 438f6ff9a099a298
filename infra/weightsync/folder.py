"""Safetensors model folders <-> versions (what ``deltaloop sync publish/fetch`` moves).

Every ``*.safetensors`` file's tensors become the version's tensors (names must be unique across
files); which file held which tensor and each file's ``__metadata__`` go into the manifest's
``meta``; every other regular file (``config.json``, tokenizer files...) is a side file. Writing
back uses the same files, tensors and metadata, so files written by the ``safetensors`` library
come back byte-for-byte identical (its layout is deterministic), and every tensor always does.
A folder written by :func:`write_folder` carries ``.deltaloop-sync.json`` (store, prefix, version)
so the next fetch into it downloads only the deltas since.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.atomicio import is_temp_name, write_atomic, write_json_atomic
from infra.errors import DeltaloopError
from infra.weightsync.errors import ManifestError
from infra.weightsync.validate import relative_name

if TYPE_CHECKING:
    import torch

MARKER = ".deltaloop-sync.json"


class FolderError(DeltaloopError, ValueError):
    """A model folder that cannot be published as it is (unreadable safetensors, clashing names)."""


def _st_metadata(path: Path) -> dict[str, str] | None:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return header.get("__metadata__")


def read_folder(folder: str | Path) -> tuple[dict[str, "torch.Tensor"], dict[str, bytes], dict[str, Any]]:
    """Tensors, side files and layout meta of a safetensors folder."""
    from safetensors.torch import load_file

    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"not a folder: {root}")
    tensors: dict[str, "torch.Tensor"] = {}
    layout: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MARKER or is_temp_name(path.name):  # the sync marker; a killed writer's temporary file
            continue
        if path.suffix == ".safetensors":
            try:
                loaded = load_file(str(path))
                metadata = _st_metadata(path)
            except Exception as exc:  # safetensors' own error type, struct/json errors of the header
                raise FolderError(f"{path}: not a readable safetensors file ({exc})") from exc
            dup = sorted(set(loaded) & set(tensors))
            if dup:
                raise FolderError(f"tensor {dup[0]!r} appears in more than one safetensors file")
            tensors.update(loaded)
            layout[rel] = {"tensors": list(loaded), "metadata": metadata}
        else:
            files[rel] = path.read_bytes()
    if not layout:
        raise FileNotFoundError(f"no *.safetensors file in {root}")
    return tensors, files, {"safetensors": layout}


def member_path(root: Path, rel: object, field: str) -> Path:
    """``root / rel`` for a file name ``rel`` read from a manifest's ``field``, refused unless it is a
    plain relative '/'-path (no absolute path, no ``.``/``..`` or empty segment, no backslash or NUL)
    that resolves inside ``root`` even through symlinks already in the folder. Raises
    :class:`~infra.weightsync.errors.ManifestError` naming the field. (Parsing a manifest checked
    the name already, :func:`~infra.weightsync.validate.relative_name`; only here is the folder
    known.)"""
    rel = relative_name(rel, field)
    if rel == MARKER:
        raise ManifestError(f"manifest {field}: file name {rel!r} is reserved")
    base = root.resolve()
    path = (base / rel).resolve()
    if path == base or base not in path.parents:
        raise ManifestError(f"manifest {field}: file name {rel!r} resolves outside the output folder")
    return path


def write_folder(
    folder: str | Path,
    tensors: dict[str, "torch.Tensor"],
    files: dict[str, bytes],
    meta: dict[str, Any],
    marker: dict[str, Any] | None = None,
    only: Collection[str] | None = None,
) -> Path:
    """Write a safetensors folder from a fetched version (inverse of :func:`read_folder`); with
    ``only``, the version's files hold just those tensors (a file left with none is removed, so no
    file of another version stays behind).

    Every file is replaced atomically and durably (:func:`infra.atomicio.write_atomic`). The sync
    marker is removed first and written last, so a fetch killed half-way leaves a folder without a
    marker (the next fetch downloads it whole) rather than one whose marker names a version it only
    partly holds."""
    from safetensors.torch import save

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    layout = meta.get("safetensors") or {"model.safetensors": {"tensors": list(tensors), "metadata": None}}
    # every name comes from a manifest someone else wrote: all are checked before anything is written
    paths = {rel: member_path(root, rel, "meta.safetensors") for rel in layout}
    paths.update({rel: member_path(root, rel, "files") for rel in files})
    (root / MARKER).unlink(missing_ok=True)
    for rel, spec in layout.items():
        part = {name: tensors[name].contiguous() for name in spec["tensors"] if only is None or name in only}
        if part or only is None:
            write_atomic(paths[rel], save(part, metadata=spec.get("metadata")))
        else:
            paths[rel].unlink(missing_ok=True)
    for rel, data in files.items():
        write_atomic(paths[rel], data)
    if marker is not None:
        write_json_atomic(root / MARKER, marker)
    return root


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The ``.deltaloop-sync.json`` of a folder written by a fetch, if any."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None
