"""Config sections of the services and the loop: rollout, weight sync, storage, sandbox, tracking,
loop mode, evaluation and promotion.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from infra.configs.base import Strict
from infra.configs.envs import EnvConfig, default_env_type

# ------------------------------------------------------------------------------------- rollout
class RolloutConfig(Strict):
    """The inference engine that generates rollouts."""

    type: Literal["local", "vllm"] = Field(
        "local",
        description="local: torch KV-cached sampler on CPU/GPU; vllm: vLLM (its CPU build here, CUDA on GPUs), "
        "run under rollout.vllm_python.",
    )
    max_new_tokens: int = Field(
        16, ge=1, le=32768, description="Longest completion (funcfit answers are <= 12 characters)."
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    threads: int = Field(1, ge=1, le=256, description="torch threads in the rollout worker.")
    max_batch: int = Field(256, ge=1, le=65536, description="local: rows decoded together (continuous-batching slots).")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=0.98, description="vllm: fraction of GPU memory vLLM may take (the trainer shares the GPU)."
    )
    vllm_python: str = Field(
        "",
        description="vllm: the interpreter of vLLM's environment that runs the rollout worker (default: "
        "$DELTALOOP_VLLM_PYTHON, else .venv-vllm/bin/python of this checkout, made by scripts/setup.sh).",
    )
    vllm_dtype: Literal["bfloat16", "float16", "float32", "auto"] = Field(
        "bfloat16", description="vllm: the dtype vLLM serves in (published versions are bf16)."
    )
    vllm_fp32_head: bool = Field(
        False,
        description="vllm: compute the LM head (logits) in fp32 when serving bf16/fp16, as the trainer does (vLLM's "
        "advice for RL on GPUs). On a 2-core CPU with SmolLM2 it cost ~45% of throughput and moved the log-prob gap "
        "only from 0.037 to 0.028: serve float32 there instead (docs/rollout.md).",
    )
    vllm_max_model_len: int = Field(1024, ge=16, le=1 << 20, description="vllm: prompt + completion tokens at most.")
    vllm_kv_cache_gb: int = Field(1, ge=1, le=4096, description="vllm on CPU: KV-cache memory (VLLM_CPU_KVCACHE_SPACE).")
    start_timeout_s: float = Field(120.0, gt=0, le=3600, description="Max wait for the worker.")
    max_restarts: int = Field(
        3, ge=0, le=1000,
        description="Times a run replaces a dead rollout worker (same weight version, the call sent again) before failing.",
    )
    max_body_bytes: int = Field(
        4 << 20, ge=1024, le=1 << 30, description="Largest HTTP request body the worker reads (413 above)."
    )
    max_request_rows: int = Field(
        1024, ge=1, le=1 << 20, description="OpenAI API: most prompts x n in one request (400 above)."
    )
    max_request_tokens: int = Field(
        4096, ge=1, le=32768, description="OpenAI API: largest max_tokens / max_completion_tokens (400 above)."
    )
    max_stop: int = Field(16, ge=0, le=1024, description="OpenAI API: most stop strings in one request (400 above).")
    max_stop_chars: int = Field(128, ge=1, le=65536, description="OpenAI API: longest stop string (400 above).")
    stop_cache_entries: int = Field(
        64, ge=1, le=65536, description="local: stop lists whose token sets are kept (least recently used go)."
    )


# --------------------------------------------------------------------------------- weight sync
class WeightSyncConfig(Strict):
    """How new policy versions travel from trainer to rollout workers."""

    placement: Literal["object_store", "broadcast", "colocated"] = Field(
        "object_store",
        description="Where the rollout engine gets each version. object_store: it pulls the delta from "
        "the run's object store (any distance, late joiners catch up from snapshots); broadcast: rollout "
        "workers join a torch.distributed group with trainer rank 0 and receive the weights as a "
        "collective (gloo over TCP, on GPU hosts too, from the trainer's CPU copies; one cluster); "
        "colocated: no rollout worker, the trainer "
        "ranks generate with the parameters they train (no sync at all).",
    )
    broadcast_timeout_s: float = Field(
        60.0, gt=0.0, le=86400.0,
        description="broadcast: longest wait of one collective of the trainer-worker group (joining it, one "
        "bucket of a version); a peer that died or stalled fails the sync after this long instead of hanging it.",
    )
    snapshot_chain_fraction: float = Field(
        1.0, ge=0.0, le=100.0,
        description="Every version is a delta; a full snapshot is written in the background once the "
        "deltas since the last one exceed this fraction of a snapshot's bytes (a late joiner reads at "
        "most 1 + this many snapshots; the publisher writes 1 + 1/this times the delta bytes).",
    )
    codec: Literal["auto", "xor", "sparse"] = Field(
        "auto", description="auto: per tensor, the smallest of the available delta encodings."
    )
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level for delta frames.")
    threads: int = Field(2, ge=1, le=256, description="Encode/decode worker threads.")
    keep_versions: int = Field(
        0, ge=0, le=1_000_000, description="Garbage-collect versions older than this many (0 = keep all)."
    )
    delta_shard_kib: int | None = Field(
        None, ge=64, le=65536,
        description="Size of the objects delta frames are packed into, KiB (None: the publisher's default, "
        "4096). A delta under one shard rides in the manifest object: one GET, which suits links with long "
        "round trips; smaller shards upload while encoding continues and decode as they arrive, which "
        "suits short round trips (docs/weightsync.md, Measured).",
    )
    publish_ranks: int = Field(
        1, ge=1, le=1024,
        description="object_store: how many trainer ranks publish each version. 1: rank 0 gathers and "
        "publishes the whole model; P > 1: the tensors are dealt by size to P ranks spread evenly (ranks "
        "0, W/P, 2W/P... of W: one per node when P is the number of nodes), each encodes and uploads its "
        "own, and rank 0 commits one manifest (docs/weightsync.md, Sharded publishing). At most "
        "cluster.ranks; not with LoRA.",
    )

    def publisher_kwargs(self) -> dict[str, Any]:
        """The :class:`infra.weightsync.VersionPublisher` arguments this section sets."""
        out: dict[str, Any] = {"snapshot_chain_fraction": self.snapshot_chain_fraction, "codec": self.codec,
                               "zstd_level": self.zstd_level, "threads": self.threads}
        if self.delta_shard_kib is not None:
            out["delta_shard_bytes"] = self.delta_shard_kib << 10
        return out


# ------------------------------------------------------------------------------------- storage
class StorageConfig(Strict):
    """The object store for every artefact between stages."""

    type: Literal["file", "s3"] = Field("file", description="file: a local folder; s3: boto3.")
    root: str = Field(
        "",
        description="file: folder (default: <run_root>/store); s3: 's3://bucket/prefix'.",
    )
    endpoint_url: str | None = Field(None, description="s3: custom endpoint (MinIO, moto, R2...).")
    region: str | None = Field(None, description="s3: region name.")

    @model_validator(mode="after")
    def _s3_root(self) -> "StorageConfig":
        if self.type == "s3" and not self.root.startswith("s3://"):
            raise ValueError(f"storage.root must look like 's3://bucket/prefix' for s3, got {self.root!r}")
        return self


# ------------------------------------------------------------------------------------- sandbox
class SandboxConfig(Strict):
    """Where untrusted model output is executed and scored."""

    runtime: Literal["bwrap", "docker", "unsafe_local"] = Field(
        "bwrap",
        description="bwrap: bubblewrap (no daemon); docker: the docker SDK; unsafe_local: NO "
        "isolation (needs allow_unsandboxed: true; loudly warned).",
    )
    allow_unsandboxed: bool = Field(
        False, description="Explicit opt-out that permits runtime unsafe_local."
    )
    image: str = Field("deltaloop-sandbox:latest", description="docker: image to run.")
    docker_hosts: list[str] = Field(
        default_factory=list, description="docker: DOCKER_HOST URLs serving one pool (empty = env)."
    )
    concurrency: int = Field(2, ge=1, le=4096, description="Jobs run at once.")
    min_warm: int = Field(1, ge=0, le=4096, description="Warm sandboxes kept at least.")
    max_warm: int = Field(8, ge=1, le=4096, description="Warm sandboxes kept at most.")
    max_jobs_per_sandbox: int = Field(200, ge=1, le=1_000_000, description="Recycle limit.")
    timeout_s: float = Field(2.0, gt=0, le=3600, description="Wall-clock limit per job.")
    dedupe: bool = Field(
        True,
        description="Score identical completions of one batch once (same program and tests): RL groups repeat "
        "themselves. Turn off for verifiers whose result is not a function of the program (time, randomness).",
    )
    memory_mb: int = Field(256, ge=16, le=1_048_576, description="Memory limit per sandbox.")
    pids: int = Field(64, ge=4, le=65536, description="Process limit per sandbox.")
    cpus: float = Field(1.0, gt=0, le=256, description="CPU limit per sandbox.")
    output_limit_bytes: int = Field(65536, ge=256, le=1 << 30, description="stdout+stderr cap.")
    scratch_mb: int = Field(
        64, ge=1, le=65536, description="Size of the tmpfs scratch dir (also the per-file size limit)."
    )
    tail_bytes: int = Field(4096, ge=0, le=1 << 20, description="Bytes of stdout/stderr kept in results.")
    uid: int = Field(
        65534, ge=0, le=2**31 - 1, description="Uid inside the sandbox (and bwrap's host uid when run as root)."
    )
    python: str = Field(
        "/usr/bin/python3",
        description="bwrap (host /usr) and unsafe_local: interpreter that runs the runner; docker: "
        "'python3' inside the image is used.",
    )
    bwrap_path: str = Field("bwrap", description="bwrap: the bubblewrap executable.")
    rootfs: str | None = Field(
        None,
        description="bwrap: a root filesystem folder to use as / (e.g. /var/cache/deltaloop/rootfs from "
        "scripts/setup_sandbox.sh); None = the host's /usr read-only.",
    )
    start_timeout_s: float = Field(60.0, gt=0, le=3600, description="Max wait for one sandbox to start.")
    idle_timeout_s: float = Field(
        30.0, ge=0, le=86400, description="Idle sandboxes above the warm target are retired after this long."
    )
    kill_grace_s: float = Field(
        10.0, gt=0, le=3600, description="Host backstop beyond the job timeout before a sandbox is killed."
    )
    infra_retries: int = Field(
        2,
        ge=0,
        le=20,
        description="Fresh-sandbox retries of a job whose sandbox or runtime failed for reasons outside the job "
        "(runner killed from outside, container removed, daemon error, no sandbox could start); after "
        "infra_retries + 1 failed attempts the result says infra=True (reason 'infra') instead of a score.",
    )
    infra_backoff_s: float = Field(
        0.5,
        ge=0,
        le=600,
        description="Wait before the first infrastructure retry of a job; doubled before each further one "
        "(at most 30 s a wait).",
    )

    @model_validator(mode="after")
    def _rules(self) -> "SandboxConfig":
        if self.runtime == "unsafe_local" and not self.allow_unsandboxed:
            raise ValueError(
                "sandbox.runtime 'unsafe_local' runs untrusted code WITHOUT isolation; "
                "set sandbox.allow_unsandboxed: true to accept that"
            )
        if self.min_warm > self.max_warm:
            raise ValueError(f"sandbox.min_warm ({self.min_warm}) > sandbox.max_warm ({self.max_warm})")
        return self


# ------------------------------------------------------------------------------------ tracking
class TrackingConfig(Strict):
    """MLflow tracking and registry."""

    uri: str = Field(
        "", description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite under <run_root>)."
    )
    experiment: str = Field("deltaloop", description="MLflow experiment name.")
    registered_model: str = Field("deltaloop-policy", description="Registry name for promotions.")


class LoopConfig(Strict):
    """How rollouts and training overlap (asynchronous RL) and how stale a batch may be."""

    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: each batch comes from the newest policy; async: the batch for step t+1 is "
        "generated and scored while step t trains (one version behind).",
    )
    max_staleness: int = Field(
        1, ge=0, le=1000, description="Largest allowed policy lag (in versions) of a training batch."
    )
    stale_policy: Literal["drop", "importance"] = Field(
        "drop",
        description="A batch older than max_staleness is dropped and regenerated from the current "
        "policy (drop), or trained on with the clipped importance ratio against the policy that "
        "produced it (importance).",
    )
    max_infra_failure_rate: float = Field(
        0.1, ge=0.0, le=1.0,
        description="Largest share of a step's samples that may be masked (not scorable: the sandbox "
        "infrastructure failed after sandbox.infra_retries retries). Above it the step's scoring fails as "
        "retryable and nothing is stored, instead of training on a damaged batch.",
    )


class SuiteConfig(Strict):
    """An extra evaluation suite: an environment's split, its size and how to decode it.

    The main suite is always the run environment's held-out split (``env.eval_problems`` problems,
    greedy); suites add others (a second task, HumanEval, the train split) that evaluate, summary and
    the promotion gate report one by one."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="Suite name in reports.")
    env: EnvConfig | None = Field(None, description="The suite's environment (None: the run's env).")
    split: Literal["heldout", "train"] = Field("heldout", description="Which split of the environment.")
    size: int | None = Field(None, ge=1, le=100_000, description="Problems (None: the env's eval_problems).")
    max_new_tokens: int | None = Field(None, ge=1, le=32768, description="Decode length (None: eval.max_new_tokens).")
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="0 = greedy; > 0 with samples > 1 for pass@k.")
    samples: int = Field(1, ge=1, le=200, description="Completions per problem (pass@k needs samples >= k).")
    k: list[int] = Field(default_factory=lambda: [1], min_length=1, max_length=8, description="pass@k values reported.")
    guard: bool = Field(True, description="With promote.no_regression, this suite may not regress significantly.")

    @field_validator("env", mode="before")
    @classmethod
    def _env_type(cls, v: object) -> object:
        return default_env_type(v)

    @model_validator(mode="after")
    def _k_fits(self) -> "SuiteConfig":
        if max(self.k) > self.samples:
            raise ValueError(f"k={max(self.k)} needs samples >= {max(self.k)} (got {self.samples})")
        if self.samples > 1 and self.temperature == 0.0:
            raise ValueError("samples > 1 needs temperature > 0 (greedy samples are all the same)")
        return self


