"""LocalEngine under a failing request: only that request fails, its batch mates are answered, and
the engine keeps serving and loading weights (issue #15, finding 4)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer, publishable_state  # noqa: E402
from infra.rollout.engine import SamplingParams  # noqa: E402
from infra.rollout.errors import BadRequest, RequestFailed  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.rollout.slots import SlotRunner  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=128)
GOOD = ["1,2,3=", "10,20,30,40=", "7,7,7=", "2,4,6,8="]
PARAMS = SamplingParams(max_new_tokens=12, temperature=0.9, stop=["\n"], seed=4)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def parts() -> tuple:
    tok = build_tokenizer()
    return build_tiny_model(SMALL, tok, seed=0), tok


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=True)["input_ids"])


def _together(engine: LocalEngine, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads whose rows all enter the queue before any step runs (the driver lock
    is held until every row is queued), so they are admitted into one prefill. Returns each call's
    result or the exception it raised; a call still running after WAIT_S is a hang and fails."""
    out: list[Any] = [None] * len(calls)

    def run(k: int) -> None:
        try:
            out[k] = calls[k]()
        except Exception as exc:  # noqa: BLE001 - the test inspects what each call raised
            out[k] = exc

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(calls))]
    with engine._driver:
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT_S
        # every call has queued its rows, or was refused before queueing (and so has returned)
        while engine._inflight + sum(x is not None for x in out) < len(calls):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a request hangs after its batch mate failed"
    return out


def _load_finishes(engine: LocalEngine, tok: Any, version: int) -> None:
    state = publishable_state(build_tiny_model(SMALL, tok, seed=version))
    t = threading.Thread(target=engine.load_weights, args=(state, version), daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), "load_weights is blocked by a lost request"
    assert engine.generate_ids([_ids(tok, "1=")], 1, PARAMS)[0].version == version


def test_out_of_vocab_request_fails_alone(parts: tuple) -> None:
    """Replays finding 4 of issue #15: a prompt with a token id outside the vocabulary, admitted in
    the same prefill as other requests, raised inside the prefill; its batch mates were lost from
    every queue and hung, and the next weight load waited for them forever."""
    model, tok = parts
    engine = LocalEngine(model, tok, max_batch=64)
    alone = [engine.generate_ids([_ids(tok, p)], 2, PARAMS) for p in GOOD]
    bad = [[tok.bos_token_id, len(tok) + 5, 9]]
    calls = [lambda p=p: engine.generate_ids([_ids(tok, p)], 2, PARAMS) for p in GOOD]
    calls.insert(2, lambda: engine.generate_ids(bad, 2, PARAMS))
    out = _together(engine, calls)
    assert isinstance(out[2], BadRequest) and "vocabulary" in str(out[2])
    got = out[:2] + out[3:]
    assert [[c.token_ids for c in r] for r in got] == [[c.token_ids for c in r] for r in alone]
    with pytest.raises(BadRequest, match="vocabulary"):
        engine.generate_ids([[-1, 5]], 1, PARAMS)
    _load_finishes(engine, tok, version=3)


class _PoisonRunner(SlotRunner):
    """The real slot runner, except that a prefill or decode touching a row whose prompt contains
    ``poison`` raises: a fault no admission check can see, standing in for a bug or a bad input."""

    def __init__(self, model: Any, engine: LocalEngine, poison: int, where: str) -> None:
        super().__init__(model)
        self.engine, self.poison, self.where = engine, poison, where

    def prefill(self, slot_ids: list[int], prompts: list[list[int]]) -> "torch.Tensor":
        if self.where == "prefill" and any(self.poison in p for p in prompts):
            raise RuntimeError("injected prefill fault")
        return super().prefill(slot_ids, prompts)

    def decode(self, tokens: "torch.Tensor", positions: "torch.Tensor", span: int) -> "torch.Tensor":
        rows = self.engine._active[: tokens.shape[0]]
        if self.where == "decode" and any(self.poison in r.prompt_ids for r in rows):
            raise RuntimeError("injected decode fault")
        return super().decode(tokens, positions, span)


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_fault_inside_the_batch_fails_only_its_request(parts: tuple, where: str) -> None:
    """Replays finding 4 of issue #15 with a fault that passes admission: an exception while serving
    a batch (in the prefill, or in a later decode step) must fail the request that causes it and no
    other; the batch mates are served again and answered as if alone, and loads keep working."""
    model, tok = parts
    engine = LocalEngine(model, tok, max_batch=64)
    alone = [engine.generate_ids([_ids(tok, p)], 2, PARAMS) for p in GOOD]
    poison = tok.convert_tokens_to_ids("~")
    engine._runner = _PoisonRunner(model, engine, poison, where)
    calls = [lambda p=p: engine.generate_ids([_ids(tok, p)], 2, PARAMS) for p in GOOD]
    calls.insert(1, lambda: engine.generate_ids([_ids(tok, "5,~,5=")], 2, PARAMS))
    out = _together(engine, calls)
    assert isinstance(out[1], RequestFailed) and f"injected {where} fault" in str(out[1])
    got = out[:1] + out[2:]
    assert [[c.token_ids for c in r] for r in got] == [[c.token_ids for c in r] for r in alone]
    # the engine still serves, also the culprit's prompt shape without the poison
    assert engine.generate_ids([_ids(tok, "5,5,5=")], 1, PARAMS)[0].token_ids
    _load_finishes(engine, tok, version=4)


def test_stop_list_cache_is_bounded(parts: tuple) -> None:
    """Replays finding 4 of issue #15: every distinct ``stop`` list of a request added an entry to a
    cache that never shrank, so a client could grow the worker's memory without bound."""
    model, tok = parts
    engine = LocalEngine(model, tok, max_batch=8, stop_cache_entries=4)
    for k in range(12):
        engine.generate_ids([_ids(tok, "1,2=")], 1, SamplingParams(max_new_tokens=2, stop=[f"#{k}"], seed=k))
    assert len(engine._stop_cache) == 4
    # the most recently used lists are the ones kept, and a kept list gives the same token set
    assert list(engine._stop_cache) == [(f"#{k}",) for k in range(8, 12)]
    assert engine._stop_ids(["#11"]) == LocalEngine(model, tok)._stop_ids(["#11"])
