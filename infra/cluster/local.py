"""``cluster.type: local`` — N trainer ranks on this host under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infra.cluster.base import PopenGroup, free_port
from infra.config import ClusterConfig


class LocalProvider:
    """Runs ``torch.distributed.run --nproc_per_node=N`` as one local child process group."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.world_size = cfg.ranks

    def launch(self, module: str, args: list[str], env: dict[str, str], log_dir: str) -> PopenGroup:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_path = str(Path(log_dir) / "trainer.log")
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={self.cfg.ranks}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            "-m", module, *args,
        ]
        full_env = {**os.environ, **env, "OMP_NUM_THREADS": str(self.cfg.threads_per_rank)}
        log = open(log_path, "ab")
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return PopenGroup([proc], master_addr="127.0.0.1", logs=[log_path])
