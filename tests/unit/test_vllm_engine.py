"""vLLM backend: registration without vLLM installed; the backend check on a GPU (the CPU run of the
same backend is tests/integration/test_vllm_cpu.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


def test_module_imports_and_registers_without_vllm() -> None:
    import infra.rollout as rollout
    from infra.rollout.vllm_engine import VLLMEngine  # (must not import vllm itself)

    assert "vllm" in rollout.ENGINES and rollout.ENGINES.get("vllm") is rollout._vllm
    assert VLLMEngine.__module__ == "infra.rollout.vllm_engine"
    if importlib.util.find_spec("vllm") is None:
        assert "vllm" not in sys.modules


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU (the CPU run is tests/integration/test_vllm_cpu.py)")
def test_generate_and_load_in_place_on_gpu() -> None:
    from infra.rollout.vllm_env import check_vllm_python, vllm_python

    python = vllm_python()
    check_vllm_python(python)
    done = subprocess.run([python, "-m", "bench.vllm_check"], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
