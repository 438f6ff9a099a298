"""Multi-turn funcfit: a policy behind the OpenAI endpoint, a code tool in real bwrap sandboxes."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from evals.funcfit import FuncfitEnv, make_problem  # noqa: E402
from evals.multiturn import run_episodes, run_tool  # noqa: E402
from infra.proc import free_port  # noqa: E402
from infra.config import TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.rollout.openai_api import create_app  # noqa: E402
from infra.sandbox import SandboxPool  # noqa: E402
from tests.sandbox_helpers import running_pool  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=512)


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    # SandboxConfig's default 2 s job timeout: an expression of the random policy that hangs costs 2 s, not 20.
    with running_pool("bwrap", min_warm=1, max_warm=2, timeout_s=2.0) as p:
        yield p


@pytest.fixture(scope="module")
def client() -> Iterator["openai.OpenAI"]:
    tok = build_tokenizer()
    engine = LocalEngine(build_tiny_model(SMALL, tok, seed=0), tok)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "policy"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(timeout=10)


def test_tool_runs_in_the_sandbox(pool: SandboxPool) -> None:
    assert run_tool(pool, "2*x+1") == ("[1, 3, 5, 7, 9, 11]", "ok")
    out, reason = run_tool(pool, "x/0")
    assert out.startswith("error:") and "ZeroDivisionError" in out
    out, reason = run_tool(pool, "__import__('os').system('echo hi')")  # runs, but only inside the sandbox
    assert reason in ("ok", "error")


def test_episodes_alternate_policy_and_tool(client: "openai.OpenAI", pool: SandboxPool) -> None:
    problems = FuncfitEnv(seed=0).train_items(1, 4) + [FuncfitEnv.to_item(make_problem("a*x+b", 2, 1))]
    episodes = run_episodes(client, "policy", problems, pool, concurrency=5, max_turns=2, max_tokens=12)
    assert len(episodes) == 5
    for ep in episodes:
        assert 1 <= len(ep.turns) <= 2 and 0.0 <= ep.reward <= 1.0 and ep.reason
        assert ep.versions == {0}
        for t in ep.turns:
            assert t.tool_reason and t.tool_output
            assert len(t.token_ids) == len(t.logprobs) >= 1 and t.prompt_token_ids
        if len(ep.turns) == 2:  # the second prompt contains the sandbox's answer to the first turn
            tok = build_tokenizer()
            second = tok.decode(ep.turns[1].prompt_token_ids)
            assert "f gave " + ep.turns[0].tool_output in second
    assert any(len(ep.turns) == 2 for ep in episodes)  # a random policy gets feedback
