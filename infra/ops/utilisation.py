"""Utilisation accounting: where every second of every resource of a run went.

A run holds four kinds of resource for its whole wall time (from the start of the flow to the
summary): the trainer ranks (``cluster.ranks``), the rollout worker, the sandbox pool's slots and
the orchestrator (the flow process). Each second of each of them lands in exactly one bucket —
*busy* (by kind of work) or *idle* (by cause) — so per resource ``busy + idle = wall × count``
exactly, not approximately.

What is measured (wall-clock ``time.time()`` stamps, all in the run's history):

- phases, appended by :func:`phase` / :func:`timed`: ``provision`` (and ``warmstart`` inside it,
  recorded by :mod:`infra.stages.provision`), each ``eval`` (with the rollout worker's generation
  seconds), ``promote`` and ``teardown`` (with the pool's last metrics window);
- per step (``spans`` of a step row, :func:`stage_span` in :mod:`infra.stages.steps`): the
  rollout, score, train (training, checkpoint and publish on every rank) and sync (the worker
  loading the new version) stages;
- per pool window (:meth:`infra.sandbox.pool.SandboxPool.metrics`): sandbox-seconds running a
  job, warm with no job, starting, and slot-seconds jobs waited for a sandbox.

Trainer, rollout and orchestrator are *lanes*: labelled intervals on the run's clock; where
intervals overlap (async mode) the higher-priority label wins (busy before idle), and time no
interval covers gets the lane's default cause (:data:`LANES`). The sandbox pool's seconds are
totals per window (not placed in time): the slots not covered by a live sandbox are the
``no_sandbox`` bucket, which costs nothing.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")
Span = tuple[float, float, str]

# per lane: labels from highest to lowest priority, then the default (time no interval covers)
LANES: dict[str, tuple[tuple[str, ...], str]] = {
    "trainer": (("train", "generate", "eval_generate", "warmstart", "evaluation", "startup", "teardown"),
                "waiting_for_rollouts"),
    "rollout": (("generate", "load_weights", "eval_generate", "evaluation", "startup", "teardown"),
                "waiting_for_weights"),
    "orchestrator": (("scoring_queue_wait", "scoring", "waiting_for_services", "evaluation", "startup", "teardown"),
                     "orchestration"),
}
BUSY = frozenset({"train", "warmstart", "generate", "load_weights", "eval_generate", "scoring", "orchestration", "jobs"})
RESOURCES = ("trainer", "rollout", "sandboxes", "orchestrator")
POOL_KEYS = ("busy_sandbox_seconds", "idle_sandbox_seconds", "start_sandbox_seconds", "acquire_wait_seconds")


# --------------------------------------------------------------------------------- recording
def stage_span(t0: float) -> dict[str, float]:
    """``{"t0", "t1"}`` of a stage that started at ``t0`` (``time.time()``) and ends now."""
    return {"t0": t0, "t1": time.time()}


@contextmanager
def phase(history: list[dict[str, Any]], name: str, step: int | None = None) -> Iterator[dict[str, Any]]:
    """Append a ``{"kind": "phase", "phase": name, "t0", "t1"}`` row to ``history`` when the block
    ends (also on an exception); the caller may add fields to the yielded row."""
    row: dict[str, Any] = {"kind": "phase", "phase": name, "step": step, "t0": time.time()}
    try:
        yield row
    finally:
        row["t1"] = time.time()
        history.append(row)


def timed(history: list[dict[str, Any]], name: str, fn: Callable[..., T], *args: Any, step: int | None = None) -> T:
    """Run ``fn(*args)`` inside :func:`phase`; for an ``eval`` phase also keep the rollout worker's
    generation seconds (main suite and extra suites) from the returned report."""
    with phase(history, name, step) as row:
        out = fn(*args)
        if name == "eval" and isinstance(out, dict):
            suites = out.get("suites") or {}
            row["generate_seconds"] = float(out.get("generate_seconds") or 0.0) + sum(
                float(s.get("generate_seconds") or 0.0) for s in suites.values())
    return out


def pool_window(pool: Any) -> dict[str, float]:
    """The sandbox pool's seconds since its last metrics window (:data:`POOL_KEYS`), closing the window."""
    if pool is None:
        return {}
    m = pool.metrics(reset=True)
    return {k: float(m.get(k, 0.0)) for k in POOL_KEYS}


