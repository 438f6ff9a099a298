"""``deltaloop bench``: bad option values are refused with exit 2 before any benchmark work starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltaloop.cli_bench import register
from tests.cli_helpers import cli_app


@pytest.mark.parametrize("args, message", [
    (["sync", "--delta-shard-kib", "0"], "positive"),
    (["sync", "--delta-shard-kib", "256,-4"], "positive"),
    (["sync", "--delta-shard-kib", "1MiB"], "bad option value"),
    (["sync", "--lr", "fast"], "bad option value"),
    (["sandbox", "--delta-shard-kib", "256"], "takes no --delta-shard-kib"),
    (["weightsync", "--delta-shard-kib", "0"], "positive"),
    (["weightsync", "--rtt-ms", "40"], "takes no --rtt-ms"),
    (["no-such-bench"], "no-such-bench"),
])
def test_bad_bench_options_exit_2_without_running(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "b.json"
    res = CliRunner().invoke(cli_app(register), ["bench", *args, "--json", str(out)])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not out.exists()
