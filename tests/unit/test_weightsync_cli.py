"""``deltaloop sync publish/fetch`` round-trips a safetensors folder byte for byte."""

from __future__ import annotations

from pathlib import Path

import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

from deltaloop.cli_sync import register
from infra.weightsync.testing import Drift


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """deltaloop"""

    register(app)
    return app


def _write_model(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:3]}, str(folder / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt"})
    save_file({k: tensors[k] for k in names[3:]}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tok").mkdir(exist_ok=True)
    (folder / "tok" / "vocab.txt").write_text("a\nb\n")


def _same_folder(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and p.name != ".deltaloop-sync.json")
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_publish_fetch_byte_identical(tmp_path: Path) -> None:
    runner = CliRunner()
    app = _app()
    store = f"file://{tmp_path / 'store'}"
    d = Drift()
    src, out = tmp_path / "src", tmp_path / "out"
    for step in range(3):
        _write_model(src, d.bf16())
        res = runner.invoke(app, ["sync", "publish", str(src), "--store", store, "--keyframe-every", "5"])
        assert res.exit_code == 0, res.output
        assert f"version {step + 1} (" in res.output and "bytes written" in res.output
        res = runner.invoke(app, ["sync", "fetch", "--store", store, "--out", str(out)])
        assert res.exit_code == 0, res.output
        _same_folder(src, out)
        if step:
            assert "via have" in res.output  # incremental: only the delta was read
        d.step()
    res = runner.invoke(app, ["sync", "fetch", "--store", store, "--version", "1", "--out", str(tmp_path / "v1")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sync", "list", "--store", store])
    assert res.output.split() == ["1", "K", "2", "d", "3", "d"]
    res = runner.invoke(app, ["sync", "gc", "--store", store, "--keep", "1"])
    assert res.exit_code == 0 and "none" in res.output  # keyframe 1 anchors version 3
