"""The real rollout worker process (RolloutService): OpenAI API plus load/version/rollout endpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from infra.config import RunConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer, publishable_state  # noqa: E402
from infra.rollout.service import RolloutService  # noqa: E402
from infra.storage import get_json, open_store, put_json, run_key  # noqa: E402
from infra.weightsync import VersionPublisher  # noqa: E402


def test_worker_serves_openai_and_loads_versions_in_place(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"model": {"tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                                       "intermediate_size": 64}}})
    store = open_store(str(tmp_path / "store"))
    service = RolloutService(cfg, "run1", store, tmp_path / "run")
    service.start()
    try:
        client = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1,2,3="}],
                                              max_tokens=8, temperature=0, seed=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        assert chat.system_fingerprint == "v0"
        comp = client.completions.create(model="policy", prompt="4,5,6=", max_tokens=6, temperature=0.7, seed=1)
        assert comp.usage.completion_tokens >= 1

        # the pipeline's own endpoints keep working next to the OpenAI ones
        tok = build_tokenizer()
        other = build_tiny_model(cfg.model.tiny, tok, seed=5)
        VersionPublisher(store, run_key("run1", None, "weights")).publish(publishable_state(other))
        assert service.load()["version"] >= 0 and service.version() == service.load()["version"]
        version = service.version()
        prompts_key, out_key = run_key("run1", 1, "prompts.json"), run_key("run1", 1, "rollouts.json")
        put_json(store, prompts_key, {"prompts": ["1,2=", "7,8,9="]})
        info = service.rollout(prompts_key, out_key, n=2, temperature=1.0, max_new_tokens=6, seed=0)
        assert info["samples"] == 4 and get_json(store, out_key)["version"] == version
        after = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1,2,3="}],
                                               max_tokens=8, temperature=0, seed=0)
        assert after.system_fingerprint == f"v{version}"
        assert [m.id for m in client.models.list().data] == ["policy"]
    finally:
        service.close()
