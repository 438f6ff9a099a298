"""The rollout worker's control endpoints: bearer token, store keys in the run's rollout areas,
committed versions only (issue #15, finding 4), on the real app over an in-process worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
testclient = pytest.importorskip("fastapi.testclient")

from infra.config import load_config  # noqa: E402
from infra.model import publishable_state  # noqa: E402
from infra.rollout.guard import check_rollout_key, control_token  # noqa: E402
from infra.rollout.errors import ControlRefused  # noqa: E402
from infra.rollout.server import RolloutWorker, build_app  # noqa: E402
from infra.secrets import derive_key  # noqa: E402
from infra.specs import RolloutSpec  # noqa: E402
from infra.storage import FileStore, put_json, run_key  # noqa: E402
from infra.weightsync import VersionPublisher  # noqa: E402

OVERRIDES = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
             "model.tiny.intermediate_size=64", "rollout.threads=1", "rollout.max_body_bytes=4096"]
SECRET = bytes(range(32))


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Any, FileStore, RolloutWorker]]:
    threads = torch.get_num_threads()
    store = FileStore(tmp_path / "store")
    worker = RolloutWorker(RolloutSpec.build(load_config(None, OVERRIDES), "r1", store.uri))
    client = testclient.TestClient(build_app(worker, control_token(SECRET)))
    yield client, store, worker
    client.close()
    torch.set_num_threads(threads)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_token_is_the_runs_derived_key() -> None:
    assert control_token(SECRET) == derive_key(SECRET, "rollout-control").hex()
    assert control_token(SECRET) != control_token(bytes(32))


def test_control_endpoints_need_the_runs_token(setup: tuple) -> None:
    """Replays finding 4 of issue #15: anyone who could reach the worker's port could call
    ``/v1/load`` and ``/v1/rollout`` (move the policy, make the worker read and write the store)
    with no token at all."""
    client, store, worker = setup
    VersionPublisher(store, run_key("r1", None, "weights")).publish(publishable_state(worker.engine.model))
    put_json(store, "runs/r1/step-000001/prompts.json", {"prompts": ["1,2="], "stop": ["\n"]})
    body = {"prompts_key": "runs/r1/step-000001/prompts.json", "out_key": "runs/r1/step-000001/rollouts.json",
            "n": 2, "max_new_tokens": 4}
    for path, doc in (("/v1/load", {"version": 1}), ("/v1/rollout", body)):
        missing = client.post(path, json=doc)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert "Bearer" in missing.json()["error"]["message"]
        assert client.post(path, json=doc, headers={"Authorization": "Basic x"}).status_code == 401
        assert client.post(path, json=doc, headers=_auth(control_token(bytes(32)))).status_code == 403
        # refused before the body is read: garbage from an unauthenticated caller is still 401
        assert client.post(path, content=b"{not json").status_code == 401
    assert worker.version == 0 and not store.exists(body["out_key"])
    good = _auth(control_token(SECRET))
    assert client.post("/v1/load", json={"version": 1}, headers=good).json()["version"] == 1
    res = client.post("/v1/rollout", json=body, headers=good)
    assert res.status_code == 200 and res.json()["samples"] == 2 and store.exists(body["out_key"])
    # the OpenAI endpoints and the read-only ones stay open
    assert client.get("/v1/version").json() == {"version": 1}
    assert client.post("/v1/completions", json={"model": "policy", "prompt": "1=", "max_tokens": 2}).status_code == 200


def test_control_endpoints_take_only_rollout_keys_and_committed_versions(setup: tuple) -> None:
    """Replays finding 4 of issue #15: ``/v1/rollout`` read and wrote any store key (other runs,
    the weights, the control records) and ``/v1/load`` took any version number."""
    client, store, worker = setup
    good = _auth(control_token(SECRET))
    put_json(store, "runs/r1/eval/main-0123456789/prompts.json", {"prompts": ["1,2="]})
    ok = {"prompts_key": "runs/r1/eval/main-0123456789/prompts.json",
          "out_key": "runs/r1/eval/main-0123456789/v000000-completions.json", "n": 1, "max_new_tokens": 3}
    for field, key in (("out_key", "runs/r1/weights/v000001/manifest.json"), ("out_key", "runs/r1/control/rollout.json"),
                       ("prompts_key", "runs/other/step-000001/prompts.json"), ("out_key", "runs/r1/step-1/../x.json"),
                       ("out_key", "/runs/r1/step-000001/x.json"), ("prompts_key", "runs/r1/step-000001/p.bin"),
                       ("out_key", "runs/r1/eval//x.json")):
        res = client.post("/v1/rollout", json={**ok, field: key}, headers=good)
        assert res.status_code == 403 and field in res.json()["error"]["message"], (field, key)
    missing = client.post("/v1/rollout", json={**ok, "prompts_key": "runs/r1/step-000002/prompts.json"}, headers=good)
    assert missing.status_code == 404
    assert client.post("/v1/rollout", json=ok, headers=good).status_code == 200
    assert client.post("/v1/load", json={"version": 5}, headers=good).status_code == 404
    assert client.post("/v1/load", json={"version": 0}, headers=good).status_code == 422
    assert client.post("/v1/load", json={"version": 1, "extra": 1}, headers=good).status_code == 422
    assert client.post("/v1/load", json={"version": 1, "wait_s": -1}, headers=good).status_code == 422
    assert client.post("/v1/load", json={"version": 1, "wait_s": 3601}, headers=good).status_code == 422
    big = client.post("/v1/load", content=b" " * 5000, headers={**good, "content-type": "application/json"})
    assert big.status_code == 413
    assert worker.version == 0


def test_rollout_key_rule() -> None:
    assert check_rollout_key("r", "runs/r/step-000003/rollouts.json", "k") == "runs/r/step-000003/rollouts.json"
    for key in ("runs/r/step-3", "runs/r/eval/x.json/..", "runs/r/stepx-1/a.json", "runs/r/step-1/a\\b.json",
                "runs/r/step-1/a\0.json", 5, "", "runs/r2/step-1/a.json", "runs/r/step-1/" + "a" * 1100 + ".json"):
        with pytest.raises(ControlRefused) as info:
            check_rollout_key("r", key, "k")
        assert info.value.status == 403


def test_worker_holds_only_its_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker parses untrusted HTTP, so it is handed its control token and never the run secret
    (from which the trainer's RPC key and the checkpoint MAC key derive); no valid token, no worker."""
    from infra.rollout.errors import RolloutError
    from infra.rollout.guard import TOKEN_ENV, token_env, worker_token

    env = token_env(SECRET)
    assert list(env) == [TOKEN_ENV] and SECRET.hex() not in env[TOKEN_ENV]
    monkeypatch.setenv(TOKEN_ENV, env[TOKEN_ENV])
    assert worker_token() == control_token(SECRET)
    for bad in ("", "00" * 8, "zz" * 32):
        monkeypatch.setenv(TOKEN_ENV, bad)
        with pytest.raises(RolloutError, match=TOKEN_ENV):
            worker_token()
