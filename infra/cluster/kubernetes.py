"""``cluster.type: kubernetes`` — trainer ranks as an indexed Job with a headless Service.

Each launch renders three manifests named ``<job_name>-<id>`` (:func:`render`, pure, no cluster
needed):

* a **Secret** holding the environment given to ``launch`` (it may carry keys such as the trainer's
  control auth key, which must not sit in a Job spec that anyone with read access can see);
* a **headless Service** (``clusterIP: None``, ``publishNotReadyAddresses``) selecting the Job's
  pods, so pod ``i`` resolves as ``<name>-<i>.<name>`` before it is Ready;
* an **indexed Job** (``completionMode: Indexed``, ``completions = parallelism = nodes``) whose pods
  set ``subdomain`` to the Service and run ``python -m torch.distributed.run`` with a static
  rendezvous: ``--node_rank`` from the Job completion index (downward API), ``MASTER_ADDR`` =
  pod 0's DNS name, ``--nproc_per_node = procs_per_node``. Resources: CPU, memory, GPUs
  (``gpu_resource``) and a memory-backed ``/dev/shm``.

:class:`KubernetesProvider` applies them with the official ``kubernetes`` Python client (imported
only when used; ``pip install kubernetes``), from the kubeconfig (``context``) or in-cluster
credentials. ``poll()`` reads the Job status; ``terminate()`` saves pod logs into ``log_dir`` and
deletes Job (with its pods), Service and Secret. ``master_addr`` is pod 0's DNS name, which resolves
inside the cluster only: run the flow in the cluster (or port-forward pod 0) to reach rank 0.

A single service (:meth:`KubernetesProvider.launch_service`, the rollout worker) is not given a pod
of its own: it runs as a child of the flow, which must run inside the cluster to reach rank 0
anyway, and is reached on loopback.

Kubernetes restarts nothing (``backoffLimit: 0``, ``restartPolicy: Never``): the flow decides.
There is no dead-man switch as with ``hosts``; ``ttlSecondsAfterFinished`` cleans finished Jobs and
``DELTALOOP_PARENT_PID`` is not forwarded (that pid means nothing inside a pod).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.cluster.base import ClusterError
from infra.config import ClusterConfig
from infra.proc import ServiceProcess, ServiceSpec, spawn

COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
_DROPPED_ENV = {"DELTALOOP_PARENT_PID"}


def render(
    cfg: ClusterConfig, module: str, args: list[str], env: dict[str, str], launch_id: str = "0"
) -> list[dict[str, Any]]:
    """The Secret, headless Service and indexed Job for one launch (plain dicts, apply order)."""
    k = cfg.kubernetes
    name = f"{k.job_name}-{launch_id}"
    labels = {"app.kubernetes.io/name": "deltaloop", "app.kubernetes.io/component": "trainer",
              "deltaloop.dev/launch": name}
    meta = {"name": name, "namespace": k.namespace, "labels": labels}
    secret = {
        "apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
        "stringData": {key: val for key, val in env.items() if key not in _DROPPED_ENV},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"deltaloop.dev/launch": name},
                 "ports": [{"name": "torchrun", "port": k.master_port, "targetPort": k.master_port}]},
    }
    command = [
        k.python, "-m", "torch.distributed.run", f"--nnodes={k.nodes}", f"--nproc_per_node={k.procs_per_node}",
        "--node_rank=$(NODE_RANK)", "--master_addr=$(MASTER_ADDR)", f"--master_port={k.master_port}",
        "--max_restarts=0", "-m", module, *args,
    ]
    resources: dict[str, dict[str, str]] = {"requests": {"cpu": k.cpu, "memory": k.memory},
                                            "limits": {"cpu": k.cpu, "memory": k.memory}}
    if k.gpus:
        resources["limits"][k.gpu_resource] = str(k.gpus)
        resources["requests"][k.gpu_resource] = str(k.gpus)
    container: dict[str, Any] = {
        "name": "trainer", "image": k.image, "imagePullPolicy": k.image_pull_policy,
        "workingDir": k.workdir, "command": command,
        "env": [
            {"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
            {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
            {"name": "MASTER_PORT", "value": str(k.master_port)},
            {"name": "OMP_NUM_THREADS", "value": str(cfg.threads_per_rank)},
            {"name": "DELTALOOP_NODE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "envFrom": [{"secretRef": {"name": name}}],
        "ports": [{"name": "torchrun", "containerPort": k.master_port}],
        "resources": resources,
    }
    pod_spec: dict[str, Any] = {"subdomain": name, "restartPolicy": "Never", "containers": [container]}
    if k.shm_size:
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        pod_spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}}]
    if k.service_account:
        pod_spec["serviceAccountName"] = k.service_account
    if k.node_selector:
        pod_spec["nodeSelector"] = dict(k.node_selector)
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed", "completions": k.nodes, "parallelism": k.nodes,
        "backoffLimit": k.backoff_limit,
        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
    }
    if k.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}
    return [secret, service, job]


@dataclass
class KubeApis:
    """The two API groups used (real ``kubernetes.client`` objects, or test doubles)."""

    core: Any
    batch: Any


def connect(cfg: ClusterConfig) -> KubeApis:
    """Load credentials (in-cluster or kubeconfig ``context``) and return the API clients."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ClusterError("cluster.type 'kubernetes' needs the kubernetes client: pip install kubernetes") from None
    if cfg.kubernetes.in_cluster:
        config.load_incluster_config()
    else:
        config.load_kube_config(context=cfg.kubernetes.context)
    return KubeApis(core=client.CoreV1Api(), batch=client.BatchV1Api())


