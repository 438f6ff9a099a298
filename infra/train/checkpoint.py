"""Trainer checkpoints in the object store: committed atomically, authenticated, one per (run, step).

Layout under ``runs/<run>/checkpoints/step-<NNNNNN>/``::

    files/<name>          what the engine wrote (replica, FSDP shards, DeepSpeed per-rank files)
    rank-<RRRRR>.json     per-rank state: RNG states (python, numpy, torch, cuda), step, rank
    manifest.json         written LAST by rank 0, after every rank's uploads finished:
                          {"format", "run_id", "step", "world", "weights_version", "engine", ...,
                           "keys": {key: size}, "sha256": {key: hex digest}, "mac": hex}

A checkpoint exists only once its manifest does (:func:`committed_steps`); a checkpoint whose
manifest is missing is garbage left by a killed trainer and is ignored, then overwritten or
collected. Saving orders its writes so that a crash between any two of them leaves one complete
checkpoint: every object, then the manifest (the commit), then a read-back that verifies the
manifest (MAC, names) and the size of every object it lists; only after that does
``runs/<run>/checkpoints/latest.json`` (a pointer for humans and tools; readers trust manifests)
name the new step and are older checkpoints collected. A checkpoint that does not verify after
saving is un-committed (its manifest deleted) and :class:`CheckpointError` names the object: the
previous checkpoint stays the newest. With the file store every write is fsync-ed
(:mod:`infra.atomicio`), so this also holds across a power loss. Saving and restoring are collectives: every rank
calls :func:`save` / :func:`restore` with its own engine.

Whoever can write the run's store must not be able to make the trainer run code or load state it
did not write. So nothing a rank restores is a pickle it cannot vouch for: the per-rank state is
JSON, and the manifest lists the size and SHA-256 of every object and carries an HMAC
(:func:`sign_manifest`) under the run's ``"checkpoint"`` key (:func:`checkpoint_key`, derived from
the run secret of :mod:`infra.secrets`, which the ranks receive in their environment). On restore
every rank verifies the MAC, checks every name (only this step's ``files/...`` and ``rank-*.json``
objects, no ``..``, no empty or absolute parts), then downloads each object and checks its size and
digest *before* any loader — ``torch.load`` of the engine files, DeepSpeed's ``load_checkpoint``
(which unpickles), FSDP's shards — sees it. Anything that does not verify raises
:class:`CheckpointError` naming the object or field; a manifest without a MAC is refused as
unsigned. The engine files that stay torch files are read with ``weights_only=True`` where the
engine's loader allows it (:mod:`infra.train.engines`, :mod:`infra.train.fsdp`,
:mod:`infra.train.ds`).

Resume does not fall back: the newest committed step is restored or the restore fails loudly. A
newest checkpoint that does not verify means the store was tampered with (or corrupted), and
training on silently from an older step would hide that; the operator inspects it, and deleting
that step's folder makes the previous one the newest.

The data cursor is the step itself: the batch a step trains on is keyed by (run, step) in the
store, so restoring ``step`` and replaying later steps from their stored rollouts reproduces them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.errors import DeltaloopError
from infra.secrets import SecretError, derive_key, mac, mac_ok, run_secret
from infra.storage import ObjectNotFound, ObjectStore, put_json, run_key

if TYPE_CHECKING:
    from infra.train.engines import TrainEngine

#: Manifest layout version; a manifest of any other format is refused.
FORMAT = 2
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
_STEP_DIR = re.compile(r"step-(\d{6,})")
_RANK_FILE = re.compile(r"rank-(\d{5,})\.json")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(DeltaloopError):
    """A checkpoint is missing, incomplete, forged or does not fit this trainer (not retryable)."""

    retryable = False


def ckpt_dir(run_id: str, step: int) -> str:
    """Key prefix of the checkpoint of ``step``."""
    return run_key(run_id, None, "checkpoints", f"step-{step:06d}")


def _step_of(name: str) -> int | None:
    """The step of a folder name ``step-NNNNNN`` as :func:`ckpt_dir` writes it, else None."""
    m = _STEP_DIR.fullmatch(name)
    if m is None or name != f"step-{int(m.group(1)):06d}":
        return None
    return int(m.group(1))


def committed_steps(store: ObjectStore, run_id: str) -> list[int]:
    """Steps that have a committed checkpoint (a manifest), ascending. Names that :func:`ckpt_dir`
    does not write are ignored (a committed step is still only trusted once :func:`restore` verifies it)."""
    base = run_key(run_id, None, "checkpoints") + "/"
    steps = []
    for key in store.list(base):
        parts = key[len(base):].split("/")
        if len(parts) == 2 and parts[1] == MANIFEST and (step := _step_of(parts[0])) is not None:
            steps.append(step)
    return sorted(steps)


def checkpoint_key(run_dir: str | Path | None = None) -> bytes:
    """The run's checkpoint MAC key: ``derive_key(run_secret(run_dir), "checkpoint")``.

    Ranks read the secret from ``DELTALOOP_RUN_SECRET``; the flow's process from ``run_dir``.
    Without a secret there is nothing to sign or verify with: :class:`CheckpointError`.
    """
    try:
        return derive_key(run_secret(run_dir), "checkpoint")
    except SecretError as exc:
        raise CheckpointError(f"cannot sign or verify checkpoints: {exc}") from None


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign_manifest(body: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``body`` plus ``"mac"``: the HMAC of its canonical JSON (sorted keys) under ``key``."""
    out = {k: v for k, v in body.items() if k != "mac"}
    out["mac"] = mac(key, _canonical(out))
    return out


