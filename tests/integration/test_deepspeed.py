"""Each trainer engine trains a GRPO step on 2 real ranks (torchrun, gloo) and checkpoints exactly.

DeepSpeed ZeRO-1/2/3 (plus ZeRO-3 with CPU offload and bf16) and FSDP are compared against the
plain torch engine from the same initial weights on the same scored batch: the gradient norm must
agree, and so must the updated weights (Adam's first step is ``lr * sign(g)`` where gradients are
~0, so a few elements may differ by up to 2*lr; nearly all must match to 1e-6). Then a fresh group
restores the engine's checkpoint and exports bit-identical weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TINY = [
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
    "model.tiny.num_heads=2", "warmstart.steps=0", "trainer.checkpoint_every=1", "trainer.micro_batch=3",
    "trainer.lr=1e-3",
]


def _batch(store: Any, run_id: str) -> tuple[str, str]:
    """A scored batch in the store: 2 funcfit prompts x 4 completions with differing rewards."""
    from evals.funcfit import train_batch
    from infra.model import build_tokenizer
    from infra.storage import put_json, run_key

    tok = build_tokenizer()
    problems = train_batch(7, 1, 2, 6)
    texts = ["x*x+1\n", "3*x\n", "x+2\n", "2**x\n"]
    samples = []
    for pi in range(2):
        for t in texts:
            ids = tok(t, add_special_tokens=False)["input_ids"]
            samples.append({"prompt_index": pi, "text": t, "token_ids": ids, "logprobs": [-2.0] * len(ids),
                            "finish_reason": "stop", "version": 1})
    rk, sk = run_key(run_id, 1, "rollouts.json"), run_key(run_id, 1, "scores.json")
    put_json(store, rk, {"version": 1, "group_size": 4, "prompts": [p.prompt for p in problems], "samples": samples})
    put_json(store, sk, {"rewards": [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.25]})
    return rk, sk


def _train_one(tmp: Path, overrides: list[str]) -> dict[str, Any]:
    """Start a 2-rank group, train step 1, export; restore the checkpoint in a new group, export again."""
    from safetensors.torch import load_file

    from infra.config import load_config
    from infra.storage import open_store
    from infra.train.service import TrainerService

    cfg = load_config("configs/demo.yaml", [*TINY, *overrides, f"run_root={tmp}"])
    store = open_store(cfg.resolved_storage_root())
    run_id = "engine-test"
    rk, sk = _batch(store, run_id)
    with TrainerService(cfg, run_id, store, tmp / run_id) as svc:
        init = svc.call("init")
        svc.call("publish")
        svc.call("checkpoint", step=0)
        res = svc.call("train_step", step=1, rollouts_key=rk, scores_key=sk)
        svc.call("export", path=str(tmp / "after"))
    with TrainerService(cfg, run_id, store, tmp / run_id) as svc:
        svc.call("init")
        restored = svc.call("restore")
        svc.call("export", path=str(tmp / "restored"))
    return {"init": init, "result": res, "restored": restored,
            "after": load_file(str(tmp / "after" / "model.safetensors")),
            "again": load_file(str(tmp / "restored" / "model.safetensors"))}


@pytest.fixture(scope="module")
def torch_ref(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train_one(tmp_path_factory.mktemp("torch"), ["trainer.engine=torch"])


ENGINES = {
    "zero1": ["trainer.engine=deepspeed", "trainer.zero_stage=1"],
    "zero2": ["trainer.engine=deepspeed", "trainer.zero_stage=2"],
    "zero3": ["trainer.engine=deepspeed", "trainer.zero_stage=3"],
    "fsdp": ["trainer.engine=fsdp"],
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_engine_trains_like_torch_and_restores_exactly(name: str, torch_ref: dict[str, Any], tmp_path: Path) -> None:
    import torch

    got = _train_one(tmp_path, ENGINES[name])
    assert got["init"]["world_size"] == 2
    assert got["result"]["publish"]["version"] == 2
    g_ref = torch_ref["result"]["metrics"]["grad_norm"]
    g = got["result"]["metrics"]["grad_norm"]
    assert g > 0 and abs(g - g_ref) <= 1e-4 * g_ref, (g, g_ref)
    lr = 1e-3
    for k, ref in torch_ref["after"].items():
        diff = (got["after"][k] - ref).abs()
        assert float(diff.max()) <= 2 * lr + 1e-6, k
        assert float((diff <= 1e-6).float().mean()) >= 0.99, k
    assert got["restored"] == {"step": 1, "weights_version": 2}
    for k, t in got["after"].items():
        assert torch.equal(t, got["again"][k]), f"{name}: restored weights differ at {k}"


def test_zero3_offload_bf16_trains(tmp_path: Path) -> None:
    got = _train_one(tmp_path, ["trainer.engine=deepspeed", "trainer.zero_stage=3", "trainer.offload_optimizer=true",
                                "trainer.offload_params=true", "trainer.bf16=true", "trainer.activation_checkpointing=true"])
    g = got["result"]["metrics"]["grad_norm"]
    assert g > 0 and g == g  # finite, non-zero
    assert got["restored"]["step"] == 1


@pytest.mark.parametrize("engine", [["trainer.engine=torch"], ["trainer.engine=deepspeed", "trainer.zero_stage=2"]],
                         ids=["torch", "zero2"])
def test_lora_publishes_adapters_only(engine: list[str], tmp_path: Path) -> None:
    """With LoRA, versions hold only the adapter factors; the export is a plain merged model."""
    from infra.storage import open_store
    from infra.train.lora import is_adapter_state
    from infra.weightsync import VersionReader

    got = _train_one(tmp_path, [*engine, "trainer.lora.enabled=true", "trainer.lora.rank=4"])
    assert got["init"]["trainable_params"] < got["init"]["params"] / 5
    assert got["result"]["metrics"]["grad_norm"] > 0
    store = open_store(f"file://{tmp_path}/store")
    v1, _ = VersionReader(store, "runs/engine-test/weights").fetch(1)
    v2, _ = VersionReader(store, "runs/engine-test/weights").fetch(2)
    assert is_adapter_state(v2) and set(v1) == set(v2)
    assert any(not (v1[k] == v2[k]).all() for k in v2)  # the adapters trained
    assert not any("lora" in k for k in got["after"])  # export merged the adapters into plain weights
    assert set(got["after"]) == set(got["again"])
