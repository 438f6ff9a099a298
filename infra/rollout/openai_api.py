"""OpenAI-compatible HTTP API over a rollout engine: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``.

Why: agent harnesses and multi-turn environments already speak the OpenAI protocol; serving it from
the rollout worker lets them drive the *policy being trained* (current weight version, shared
continuous batch) with the official ``openai`` client and no adapter.

What is supported: ``model`` (must be the served name), ``prompt`` (string, list of strings, token
ids or lists of token ids), ``messages``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``logprobs`` (the sampled token's log-prob;
``top_logprobs`` alternatives are returned empty) and ``stream`` (the finished completion is sent
as one SSE chunk, then ``[DONE]``). ``usage`` counts prompt and completion tokens.

Refused with 400 (OpenAI's ``{"error": {"message", "type", "param", "code"}}``): unknown request
fields, as OpenAI itself answers "Unrecognized request argument supplied" (a client that sends
``tools`` or ``logit_bias`` must learn they are not applied, not get a silently different sample);
OpenAI fields this server does not implement are accepted only at their neutral value
(``frequency_penalty: 0``, ``logit_bias: {}``, ``tools: []``...), and bookkeeping fields (``user``,
``stream_options``, ``metadata``, ``store``...) are accepted and ignored. Fields of a chat message
other than ``role``/``content``/``name`` are ignored (histories replayed from OpenAI carry many).
Also 400: token ids outside the vocabulary, more than :class:`ApiLimits` allows (prompts x n,
``max_tokens``, number and length of ``stop`` strings), a body that is not JSON or not the schema;
413: a body over ``max_body_bytes``. Every check runs before the request joins the batch; a request
that fails inside the engine anyway gets 500 and only it fails (:mod:`infra.rollout.local`).

RL extensions (extra response fields, ignored by clients that do not know them): every choice
carries ``token_ids`` and ``token_logprobs`` and the response carries ``prompt_token_ids`` per
choice and ``weight_version``; ``system_fingerprint`` is ``"v<version>"``. A multi-turn environment
can therefore rebuild exactly what was sampled, under which policy version, for training.

Chat formatting: the tokenizer's chat template when it has one; otherwise a plain-text template
(``System: ...`` / ``User: ...`` / ``Assistant:`` lines) whose turn headers are also stop strings.
Requests run concurrently (FastAPI's thread pool) and join the engine's continuous batch.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from infra.errors import DeltaloopError
from infra.rollout.errors import BadRequest, RequestFailed
from infra.rollout.guard import error_body

if TYPE_CHECKING:
    from infra.config import RolloutConfig

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
PLAIN_STOPS = ["\nUser:", "\nSystem:", "\nTool:"]
DEFAULT_MAX_TOKENS = 256


def plain_chat_template() -> str:
    """The plain chat rendering (``Role: content`` lines, then ``Assistant:``) as a Jinja chat
    template, for servers that need one (vLLM's) when the tokenizer has none: the same text
    :meth:`OpenAIFrontend.render_chat` builds, bos first."""
    roles = "{" + ", ".join(f"'{k}': '{v}'" for k, v in PLAIN_ROLES.items()) + "}"
    return ("{{ bos_token or '' }}{% set roles = " + roles + " %}{% for m in messages %}"
            "{{ roles.get(m['role'], m['role'] | capitalize) }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")
# OpenAI request fields that change nothing here and are accepted (and ignored) with any value
IGNORED_FIELDS = frozenset({"user", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls",
                            "prediction", "modalities", "reasoning_effort"})
# OpenAI request fields this server does not implement: accepted only at these neutral values
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None, {}),
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}


@dataclass(frozen=True)
class ApiLimits:
    """Caps on one OpenAI request (config: ``rollout.max_*``); above them the request gets 400
    (413 for the body) before it reaches the engine."""

    max_body_bytes: int = 4 << 20
    max_rows: int = 1024  # prompts x n
    max_tokens: int = 4096  # max_tokens / max_completion_tokens
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 128  # characters of one stop string

    @classmethod
    def of(cls, cfg: "RolloutConfig") -> "ApiLimits":
        """The limits a rollout config sets."""
        return cls(max_body_bytes=cfg.max_body_bytes, max_rows=cfg.max_request_rows,
                   max_tokens=cfg.max_request_tokens, max_stop=cfg.max_stop, max_stop_chars=cfg.max_stop_chars)


class TokenEngine(Protocol):
    """What the API needs from an engine: token-level generation and the served version."""

    version: int
    tokenizer: Any

    def generate_ids(self, prompt_ids: list[list[int]], n: int, params: Any) -> list[Any]:
        ...


# ----------------------------------------------------------------------------- request schemas
class _Req(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are kept to be refused by name

    model: str
    max_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=256)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class CompletionRequest(_Req):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    """One chat turn. ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")
        return self.content or ""


class ChatRequest(_Req):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# ----------------------------------------------------------------------------- response schemas
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class _ChoiceBase(BaseModel):
    """Fields every choice carries, completions and chat alike: OpenAI's ``index`` and
    ``finish_reason`` plus the RL extension (the sampled token ids, their log-probs under the
    serving policy, and the prompt's token ids), so a trainer can use the sample as is."""

    index: int
    finish_reason: Literal["stop", "length"]
    token_ids: list[int]
    token_logprobs: list[float]
    prompt_token_ids: list[int]


class _ResponseBase(BaseModel):
    """Fields every response carries, plus ``weight_version``: the policy version that sampled it."""

    id: str
    created: int
    model: str
    usage: Usage
    system_fingerprint: str
    weight_version: int


class CompletionChoice(_ChoiceBase):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_ChoiceBase):
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None