def _ignore_missing(call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, **kwargs)
    except Exception as exc:  # kubernetes.client.ApiException 404: already gone
        if getattr(exc, "status", None) != 404:
            raise


@dataclass
class KubernetesGroup:
    """A launched Job; ``poll`` asks the API server, ``terminate`` deletes everything."""

    apis: KubeApis
    name: str
    namespace: str
    nodes: int
    master_addr: str
    log_dir: str
    logs: list[str] = field(default_factory=list)
    _done: bool = False

    def poll(self) -> int | None:
        status = self.apis.batch.read_namespaced_job_status(self.name, self.namespace).status
        if (status.failed or 0) > 0:
            return 1
        for cond in status.conditions or []:
            if cond.type == "Failed" and cond.status == "True":
                return 1
        if (status.succeeded or 0) >= self.nodes:
            return 0
        return None

    def save_logs(self) -> list[str]:
        """Write each pod's log to ``log_dir/<pod>.log`` (best effort); returns the paths."""
        pods = self.apis.core.list_namespaced_pod(self.namespace, label_selector=f"deltaloop.dev/launch={self.name}")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        for pod in pods.items:
            path = str(Path(self.log_dir) / f"{pod.metadata.name}.log")
            try:
                Path(path).write_text(self.apis.core.read_namespaced_pod_log(pod.metadata.name, self.namespace))
            except Exception:  # a pod that never started has no log
                continue
            self.logs.append(path)
        return self.logs

    def terminate(self, timeout: float = 10.0) -> None:
        if self._done:
            return
        try:
            self.save_logs()
        except Exception:  # teardown must go on
            pass
        _ignore_missing(self.apis.batch.delete_namespaced_job, self.name, self.namespace,
                        propagation_policy="Background", grace_period_seconds=int(timeout))
        _ignore_missing(self.apis.core.delete_namespaced_service, self.name, self.namespace)
        _ignore_missing(self.apis.core.delete_namespaced_secret, self.name, self.namespace)
        self._done = True

    def describe(self) -> str:
        return (f"job {self.namespace}/{self.name} ({self.nodes} pods; rank 0 at {self.master_addr}; "
                f"kubectl -n {self.namespace} logs -l deltaloop.dev/launch={self.name})")


class KubernetesProvider:
    """Applies :func:`render`'s manifests; ``apis`` may be injected (tests), else :func:`connect`."""

    def __init__(self, cfg: ClusterConfig, apis: KubeApis | None = None) -> None:
        self.cfg = cfg
        self.world_size = cfg.ranks
        self._apis = apis

    def launch(self, module: str, args: list[str], env: dict[str, str], log_dir: str) -> KubernetesGroup:
        apis = self._apis or connect(self.cfg)
        launch_id = uuid.uuid4().hex[:6]
        secret, service, job = render(self.cfg, module, args, env, launch_id)
        ns = self.cfg.kubernetes.namespace
        name = job["metadata"]["name"]
        group = KubernetesGroup(apis, name, ns, self.cfg.kubernetes.nodes, f"{name}-0.{name}.{ns}.svc", log_dir)
        try:
            apis.core.create_namespaced_secret(ns, secret)
            apis.core.create_namespaced_service(ns, service)
            apis.batch.create_namespaced_job(ns, job)
        except Exception as exc:
            group.terminate()
            raise ClusterError(f"cannot create {name} in namespace {ns}: {exc}") from exc
        return group

    def launch_service(self, spec: ServiceSpec) -> ServiceProcess:
        """Start ``spec`` next to the flow (in the flow's pod), reached on loopback."""
        return spawn(spec)
