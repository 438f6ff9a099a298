"""``deltaloop sync fetch`` writes file names taken from a version's manifest: a crafted version must
not write outside ``--out`` (replays the path-traversal attack: ``../x``, absolute names, symlinks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infra.weightsync.errors import ManifestError, WeightSyncError
from infra.weightsync.folder import member_path, write_folder

T = {"w": torch.zeros(2)}


@pytest.mark.parametrize("name", ["../escape.json", "/tmp/abs.json", "a/../../x", "a//b", "./c", "a\\b", "", 7,
                                  ".deltaloop-sync.json"])
def test_side_file_names_outside_the_folder_are_refused(tmp_path: Path, name: object) -> None:
    out = tmp_path / "out"
    with pytest.raises(ManifestError, match="manifest files"):
        write_folder(out, T, {name: b"pwned"}, {})  # type: ignore[dict-item]
    assert not (tmp_path / "escape.json").exists() and not list(out.glob("*.safetensors"))  # nothing written


def test_safetensors_layout_names_are_checked_too(tmp_path: Path) -> None:
    meta = {"safetensors": {"../model.safetensors": {"tensors": ["w"], "metadata": None}}}
    with pytest.raises(ManifestError, match="meta.safetensors"):
        write_folder(tmp_path / "out", T, {}, meta)
    assert not (tmp_path / "model.safetensors").exists()


def test_a_symlink_in_the_folder_does_not_lead_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out / "sub").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(WeightSyncError, match="outside the output folder"):
        write_folder(out, T, {"sub/config.json": b"{}"}, {})
    assert not (tmp_path / "elsewhere" / "config.json").exists()


def test_plain_nested_names_are_written(tmp_path: Path) -> None:
    out = write_folder(tmp_path / "out", T, {"tokenizer/vocab.json": b"{}"}, {})
    assert (out / "tokenizer" / "vocab.json").read_bytes() == b"{}" and (out / "model.safetensors").is_file()
    assert member_path(out, "a/b.json", "files") == (out / "a" / "b.json").resolve()
