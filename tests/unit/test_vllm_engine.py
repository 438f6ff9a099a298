"""vLLM backend: registration without vLLM installed; real generation and in-place loads on a GPU."""

from __future__ import annotations

import importlib.util
import sys

import pytest


def test_module_imports_and_registers_without_vllm() -> None:
    import infra.rollout as rollout
    from infra.rollout.vllm_engine import VLLMEngine  # (must not import vllm itself)

    assert "vllm" in rollout.ENGINES and rollout.ENGINES.get("vllm") is rollout._vllm
    assert VLLMEngine.__module__ == "infra.rollout.vllm_engine"
    if importlib.util.find_spec("vllm") is None:
        assert "vllm" not in sys.modules


def _gpu_ready() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs vLLM and an NVIDIA GPU")
def test_generate_and_load_in_place() -> None:
    from bench.vllm_check import check

    report = check(quick=True)
    assert report["ok"], report
