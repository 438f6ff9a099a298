"""The MLflow model registry: versions with lineage tags, and the ``champion`` alias.

A promoted policy is logged as the ``model`` artifact of the MLflow run in MLflow's
``transformers`` flavour (:func:`save_mlflow_model`: ``MLmodel``, ``model/`` = a complete Hugging
Face safetensors folder, ``components/tokenizer/``, pinned requirements), and registered as a model
version whose tags carry its lineage (run, step, weight version, eval scores, sandbox image, config
hash) and its gate decision. Aliases (MLflow 3) mark the champion; the previous champion is
remembered in a tag so ``rollback`` can restore it.

Loading the champion needs nothing from deltaloop:
``mlflow.pyfunc.load_model("models:/NAME@champion")`` (a ``text-generation`` pipeline; ``mlflow
models serve -m models:/NAME@champion`` serves it), or
``mlflow.artifacts.download_artifacts("models:/NAME@champion")`` then
``AutoModelForCausalLM.from_pretrained(folder + "/model")``. The weights are stored once: the
flavour's ``model/`` folder is what :meth:`Registry.download` returns. Versions registered before
the flavour (a bare Hugging Face folder) download as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREVIOUS_TAG = "deltaloop.previous_champion"
FLAVOUR_TASK = "text-generation"
# generation settings a pyfunc / ``mlflow models serve`` caller may pass as ``params`` (and defaults)
PYFUNC_PARAMS: dict[str, Any] = {"max_new_tokens": 64, "do_sample": False, "temperature": 1.0, "top_p": 1.0}


def save_mlflow_model(hf_folder: str | Path, dst: str | Path, card: str = "") -> Path:
    """Write ``hf_folder`` (an exported safetensors policy) as an MLflow ``transformers`` model at ``dst``.

    The model is opened from local files only (safetensors, no remote code) and saved once, by
    MLflow, under ``dst/model``; the tokenizer is written there too, so that folder alone opens with
    ``from_pretrained``. Requirements are pinned to this environment (no inference run) and the
    model card is ``card``, so nothing is fetched from a hub. (MLflow 3.17's save from a checkpoint
    *path* fails under transformers 5, hence the pipeline object.)
    """
    import mlflow
    import mlflow.transformers
    import tokenizers
    import torch
    import transformers
    from huggingface_hub import ModelCard
    from mlflow.models import infer_signature

    src, out = str(hf_folder), Path(dst)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src, local_files_only=True, trust_remote_code=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, local_files_only=True, dtype="auto", use_safetensors=True, trust_remote_code=False)
    pipe = transformers.pipeline(FLAVOUR_TASK, model=model, tokenizer=tokenizer)
    reqs = [f"mlflow=={mlflow.__version__}", f"transformers=={transformers.__version__}",
            f"tokenizers=={tokenizers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
    signature = infer_signature(["text"], ["text"], params=PYFUNC_PARAMS)
    model_card = ModelCard(f"---\nlibrary_name: transformers\n---\n{card or 'deltaloop policy'}\n")
    mlflow.transformers.save_model(pipe, str(out), signature=signature, pip_requirements=reqs, model_card=model_card)
    tokenizer.save_pretrained(str(out / "model"))
    return out


def hf_folder(downloaded: str | Path) -> Path:
    """The Hugging Face folder inside a downloaded version: ``model/`` of the MLflow flavour, or
    the folder itself for a version registered as a bare Hugging Face folder."""
    path = Path(downloaded)
    inner = path / "model"
    return inner if (path / "MLmodel").is_file() and (inner / "config.json").is_file() else path


@dataclass
class VersionInfo:
    """A registered version and the tags deltaloop reads back."""

    name: str
    version: str
    tags: dict[str, str]
    run_id: str | None

    def score(self, key: str = "eval_score") -> float | None:
        """A float tag (e.g. the eval score recorded at registration)."""
        raw = self.tags.get(key)
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None


class Registry:
    """Registry operations on one registered model name."""

    def __init__(self, tracking_uri: str, name: str) -> None:
        from mlflow.tracking import MlflowClient

        self.name = name
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(
                self.name, description="Policies trained by deltaloop (GRPO); alias 'champion' is production."
            )

    def register(self, run_id: str, artifact_path: str, tags: dict[str, Any]) -> VersionInfo:
        """Register ``runs:/RUN/ARTIFACT_PATH`` as a new version with ``tags``."""
        self._ensure_model()
        source = f"runs:/{run_id}/{artifact_path}"
        mv = self.client.create_model_version(
            self.name, source=source, run_id=run_id, tags={k: str(v) for k, v in tags.items()}
        )
        return VersionInfo(self.name, str(mv.version), dict(mv.tags or {}), run_id)

    def get(self, version: str | int) -> VersionInfo:
        """A version by number."""
        mv = self.client.get_model_version(self.name, str(version))
        return VersionInfo(self.name, str(mv.version), dict(mv.tags or {}), mv.run_id)

    def alias(self, alias: str) -> VersionInfo | None:
        """The version an alias points to, or None."""
        from mlflow.exceptions import MlflowException

        try:
            mv = self.client.get_model_version_by_alias(self.name, alias)
        except MlflowException:
            return None
        return VersionInfo(self.name, str(mv.version), dict(mv.tags or {}), mv.run_id)

    def set_tags(self, version: str | int, tags: dict[str, Any]) -> None:
        """Add or replace tags on a version."""
        for k, v in tags.items():
            self.client.set_model_version_tag(self.name, str(version), k, str(v))

    def point(self, alias: str, version: str | int) -> str | None:
        """Move ``alias`` to ``version``; remember and return the version it pointed to before."""
        previous = self.alias(alias)
        self.client.set_registered_model_alias(self.name, alias, str(version))
        if previous is not None and previous.version != str(version):
            self.client.set_model_version_tag(self.name, str(version), PREVIOUS_TAG, previous.version)
            return previous.version
        return None

    def rollback(self, alias: str) -> tuple[str, str]:
        """Re-point ``alias`` to the champion before the current one. Returns (from, to)."""
        current = self.alias(alias)
        if current is None:
            raise LookupError(f"model {self.name!r} has no alias {alias!r} to roll back")
        prev = current.tags.get(PREVIOUS_TAG)
        if not prev:
            raise LookupError(f"{self.name} v{current.version} has no previous {alias} recorded")
        self.client.set_registered_model_alias(self.name, alias, prev)
        self.client.set_model_version_tag(self.name, current.version, "deltaloop.status", "rolled_back")
        return current.version, prev

    def download(self, ref: str, dst: str | Path) -> str:
        """Download a version and return its Hugging Face folder (:func:`hf_folder`). ``ref``: an
        alias, a version number or a models:/ URI."""
        import mlflow.artifacts

        if ref.startswith("models:/"):
            body = ref[len("models:/"):]
            name, _, sel = body.partition("@") if "@" in body else body.partition("/")
            if name != self.name:
                return Registry(self.tracking_uri, name).download(sel, dst)
            ref = sel
        info = self.get(ref) if ref.isdigit() else self.alias(ref)
        if info is None:
            raise LookupError(f"model {self.name!r} has no alias {ref!r}")
        mv = self.client.get_model_version(self.name, info.version)
        Path(dst).mkdir(parents=True, exist_ok=True)
        if mv.source.startswith("runs:/"):
            run_id, _, path = mv.source[len("runs:/"):].partition("/")
            return str(hf_folder(self.client.download_artifacts(run_id, path, str(dst))))
        return str(hf_folder(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst),
                                                                 tracking_uri=self.tracking_uri)))

    def versions(self) -> list[VersionInfo]:
        """All versions, newest first."""
        found = self.client.search_model_versions(f"name='{self.name}'")
        out = [VersionInfo(self.name, str(m.version), dict(m.tags or {}), m.run_id) for m in found]
        return sorted(out, key=lambda v: int(v.version), reverse=True)