class ChatResponse(_ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class APIError(DeltaloopError):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``
    (``type`` is ``invalid_request_error`` below 500, ``server_error`` from 500)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


# ----------------------------------------------------------------------------- the frontend
class OpenAIFrontend:
    """Turns OpenAI requests into engine calls and engine completions into OpenAI responses."""

    def __init__(self, engine: TokenEngine, model_name: str = "policy", max_context: int | None = None,
                 limits: ApiLimits | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.limits = limits or ApiLimits()
        self.vocab_size = int(getattr(engine, "vocab_size", None) or len(self.tokenizer))
        if max_context is None:  # the model's position limit, when the engine exposes its model
            cfg = getattr(getattr(engine, "model", None), "config", None)
            max_context = getattr(cfg, "max_position_embeddings", None)
        self.max_context = max_context
        self.created = int(time.time())

    # ---- helpers
    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                           "model_not_found")

    def _check(self, req: _Req, rows: int, max_tokens: int | None) -> None:
        """Refuse unknown fields, unimplemented ones away from their neutral value, and requests over
        the :class:`ApiLimits` (400, naming the field)."""
        for name, value in (req.model_extra or {}).items():
            if name in IGNORED_FIELDS:
                continue
            if name in NEUTRAL_FIELDS:
                if value not in NEUTRAL_FIELDS[name]:
                    raise APIError(400, f"'{name}' is not supported by this server (only its default)", param=name)
                continue
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)
        lim = self.limits
        if rows > lim.max_rows:
            raise APIError(400, f"prompts x n = {rows} exceeds this server's limit of {lim.max_rows}", param="n")
        if max_tokens is not None and max_tokens > lim.max_tokens:
            raise APIError(400, f"max_tokens {max_tokens} exceeds this server's limit of {lim.max_tokens}",
                           param="max_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > lim.max_stop:
            raise APIError(400, f"{len(stop)} stop strings exceed this server's limit of {lim.max_stop}",
                           param="stop")
        if any(len(x) > lim.max_stop_chars for x in stop):
            raise APIError(400, f"a stop string is longer than this server's limit of {lim.max_stop_chars} "
                           "characters", param="stop")

    def _generate(self, prompts: list[list[int]], n: int, params: Any) -> list[Any]:
        """The engine's completions; its refusals become 400 and its failures 500."""
        try:
            return self.engine.generate_ids(prompts, n, params)
        except BadRequest as exc:
            raise APIError(400, str(exc), param="prompt") from exc
        except RequestFailed as exc:
            raise APIError(500, str(exc), "server_error") from exc

    def _params(self, req: _Req, max_tokens: int | None, prompt_len: int, extra_stop: list[str]) -> Any:
        from infra.rollout.engine import SamplingParams

        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        budget = min(max_tokens or DEFAULT_MAX_TOKENS, self.limits.max_tokens)
        if self.max_context is not None:
            room = self.max_context - prompt_len
            if room < 1:
                raise APIError(400, f"prompt of {prompt_len} tokens fills the {self.max_context}-token context")
            budget = min(budget, room)
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        try:
            return SamplingParams(max_new_tokens=budget, temperature=req.temperature, top_p=req.top_p,
                                  stop=stop + [s for s in extra_stop if s not in stop], seed=seed)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def _token_strs(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    def render_chat(self, messages: list[ChatMessage]) -> tuple[list[int], list[str]]:
        """Prompt token ids for ``messages`` and the stop strings the template implies."""
        tok = self.tokenizer
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
            return list(tok(text, add_special_tokens=False)["input_ids"]), []
        lines = [f"{PLAIN_ROLES.get(t['role'], t['role'].capitalize())}: {t['content']}" for t in turns]
        text = "\n".join(lines) + "\nAssistant:"
        return list(tok(text, add_special_tokens=True)["input_ids"]), PLAIN_STOPS

    # ---- endpoints
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "deltaloop"}]}

    def completions(self, req: CompletionRequest) -> CompletionResponse:
        self._check_model(req.model)
        n_prompts = 1 if isinstance(req.prompt, str) or all(isinstance(x, int) for x in req.prompt) else len(req.prompt)
        self._check(req, n_prompts * req.n, req.max_tokens)
        prompts = self._prompt_ids(req.prompt)
        longest = max(len(p) for p in prompts)
        params = self._params(req, req.max_tokens or 16, longest, [])
        comps = self._generate(prompts, req.n, params)
        version = comps[0].version if comps else self.engine.version
        choices = []
        for k, c in enumerate(comps):
            p_ids = prompts[c.prompt_index]
            text = (self.tokenizer.decode(p_ids) if req.echo else "") + c.text
            lp = None
            if req.logprobs is not None:
                toks = self._token_strs(c.token_ids)
                offsets, at = [], len(text) - len(c.text)
                for t in toks:
                    offsets.append(at)
                    at += len(t)
                lp = CompletionLogprobs(tokens=toks, token_logprobs=list(c.logprobs),
                                        top_logprobs=[{} for _ in toks], text_offset=offsets)
            choices.append(CompletionChoice(index=k, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                            token_ids=list(c.token_ids), token_logprobs=list(c.logprobs),
                                            prompt_token_ids=p_ids))
        return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
                                  choices=choices, usage=self._usage([prompts[c.prompt_index] for c in comps], comps),
                                  system_fingerprint=f"v{version}", weight_version=version)

    def chat(self, req: ChatRequest) -> ChatResponse:
        self._check_model(req.model)
        self._check(req, req.n, req.max_completion_tokens or req.max_tokens)
        ids, stops = self.render_chat(req.messages)
        params = self._params(req, req.max_completion_tokens or req.max_tokens, len(ids), stops)
        comps = self._generate([ids], req.n, params)
        version = comps[0].version if comps else self.engine.version
        choices = []
        for k, c in enumerate(comps):
            lp = None
            if req.logprobs:
                lp = ChoiceLogprobs(content=[
                    TokenLogprob(token=t, logprob=v, bytes=list(t.encode()))
                    for t, v in zip(self._token_strs(c.token_ids), c.logprobs)
                ])
            choices.append(ChatChoice(index=k, message=AssistantMessage(content=c.text.strip() if stops else c.text),
                                      logprobs=lp, finish_reason=c.finish_reason, token_ids=list(c.token_ids),
                                      token_logprobs=list(c.logprobs), prompt_token_ids=ids))
        return ChatResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
                            choices=choices, usage=self._usage([ids] * len(comps), comps),
                            system_fingerprint=f"v{version}", weight_version=version)

    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty")
        if all(isinstance(x, int) for x in prompt):
            out = [list(prompt)]
        elif all(isinstance(x, str) for x in prompt):
            out = [list(x) for x in self.tokenizer(list(prompt), add_special_tokens=True)["input_ids"]]
        else:
            out = [list(x) for x in prompt]
        for i, p in enumerate(out):
            if not p:
                raise APIError(400, "every prompt must have at least one token", param="prompt")
            bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"prompt {i}: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
        return out

    @staticmethod
    def _usage(prompts: list[list[int]], comps: list[Any]) -> Usage:
        # one prompt per distinct request prompt (n samples share it), as OpenAI counts
        seen: dict[int, int] = {}
        for p, c in zip(prompts, comps):
            seen[c.prompt_index] = len(p)
        p_tok, c_tok = sum(seen.values()), sum(len(c.token_ids) for c in comps)
        return Usage(prompt_tokens=p_tok, completion_tokens=c_tok, total_tokens=p_tok + c_tok)


