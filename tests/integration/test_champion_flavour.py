"""Registered policies carry MLflow's transformers flavour: ``mlflow.pyfunc.load_model`` and
``mlflow models serve`` of ``models:/deltaloop-policy@champion`` work, with nothing from a hub, and
:meth:`Registry.download` still returns a Hugging Face folder the pipeline loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.champion import register_policies
from infra.model import load_policy
from infra.config import ModelConfig
from infra.proc import free_port
from infra.registry import Registry

URI = "models:/deltaloop-policy@champion"


@pytest.fixture()
def champion(tmp_path: Path) -> tuple[str, Registry, list[str]]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    versions = register_policies(uri, tmp_path)
    reg = Registry(uri, "deltaloop-policy")
    reg.point("champion", versions[0])
    return uri, reg, versions


def test_pyfunc_loads_the_champion_and_download_is_a_hf_folder(champion: tuple[str, Registry, list[str]],
                                                                tmp_path: Path) -> None:
    import mlflow.pyfunc

    uri, reg, versions = champion
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(URI)
        out = model.predict(["f(x)="], params={"max_new_tokens": 4})
    finally:
        mlflow.set_tracking_uri("")
        mlflow.set_registry_uri("")
    assert model.metadata.flavors["transformers"]["task"] == "text-generation"
    assert len(out) == 1 and str(out[0]).startswith("f(x)=") and len(str(out[0])) > len("f(x)=")
    folder = Path(reg.download("champion", tmp_path / "dl"))
    assert folder.name == "model" and (folder / "model.safetensors").is_file()
    assert not list(folder.parent.rglob("*.safetensors"))[1:]  # the weights are stored once
    loaded, tok = load_policy(ModelConfig(), folder=folder)
    assert loaded.config.architectures == ["LlamaForCausalLM"] and len(tok) > 0


@pytest.mark.slow
def test_mlflow_models_serve_answers_an_invocation(champion: tuple[str, Registry, list[str]], tmp_path: Path) -> None:
    uri, _, _ = champion
    port = free_port()
    venv_bin = str(Path(sys.executable).parent)  # mlflow execs uvicorn from PATH, as in an activated venv
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_REGISTRY_URI": uri, "HF_HUB_OFFLINE": "1",
           "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}
    log = open(tmp_path / "serve.log", "w")
    mlflow_bin = str(Path(venv_bin) / "mlflow")
    proc = subprocess.Popen([mlflow_bin, "models", "serve", "-m", URI, "--env-manager", "local", "-h", "127.0.0.1",
                             "-p", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        body = json.dumps({"inputs": ["f(x)="], "params": {"max_new_tokens": 4}}).encode()
        deadline, answer = time.time() + 240, None
        while answer is None:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    answer = json.loads(resp.read())
            except OSError:
                time.sleep(1)
        preds = answer["predictions"]
        assert len(preds) == 1 and str(preds[0]).startswith("f(x)=")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(30)
        log.close()
