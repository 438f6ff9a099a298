"""Test-only fault injection for trainer ranks, outside the package.

A test puts this folder first on ``PYTHONPATH`` and sets ``DELTALOOP_TRAINER_FAULT="step=S,rank=R"``;
every Python process of the run then imports this module at start-up (``site`` imports
``sitecustomize``). In the trainer rank processes — started by torchrun as
``python -m infra.train.worker`` — trainer rank R SIGKILLs itself in the middle of step S, right
after its first backward, once per run: before dying it writes the marker
``runs/<run>/faults/trainer-step-S-rank-R.json`` to the store, and a restarted group that finds the
marker trains on normally. Every other process, and every process without the variable, is left
as it is.

The seam: ``python -m`` runs a module through ``runpy._run_module_as_main``. For the worker module
only, this wraps that call to import :mod:`infra.train.worker` as a module, wrap
``Trainer.op_train_step`` (the rank's handler of a train command), and call the module's ``main()``
(what running it as ``__main__`` would do). The kill is a real SIGKILL of a real rank in the middle
of a real optimisation step: the flow's recovery (restart from the checkpoint, replay) is untouched.
"""

from __future__ import annotations

import os
from typing import Any, Callable

WORKER = "infra.train.worker"


def _parse(spec: str) -> tuple[int, int]:
    """``"step=S,rank=R"`` -> (S, R); rank defaults to 0."""
    kv = dict(item.split("=", 1) for item in spec.split(","))
    return int(kv["step"]), int(kv.get("rank", 0))


def arm(trainer_cls: Any, fault_step: int, fault_rank: int) -> None:
    """Make ``trainer_cls.op_train_step`` kill rank ``fault_rank`` after the first backward of
    ``fault_step`` (once per run: a marker in the store)."""
    import signal
    import time

    from infra.storage import put_json, run_key

    train_step: Callable[..., Any] = trainer_cls.op_train_step

    def op_train_step(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == fault_step and self.rank == fault_rank:
            marker = run_key(self.run_id, None, "faults", f"trainer-step-{step}-rank-{self.rank}.json")
            if not self.store.exists(marker):
                backward = self.engine.backward

                def backward_then_die(loss: Any) -> None:
                    backward(loss)
                    put_json(self.store, marker, {"killed": time.time()})
                    os.kill(os.getpid(), signal.SIGKILL)

                self.engine.backward = backward_then_die  # this engine instance only
        return train_step(self, step, *args, **kwargs)

    trainer_cls.op_train_step = op_train_step


def _install(spec: str) -> None:
    """Route ``python -m infra.train.worker`` through :func:`arm`."""
    import runpy

    run_module_as_main = runpy._run_module_as_main  # type: ignore[attr-defined]
    step, rank = _parse(spec)

    def run_worker_armed(mod_name: str, alter_argv: bool = True) -> Any:
        if mod_name != WORKER:
            return run_module_as_main(mod_name, alter_argv)
        import sys

        from infra.train import worker

        arm(worker.Trainer, step, rank)
        if alter_argv:
            sys.argv[0] = worker.__file__
        worker.main()
        return None

    runpy._run_module_as_main = run_worker_armed  # type: ignore[attr-defined]


if os.environ.get("DELTALOOP_TRAINER_FAULT"):
    _install(os.environ["DELTALOOP_TRAINER_FAULT"])
