"""Process environment defaults: keep every tool's state out of ``$HOME`` and quiet.

Called by the CLI before Prefect or MLflow is imported, since both read their settings at import.
Existing values are never overwritten, so users (and CI) can point them elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    """Folder for tool state (Prefect home, torch extensions...): ``$DELTALOOP_STATE`` or ``./.state``."""
    return Path(os.environ.get("DELTALOOP_STATE", ".state")).resolve()


def set_defaults() -> None:
    """Set environment defaults for Prefect, MLflow, torch and DeepSpeed (never overriding)."""
    state = state_dir()
    defaults = {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_LOGGING_LEVEL": "WARNING",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # no tqdm bars between the progress lines
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(state / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_EXTENSIONS_DIR": str(state / "torch_extensions"),
        "DS_ACCELERATOR": "cpu",
        "TRITON_CACHE_DIR": str(state / "triton"),
        "MPLCONFIGDIR": str(state / "matplotlib"),
        "XDG_CACHE_HOME": str(state / "cache"),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    import logging

    for noisy in ("mlflow", "alembic", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
