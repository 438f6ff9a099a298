"""OpenAI-compatible HTTP API over a rollout engine: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``.

Why: agent harnesses and multi-turn environments already speak the OpenAI protocol; serving it from
the rollout worker lets them drive the *policy being trained* (current weight version, shared
continuous batch) with the official ``openai`` client and no adapter.

What is supported: ``model`` (must be the served name), ``prompt`` (string, list of strings, token
ids or lists of token ids), ``messages``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``logprobs`` (the sampled token's log-prob;
``top_logprobs`` alternatives are returned empty) and ``stream`` (the finished completion is sent
as one SSE chunk, then ``[DONE]``). ``usage`` counts prompt and completion tokens. Unknown fields
are ignored, as OpenAI-compatible servers usually do.

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
from typing import Any, Iterator, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from infra.errors import DeltaloopError

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
PLAIN_STOPS = ["\nUser:", "\nSystem:", "\nTool:"]
DEFAULT_MAX_TOKENS = 256


class TokenEngine(Protocol):
    """What the API needs from an engine: token-level generation and the served version."""

    version: int
    tokenizer: Any

    def generate_ids(self, prompt_ids: list[list[int]], n: int, params: Any) -> list[Any]:
        ...


# ----------------------------------------------------------------------------- request schemas
class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")

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
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


# ----------------------------------------------------------------------------- the frontend
class OpenAIFrontend:
    """Turns OpenAI requests into engine calls and engine completions into OpenAI responses."""

    def __init__(self, engine: TokenEngine, model_name: str = "policy", max_context: int | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
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

    def _params(self, req: _Req, max_tokens: int | None, prompt_len: int, extra_stop: list[str]) -> Any:
        from infra.rollout.engine import SamplingParams

        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        budget = max_tokens or DEFAULT_MAX_TOKENS
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
        prompts = self._prompt_ids(req.prompt)
        longest = max(len(p) for p in prompts)
        params = self._params(req, req.max_tokens or 16, longest, [])
        comps = self.engine.generate_ids(prompts, req.n, params)
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
        ids, stops = self.render_chat(req.messages)
        params = self._params(req, req.max_completion_tokens or req.max_tokens, len(ids), stops)
        comps = self.engine.generate_ids([ids], req.n, params)
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
        if any(not p for p in out):
            raise APIError(400, "every prompt must have at least one token")
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


def add_routes(app: Any, frontend: OpenAIFrontend) -> None:
    """Mount ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` on a FastAPI ``app``."""
    from fastapi import Request
    from fastapi.exception_handlers import request_validation_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    def _error(status: int, message: str, code: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": code}}, status_code=status)

    @app.exception_handler(APIError)
    def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        if request.url.path in ("/v1/completions", "/v1/chat/completions"):  # OpenAI answers 400
            return _error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()),
                          "invalid_request_error")
        return await request_validation_exception_handler(request, exc)

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


def create_app(engine: TokenEngine, model_name: str = "policy", max_context: int | None = None) -> Any:
    """A standalone FastAPI app serving ``engine`` over the OpenAI API (plus ``/health``)."""
    from fastapi import FastAPI

    app = FastAPI(title="deltaloop OpenAI-compatible rollout API")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "version": int(getattr(engine, "version", 0) or 0)}

    add_routes(app, OpenAIFrontend(engine, model_name, max_context))
    return app