# --------------------------------------------------------------------------------- accounting
def sweep(start: float, end: float, spans: list[Span], priority: tuple[str, ...], default: str) -> list[Span]:
    """Split ``[start, end]`` into consecutive segments, each with one label: the highest-priority
    label (earliest in ``priority``) of the spans covering it, else ``default``. Spans are clipped
    to the window; adjacent segments with the same label are merged. The segments tile the window:
    their lengths add up to ``end - start``."""
    if end <= start:
        return []
    rank = {lab: i for i, lab in enumerate(priority)}
    events: list[tuple[float, int, str]] = []
    for t0, t1, lab in spans:
        a, b = max(t0, start), min(t1, end)
        if b > a:
            events += [(a, 1, lab), (b, -1, lab)]
    events.sort(key=lambda e: e[0])
    active: dict[str, int] = {}
    out: list[Span] = []
    t = start
    i = 0
    while t < end:
        while i < len(events) and events[i][0] <= t:
            _, d, lab = events[i]
            active[lab] = active.get(lab, 0) + d
            i += 1
        nxt = events[i][0] if i < len(events) else end
        live = [lab for lab, n in active.items() if n > 0]
        label = min(live, key=lambda x: rank.get(x, len(rank))) if live else default
        if out and out[-1][2] == label:
            out[-1] = (out[-1][0], nxt, label)
        else:
            out.append((t, nxt, label))
        t = nxt
    return out


def lane_spans(history: list[dict[str, Any]], start: float, end: float, concurrency: int,
               colocated: bool = False) -> dict[str, list[Span]]:
    """The labelled intervals of the trainer, rollout and orchestrator lanes from the run's history.

    ``concurrency`` (the pool's job slots) turns the slot-seconds scoring jobs waited for a sandbox
    into the wall seconds the orchestrator waited (placed at the start of the score stage).
    ``colocated`` (``weight_sync.placement: colocated``): generation (``generate``, ``eval_generate``)
    is the trainer ranks' busy time, and the rollout lane, which no resource holds, stays empty."""
    gen = "trainer" if colocated else "rollout"
    phases = [h for h in history if h.get("kind") == "phase"]
    prov_end = max((h["t1"] for h in phases if h["phase"] == "provision"), default=start)
    td_start = min((h["t0"] for h in phases if h["phase"] == "teardown"), default=end)
    lanes: dict[str, list[Span]] = {n: [(start, prov_end, "startup"), (td_start, end, "teardown")] for n in LANES}
    for h in phases:
        t0, t1 = h["t0"], h["t1"]
        if h["phase"] == "warmstart":
            lanes["trainer"].append((t0, t1, "warmstart"))
        elif h["phase"] in ("eval", "promote"):
            for spans in lanes.values():
                spans.append((t0, t1, "evaluation"))
            lanes[gen].append((t0, t0 + min(t1 - t0, float(h.get("generate_seconds") or 0.0)), "eval_generate"))
    for h in history:
        spans = h.get("spans") if h.get("kind") == "step" else None
        for stage, (t0, t1) in (spans or {}).items():
            if stage == "rollout":
                lanes[gen].append((t0, t1, "generate"))
            elif stage == "train":
                lanes["trainer"].append((t0, t1, "train"))
            elif stage == "sync" and not colocated:  # colocated: a version check, nothing loads
                lanes["rollout"].append((t0, t1, "load_weights"))
            if stage == "score":
                wait = min(t1 - t0, float((h.get("sandbox_window") or {}).get("acquire_wait_seconds", 0.0))
                           / max(1, concurrency))
                lanes["orchestrator"] += [(t0, t0 + wait, "scoring_queue_wait"), (t0 + wait, t1, "scoring")]
            else:
                lanes["orchestrator"].append((t0, t1, "waiting_for_services"))
    if colocated:
        lanes["rollout"] = []
    return lanes


