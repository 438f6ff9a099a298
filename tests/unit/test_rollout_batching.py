"""LocalEngine continuous batching: results independent of slots/refills/concurrency; stop strings."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer, publishable_state  # noqa: E402
from infra.rollout.engine import SamplingParams  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=256)
PROMPTS = ["1,2,3,4,5,6=", "10,20,30,40,50,60=", "3=", "0,1,4,9,16,25=", "7,7,7=", "2,4="]


@pytest.fixture(scope="module")
def parts() -> tuple:
    tok = build_tokenizer()
    return build_tiny_model(SMALL, tok, seed=0), tok


def _tokens(comps: list) -> list[list[int]]:
    return [c.token_ids for c in comps]


def test_slot_refill_equals_one_row_at_a_time(parts: tuple) -> None:
    model, tok = parts
    # varied lengths: '5' and '0' end completions at different points; refills happen mid-batch
    params = SamplingParams(max_new_tokens=20, temperature=1.0, stop=["5", "0"], seed=11)
    wide = LocalEngine(model, tok, max_batch=64).generate(PROMPTS, 3, params)
    assert LocalEngine(model, tok, max_batch=64).continuous
    lengths = {len(c.token_ids) for c in wide}
    assert len(lengths) > 2  # the workload really has different lengths
    for max_batch in (1, 2, 5):
        assert _tokens(LocalEngine(model, tok, max_batch=max_batch).generate(PROMPTS, 3, params)) == _tokens(wide)


def test_concurrent_callers_share_steps_without_changing_results(parts: tuple) -> None:
    model, tok = parts
    engine = LocalEngine(model, tok, max_batch=4)
    calls = [(p, SamplingParams(max_new_tokens=8 + 3 * k, temperature=0.9, top_p=0.95 if k % 2 else 1.0,
                                stop=["\n", "9"] if k % 3 else [], seed=k)) for k, p in enumerate(PROMPTS)]
    alone = [engine.generate([p], 2, sp) for p, sp in calls]
    barrier = threading.Barrier(len(calls))

    def one(call: tuple) -> list:
        barrier.wait()
        return engine.generate([call[0]], 2, call[1])

    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(one, calls))
    assert [_tokens(c) for c in together] == [_tokens(c) for c in alone]
    flat = [x for cs in together for c in cs for x in c.logprobs]
    assert flat == pytest.approx([x for cs in alone for c in cs for x in c.logprobs], abs=1e-5)


def test_hf_fallback_matches_slot_runner(parts: tuple) -> None:
    model, tok = parts
    fast = LocalEngine(model, tok, max_batch=8)
    slow = LocalEngine(model, tok, max_batch=8)
    slow._runner = None  # what a non-Llama architecture gets
    for params in (SamplingParams(max_new_tokens=12, temperature=0.0, stop=[]),
                   SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, stop=["7"], seed=2)):
        a, b = fast.generate(PROMPTS, 2, params), slow.generate(PROMPTS, 2, params)
        assert _tokens(a) == _tokens(b)
        assert [c.finish_reason for c in a] == [c.finish_reason for c in b]


def test_multi_token_stop_strings_and_reasons(parts: tuple) -> None:
    model, tok = parts
    engine = LocalEngine(model, tok)
    checked = 0
    for p in PROMPTS:
        b = engine.generate([p], 1, SamplingParams(max_new_tokens=16, stop=[], seed=5))[0]
        text = tok.decode(b.token_ids, skip_special_tokens=True)
        if len(text) < 8 or len(text) != len(b.token_ids):
            continue
        stop = text[4:7]  # three characters, one token each: first complete at token text.find(stop)+3
        first = text.find(stop)
        c = engine.generate([p], 1, SamplingParams(max_new_tokens=16, stop=["@@", stop], seed=5))[0]
        assert c.finish_reason == "stop" and c.text == text[:first]
        assert c.token_ids == b.token_ids[: first + len(stop)]  # the completing token is kept
        checked += 1
    assert checked >= 3
    long = engine.generate(PROMPTS[:2], 1, SamplingParams(max_new_tokens=5, stop=[], seed=1))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in long)


def test_load_waits_for_inflight_requests(parts: tuple) -> None:
    model, tok = parts
    engine = LocalEngine(build_tiny_model(SMALL, tok, seed=0), tok, max_batch=2)
    new_state = publishable_state(build_tiny_model(SMALL, tok, seed=3))
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(
        engine.generate(PROMPTS * 4, 2, SamplingParams(max_new_tokens=24, stop=[], seed=0))))
    worker.start()
    engine.load_weights(new_state, version=7)
    worker.join()
    versions = {c.version for c in results}
    assert len(versions) == 1  # one version produced the whole request
    after = engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4, stop=[]))
    assert after[0].version == 7
