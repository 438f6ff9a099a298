"""Test-only pause points for crash tests of the RL flow, outside the package.

A test puts this folder first on ``PYTHONPATH`` and sets ``DELTALOOP_PAUSE_AT`` (comma-separated
``POINT@N``) and ``DELTALOOP_PAUSE_DIR`` (a local folder); every Python process of the run imports
this module at start-up (``site`` imports ``sitecustomize``). A process that reaches a point writes
``<DELTALOOP_PAUSE_DIR>/<POINT>@<N>.json`` (its pid) and then blocks for good, so the test can kill
the run (or one service) with SIGKILL at exactly that moment. Each point pauses once per run: a
process that finds the point's file already written goes on (a restarted service does not pause
again). Points:

* ``rollout@S`` — rollout worker: a ``/v1/rollout`` request for step S arrived, nothing generated.
* ``load@V`` — rollout worker: a ``/v1/load`` of weight version V arrived, nothing fetched.
* ``train@S`` — trainer rank 0: the ``train_step`` command of step S arrived, nothing trained.
* ``record@S`` — the ``deltaloop run`` process: the flow has just recorded step S
  (:func:`infra.stages.summary.record_step` returned).

The seams: services run as ``python -m MODULE`` (``runpy._run_module_as_main``), which is wrapped to
patch the module's class and call its ``main()``; the CLI gets an import hook that wraps
``record_step`` when :mod:`infra.stages.summary` is first imported. Every other process, and every
process without the variable, is left as it is.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

ROLLOUT = "infra.rollout.server"
TRAINER = "infra.train.worker"


def _points() -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for item in filter(None, os.environ.get("DELTALOOP_PAUSE_AT", "").split(",")):
        name, _, n = item.partition("@")
        out.setdefault(name.strip(), set()).add(int(n))
    return out


def pause(point: str, n: int) -> None:
    """Write the point's file and block forever, unless this point already paused in this run."""
    path = os.path.join(os.environ["DELTALOOP_PAUSE_DIR"], f"{point}@{n}.json")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as fh:
        json.dump({"pid": os.getpid(), "time": time.time()}, fh)
    while True:
        time.sleep(3600)


def _arm_rollout(points: dict[str, set[int]]) -> None:
    from infra.rollout import server

    rollout: Callable[..., Any] = server.RolloutWorker.rollout
    load: Callable[..., Any] = server.RolloutWorker.load

    def paused_rollout(self: Any, prompts_key: str, out_key: str, *args: Any, **kwargs: Any) -> Any:
        for s in points.get("rollout", ()):
            if f"/step-{s:06d}/" in out_key:
                pause("rollout", s)
        return rollout(self, prompts_key, out_key, *args, **kwargs)

    def paused_load(self: Any, version: Any, *args: Any, **kwargs: Any) -> Any:
        if version in points.get("load", ()):
            pause("load", int(version))
        return load(self, version, *args, **kwargs)

    server.RolloutWorker.rollout = paused_rollout
    server.RolloutWorker.load = paused_load


def _arm_trainer(points: dict[str, set[int]]) -> None:
    from infra.train import worker

    train_step: Callable[..., Any] = worker.Trainer.op_train_step

    def paused_train_step(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        if step in points.get("train", ()) and self.rank == 0:
            pause("train", step)
        return train_step(self, step, *args, **kwargs)

    worker.Trainer.op_train_step = paused_train_step


def _install_services(points: dict[str, set[int]]) -> None:
    """Route ``python -m`` of the rollout worker and the trainer rank through the patches above."""
    import runpy

    run_module_as_main = runpy._run_module_as_main  # type: ignore[attr-defined]

    def run_armed(mod_name: str, alter_argv: bool = True) -> Any:
        if mod_name not in (ROLLOUT, TRAINER):
            return run_module_as_main(mod_name, alter_argv)
        import importlib

        (_arm_rollout if mod_name == ROLLOUT else _arm_trainer)(points)
        module = importlib.import_module(mod_name)
        if alter_argv:
            sys.argv[0] = str(module.__file__)
        module.main()
        return None

    runpy._run_module_as_main = run_armed  # type: ignore[attr-defined]


def _install_flow(steps: set[int]) -> None:
    """Wrap ``record_step`` as soon as :mod:`infra.stages.summary` is imported (before the flow
    module binds the name)."""
    import importlib.abc
    import importlib.machinery

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "infra.stages.summary":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module: Any) -> None:
                exec_module(module)
                record = module.record_step

                def paused_record(ctx: Any, step: int, *args: Any, **kwargs: Any) -> Any:
                    row = record(ctx, step, *args, **kwargs)
                    if step in steps:
                        pause("record", step)
                    return row

                module.record_step = paused_record

            spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())


if os.environ.get("DELTALOOP_PAUSE_AT") and os.environ.get("DELTALOOP_PAUSE_DIR"):
    _POINTS = _points()
    _install_services(_POINTS)
    if _POINTS.get("record") and os.path.basename(sys.argv[0] if sys.argv else "") == "deltaloop":
        _install_flow(_POINTS["record"])
