"""Benchmarks run by ``deltaloop bench NAME --json PATH``.

Each benchmark is a module ``bench/<name>.py`` with ``run(json_path: Path, quick: bool) -> object``
that prints a table and writes its JSON result to ``json_path``; one that takes a seed also accepts
``seed: int`` (``--seed``), and ``sync`` takes ``readers``, ``rtt_ms``, ``link_mbps``, ``versions``,
``lr`` and ``placement`` (the CLI passes an option only to a ``run`` whose signature has it). :data:`BENCHMARKS` names them
(``module:run``, imported only when chosen); add new ones there.
"""

from __future__ import annotations

from infra.backends import Registry

BENCHMARKS: Registry[object] = Registry("benchmark", {
    "weightsync": "bench.weightsync:run",
    "sandbox": "bench.sandbox:run",
    "rollout": "bench.rollout:run",
    "train": "bench.train:run",
    "chaos": "bench.chaos:run",
    "sandbox-sim": "bench.sandbox_sim:run",
    "sync": "bench.sync:run",
    "publish": "bench.publish:run",
    "champion": "bench.champion:run",
})
