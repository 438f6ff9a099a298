"""VLLMEngine: the ``vllm`` rollout backend (GPU), vLLM's offline ``LLM`` engine behind our protocol.

Selected by ``rollout.type: vllm`` (listed in :data:`infra.rollout.ENGINES`). vLLM itself is
imported only when an engine is built, so configs, ``--help`` and CPU-only installs never need it.

- Start-up: the worker's Hugging Face model and tokenizer are written to a temporary folder
  (:func:`infra.model.save_hf`) and vLLM loads that (same architecture, same weights, any model
  vLLM supports).
- Weights in place: :meth:`load_weights` hands the published tensors (HF parameter names) to the
  vLLM model's own ``load_weights`` inside the worker (``LLM.apply_model``; older vLLM: the driver
  worker's model runner), so a new version needs no restart and no re-allocation of the KV cache.
  The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tensors are not
  pickled across processes. The prefix cache is reset after a load (cached KV of the old weights
  must not be reused).
- Sampling: one vLLM request per (prompt, sample) with ``seed = row_seed(params.seed, i, j)``,
  the same per-row stream contract as the local engine (the streams differ, the property holds:
  results do not depend on batch composition). Log-probs are the sampled tokens' log-probs after
  temperature (``logprobs_mode="processed_logprobs"`` where vLLM supports it).
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

from infra.rollout.engine import Completion, SamplingParams, check_request, encode_prompts
from infra.rollout.local import row_seed


class VLLMEngine:
    """vLLM offline engine serving one policy version at a time."""

    def __init__(self, model: Any, tokenizer: Any, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, dtype: str = "auto", seed: int = 0) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        from vllm import LLM

        from infra.model import save_hf

        self.tokenizer = tokenizer
        self.version = 0
        self._lock = threading.Lock()
        self._dir = tempfile.TemporaryDirectory(prefix="deltaloop-vllm-")
        save_hf(model, tokenizer, self._dir.name)
        kwargs: dict[str, Any] = {"model": self._dir.name, "dtype": dtype, "seed": seed,
                                  "gpu_memory_utilization": gpu_memory_utilization, "enable_prefix_caching": True}
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        try:
            self.llm = LLM(logprobs_mode="processed_logprobs", **kwargs)
        except TypeError:  # vLLM before logprobs_mode: raw log-probs (equal at temperature 1)
            self.llm = LLM(**kwargs)

    # ------------------------------------------------------------------ weights
    def load_weights(self, tensors: dict, version: int) -> None:
        """Load published tensors into the running vLLM model in place; record ``version``."""
        items = list(tensors.items())

        def _load(model: Any) -> None:
            model.load_weights(weights=iter(items))

        with self._lock:
            if hasattr(self.llm, "apply_model"):
                self.llm.apply_model(_load)
            else:  # vLLM 0.6-0.8 (V0 engine)
                _load(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
            reset = getattr(self.llm, "reset_prefix_cache", None)
            if reset is not None:
                reset()
            self.version = version

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` completions per prompt, grouped by prompt."""
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), n, params)

    def generate_ids(self, prompt_ids: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """Like :meth:`generate` for token-id prompts."""
        from vllm import SamplingParams as VSP

        check_request(prompt_ids, n, len(self.tokenizer))  # refused before vLLM sees it
        reqs, sps, index = [], [], []
        for i, ids in enumerate(prompt_ids):
            for j in range(n):
                reqs.append({"prompt_token_ids": list(ids)})
                sps.append(VSP(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature,
                               top_p=params.top_p, stop=list(params.stop), seed=row_seed(params.seed, i, j),
                               logprobs=0, include_stop_str_in_output=False, skip_special_tokens=True))
                index.append(i)
        with self._lock:
            version = self.version
            outs = self.llm.generate(reqs, sampling_params=sps, use_tqdm=False)
        comps = []
        for i, out in zip(index, outs):
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, o.logprobs or [])] if o.logprobs else []
            comps.append(Completion(prompt_index=i, text=o.text, token_ids=ids, logprobs=lps,
                                    finish_reason="stop" if o.finish_reason == "stop" else "length", version=version))
        return comps

    def greedy(self, prompts: list[str], max_new_tokens: int, stop: list[str] | None = None) -> list[str]:
        """Greedy completions' text (evaluation path)."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop or ["\n"])
        return [c.text for c in self.generate(prompts, 1, params)]
