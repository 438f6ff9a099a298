"""The chaos bench's own logic: the seeded fault schedule, progress events from the S3 journal, the
journal's durability across a restart, the ground-truth comparisons and the record's schema."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

from bench.chaos import KINDS, REQUIRED, build_record, plan_faults
from bench.chaos_driver import Event, Fault, FlowLog, find_trigger, parse_event
from bench.chaos_measure import compare_prompts, compare_rewards, steps_completed, version_regressions
from bench.chaos_s3 import Journal, JournalTail, replay
from infra.storage import FileStore, put_json, run_key


def test_plan_is_seeded_and_covers_every_kind() -> None:
    plan = plan_faults(7, 16, 2)
    assert plan == plan_faults(7, 16, 2)
    assert plan != plan_faults(8, 16, 2)
    assert sorted(f.kind for f in plan) == sorted(KINDS * 2)
    assert all(1 <= f.step <= 16 for f in plan)
    assert [(f.step, f.trigger) for f in plan] == sorted(((f.step, f.trigger) for f in plan),
                                                         key=lambda p: (p[0], ["prompts", "rollouts", "scores",
                                                                               "manifest"].index(p[1])))


@pytest.mark.parametrize("seed", range(12))
def test_sandbox_kills_fall_in_their_runtime_segment(seed: int) -> None:
    """The run starts on bwrap and each flow kill switches runtime: docker kills lie strictly between
    the two flow kills, bwrap kills outside them."""
    plan = plan_faults(seed, 16, 2)
    first, second = sorted(f.step for f in plan if f.kind == "flow")
    assert second - first >= 3
    assert all(first < f.step < second for f in plan if f.kind == "sandbox_docker")
    assert all(f.step < first or f.step > second for f in plan if f.kind == "sandbox_bwrap")


def test_quick_plan_has_one_of_each() -> None:
    plan = plan_faults(0, 6, 1)
    assert sorted(f.kind for f in plan) == sorted(KINDS)
    flow = next(f.step for f in plan if f.kind == "flow")
    assert all(f.step > flow for f in plan if f.kind == "sandbox_docker")
    assert all(f.step < flow for f in plan if f.kind == "sandbox_bwrap")


def test_events_from_journal_paths() -> None:
    assert parse_event("PUT", "/chaos/sync/runs/demo-1/step-000004/rollouts.json", 1.0) == Event("rollouts", 4, 1.0)
    assert parse_event("PUT", "/chaos/sync/runs/demo-1/weights/v00000007/manifest.json.zst", 2.0) == \
        Event("manifest", 7, 2.0)
    assert parse_event("DELETE", "/chaos/sync/runs/demo-1/step-000004/rollouts.json", 1.0) is None
    assert parse_event("PUT", "/chaos/sync/runs/demo-1/weights/v00000007/d-0000.bin", 1.0) is None
    assert parse_event("PUT", "/chaos/sync/runs/demo-1/eval/main/v000002.json", 1.0) is None


def test_trigger_waits_for_its_step_and_takes_a_later_one_when_passed() -> None:
    ev = [Event("prompts", 1, 0), Event("rollouts", 1, 0), Event("scores", 1, 0), Event("manifest", 2, 0),
          Event("prompts", 2, 0), Event("rollouts", 2, 0), Event("scores", 2, 0), Event("manifest", 3, 0)]
    assert find_trigger(ev, 0, Fault("rollout_worker", 2, "prompts", 0, 0)) == 4
    assert find_trigger(ev, 0, Fault("x", 3, "prompts", 0, 0)) is None
    # a fault whose step's event lies before the cursor fires on the next step's event
    assert find_trigger(ev, 2, Fault("x", 1, "rollouts", 0, 0)) == 5
    # manifest: the first version published after that step's scores
    assert find_trigger(ev, 0, Fault("corrupt_weight", 2, "manifest", 0, 0)) == 7
    assert find_trigger(ev[:7], 0, Fault("corrupt_weight", 2, "manifest", 0, 0)) is None


class _KV:
    """A small real WSGI key-value server (PUT/DELETE/GET by path) to journal."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        if method == "PUT":
            if path.endswith("/refused"):
                start_response("403 Forbidden", [])
                return [b""]
            length = int(environ.get("CONTENT_LENGTH") or 0)
            self.data[path] = environ["wsgi.input"].read(length)
        elif method == "DELETE":
            self.data.pop(path, None)
        elif path not in self.data:
            start_response("404 Not Found", [])
            return [b""]
        start_response("200 OK", [])
        return [self.data.get(path, b"")]


def _request(app: Any, method: str, path: str, body: bytes = b"") -> str:
    status: list[str] = []
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "", "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body), "HTTP_HOST": "127.0.0.1"}
    b"".join(app(environ, lambda s, h, e=None: status.append(s)))
    return status[0]


