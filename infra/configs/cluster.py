"""Config sections of where the trainer ranks run: cluster provider, hosts, health checks, Kubernetes.

:func:`select_hosts` is the rule that decides which listed hosts carry the ranks; the config
validator applies it to inline hosts and ``infra/cluster/hosts.py`` to hosts read from a hostfile,
so both agree on which hosts are used and which are spares.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infra.configs.base import Strict


# ------------------------------------------------------------------------------------- cluster
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class HostSpec(Strict):
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


class HealthConfig(Strict):
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


class KubernetesConfig(Strict):
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


class ClusterConfig(Strict):
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
