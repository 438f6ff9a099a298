"""``deltaloop sync publish/fetch`` round-trips a safetensors folder byte for byte."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from deltaloop.cli_sync import register
from tests.cli_helpers import cli_app
from tests.weightsync_helpers import Drift


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
    app = cli_app(register)
    store = f"file://{tmp_path / 'store'}"
    d = Drift()
    src, out = tmp_path / "src", tmp_path / "out"
    for step in range(3):
        _write_model(src, d.bf16())
        res = runner.invoke(app, ["sync", "publish", str(src), "--store", store, "--snapshot-chain-fraction", "100"])
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
    assert res.exit_code == 0 and "none" in res.output  # full version 1 anchors version 3
    _write_model(src, d.bf16())
    res = runner.invoke(app, ["sync", "publish", str(src), "--store", store, "--snapshot"])
    assert res.exit_code == 0 and "version 4 (delta)" in res.output, res.output  # the snapshot is finished on exit
    res = runner.invoke(app, ["sync", "list", "--store", store])
    assert res.output.split() == ["1", "K", "2", "d", "3", "d", "4", "S"]
    res = runner.invoke(app, ["sync", "gc", "--store", store, "--keep", "1"])
    assert res.exit_code == 0 and "1, 2, 3" in res.output  # snapshot 4 anchors version 4
    res = runner.invoke(app, ["sync", "fetch", "--store", store, "--out", str(tmp_path / "v4")])
    assert res.exit_code == 0 and "via snapshot 4" in res.output, res.output
    _same_folder(src, tmp_path / "v4")


def _cli(*args: str, cwd: Path) -> "subprocess.CompletedProcess[str]":
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("DELTALOOP_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "deltaloop.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_user_errors_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    """What a user gets wrong (an empty store, a folder without weights, a version that is not there)
    exits 1 with one ``error:`` line naming the problem, not a Python traceback."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["sync", "fetch", "--store", f"file://{tmp_path / 'nothing'}", "--out", str(tmp_path / "o")],
         "no committed version under weights/"),
        (["sync", "publish", str(empty), "--store", f"file://{tmp_path / 's'}"], "no *.safetensors file"),
    ]
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x00" * 7 + b"not a safetensors file")
    cases.append((["sync", "publish", str(garbage), "--store", f"file://{tmp_path / 's'}"],
                  "not a readable safetensors file"))
    model = tmp_path / "m"
    _write_model(model, {f"t{i}": torch.randn(8, 4) for i in range(5)})
    assert _cli("sync", "publish", str(model), "--store", f"file://{tmp_path / 's'}", cwd=tmp_path).returncode == 0
    cases.append((["sync", "fetch", "--store", f"file://{tmp_path / 's'}", "--version", "7", "--out",
                   str(tmp_path / "o")], "version 7: not committed (newest is 1)"))
    cases.append((["sync", "fetch", "--store", f"file://{tmp_path / 's'}", "--tensor", "t1", "--tensor", "nope",
                   "--out", str(tmp_path / "o")], "version 1: no tensor matches 'nope'"))
    for args, message in cases:
        res = _cli(*args, cwd=tmp_path)
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        assert "error: " in res.stderr and message in res.stderr, res.stderr
        assert "Traceback" not in res.stderr, res.stderr


def test_fetch_of_some_tensors_writes_just_those_and_updates_incrementally(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    runner = CliRunner()
    app = cli_app(register)
    store = f"file://{tmp_path / 'store'}"
    d = Drift()
    src, out = tmp_path / "src", tmp_path / "out"
    stage = ["layers.0.mlp.weight", "layers.0.q.weight"]  # both in the first file of the two
    want = ["--tensor", "layers.0.*", "--tensor", "layers.0.q.weight"]  # a glob, and a name it matches too
    for step in range(2):
        _write_model(src, d.bf16())
        assert runner.invoke(app, ["sync", "publish", str(src), "--store", store]).exit_code == 0
        if step == 0:  # the folder held the whole version before: no file of it may stay behind
            assert runner.invoke(app, ["sync", "fetch", "--store", store, "--out", str(out)]).exit_code == 0
        res = runner.invoke(app, ["sync", "fetch", "--store", store, "--out", str(out), *want])
        assert res.exit_code == 0, res.output
        assert ("via have" in res.output) == (step == 1)  # the second fetch reads only the stage's delta
        first = src / "model-00001-of-00002.safetensors"
        got = load_file(str(out / first.name))
        assert sorted(got) == stage
        for name in stage:
            assert torch.equal(got[name].view(torch.uint8), load_file(str(first))[name].view(torch.uint8))
        assert not (out / "model-00002-of-00002.safetensors").exists()
        assert (out / "config.json").read_text() == '{"model_type": "llama"}'
        d.step()


def test_fetch_progress_is_quiet_for_small_downloads_and_once_a_second_for_big_ones() -> None:
    from deltaloop.cli_sync import Progress

    now = [0.0]
    lines: list[str] = []
    small = Progress(clock=lambda: now[0], echo=lines.append)
    small(10 << 20, 10 << 20)
    assert lines == []  # under 64 MB: nothing
    big = Progress(clock=lambda: now[0], echo=lines.append)
    total = 200_000_000
    for i, t in enumerate((0.0, 0.3, 0.9, 1.2, 1.5)):
        now[0] = t
        big((i + 1) * 20_000_000, total)
    big(total, total)  # the end is always said
    assert lines == ["fetched 20.0 of 200.0 MB (10%)", "fetched 80.0 of 200.0 MB (40%)",
                     "fetched 200.0 of 200.0 MB (100%)"]