def _sse(resp: CompletionResponse | ChatResponse) -> Iterator[str]:
    """The finished response as OpenAI stream chunks: one content chunk per choice, then [DONE]."""
    base = {"id": resp.id, "created": resp.created, "model": resp.model,
            "system_fingerprint": resp.system_fingerprint}
    for ch in resp.choices:
        if isinstance(ch, ChatChoice):
            first = {**base, "object": "chat.completion.chunk",
                     "choices": [{"index": ch.index, "delta": {"role": "assistant", "content": ch.message.content},
                                  "finish_reason": None}]}
            last = {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": ch.index, "delta": {}, "finish_reason": ch.finish_reason}]}
        else:
            first = {**base, "object": "text_completion",
                     "choices": [{"index": ch.index, "text": ch.text, "logprobs": None, "finish_reason": None}]}
            last = {**base, "object": "text_completion",
                    "choices": [{"index": ch.index, "text": "", "logprobs": None, "finish_reason": ch.finish_reason}]}
        yield f"data: {json.dumps(first)}\n\n"
        yield f"data: {json.dumps(last)}\n\n"
    yield f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', 'choices': [], 'usage': resp.usage.model_dump()})}\n\n"
    yield "data: [DONE]\n\n"


OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def add_routes(app: Any, frontend: OpenAIFrontend) -> None:
    """Mount ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` on a FastAPI ``app``,
    with OpenAI-shaped errors (400 for invalid requests, also JSON that does not parse, 500 for a
    failure inside the engine)."""
    from fastapi import Request
    from fastapi.exception_handlers import request_validation_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, code, param), status_code=status)

    @app.exception_handler(APIError)
    def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        if request.url.path in OPENAI_PATHS:  # OpenAI answers 400
            errors = exc.errors()
            loc = [str(x) for x in (errors[0]["loc"] if errors else ()) if x != "body"]
            return _error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors),
                          "invalid_request_error", loc[0] if loc else None)
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(Exception)
    def _failed(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"the server failed on this request: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return frontend.models()

    @app.post("/v1/completions", response_model=None)
    def completions(req: CompletionRequest) -> Any:
        resp = frontend.completions(req)
        return StreamingResponse(_sse(resp), media_type="text/event-stream") if req.stream else resp

    @app.post("/v1/chat/completions", response_model=None)
    def chat(req: ChatRequest) -> Any:
        resp = frontend.chat(req)
        return StreamingResponse(_sse(resp), media_type="text/event-stream") if req.stream else resp


def create_app(engine: TokenEngine, model_name: str = "policy", max_context: int | None = None,
               limits: ApiLimits | None = None) -> Any:
    """A standalone FastAPI app serving ``engine`` over the OpenAI API (plus ``/health``), its
    request bodies capped at ``limits.max_body_bytes``."""
    from fastapi import FastAPI

    from infra.rollout.guard import BodyLimit

    limits = limits or ApiLimits()
    app = FastAPI(title="deltaloop OpenAI-compatible rollout API")
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "version": int(getattr(engine, "version", 0) or 0)}

    add_routes(app, OpenAIFrontend(engine, model_name, max_context, limits))
    return app