def test_journal_replays_acknowledged_writes_only(tmp_path: Path) -> None:
    """What a restarted server holds: every write it acknowledged, in order; refused ones are not
    journaled, and a record cut short by a kill mid-append (never acknowledged) is dropped."""
    path = tmp_path / "s3.journal"
    live = Journal(_KV(), path)
    blob = bytes(range(256)) * 40
    assert _request(live, "PUT", "/b/a", blob).startswith("200")
    assert _request(live, "PUT", "/b/gone", b"x").startswith("200")
    assert _request(live, "DELETE", "/b/gone").startswith("200")
    assert _request(live, "PUT", "/b/refused", b"y").startswith("403")
    assert _request(live, "GET", "/b/a").startswith("200")
    with open(path, "ab") as f:  # a killed append: header and part of the body
        f.write(json.dumps({"REQUEST_METHOD": "PUT", "PATH_INFO": "/b/torn", "headers": {},
                            "body_bytes": 100}).encode() + b"\n" + b"partial")
    fresh = _KV()
    done, errors = replay(fresh, path)
    assert fresh.data == {"/b/a": blob}
    assert (done, errors) == (3, 0)
    tail = JournalTail(path)
    assert tail.poll() == [("PUT", "/b/a"), ("PUT", "/b/gone"), ("DELETE", "/b/gone")]
    assert tail.poll() == []


def _run(store: FileStore, run: str, rewards: dict[int, list[float]], reasons: dict[int, list[str]] | None = None,
         masked: dict[int, list[bool]] | None = None, versions: dict[int, int] | None = None) -> None:
    for step, rs in rewards.items():
        put_json(store, run_key(run, step, "prompts.json"), {"items": [{"id": "p0"}, {"id": "p1"}]})
        samples = [{"prompt_index": i % 2, "text": f"c{i}", "version": (versions or {}).get(step, step)}
                   for i in range(len(rs))]
        put_json(store, run_key(run, step, "rollouts.json"), {"version": (versions or {}).get(step, step),
                                                              "samples": samples})
        doc: dict[str, Any] = {"rewards": rs, "reasons": (reasons or {}).get(step, ["ok"] * len(rs))}
        if masked and step in masked:
            doc["masked"] = masked[step]
        put_json(store, run_key(run, step, "scores.json"), doc)


def test_fake_zeros_against_the_baseline(tmp_path: Path) -> None:
    """Step 1: a sample scored 0 where the baseline scored 1 (a fault step) and one 'infra' zero; one
    sample masked. Step 2 (no fault): a difference counts as noise, not as a fake zero."""
    base, chaos = FileStore(str(tmp_path / "b")), FileStore(str(tmp_path / "c"))
    _run(base, "b", {1: [1.0, 1.0, 0.0, 1.0], 2: [1.0, 0.0]})
    _run(chaos, "c", {1: [0.0, 1.0, 0.0, 0.0], 2: [0.0, 0.0]},
         reasons={1: ["killed", "ok", "infra", "infra"]}, masked={1: [False, False, False, True]})
    got = compare_rewards(chaos, "c", base, "b", 2, fault_steps={1})
    assert got["fake_zero_rewards"] == 2 and got["fake_zero_by_step"] == {1: 2}
    assert got["masked_samples"] == 1
    assert got["reward_diffs_without_fault"] == 1
    assert got["samples_compared"] == 5


def test_prompt_ids_and_version_regressions(tmp_path: Path) -> None:
    base, chaos = FileStore(str(tmp_path / "b")), FileStore(str(tmp_path / "c"))
    _run(base, "b", {1: [1.0], 2: [1.0], 3: [1.0]})
    _run(chaos, "c", {1: [1.0], 2: [1.0], 3: [1.0]}, versions={1: 2, 2: 4, 3: 3})
    assert compare_prompts(chaos, "c", base, "b", 3) == {"prompt_ids_match": True, "prompt_id_mismatch_steps": []}
    put_json(chaos, run_key("c", 2, "train.json"), {"prompt_ids": ["p1", "p0"]})
    assert compare_prompts(chaos, "c", base, "b", 3)["prompt_id_mismatch_steps"] == [2]
    assert compare_prompts(chaos, "c", base, "b", 4)["prompt_id_mismatch_steps"] == [2, 4]
    got = version_regressions(chaos, "c", 3)
    assert got == {"version_regressions": 1, "served_versions": [2, 4, 3]}
    assert steps_completed(chaos, "c", 3, {"steps": 3}) == 3
    assert steps_completed(chaos, "c", 3, None) == 0  # no weight version published after any step


def test_record_has_the_issue_fields() -> None:
    log = FlowLog(faults=[{"kind": "flow", "step": 3, "action": "kill -9 of flow process pid 1", "t": 1.0},
                          {"kind": "s3_restart", "step": None, "action": "not injected: the run ended", "t": 2.0}],
                  finished=True)
    measured = {"steps_completed": 6, "fake_zero_rewards": 0, "masked_samples": 2, "prompt_ids_match": True,
                "version_regressions": 0, "eval_after": 0.25, "baseline_eval_after": 0.5}
    rec = build_record("sync", 0, 6, log, measured, {})
    assert set(REQUIRED) <= set(rec)
    assert rec["faults"][0] == {"kind": "flow", "step": 3, "action": "kill -9 of flow process pid 1", "t": 1.0}
    assert rec["injected_by_kind"]["flow"] == 1 and rec["injected_by_kind"]["s3_restart"] == 0
    assert rec["completed"] is True
    json.dumps(rec)
    with pytest.raises(ValueError, match="prompt_ids_match"):
        build_record("sync", 0, 6, log, {**measured, "prompt_ids_match": None}, {})
