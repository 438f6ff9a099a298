"""The official ``openai`` client against a real uvicorn server over a LocalEngine (tiny model)."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from infra.proc import free_port  # noqa: E402
from infra.config import TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.rollout.openai_api import ApiLimits, create_app  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=256)
LIMITS = ApiLimits(max_body_bytes=64 << 10, max_rows=16, max_tokens=64, max_stop=4, max_stop_chars=8)


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    tok = build_tokenizer()
    return LocalEngine(build_tiny_model(SMALL, tok, seed=0), tok, max_batch=8)


@pytest.fixture(scope="module")
def base(engine: LocalEngine) -> Iterator[str]:
    port = free_port()
    app = create_app(engine, "tiny", limits=LIMITS)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0)


def test_chat_completion(client: "openai.OpenAI") -> None:
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1,2,3="}],
        max_tokens=12, temperature=0.8, seed=1, n=2, logprobs=True,
    )
    assert len(resp.choices) == 2 and resp.object == "chat.completion"
    for ch in resp.choices:
        assert ch.message.role == "assistant" and isinstance(ch.message.content, str)
        assert ch.finish_reason in ("stop", "length")
        assert ch.logprobs is not None and all(t.logprob <= 0 for t in ch.logprobs.content)
    assert resp.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in resp.choices)
    assert resp.usage.prompt_tokens > 0 and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.system_fingerprint == "v0"
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1,2,3="}],
        max_tokens=12, temperature=0.8, seed=1, n=2,
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]


def test_completion_matches_engine(client: "openai.OpenAI", engine: LocalEngine) -> None:
    from infra.rollout.engine import SamplingParams

    resp = client.completions.create(model="tiny", prompt=["3,5,7=", "1,1,1,1="], max_tokens=10, temperature=1.0,
                                     top_p=0.9, seed=4, stop=["+"], logprobs=1)
    assert len(resp.choices) == 2 and resp.usage.completion_tokens > 0
    ref = engine.generate(["3,5,7=", "1,1,1,1="], 1, SamplingParams(max_new_tokens=10, top_p=0.9, stop=["+"], seed=4))
    for ch, c in zip(resp.choices, ref):
        assert ch.text == c.text and "+" not in ch.text
        assert ch.logprobs.token_logprobs == pytest.approx(c.logprobs)
        assert ch.finish_reason == c.finish_reason


def test_greedy_stream_models_and_errors(client: "openai.OpenAI") -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    full = client.completions.create(model="tiny", prompt="2,4,6=", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="2,4,6=", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, temperature=0, stream=True)
    assert any(c.choices and c.choices[0].finish_reason for c in stream)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)


def test_concurrent_requests_share_the_batch(client: "openai.OpenAI", engine: LocalEngine) -> None:
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"{i},{i + 1},{i + 2}=" for i in range(6)]

    def one(p: str) -> str:
        return client.completions.create(model="tiny", prompt=p, max_tokens=16, seed=9, temperature=1.0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(one, prompts))
    assert together == [one(p) for p in prompts]  # seeded results do not depend on batch mates


def _error(resp: "httpx.Response", status: int) -> dict:
    """The OpenAI error document of a refused request (status and shape checked)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_malformed_requests_are_refused_before_the_engine(base: str, client: "openai.OpenAI") -> None:
    """Replays finding 4 of issue #15: an out-of-vocabulary token id reached the engine's prefill,
    and nothing bounded the body, prompts x n, max_tokens or the stop strings of a request; unknown
    fields were silently ignored. Each is now a 4xx in OpenAI's error shape, and the server still
    answers a well-formed request the same way afterwards."""
    ok = {"model": "tiny", "prompt": "1,2=", "max_tokens": 6, "temperature": 0}
    before = httpx.post(f"{base}/completions", json=ok, timeout=60).json()["choices"][0]["token_ids"]
    vocab = len(build_tokenizer())
    bad = {
        "out of vocab": ({**ok, "prompt": [1, vocab + 7, 9]}, 400, "prompt"),
        "negative id": ({**ok, "prompt": [[1, 5], [1, -3]]}, 400, "prompt"),
        "unknown field": ({**ok, "frobnicate": True}, 400, "frobnicate"),
        "unsupported value": ({**ok, "logit_bias": {"5": 100}}, 400, "logit_bias"),
        "rows": ({**ok, "prompt": ["1="] * 4, "n": 5}, 400, "n"),
        "max_tokens": ({**ok, "max_tokens": 65}, 400, "max_tokens"),
        "stop count": ({**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        "stop length": ({**ok, "stop": ["123456789"]}, 400, "stop"),
        "schema": ({**ok, "n": "many"}, 400, "n"),
    }
    for name, (body, status, param) in bad.items():
        assert _error(httpx.post(f"{base}/completions", json=body, timeout=60), status)["param"] == param, name
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    assert _error(httpx.post(f"{base}/chat/completions", json=chat, timeout=60), 400)["param"] == "tools"
    garbage = httpx.post(f"{base}/completions", content=b'{"model": "tiny", "prompt": ', timeout=60,
                         headers={"content-type": "application/json"})
    _error(garbage, 400)
    huge = httpx.post(f"{base}/completions", json={**ok, "prompt": "1" * (LIMITS.max_body_bytes + 1)}, timeout=60)
    assert _error(huge, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMITS.max_body_bytes // 1024 + 1):
            yield b"1" * 1024
        yield b'"}'

    _error(httpx.post(f"{base}/completions", content=chunks(), timeout=60), 413)
    # neutral values of unimplemented OpenAI fields and bookkeeping fields are accepted
    neutral = {**ok, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "user": "u1"}
    assert httpx.post(f"{base}/completions", json=neutral, timeout=60).json()["choices"][0]["token_ids"] == before
    assert client.completions.create(**ok).choices[0].model_extra["token_ids"] == before