def lane_segments(history: list[dict[str, Any]], start: float, end: float, concurrency: int,
                  colocated: bool = False) -> dict[str, list[Span]]:
    """Every lane as consecutive labelled segments tiling ``[start, end]`` (:func:`sweep`); with
    ``colocated`` the rollout lane has none (there is no rollout worker)."""
    spans = lane_spans(history, start, end, concurrency, colocated)
    return {name: [] if colocated and name == "rollout" else sweep(start, end, spans[name], *LANES[name])
            for name in LANES}


def buckets(segments: list[Span], count: int) -> dict[str, Any]:
    """Resource-seconds of a lane held by ``count`` identical resources: busy by kind, idle by cause."""
    busy: dict[str, float] = {}
    idle: dict[str, float] = {}
    for t0, t1, lab in segments:
        side = busy if lab in BUSY else idle
        side[lab] = side.get(lab, 0.0) + (t1 - t0) * count
    return _resource(count, busy, idle)


def _resource(count: int, busy: dict[str, float], idle: dict[str, float]) -> dict[str, Any]:
    b, i = sum(busy.values()), sum(idle.values())
    return {"count": count, "busy_seconds": b, "busy_by_kind": busy, "idle_seconds": idle,
            "idle_seconds_total": i, "busy_fraction": b / (b + i) if b + i > 0 else 0.0}


def sandbox_buckets(windows: list[dict[str, float]], wall: float, concurrency: int, min_warm: int) -> dict[str, Any]:
    """The pool's slots over ``wall`` seconds from its metrics windows.

    Slots = ``max(concurrency, min_warm)``, raised when more sandboxes were live on average (the
    warm buffer may exceed the job slots). Busy = sandbox-seconds running a job; idle: ``warm_no_job``
    (live, no job), ``startup`` (a sandbox starting), ``no_sandbox`` (an empty slot: the rest)."""
    tot = {k: sum(float(w.get(k, 0.0)) for w in windows) for k in POOL_KEYS}
    live = tot["busy_sandbox_seconds"] + tot["idle_sandbox_seconds"] + tot["start_sandbox_seconds"]
    slots = max(concurrency, min_warm, math.ceil(live / wall) if wall > 0 else 0, 1)
    idle = {"warm_no_job": tot["idle_sandbox_seconds"], "startup": tot["start_sandbox_seconds"],
            "no_sandbox": max(0.0, slots * wall - live)}
    out = _resource(slots, {"jobs": tot["busy_sandbox_seconds"]}, idle)
    out["acquire_wait_seconds"] = tot["acquire_wait_seconds"]
    return out


def account(history: list[dict[str, Any]], start: float, end: float, ranks: int, concurrency: int,
            min_warm: int, colocated: bool = False) -> dict[str, Any]:
    """The ``utilisation`` of a run: per resource its count, ``busy_seconds`` (and by kind) and
    ``idle_seconds`` by cause, in resource-seconds over the window ``[start, end]``. ``colocated``:
    the trainer ranks generate (busy ``generate`` / ``eval_generate``) and the rollout resource has
    count 0 (no worker is held, nothing is billed for it)."""
    seg = lane_segments(history, start, end, concurrency, colocated)
    windows = [h["sandbox_window"] for h in history if h.get("kind") == "step" and h.get("sandbox_window")]
    windows += [h["sandbox_window"] for h in history if h.get("kind") == "phase" and h.get("sandbox_window")]
    rollout = _resource(0, {}, {}) if colocated else buckets(seg["rollout"], 1)
    return {"trainer": buckets(seg["trainer"], ranks), "rollout": rollout,
            "sandboxes": sandbox_buckets(windows, end - start, concurrency, min_warm),
            "orchestrator": buckets(seg["orchestrator"], 1)}


def closure(util: dict[str, Any], wall: float) -> dict[str, float]:
    """How well the buckets add up: accounted resource-seconds against ``wall × resources``."""
    accounted = sum(r["busy_seconds"] + r["idle_seconds_total"] for r in util.values())
    expected = wall * sum(r["count"] for r in util.values())
    return {"accounted_seconds": accounted, "expected_seconds": expected,
            "relative_error": abs(accounted - expected) / expected if expected > 0 else 0.0}
