"""The official ``openai`` client against a real uvicorn server over a LocalEngine (tiny model)."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from infra.proc import free_port  # noqa: E402
from infra.config import TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.rollout.openai_api import create_app  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=256)


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    tok = build_tokenizer()
    return LocalEngine(build_tiny_model(SMALL, tok, seed=0), tok, max_batch=8)


@pytest.fixture(scope="module")
def client(engine: LocalEngine) -> Iterator["openai.OpenAI"]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(timeout=10)


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
