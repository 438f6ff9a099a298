"""LocalEngine: log-probs equal teacher forcing, stop handling, per-request seeds, registry."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import RolloutConfig, TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer, publishable_state  # noqa: E402
from infra.rollout import create_engine  # noqa: E402
from infra.rollout.engine import SamplingParams  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.train.grpo import build_batch, token_logprobs  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=128)
PROMPTS = ["1,2,3,4,5,6=", "10,20,30,40,50,60=", "3=", "0,1,4,9,16,25="]  # different lengths → left padding


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    tok = build_tokenizer()
    return LocalEngine(build_tiny_model(SMALL, tok, seed=0), tok)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_teacher_forcing(engine: LocalEngine, temperature: float) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=temperature, stop=[], seed=3)
    comps = engine.generate(PROMPTS, 3, params)
    assert len(comps) == 12 and [c.prompt_index for c in comps] == [i for i in range(4) for _ in range(3)]
    batch = build_batch(engine.tokenizer, PROMPTS, comps, [0.0] * len(comps))
    with torch.no_grad():
        lp, _ = token_logprobs(engine.model, batch["input_ids"], batch["attention_mask"], temperature or 1.0)
    err = ((lp - batch["old_logprobs"]) * batch["completion_mask"]).abs().max().item()
    assert err < 1e-3
    assert all(len(c.logprobs) == len(c.token_ids) <= 12 for c in comps)
    assert all(c.finish_reason == ("length" if len(c.token_ids) == 12 else "stop") for c in comps)


def test_sampling_is_per_request_deterministic(engine: LocalEngine) -> None:
    params = SamplingParams(max_new_tokens=10, seed=7)
    full = engine.generate(PROMPTS, 4, params)
    alone = engine.generate(PROMPTS[:1], 4, params)
    assert [c.token_ids for c in full[:4]] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in full[:4]}) > 1  # samples of one prompt differ
    other = engine.generate(PROMPTS[:1], 4, SamplingParams(max_new_tokens=10, seed=8))
    assert [c.token_ids for c in other] != [c.token_ids for c in alone]
    small_batches = LocalEngine(engine.model, engine.tokenizer, max_batch=3).generate(PROMPTS, 4, params)
    assert [c.token_ids for c in small_batches] == [c.token_ids for c in full]


def test_stop_tokens_and_strings(engine: LocalEngine) -> None:
    tok = engine.tokenizer
    every_char = [chr(c) for c in range(32, 127)] + ["\n"]
    comps = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, stop=every_char, seed=1))
    for c in comps:  # every token is a stop token (or eos): one token, empty text
        assert c.finish_reason == "stop" and len(c.token_ids) == 1 and c.text == ""
    base = engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=10, stop=[], seed=5))[0]
    text = tok.decode(base.token_ids, skip_special_tokens=True)
    stop = text[2:4]  # a two-character stop string that first completes at token 4
    assume = text.find(stop) == 2
    c = engine.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=10, stop=[stop], seed=5))[0]
    if assume:
        assert c.finish_reason == "stop" and c.text == text[:2] and c.token_ids == base.token_ids[:4]
    assert c.token_ids == base.token_ids[: len(c.token_ids)]


def test_greedy_and_weight_loading(engine: LocalEngine) -> None:
    g1 = engine.greedy(PROMPTS, 8)
    assert g1 == engine.greedy(PROMPTS, 8)
    other = build_tiny_model(SMALL, engine.tokenizer, seed=9)
    eng2 = LocalEngine(build_tiny_model(SMALL, engine.tokenizer, seed=0), engine.tokenizer)
    eng2.load_weights(publishable_state(other), version=5)
    assert eng2.version == 5
    comps = eng2.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert comps[0].version == 5


def test_registry_rejects_unknown_type(engine: LocalEngine) -> None:
    assert isinstance(create_engine(RolloutConfig(), engine.model, engine.tokenizer), LocalEngine)
    cfg = RolloutConfig.model_construct(type="nope")
    with pytest.raises(ValueError, match="local"):
        create_engine(cfg, engine.model, engine.tokenizer)
