"""Benchmarks run by ``deltaloop bench NAME --json PATH``.

Each benchmark is a module ``bench/<name>.py`` with ``run(json_path: Path, quick: bool) -> object``
that prints a table and writes its JSON result to ``json_path``. Register new ones in ``BENCHMARKS``.
"""

BENCHMARKS: dict[str, str] = {
    "weightsync": "bench.weightsync",
    "sandbox": "bench.sandbox",
    "rollout": "bench.rollout",
    "train": "bench.train",
}
