"""``rollout.type: vllm`` for real, on this CPU: vLLM's CPU build in its own environment (.venv-vllm,
made by scripts/setup.sh), the rollout worker under that interpreter, versions applied in place.

What is checked against the real worker process: each published version is served bit-identically
(digests taken inside vLLM's model process, from what its kernels compute), with no restart; the
log-probs it returns match the trainer's teacher-forced pass; vLLM's own OpenAI server answers the
OpenAI client; its non-OpenAI write endpoints take the control token. Then the flow end to end, and
a broken vLLM environment refused at provision before any trainer rank starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from infra.config import RunConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer, load_published_state, publishable_state  # noqa: E402
from infra.rollout.digest import state_digests  # noqa: E402
from infra.rollout.engine import Completion  # noqa: E402
from infra.rollout.guard import control_token  # noqa: E402
from infra.rollout.service import RolloutService  # noqa: E402
from infra.rollout.vllm_env import check_vllm_python, vllm_python  # noqa: E402
from infra.storage import get_json, open_store, put_json, run_key  # noqa: E402
from infra.weightsync import VersionPublisher  # noqa: E402
from tests.flow_helpers import REPO, cli, run_env  # noqa: E402

pytestmark = pytest.mark.slow
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}
RUN = "vllmrun"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One vLLM rollout worker (the real process, vLLM's interpreter) and the run's store."""
    check_vllm_python(vllm_python())  # the environment scripts/setup.sh makes: fail loudly, never skip
    root = tmp_path_factory.mktemp("vllm")
    cfg = RunConfig.model_validate({"model": {"tiny": TINY}, "rollout": {"type": "vllm", "start_timeout_s": 600}})
    store = open_store(str(root / "store"))
    service = RolloutService(cfg, RUN, store, root / "run")
    service.start()
    tok = build_tokenizer()
    model = build_tiny_model(cfg.model.tiny, tok, seed=cfg.seed)  # what the worker built from the same seed
    try:
        yield {"service": service, "store": store, "model": model, "tok": tok,
               "publisher": VersionPublisher(store, run_key(RUN, None, "weights"))}
    finally:
        service.close()


def _digest(service: RolloutService) -> dict[str, Any]:
    token = control_token(service._secret)
    resp = httpx.post(service.url + "/v1/weights/digest", headers={"Authorization": f"Bearer {token}"}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_versions_applied_in_place_and_served_bit_identical(worker: dict[str, Any]) -> None:
    service, model = worker["service"], worker["model"]
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        if step:  # a training-like step: every weight moves a little
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-2 * p.abs().mean())
        published = publishable_state(model)
        version = worker["publisher"].publish(published).version
        answer = service.load(version)
        assert answer["applied"] is True and answer["version"] == version
        served = _digest(service)
        want = state_digests(published)
        assert served["version"] == version
        assert served["tensors"] == want  # every tensor, bit for bit, as vLLM's kernels compute with it
    assert service.restarts == 0 and service.version() == 3