def read_manifest(store: ObjectStore, run_id: str, step: int, key: bytes | None = None) -> dict[str, Any]:
    """Manifest of the committed checkpoint of ``step`` (raises :class:`CheckpointError`).

    With ``key`` the manifest is verified (:func:`verify_manifest`, any world size); without, it is
    parsed only: for reports and tests, never for deciding what to load.
    """
    mkey = f"{ckpt_dir(run_id, step)}/{MANIFEST}"
    try:
        if store.size(mkey) > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"checkpoint of step {step}: manifest is over {MAX_MANIFEST_BYTES} bytes")
        raw = store.get(mkey)
    except ObjectNotFound:
        raise CheckpointError(f"run {run_id} has no committed checkpoint at step {step}") from None
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint of step {step}: manifest is not valid JSON") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint of step {step}: manifest is not a JSON object")
    if key is not None:
        verify_manifest(manifest, key, run_id, step, None)
    return manifest


def _check_mac(manifest: dict[str, Any], key: bytes, step: int) -> None:
    if "mac" not in manifest:
        raise CheckpointError(
            f"checkpoint of step {step} is unsigned (its manifest has no MAC): refused; checkpoints "
            "written without this run's secret, including those of deltaloop versions that did not "
            "sign them, cannot be restored")
    body = {k: v for k, v in manifest.items() if k != "mac"}
    try:
        data = _canonical(body)
    except (TypeError, ValueError):
        data = b""
    if not mac_ok(key, data, manifest["mac"]):
        raise CheckpointError(
            f"checkpoint of step {step}: manifest MAC does not verify under this run's key "
            "(altered, or written by another run): refused")


def _object_kind(key: str, prefix: str, world: int) -> tuple[str, Any]:
    """Classify a manifest key: ``("file", [parts])`` under ``files/`` or ``("rank", r)``."""
    bad = f"checkpoint object name {key!r}"
    if not key.startswith(prefix + "/"):
        raise CheckpointError(f"{bad} is outside the checkpoint's folder {prefix}/")
    rel = key[len(prefix) + 1:]
    if "\\" in rel or "\x00" in rel:
        raise CheckpointError(f"{bad} contains a backslash or NUL")
    parts = rel.split("/")
    if parts[0] == "files" and len(parts) > 1:
        if any(p in ("", ".", "..") for p in parts[1:]):
            raise CheckpointError(f"{bad} has an empty, '.' or '..' part")
        return "file", parts[1:]
    m = _RANK_FILE.fullmatch(rel)
    if m is not None and rel == f"rank-{int(m.group(1)):05d}.json" and int(m.group(1)) < world:
        return "rank", int(m.group(1))
    raise CheckpointError(f"{bad} is neither files/<name> nor rank-<R>.json of one of {world} ranks")


