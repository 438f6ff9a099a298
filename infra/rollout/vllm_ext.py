"""deltaloop's code inside vLLM's model worker: weight versions applied in place, and a digest of
what the model really computes with.

vLLM runs its model in an engine-core process of its own (``AsyncLLM``); this class is mixed into
that process's worker through vLLM's ``worker_extension_cls`` and its methods are called with
``collective_rpc`` from the rollout worker (:mod:`infra.rollout.vllm_engine`). Only keys, versions
and small dicts cross the process boundary: the weight reader lives here, next to the model, so a
version travels store → this process → the model, never through a pickle of the tensors.

Applying a version (:meth:`WeightSyncExtension.deltaloop_load`): the published tensors (Hugging
Face names, bf16) are patched in place by the delta reader, then handed to vLLM's own in-place
reload (``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``). That entry
point matters on vLLM's CPU build: after loading, every linear layer's weight is *repacked* into a
oneDNN / SGL kernel layout held by a closure (``layer.cpu_linear``) and the parameter itself is
replaced by an empty tensor. Copying into parameters (``model.load_weights`` alone, or
``param.copy_``) then either fails on the empty tensor or, for the tied LM head whose parameter is
kept, silently leaves the kernel computing with the old weights. ``reload_weights`` restores the
checkpoint-layout parameters, loads, and runs each layer's ``process_weights_after_loading`` again,
so the repacked copies are rebuilt from the new bits. The prefix cache is reset by the caller.

The digest (:meth:`WeightSyncExtension.deltaloop_digest`) is taken from what the kernels compute,
not from the parameters (which on CPU are empty): each linear layer is run on an identity matrix,
``I @ W.T`` — exact in bf16, since every output is one product with 1 — and the rows of fused layers
(``qkv_proj``, ``gate_up_proj``) are split back into the Hugging Face tensors they were packed
from. Per tensor, sha256 over dtype, shape and bytes, keyed by Hugging Face name
(:func:`infra.rollout.digest.tensor_digest`), so the trainer side computes the same digests from
the published tensors. Cost: one matmul per linear layer against an identity of its input width,
about 2 × (input width) × (parameters) FLOPs — a diagnostic, not a per-step check.
"""

from __future__ import annotations

import time
from typing import Any

from infra.rollout.digest import tensor_digest

_PROBE_ROWS = 4096  # identity rows per probe call: bounds the probe's activation memory


class WeightSyncExtension:
    """Methods added to vLLM's worker; state lives on the worker instance (``self``)."""

    def deltaloop_attach(self, store: dict[str, Any], prefix: str, threads: int, max_bytes: int) -> None:
        """Open the run's object store and a weight reader for ``prefix`` in this process."""
        from infra.storage import open_store
        from infra.weightsync import VersionReader

        self._dl_reader = VersionReader(open_store(**store), prefix, threads=threads, max_bytes=max_bytes)
        self._dl_tensors: dict[str, Any] | None = None
        self._dl_version = 0

    def deltaloop_load(self, target: int) -> dict[str, Any]:
        """Fetch ``target`` (delta from the held version when possible) and reload it in place.

        Returns ``{"version", "applied", "seconds", "fetch_seconds"}``, or, when the version cannot
        be fetched and verified, ``applied: False`` with ``error`` and ``retryable`` (the served
        weights are untouched: nothing is handed to vLLM before the fetch verified)."""
        from infra.errors import DeltaloopError

        started = time.perf_counter()
        have = self._dl_tensors
        try:
            tensors, got = self._dl_reader.fetch(target=target, have=have,
                                                 have_version=self._dl_version if have is not None else None,
                                                 inplace=True)
        except DeltaloopError as exc:  # corrupt, missing, unreachable: the held copy may be half-patched
            self._dl_tensors = None
            return {"version": self._dl_version, "applied": False, "error": str(exc),
                    "retryable": bool(getattr(exc, "retryable", False)),
                    "seconds": time.perf_counter() - started}
        except BaseException:
            self._dl_tensors = None
            raise
        fetched = time.perf_counter()
        self.reload_weights(weights_iterator=iter(list(tensors.items())), is_checkpoint_format=True)  # type: ignore[attr-defined]
        self._dl_tensors = tensors
        self._dl_version = got
        return {"version": got, "applied": True, "seconds": time.perf_counter() - started,
                "fetch_seconds": fetched - started}

    def deltaloop_digest(self) -> dict[str, Any]:
        """Per-tensor digests of the weights the model computes with, keyed by Hugging Face name."""
        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.inference_mode():
            digests = _served_digests(model)
        return {"version": self._dl_version, "tensors": digests}


def _served_digests(model: Any) -> dict[str, str]:
    """Digests of every weight ``model`` serves: linear layers by identity probe, the rest (norms,
    embeddings) from their parameters. A tied LM head is probed too, and reported under its own
    name when its kernel disagrees with the embedding it is tied to."""
    import torch

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, str] = {}
    handled: set[str] = set()  # modules whose weights are digested above the parameter loop
    for mod_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if method is None or not hasattr(method, "apply") or weight is None:
            continue
        is_embedding = hasattr(module, "org_vocab_size")
        if is_embedding and weight.numel():
            # the embedding lookup reads the parameter itself
            rows = int(module.org_vocab_size)
            out[f"{mod_name}.weight"] = tensor_digest(weight[:rows])
        effective = _probe(module, method)
        if effective is None:
            continue
        if is_embedding:
            effective = effective[: int(module.org_vocab_size)]
            name = f"{mod_name}.weight"
            if name in out:  # tied head: its kernel must compute with the embedding's bits
                if tensor_digest(effective) != out[name]:
                    out[f"{mod_name}.lm_head_kernel"] = tensor_digest(effective)
                continue
            out[name] = tensor_digest(effective)
            handled.add(mod_name)
            continue
        leaf = mod_name.rsplit(".", 1)[-1]
        sizes = getattr(module, "output_sizes", None)
        if leaf in packed and sizes and len(sizes) == len(packed[leaf]):
            base = mod_name[: -len(leaf)]
            for part, rows in zip(packed[leaf], torch.split(effective, list(sizes), dim=0)):
                out[f"{base}{part}.weight"] = tensor_digest(rows)
        else:
            out[f"{mod_name}.weight"] = tensor_digest(effective)
        handled.add(mod_name)
        bias = getattr(module, "bias", None)
        if bias is not None and bias.numel():
            out[f"{mod_name}.bias"] = tensor_digest(bias)
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[0] not in handled and name not in out and param.numel():
            out[name] = tensor_digest(param)
    return out


def _probe(module: Any, method: Any) -> Any:
    """The ``[out, in]`` weight a linear layer's kernel computes with (``I @ W.T``, transposed), or
    None when the layer has no 2-D input size to probe."""
    import torch

    weight = getattr(module, "weight", None)
    k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
    if k is None and weight is not None and weight.ndim == 2 and weight.numel():
        k = weight.shape[1]
    if not k:
        return None
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.bfloat16
    device = weight.device if weight is not None else "cpu"
    cols = []
    for start in range(0, int(k), _PROBE_ROWS):
        stop = min(int(k), start + _PROBE_ROWS)
        eye = torch.zeros(stop - start, int(k), dtype=dtype, device=device)
        eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
        cols.append(method.apply(module, eye, None) if _takes_bias(method) else method.apply(module, eye))
    return torch.cat(cols, dim=0).t().contiguous()


def _takes_bias(method: Any) -> bool:
    import inspect

    try:
        return "bias" in inspect.signature(method.apply).parameters
    except (TypeError, ValueError):
        return False
