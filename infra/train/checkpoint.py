"""Trainer checkpoints in the object store, committed atomically, one per (run, step).

Layout under ``runs/<run>/checkpoints/step-<NNNNNN>/``::

    files/<name>          what the engine wrote (replica, FSDP shards, DeepSpeed per-rank files)
    rank-<RRRRR>.pt       per-rank state: RNG states (python, numpy, torch, cuda), step, cursor
    manifest.json         written LAST by rank 0, after every rank's uploads finished:
                          {"step", "weights_version", "world", "engine", "keys": {key: size}, ...}

A checkpoint exists only once its manifest does (:func:`committed_steps`); a checkpoint whose
manifest is missing is garbage left by a killed trainer and is ignored, then overwritten or
collected. ``runs/<run>/checkpoints/latest.json`` is a pointer written after the manifest (a hint
for humans and tools; readers trust manifests). Saving and restoring are collectives: every rank
calls :func:`save` / :func:`restore` with its own engine.

The data cursor is the step itself: the batch a step trains on is keyed by (run, step) in the
store, so restoring ``step`` and replaying later steps from their stored rollouts reproduces them.
"""

from __future__ import annotations

import io
import random
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.errors import DeltaloopError
from infra.storage import ObjectNotFound, ObjectStore, get_json, put_json, run_key

if TYPE_CHECKING:
    from infra.train.engines import TrainEngine


class CheckpointError(DeltaloopError):
    """A checkpoint is missing, incomplete or does not fit this trainer (not retryable)."""

    retryable = False


def ckpt_dir(run_id: str, step: int) -> str:
    """Key prefix of the checkpoint of ``step``."""
    return run_key(run_id, None, "checkpoints", f"step-{step:06d}")


def committed_steps(store: ObjectStore, run_id: str) -> list[int]:
    """Steps that have a committed checkpoint (a manifest), ascending."""
    base = run_key(run_id, None, "checkpoints") + "/"
    steps = []
    for key in store.list(base):
        parts = key[len(base):].split("/")
        if len(parts) == 2 and parts[1] == "manifest.json" and parts[0].startswith("step-"):
            steps.append(int(parts[0][5:]))
    return sorted(steps)


def read_manifest(store: ObjectStore, run_id: str, step: int) -> dict[str, Any]:
    """Manifest of the committed checkpoint of ``step`` (raises :class:`CheckpointError`)."""
    try:
        return get_json(store, f"{ckpt_dir(run_id, step)}/manifest.json")
    except ObjectNotFound:
        raise CheckpointError(f"run {run_id} has no committed checkpoint at step {step}") from None


def rng_state() -> dict[str, Any]:
    """Every random generator a rank uses."""
    import numpy as np
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _upload_folder(store: ObjectStore, folder: Path, prefix: str) -> dict[str, int]:
    keys: dict[str, int] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            key = f"{prefix}/files/{path.relative_to(folder).as_posix()}"
            data = path.read_bytes()
            store.put(key, data)
            keys[key] = len(data)
    return keys


def save(store: ObjectStore, run_id: str, step: int, engine: "TrainEngine", meta: dict[str, Any],
         rank: int, world: int, keep: int) -> dict[str, Any]:
    """Collective: write every rank's state, then (rank 0) the manifest, the pointer, and GC.

    ``meta`` (same on every rank: weights version, engine, config hash...) goes into the manifest.
    Returns the manifest on rank 0, ``{}`` elsewhere.
    """
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    prefix = ckpt_dir(run_id, step)
    with tempfile.TemporaryDirectory(prefix=f"ckpt-r{rank}-") as tmp:
        folder = Path(tmp)
        engine.save(folder)
        keys = _upload_folder(store, folder, prefix)
    buf = io.BytesIO()
    torch.save({"rng": rng_state(), "step": step, "rank": rank}, buf)
    rank_key = f"{prefix}/rank-{rank:05d}.pt"
    store.put(rank_key, buf.getvalue())
    keys[rank_key] = buf.tell()
    gathered: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, keys)
    else:
        gathered = [keys]
    if rank != 0:
        return {}
    all_keys: dict[str, int] = {}
    for part in gathered:
        all_keys.update(part)
    manifest = {"step": step, "world": world, **meta, "keys": all_keys, "created": time.time(),
                "seconds": time.perf_counter() - t0}
    put_json(store, f"{prefix}/manifest.json", manifest)  # the commit
    put_json(store, run_key(run_id, None, "checkpoints", "latest.json"), {"step": step})
    collect(store, run_id, keep)
    manifest["seconds"] = time.perf_counter() - t0
    return manifest


def restore(store: ObjectStore, run_id: str, step: int, engine: "TrainEngine", rank: int,
            world: int) -> dict[str, Any]:
    """Collective: load the committed checkpoint of ``step`` into ``engine`` and this rank's RNG.

    Every rank downloads the engine files (DeepSpeed and the torch replica need the whole set) into
    a private folder. Returns the manifest.
    """
    import torch

    manifest = read_manifest(store, run_id, step)
    if manifest["world"] != world:
        raise CheckpointError(
            f"checkpoint of step {step} was written by {manifest['world']} ranks; this trainer has {world}"
        )
    prefix = ckpt_dir(run_id, step)
    with tempfile.TemporaryDirectory(prefix=f"restore-r{rank}-") as tmp:
        folder = Path(tmp)
        for key in manifest["keys"]:
            if not key.startswith(f"{prefix}/files/"):
                continue
            dst = folder / key[len(prefix) + len("/files/"):]
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(store.get(key))
        engine.load(folder)
    blob = store.get(f"{prefix}/rank-{rank:05d}.pt")
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    set_rng_state(state["rng"])
    return manifest


def collect(store: ObjectStore, run_id: str, keep: int) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep`` (step 0, the warm start, stays) and
    uncommitted leftovers older than the newest commit. Returns the deleted steps."""
    steps = committed_steps(store, run_id)
    if not steps:
        return []
    newest = steps[-1]
    keep_set = set(steps[-keep:]) | {0}
    base = run_key(run_id, None, "checkpoints") + "/"
    seen: set[int] = set()
    for key in store.list(base):
        head = key[len(base):].split("/")[0]
        if head.startswith("step-"):
            seen.add(int(head[5:]))
    doomed = sorted(s for s in seen if s not in keep_set and s < newest)
    for s in doomed:
        prefix = ckpt_dir(run_id, s) + "/"
        keys = store.list(prefix)
        for key in sorted(keys, key=lambda k: not k.endswith("manifest.json")):  # un-commit first
            store.delete(key)
    return doomed