def verify_manifest(manifest: dict[str, Any], key: bytes, run_id: str, step: int,
                    world: int | None) -> dict[str, tuple[int, str]]:
    """Check the MAC, then the identity and every object name, size and digest field of ``manifest``.

    ``world`` (None: any) is this trainer's number of ranks. Returns ``{key: (size, sha256)}``.
    Raises :class:`CheckpointError` naming the first field that is wrong.
    """
    _check_mac(manifest, key, step)
    where = f"checkpoint of step {step}"
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: manifest format {manifest.get('format')!r}, this trainer reads {FORMAT}")
    if manifest.get("step") != step or manifest.get("run_id") != run_id:
        raise CheckpointError(f"{where}: manifest is for run {manifest.get('run_id')!r} step "
                              f"{manifest.get('step')!r}, not run {run_id!r} step {step}: refused")
    saved_world = manifest.get("world")
    if not isinstance(saved_world, int) or saved_world < 1:
        raise CheckpointError(f"{where}: manifest field 'world' is {saved_world!r}")
    if world is not None and saved_world != world:
        raise CheckpointError(f"{where} was written by {saved_world} ranks; this trainer has {world}")
    sizes, digests = manifest.get("keys"), manifest.get("sha256")
    if not isinstance(sizes, dict) or not isinstance(digests, dict) or set(sizes) != set(digests):
        raise CheckpointError(f"{where}: manifest fields 'keys' and 'sha256' do not list the same objects")
    prefix = ckpt_dir(run_id, step)
    ranks = set()
    out: dict[str, tuple[int, str]] = {}
    for name, size in sizes.items():
        kind, what = _object_kind(name, prefix, saved_world)
        if kind == "rank":
            ranks.add(what)
        digest = digests[name]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointError(f"{where}: size of {name!r} is {size!r}")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise CheckpointError(f"{where}: sha256 of {name!r} is not a hex digest")
        out[name] = (size, digest)
    if ranks != set(range(saved_world)):
        raise CheckpointError(f"{where}: manifest lists rank states {sorted(ranks)}, expected 0..{saved_world - 1}")
    return out


