"""kubernetes provider: rendered manifests (validated against the client's models) and the apply path."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from infra.cluster import create_provider
from infra.cluster.base import ClusterError
from infra.cluster.kubernetes import COMPLETION_INDEX, KubeApis, KubernetesProvider, render
from infra.config import ClusterConfig


def _cfg(**k8s: Any) -> ClusterConfig:
    spec = {"image": "registry.example/deltaloop:1", "nodes": 2, "procs_per_node": 2, "namespace": "ml", **k8s}
    return ClusterConfig(type="kubernetes", ranks=spec["nodes"] * spec["procs_per_node"], kubernetes=spec)


def _manifests(**k8s: Any) -> tuple[dict, dict, dict]:
    secret, service, job = render(_cfg(**k8s), "infra.train.worker", ["--spec", "/s.json"],
                                  {"DELTALOOP_AUTHKEY": "abc", "DELTALOOP_PARENT_PID": "123"}, "x1")
    return secret, service, job


def test_render_job_service_secret() -> None:
    secret, service, job = _manifests()
    name = "deltaloop-trainer-x1"
    assert [m["kind"] for m in (secret, service, job)] == ["Secret", "Service", "Job"]
    assert {m["metadata"]["name"] for m in (secret, service, job)} == {name}
    assert {m["metadata"]["namespace"] for m in (secret, service, job)} == {"ml"}
    # secret: env goes here, not into the Job; the launcher's pid means nothing in a pod
    assert secret["stringData"] == {"DELTALOOP_AUTHKEY": "abc"}
    # headless service selecting exactly the job's pods, resolvable before readiness
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in service["spec"]["selector"].items())
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == name and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MASTER_ADDR"]["value"] == f"{name}-0.{name}"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    assert c["envFrom"] == [{"secretRef": {"name": name}}]
    cmd = c["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nnodes=2" in cmd and "--nproc_per_node=2" in cmd and "--node_rank=$(NODE_RANK)" in cmd
    assert "--master_addr=$(MASTER_ADDR)" in cmd and cmd[-4:] == ["-m", "infra.train.worker", "--spec", "/s.json"]
    assert c["resources"]["limits"] == {"cpu": "2", "memory": "8Gi"}
    assert c["volumeMounts"][0]["mountPath"] == "/dev/shm"


def test_render_gpus_and_options() -> None:
    _, _, job = _manifests(gpus=2, node_selector={"pool": "a100"}, service_account="trainer", shm_size=None,
                           ttl_seconds_after_finished=None)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"pool": "a100"} and pod["serviceAccountName"] == "trainer"
    assert "volumes" not in pod and "ttlSecondsAfterFinished" not in job["spec"]


@pytest.mark.parametrize("model,index", [("V1Secret", 0), ("V1Service", 1), ("V1Job", 2)])
def test_manifests_match_kubernetes_schema(model: str, index: int) -> None:
    """Round-trip through the official client's models: a misspelt or misplaced field would be lost."""
    client = pytest.importorskip("kubernetes.client")
    api = client.ApiClient()
    manifest = _manifests(gpus=1, node_selector={"a": "b"}, service_account="sa")[index]
    obj = api._ApiClient__deserialize(manifest, model)  # the client's own (private) dict -> model path
    assert api.sanitize_for_serialization(obj) == manifest


class _FakeApi:
    """Records calls like kubernetes.client.CoreV1Api/BatchV1Api would receive them."""

    def __init__(self, calls: list, job_status: Any = None, fail_on: str | None = None) -> None:
        self.calls, self.job_status, self.fail_on = calls, job_status, fail_on

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if name == self.fail_on:
                raise RuntimeError("forbidden")
            if name == "read_namespaced_job_status":
                return SimpleNamespace(status=self.job_status)
            if name == "list_namespaced_pod":
                return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name="p-0"))])
            if name == "read_namespaced_pod_log":
                return "rank log\n"
            if name.startswith("delete"):
                raise _NotFound()
            return None
        return call


class _NotFound(Exception):
    status = 404


def test_apply_poll_terminate(tmp_path: Path) -> None:
    calls: list = []
    status = SimpleNamespace(failed=None, succeeded=None, conditions=None)
    apis = KubeApis(core=_FakeApi(calls), batch=_FakeApi(calls, status))
    group = KubernetesProvider(_cfg(), apis).launch("m", [], {"K": "V"}, str(tmp_path))
    assert [c[0] for c in calls] == ["create_namespaced_secret", "create_namespaced_service", "create_namespaced_job"]
    assert all(c[1][0] == "ml" for c in calls)
    assert group.master_addr.endswith(".ml.svc") and group.master_addr.startswith(group.name + "-0.")
    assert group.poll() is None
    status.succeeded = 2
    assert group.poll() == 0
    status.failed = 1
    assert group.poll() == 1
    calls.clear()
    group.terminate()
    group.terminate()  # idempotent
    names = [c[0] for c in calls]
    assert {"delete_namespaced_job", "delete_namespaced_service", "delete_namespaced_secret"} <= set(names)
    assert (tmp_path / "p-0.log").read_text() == "rank log\n" and group.logs
    assert "kubectl" in group.describe()


def test_apply_failure_cleans_up(tmp_path: Path) -> None:
    calls: list = []
    apis = KubeApis(core=_FakeApi(calls), batch=_FakeApi(calls, fail_on="create_namespaced_job"))
    with pytest.raises(ClusterError, match="cannot create deltaloop-trainer-"):
        KubernetesProvider(_cfg(), apis).launch("m", [], {}, str(tmp_path))
    assert "delete_namespaced_secret" in [c[0] for c in calls]


def test_registered() -> None:
    assert isinstance(create_provider(_cfg()), KubernetesProvider)


def test_service_runs_next_to_the_flow(tmp_path: Path) -> None:
    """A single service (the rollout worker) gets no pod: it runs beside the flow, reached on loopback."""
    import sys

    from infra.proc import ServiceSpec

    calls: list = []
    apis = KubeApis(core=_FakeApi(calls), batch=_FakeApi(calls))
    spec = ServiceSpec(name="svc", argv=[sys.executable, "-c", "print('up')"], log=str(tmp_path / "svc.log"))
    handle = KubernetesProvider(_cfg(), apis).launch_service(spec)
    handle.proc.wait(timeout=30)
    assert handle.host == "127.0.0.1" and handle.poll() == 0 and not calls
    assert (tmp_path / "svc.log").read_text().strip() == "up"
