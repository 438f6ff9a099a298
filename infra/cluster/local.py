"""``cluster.type: local`` — N trainer ranks on this host under torchrun, and services on this host.

torchrun runs with ``--standalone``: its rendezvous store binds port 0 itself and the ranks join
through it, so no master port is chosen here and then bound by another process.
"""

from __future__ import annotations

import sys
from pathlib import Path

from infra.cluster.base import PopenGroup
from infra.config import ClusterConfig
from infra.proc import LOOPBACK, ServiceProcess, ServiceSpec, spawn


class LocalProvider:
    """Runs ``torch.distributed.run --standalone --nproc_per_node=N`` as one local process group."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.world_size = cfg.ranks

    def launch(self, module: str, args: list[str], env: dict[str, str], log_dir: str) -> PopenGroup:
        """Start torchrun with ``cluster.ranks`` ranks of ``python -m MODULE ARGS``; log in ``log_dir``."""
        spec = ServiceSpec(
            name="trainer",
            argv=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={self.cfg.ranks}", "-m", module, *args],
            env={**env, "OMP_NUM_THREADS": str(self.cfg.threads_per_rank)},
            log=str(Path(log_dir) / "trainer.log"),
            lifeline=False,  # the caller's env decides (ranks watch DELTALOOP_PARENT_PID when given)
        )
        svc = spawn(spec)
        return PopenGroup([svc.proc], master_addr=LOOPBACK, logs=svc.logs)

    def launch_service(self, spec: ServiceSpec) -> ServiceProcess:
        """Start ``spec`` on this host (reached on loopback)."""
        return spawn(spec)