def _encode_bytes(t: Any) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _decode_bytes(text: Any, field: str) -> Any:
    import torch

    if not isinstance(text, str):
        raise CheckpointError(f"rank state field {field!r} is not a string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise CheckpointError(f"rank state field {field!r} is not base64") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every random generator a rank uses, as JSON values (no pickle)."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    algo, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": {"algorithm": algo, "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": _encode_bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured; a malformed field raises :class:`CheckpointError`."""
    import numpy as np
    import torch

    field = "rng"
    try:
        field = "python"
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        field = "numpy"
        s = state["numpy"]
        np.random.set_state((s["algorithm"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
        field = "torch"
        torch.set_rng_state(_decode_bytes(state["torch"], "torch"))
        field = "cuda"
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_decode_bytes(s, "cuda") for s in state["cuda"]])
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"rank state field {field!r} is malformed: {exc}") from None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _upload_folder(store: ObjectStore, folder: Path, prefix: str) -> dict[str, tuple[int, str]]:
    objects: dict[str, tuple[int, str]] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            key = f"{prefix}/files/{path.relative_to(folder).as_posix()}"
            data = path.read_bytes()
            store.put(key, data)
            objects[key] = (len(data), _digest(data))
    return objects


def save(store: ObjectStore, run_id: str, step: int, engine: "TrainEngine", meta: dict[str, Any],
         rank: int, world: int, keep: int, *, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Collective: write every rank's state, then (rank 0) the signed manifest, the pointer, and GC.

    ``meta`` (same on every rank: weights version, engine, config hash...) goes into the manifest.
    The MAC key is :func:`checkpoint_key` of ``run_dir`` (ranks: the secret in their environment).
    Returns the manifest on rank 0, ``{}`` elsewhere.
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    key = checkpoint_key(run_dir)  # every rank, before any collective: a missing secret fails them all
    prefix = ckpt_dir(run_id, step)
    with tempfile.TemporaryDirectory(prefix=f"ckpt-r{rank}-") as tmp:
        folder = Path(tmp)
        engine.save(folder)
        objects = _upload_folder(store, folder, prefix)
    blob = json.dumps({"rng": rng_state(), "step": step, "rank": rank}, separators=(",", ":")).encode()
    rank_key = f"{prefix}/rank-{rank:05d}.json"
    store.put(rank_key, blob)
    objects[rank_key] = (len(blob), _digest(blob))
    gathered: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, objects)
    else:
        gathered = [objects]
    if rank != 0:
        return {}
    every: dict[str, tuple[int, str]] = {}
    for part in gathered:
        every.update(part)
    body = {**meta, "format": FORMAT, "run_id": run_id, "step": step, "world": world,
            "keys": {k: v[0] for k, v in sorted(every.items())},
            "sha256": {k: v[1] for k, v in sorted(every.items())},
            "created": time.time(), "seconds": time.perf_counter() - t0}
    manifest = sign_manifest(body, key)
    put_json(store, f"{prefix}/{MANIFEST}", manifest)  # the commit
    _verify_saved(store, run_id, step, key, world)  # before anything points at it or older ones go
    put_json(store, run_key(run_id, None, "checkpoints", "latest.json"), {"step": step})
    collect(store, run_id, keep)
    return {**manifest, "seconds": time.perf_counter() - t0}


def _verify_saved(store: ObjectStore, run_id: str, step: int, key: bytes, world: int) -> None:
    """Read the just-committed manifest of ``step`` back, verify it, and check that every object it
    lists is in the store with the size it records (digests are checked on restore, which downloads
    them anyway). On a failure the manifest is deleted, un-committing the step, and
    :class:`CheckpointError` names the object."""
    try:
        objects = verify_manifest(read_manifest(store, run_id, step), key, run_id, step, world)
        for name, (size, _digest) in sorted(objects.items()):
            try:
                got = store.size(name)
            except ObjectNotFound:
                raise CheckpointError(f"checkpoint object {name} is missing") from None
            if got != size:
                raise CheckpointError(f"checkpoint object {name} has {got} bytes, the manifest says {size}")
    except CheckpointError as exc:
        store.delete(f"{ckpt_dir(run_id, step)}/{MANIFEST}")
        raise CheckpointError(f"checkpoint of step {step} did not verify after saving ({exc}): not made "
                              "current; older checkpoints kept") from None


def _fetch(store: ObjectStore, name: str, size: int, digest: str) -> bytes:
    """The object ``name``, once its size and SHA-256 match the (verified) manifest."""
    try:
        data = store.get(name)
    except ObjectNotFound:
        raise CheckpointError(f"checkpoint object {name} listed in the manifest is missing") from None
    if len(data) != size:
        raise CheckpointError(f"checkpoint object {name} has {len(data)} bytes, the manifest says {size}")
    if _digest(data) != digest:
        raise CheckpointError(f"checkpoint object {name}: sha256 does not match the manifest")
    return data


def _download(store: ObjectStore, objects: dict[str, tuple[int, str]], prefix: str, folder: Path,
              rank: int, step: int) -> dict[str, Any]:
    """Verify and write every engine file into ``folder``; return this rank's verified state."""
    root = folder.resolve()
    for name, (size, digest) in sorted(objects.items()):
        if not name.startswith(f"{prefix}/files/"):
            continue
        dst = root.joinpath(*name[len(prefix) + len("/files/"):].split("/"))
        if root not in dst.resolve().parents:
            raise CheckpointError(f"checkpoint object name {name!r} resolves outside the restore folder")
        data = _fetch(store, name, size, digest)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    rank_key = f"{prefix}/rank-{rank:05d}.json"
    blob = _fetch(store, rank_key, *objects[rank_key])
    try:
        state = json.loads(blob)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint object {rank_key} is not valid JSON") from None
    if not isinstance(state, dict) or state.get("rank") != rank or state.get("step") != step \
            or not isinstance(state.get("rng"), dict):
        raise CheckpointError(f"checkpoint object {rank_key} is not rank {rank}'s state of step {step}")
    return state


def _agree(error: str | None) -> None:
    """Collective: raise on every rank if any rank failed to verify (no rank enters a loader alone)."""
    import torch.distributed as dist

    errors: list[Any] = [error]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    if error is not None:
        raise CheckpointError(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")


def restore(store: ObjectStore, run_id: str, step: int, engine: "TrainEngine", rank: int,
            world: int, *, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Collective: verify, then load the committed checkpoint of ``step`` into ``engine`` and the RNG.

    Every rank verifies the manifest's MAC (key: :func:`checkpoint_key` of ``run_dir``), downloads
    the engine files (DeepSpeed and the torch replica need the whole set) into a private folder,
    checking each object's size and digest before it is written, and only when every rank verified
    hands the folder to the engine's loader. Returns the manifest.
    """
    key = checkpoint_key(run_dir)
    prefix = ckpt_dir(run_id, step)
    with tempfile.TemporaryDirectory(prefix=f"restore-r{rank}-") as tmp:
        manifest: dict[str, Any] = {}
        state: dict[str, Any] = {}
        error = None
        try:
            manifest = read_manifest(store, run_id, step)
            objects = verify_manifest(manifest, key, run_id, step, world)
            state = _download(store, objects, prefix, Path(tmp), rank, step)
        except CheckpointError as exc:
            error = str(exc)
        _agree(error)
        engine.load(Path(tmp))
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
        step = _step_of(key[len(base):].split("/")[0])
        if step is not None:
            seen.add(step)
    doomed = sorted(s for s in seen if s not in keep_set and s < newest)
    for s in doomed:
        prefix = ckpt_dir(run_id, s) + "/"
        keys = store.list(prefix)
        for key in sorted(keys, key=lambda k: not k.endswith(MANIFEST)):  # un-commit first
            store.delete(key)
    return doomed