class EvalConfig(Strict):
    """When to evaluate, and on which suites besides the run environment's held-out split."""

    every: int = Field(0, ge=0, le=1_000_000, description="Evaluate every N steps (0 = only before/after).")
    max_new_tokens: int = Field(24, ge=1, le=32768, description="Greedy decode length for eval.")
    suites: list[SuiteConfig] = Field(default_factory=list, max_length=32, description="Extra suites (before/after).")

    @field_validator("suites")
    @classmethod
    def _distinct_names(cls, v: list[SuiteConfig]) -> list[SuiteConfig]:
        names = [s.name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1} | ({"main"} & set(names)))
        if dup:
            raise ValueError(f"suite name(s) {dup} repeated or reserved ('main' is the run env's held-out split)")
        return v


class PromoteConfig(Strict):
    """Eval-gated promotion to the registry alias."""

    alias: str = Field("champion", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$", description="Alias to move.")
    margin: float = Field(0.0, ge=-1.0, le=1.0, description="Required gain over the champion.")
    enabled: bool = Field(True, description="Register and gate the final model at all.")
    confidence: float = Field(
        0.95, ge=0.5, le=0.999,
        description="Two-sided level of the paired bootstrap CI; its lower end must clear the margin.",
    )
    guard_tolerance: float = Field(
        0.05, ge=0.0, le=1.0,
        description="Largest drop allowed on any guard slice (one per problem group, e.g. funcfit family or "
        "reasoning_gym task); 1.0 disables them.",
    )
    no_regression: bool = Field(
        False,
        description="Also reject when any guard suite of eval.suites is significantly worse than the champion "
        "(the upper end of its paired-bootstrap interval below 0).",
    )
    floors: dict[str, float] = Field(
        default_factory=dict, max_length=33,
        description="Absolute minimum mean score per suite ('main' = the run env's held-out split, else a name "
        "in eval.suites): a candidate below any floor is never promoted, even with no champion.",
    )

    @field_validator("floors")
    @classmethod
    def _floors_bounded(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(name for name, floor in v.items() if not 0.0 <= floor <= 1.0)
        if bad:
            raise ValueError(f"floor(s) of {bad} outside [0, 1] (suite scores are mean rewards in [0, 1])")
        return v
