"""Which Python runs a vLLM rollout worker, and the check that it can, before a run starts.

vLLM pins packages that clash with the trainer's (transformers, numba), so ``rollout.type: vllm``
runs the rollout worker under the interpreter of an environment of its own: ``rollout.vllm_python``,
else ``$DELTALOOP_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` beside this checkout (made by
``scripts/setup.sh``). :func:`check_vllm_python` imports vLLM and the worker's modules under that
interpreter at provision, so a missing or broken environment is one clear error (which interpreter,
what failed) before any trainer rank starts, not a worker that dies during start-up.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from infra.errors import DeltaloopError

ENV_VAR = "DELTALOOP_VLLM_PYTHON"
CHECK_TIMEOUT_S = 300.0  # a cold import of vLLM and torch on a busy 2-core host takes ~10-30 s
_PROBE = ("import vllm, infra.rollout.server, infra.rollout.vllm_engine, infra.rollout.vllm_ext; "
          "print(vllm.__version__)")


class VllmEnvironmentError(DeltaloopError):
    """The interpreter configured for vLLM is missing or cannot import vLLM and the worker."""


def repo_root() -> Path:
    """The checkout this package is imported from (where ``.venv-vllm`` is made)."""
    return Path(__file__).resolve().parents[2]


def vllm_python(configured: str = "") -> str:
    """The interpreter of vLLM's environment: ``configured``, ``$DELTALOOP_VLLM_PYTHON``, or the
    checkout's ``.venv-vllm/bin/python``."""
    return configured or os.environ.get(ENV_VAR) or str(repo_root() / ".venv-vllm" / "bin" / "python")


def check_vllm_python(python: str, timeout_s: float = CHECK_TIMEOUT_S) -> str:
    """vLLM's version as ``python`` imports it with the worker's modules; :class:`VllmEnvironmentError`
    naming the interpreter and the failure otherwise."""
    hint = "run scripts/setup.sh (it makes .venv-vllm) or set rollout.vllm_python / $" + ENV_VAR
    if not Path(python).exists():
        raise VllmEnvironmentError(f"rollout.type vllm: the vLLM interpreter {python} does not exist; {hint}")
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                              cwd=str(repo_root()))
    except subprocess.TimeoutExpired:
        raise VllmEnvironmentError(f"rollout.type vllm: {python} did not import vLLM within {timeout_s:.0f} s") from None
    except OSError as exc:
        raise VllmEnvironmentError(f"rollout.type vllm: cannot run {python}: {exc}; {hint}") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise VllmEnvironmentError(f"rollout.type vllm: {python} cannot import vLLM and the rollout worker: {last}; {hint}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "unknown"