def test_rollout_logprobs_match_the_trainer(worker: dict[str, Any]) -> None:
    service, store, tok = worker["service"], worker["store"], worker["tok"]
    prompts = ["1,2,3=", "f(4)=", "7,8,9,10="]
    put_json(store, run_key(RUN, 1, "prompts.json"), {"prompts": prompts})
    info = service.rollout(run_key(RUN, 1, "prompts.json"), run_key(RUN, 1, "rollouts.json"), n=4,
                           temperature=0.8, max_new_tokens=12, seed=3)
    doc = get_json(store, run_key(RUN, 1, "rollouts.json"))
    assert info["samples"] == 12 and doc["version"] == service.version()
    for s in doc["samples"]:  # stop rules as with the local engine: text cut before the stop string,
        assert "\n" not in s["text"] and len(s["token_ids"]) <= 12  # the completing token kept in token_ids
        if s["finish_reason"] == "stop":
            assert "\n" in tok.decode(s["token_ids"]) or s["token_ids"][-1] == tok.eos_token_id
    comps = [Completion(**{k: s[k] for k in ("prompt_index", "text", "token_ids", "logprobs", "finish_reason")})
             for s in doc["samples"]]
    from infra.train.grpo import build_batch, token_logprobs

    served = worker["model"]
    load_published_state(served, publishable_state(served))  # the bf16 bits the worker serves
    batch = build_batch(tok, prompts, comps, [0.0] * len(comps))
    with torch.inference_mode():
        lp, _ = token_logprobs(served, batch["input_ids"], batch["attention_mask"], 0.8)
    err = (lp - batch["old_logprobs"]).abs()[batch["completion_mask"].bool()]
    assert err.numel() >= 12
    assert float(err.mean()) <= 0.02 and float(err.quantile(0.99)) <= 0.1  # bf16 serving vs fp32 teacher pass

    again = service.rollout(run_key(RUN, 1, "prompts.json"), run_key(RUN, 1, "again.json"), n=4,
                            temperature=0.8, max_new_tokens=12, seed=3)
    assert again["samples"] == 12
    assert [s["token_ids"] for s in get_json(store, run_key(RUN, 1, "again.json"))["samples"]] == \
        [s["token_ids"] for s in doc["samples"]]  # seeded per row: the same request samples the same tokens


def test_openai_client_is_answered_by_vllms_server(worker: dict[str, Any]) -> None:
    service = worker["service"]
    client = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
    comp = client.completions.create(model="policy", prompt="1,2,3=", max_tokens=6, temperature=0.0)
    assert comp.usage.completion_tokens >= 1 and comp.model == "policy"
    chat = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "4,5="}],
                                          max_tokens=6, temperature=0.7, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == ["policy"]
    version = httpx.get(service.url + "/version", timeout=30).json()  # vLLM's own server answers this path
    assert "version" in version and not str(version["version"]).startswith("v")
    for path in ("/v1/weights/digest", "/tokenize", "/v1/load"):  # default deny outside the OpenAI API
        assert httpx.post(service.url + path, json={}, timeout=30).status_code == 401, path


@pytest.fixture(scope="module", autouse=True)
def vllm_flow(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Path] | None]:
    """The flow run of :func:`test_flow_with_vllm_rollouts`, started when this module starts: its
    vLLM worker starts up (~100 s on 2 CPUs) while the tests of the ``worker`` fixture run. None
    when that test is not selected (nothing is started)."""
    if not any(item.name == "test_flow_with_vllm_rollouts" for item in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("vllmflow")
    log = (root / "cli.log").open("wb")
    proc = subprocess.Popen(cli(root / "runs", "sync", "--set", "rollout.type=vllm", "--set", "trainer.steps=3",
                                "--set", "rollout.start_timeout_s=600"),
                            cwd=REPO, env=run_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, root
    finally:
        log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_flow_with_vllm_rollouts(vllm_flow: tuple[subprocess.Popen, Path] | None) -> None:
    assert vllm_flow is not None  # (the fixture starts the run whenever this test is selected)
    proc, tmp_path = vllm_flow
    proc.wait(timeout=900)
    assert proc.returncode == 0, (tmp_path / "cli.log").read_text(errors="replace")[-4000:]
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["steps"] == 3 and summary["final_weight_version"] == 4
    run = tmp_path / "runs" / "store" / "runs" / summary["run_id"]
    # sync mode: step k samples from version k, published by step k-1 and applied in place
    served = [json.loads((run / f"step-{k:06d}" / "rollouts.json").read_text())["version"] for k in (1, 2, 3)]
    assert served == [1, 2, 3]
    log = next((tmp_path / "runs").glob("*/logs/rollout.log")).read_text(errors="replace")
    assert "EngineCore" in log  # vLLM's engine core served the rollouts


def test_broken_vllm_environment_is_refused_before_training(tmp_path: Path) -> None:
    proc = subprocess.run(cli(tmp_path / "runs", "sync", "--set", "rollout.type=vllm",
                              "--set", f"rollout.vllm_python={sys.executable}"),
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert sys.executable in proc.stderr and "No module named 'vllm'" in proc.stderr
    assert "trainer up" not in proc.stdout + proc.stderr
