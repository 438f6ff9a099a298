"""The real rollout worker process under hostile traffic (issue #15, finding 4): 200 concurrent
requests, a quarter of them malformed, over HTTP; then a weight load; then the control endpoints
without and with a wrong token."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from infra.config import RunConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer, publishable_state  # noqa: E402
from infra.rollout.service import RolloutService  # noqa: E402
from infra.secrets import derive_key  # noqa: E402
from infra.storage import open_store, put_json, run_key  # noqa: E402
from infra.weightsync import VersionPublisher  # noqa: E402

MAX_BODY = 64 << 10
TIMEOUT_S = 300.0


def _good(k: int) -> tuple[str, dict[str, Any]]:
    """Well-formed request ``k``: completions or chat, text or token-id prompts, n 1-2, greedy."""
    digits = ",".join(str((k * 7 + j) % 10) for j in range(2 + k % 5))
    if k % 3 == 0:
        return "/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": digits + "="}],
                                     "max_tokens": 6 + k % 4, "temperature": 0, "n": 1 + k % 2, "seed": k}
    prompt: Any = digits + "=" if k % 3 == 1 else [[1] + [4 + (k + j) % 60 for j in range(3 + k % 4)]]
    return "/completions", {"model": "policy", "prompt": prompt, "max_tokens": 5 + k % 6, "temperature": 0,
                            "n": 1 + k % 2, "stop": ["\n"], "user": f"u{k}"}


def _bad(k: int, vocab: int) -> tuple[str, dict[str, Any] | bytes]:
    """Malformed request ``k``: each kind of finding 4's attack, in turn."""
    base = {"model": "policy", "prompt": "1,2=", "max_tokens": 6, "temperature": 0}
    kinds: list[tuple[str, dict[str, Any] | bytes]] = [
        ("/completions", {**base, "prompt": [1, 5, vocab + k, 9]}),  # out-of-vocab id
        ("/completions", {**base, "prompt": [[1, 5], [1, -1 - k]]}),  # negative id
        ("/completions", {**base, "prompt": "7" * (MAX_BODY + k)}),  # huge body
        ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "1="}],
                               "response_format": {"type": "json_object"}}),  # unsupported value
        ("/completions", {**base, f"unknown_{k}": [1, 2]}),  # unknown field
        ("/completions", b'{"model": "policy", "prompt": [1, 2'),  # garbage JSON
        ("/completions", {**base, "prompt": ["1="] * 40, "n": 30}),  # too many prompts x n
        ("/completions", {**base, "stop": [str(j) for j in range(40)]}),  # too many stop strings
        ("/completions", {**base, "max_tokens": 30000}),  # max_tokens over the cap
    ]
    return kinds[k % len(kinds)]


async def _send(client: "httpx.AsyncClient", path: str, body: dict[str, Any] | bytes) -> "httpx.Response":
    if isinstance(body, bytes):
        return await client.post(path, content=body, headers={"content-type": "application/json"})
    return await client.post(path, json=body)


async def _burst(base: str, requests: list[tuple[str, dict[str, Any] | bytes]]) -> list["httpx.Response"]:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT_S, limits=limits) as client:
        return list(await asyncio.gather(*(_send(client, p, b) for p, b in requests)))


def test_hostile_burst_leaves_the_worker_serving_and_loading(tmp_path: Path) -> None:
    """Replays finding 4 of issue #15: an out-of-vocabulary token id raised inside the shared
    prefill, its batch mates hung forever and the next weight load blocked every later request;
    bodies, prompts x n and stop lists were unbounded and unknown fields were accepted. Now: 200
    concurrent requests, 50 of them malformed, leave every well-formed one answered exactly as
    when sent alone (greedy), every malformed one refused with a 4xx, and the worker then loads a
    new version and answers with it."""
    cfg = RunConfig.model_validate({
        "model": {"tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}},
        "rollout": {"max_body_bytes": MAX_BODY, "max_request_rows": 64, "max_request_tokens": 64},
    })
    store = open_store(str(tmp_path / "store"))
    service = RolloutService(cfg, "run1", store, tmp_path / "run")
    service.start()
    try:
        base = service.url + "/v1"
        vocab = len(build_tokenizer())
        good = [_good(k) for k in range(150)]
        with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:
            alone = [client.post(p, json=b).json() for p, b in good]
        order = [("good", k) for k in range(150)] + [("bad", k) for k in range(50)]
        order = sorted(order, key=lambda x: (x[1] * 4 + (x[0] == "bad") * 3) % 200)  # interleaved
        reqs = [good[k] if kind == "good" else _bad(k, vocab) for kind, k in order]
        answers = asyncio.run(_burst(base, reqs))
        for (kind, k), resp in zip(order, answers):
            if kind == "good":
                assert resp.status_code == 200, (k, resp.text[:300])
                got, ref = resp.json(), alone[k]
                assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in ref["choices"]], k
                assert got["weight_version"] == 0
            else:
                assert 400 <= resp.status_code < 500, (k, resp.status_code, resp.text[:300])
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

        # the worker still loads a new version and answers with it
        other = build_tiny_model(cfg.model.tiny, build_tokenizer(), seed=5)
        VersionPublisher(store, run_key("run1", None, "weights")).publish(publishable_state(other))
        assert service.load(1)["version"] == 1
        with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:
            after = client.post(good[1][0], json=good[1][1]).json()
        assert after["weight_version"] == 1 and after["system_fingerprint"] == "v1"
    finally:
        service.close()


def test_control_endpoints_refuse_missing_and_wrong_tokens(tmp_path: Path) -> None:
    """Replays finding 4 of issue #15: ``/v1/load`` and ``/v1/rollout`` of the running worker
    accepted any caller. Without a token they answer 401, with another run's token 403, and the
    flow's own client (which sends the run's token) is served."""
    cfg = RunConfig.model_validate({"model": {"tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                                       "intermediate_size": 64}}})
    store = open_store(str(tmp_path / "store"))
    service = RolloutService(cfg, "run1", store, tmp_path / "run")
    service.start()
    try:
        VersionPublisher(store, run_key("run1", None, "weights")).publish(
            publishable_state(build_tiny_model(cfg.model.tiny, build_tokenizer(), seed=5)))
        prompts_key, out_key = run_key("run1", 0, "prompts.json"), run_key("run1", 0, "rollouts.json")
        put_json(store, prompts_key, {"prompts": ["1,2="]})
        calls = [("/v1/load", {"version": 1}),
                 ("/v1/rollout", {"prompts_key": prompts_key, "out_key": out_key, "n": 1, "max_new_tokens": 4})]
        wrong = {"Authorization": f"Bearer {derive_key(bytes(32), 'rollout-control').hex()}"}
        for path, body in calls:
            assert httpx.post(service.url + path, json=body, timeout=60).status_code == 401
            assert httpx.post(service.url + path, json=body, headers=wrong, timeout=60).status_code == 403
            assert httpx.post(service.url + path, content=json.dumps(body).encode() + b"}", timeout=60,
                              headers={"Authorization": "Bearer x" * 3}).status_code == 403
        assert service.version() == 0 and not store.exists(out_key)
        assert service.load(1)["version"] == 1
        assert service.rollout(prompts_key, out_key, 1, 1.0, 4, 0)["samples"] == 1
    finally:
        service.close()
