"""LocalEngine: a torch sampler with continuous batching for Hugging Face causal LMs (CPU or GPU).

How it works. Every sample is a *row* with its own prompt, sampling parameters and random stream.
Rows wait in one queue shared by all callers (``generate`` may be called from many threads, e.g.
concurrent OpenAI requests, and their rows share decode steps). Whichever caller holds the driver
lock runs steps for everyone:

1. admit queued rows into free slots (up to ``max_batch``) and prefill them together;
2. decode one token for every active row;
3. rows that stop (eos, a stop string, ``max_new_tokens``) leave their slot at once, and the next
   step admits queued rows into it — requests of different lengths do not wait for the longest.

For Llama-family models the forward pass is :class:`infra.rollout.slots.SlotRunner` (preallocated
slot KV cache, fused projections, no per-step Hugging Face overhead); other architectures use the
model's own forward with a ``DynamicCache`` in waves (same sampling and stopping, no refill).

Sampling is inverse-CDF with one *counter-based* uniform per row and step — a hash of (row stream,
step) — so every request has its own reproducible stream that does not depend on which other
requests share the batch or when it was admitted. Sample j of prompt i of a call uses stream
``row_seed(seed, i, j)``. Log-probs come from the logits that were sampled (``log_softmax(logits
/ T)``; raw logits when greedy), so they equal a teacher-forced forward pass of the same weights up
to float rounding — GRPO's old log-probs. ``load_weights`` waits until no request is in flight
(and holds new ones back), so every completion is produced by exactly one version.

Failures. A request is checked before any of its rows is queued (token ids inside the vocabulary,
prompt plus ``max_new_tokens`` within the model's positions): a bad one is refused with
:class:`~infra.rollout.errors.BadRequest` and never touches the batch. A step that raises anyway is
charged to the requests whose rows it touched: one request alone fails with
:class:`~infra.rollout.errors.RequestFailed`; several start over and are served one at a time,
alone, so the one that fails again is the cause and the others are answered (the per-row streams
make the rerun sample the same tokens). No row is ever dropped from the queue and the slots without
its request finishing, so callers and ``load_weights`` never wait on a lost row.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from infra.rollout.engine import Completion, SamplingParams, check_request, encode_prompts
from infra.rollout.errors import RequestFailed

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x5BD1E995  # both < 2**31: products of 32-bit values stay inside int64


def _mix_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    x ^= x >> 16
    return x


def _mix(x: "torch.Tensor") -> "torch.Tensor":
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 32-bit stream id of sample ``sample_index`` of prompt ``prompt_index``."""
    return _mix_int(_mix_int(_mix_int(seed) ^ _mix_int(prompt_index + 0x1000)) + sample_index)


def stream_uniforms(streams: list[int], steps: int) -> list[list[float]]:
    """Uniform(0,1) draws [rows][steps], a pure function of (stream, step); 24-bit, never 1.0."""
    import torch

    s = torch.tensor(streams, dtype=torch.int64)[:, None]
    k = _mix(torch.arange(steps, dtype=torch.int64) + 0x9E37)[None, :]
    h = _mix(_mix(s ^ k) + 0x2545F491)
    return (((h >> 8).to(torch.float64) + 0.5) / 16777216.0).tolist()


@dataclass(eq=False)
class _Row:
    """One sample in flight: its prompt, parameters, stream and what it has produced."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: int
    stop_ids: frozenset[int]
    multi_stops: tuple[str, ...]
    req: "_Request | None" = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    uniforms: list[float] = field(default_factory=list)
    reason: str = "length"
    done: bool = False

    def reset(self) -> None:
        """Forget what was sampled: the row starts over (its stream makes it sample the same)."""
        self.tokens, self.logprobs, self.uniforms = [], [], []
        self.reason, self.done = "length", False


@dataclass(eq=False)
class _Request:
    """The rows of one ``generate_ids`` call; ``error`` is set when the engine failed it."""

    rows: list[_Row]
    error: BaseException | None = None

    def finished(self) -> bool:
        return self.error is not None or all(r.done for r in self.rows)


class LocalEngine:
    """Continuous-batching KV-cached sampler over ``model`` (put in eval mode and used in place).

    ``max_batch`` bounds the rows decoded together (slots); more rows queue for free slots.
    ``stop_cache_entries`` bounds the per-stop-list token sets kept (least recently used go)."""

    def __init__(self, model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", max_batch: int = 256,
                 stop_cache_entries: int = 64) -> None:
        from infra.rollout.slots import SlotRunner, supports

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.version = 0
        self.vocab_size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
        self._stop_cache: OrderedDict[tuple[str, ...], frozenset[int]] = OrderedDict()
        self._stop_cache_entries = stop_cache_entries
        self._stop_lock = threading.Lock()
        self._token_texts: list[str] | None = None
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 rename
        self._runner = SlotRunner(model) if supports(model) else None
        self._queue: deque[_Row] = deque()
        self._active: list[_Row] = []  # slot s holds _active[s]; live slots are packed at 0..k-1
        self._suspects: deque[_Request] = deque()  # requests of a failed shared step, to serve alone
        self._alone: _Request | None = None  # the suspect being served alone now
        self._alone_rows: deque[_Row] = deque()  # its rows not yet admitted
        self._cv = threading.Condition()
        self._driver = threading.Lock()
        self._load_lock = threading.Lock()
        self._inflight = 0
        self._loading = False

    @property
    def continuous(self) -> bool:
        """True when this model runs on the slot runner (continuous batching)."""
        return self._runner is not None

    # ------------------------------------------------------------------ weights
    def load_weights(self, tensors: dict, version: int) -> None:
        """Copy a published state into the served model and record its version.

        Waits for in-flight requests to finish and holds new ones back meanwhile. Every admitted
        request finishes (answered or failed, never lost), so the wait ends."""
        from infra.model import load_published_state

        with self._load_lock:
            with self._cv:
                self._loading = True
                self._cv.wait_for(lambda: self._inflight == 0)
            try:
                load_published_state(self.model, tensors)
                self.version = version
            finally:
                with self._cv:
                    self._loading = False
                    self._cv.notify_all()

    # ------------------------------------------------------------------ public sampling API
    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` completions per prompt, grouped by prompt."""
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), n, params)

    def generate_ids(self, prompt_ids: list[list[int]], n: int, params: SamplingParams,
                     first_prompt: int = 0) -> list[Completion]:
        """Like :meth:`generate` for already tokenized prompts (e.g. a rendered chat template).

        ``first_prompt``: the index of ``prompt_ids[0]`` in a batch split across engines (the
        colocated placement's ranks): rows take the stream and ``prompt_index`` of their place in
        the whole batch, so a slice samples what the whole batch would.

        Raises :class:`~infra.rollout.errors.BadRequest` before admission for ids outside the
        vocabulary or prompts too long for the model, and
        :class:`~infra.rollout.errors.RequestFailed` when serving this request failed."""
        max_pos = self._runner.max_position if self._runner is not None else None
        check_request(prompt_ids, n, self.vocab_size, max_pos, params.max_new_tokens)
        stop_ids = self._stop_ids(params.stop)
        multi = tuple(s for s in params.stop if len(s) > 1)
        rows = [
            _Row(list(p), params, row_seed(params.seed, first_prompt + i, j), stop_ids, multi)
            for i, p in enumerate(prompt_ids) for j in range(n)
        ]
        req = _Request(rows)
        for r in rows:
            r.req = req
        version = self._run(req)
        return [
            Completion(prompt_index=first_prompt + k // n, text=self._text(r.tokens, params.stop), token_ids=r.tokens,
                       logprobs=r.logprobs, finish_reason=r.reason, version=version)
            for k, r in enumerate(rows)
        ]

    def greedy(self, prompts: list[str], max_new_tokens: int, stop: list[str] | None = None) -> list[str]:
        """Greedy completions' text (evaluation path)."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop or ["\n"])
        return [c.text for c in self.generate(prompts, 1, params)]

    # ------------------------------------------------------------------ scheduling
    def _run(self, req: _Request) -> int:
        """Queue ``req``'s rows and drive (or wait for) the step loop until it is finished; returns
        the weight version that produced it, or raises the error that failed it."""
        with self._cv:
            self._cv.wait_for(lambda: not self._loading)
            self._inflight += 1
            version = self.version
            self._queue.extend(req.rows)
        try:
            while not req.finished():
                if self._driver.acquire(blocking=False):
                    try:
                        self._drive(req)
                    finally:
                        self._driver.release()
                        with self._cv:
                            self._cv.notify_all()
                else:
                    with self._cv:
                        self._cv.wait_for(lambda: req.finished() or not self._driver.locked(), 0.5)
        finally:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
        if req.error is not None:
            raise req.error
        return version

    def _drive(self, req: _Request) -> None:
        """Run steps for every caller until ``req`` is finished (the caller holds the driver lock)."""
        import torch

        with torch.inference_mode():
            while not req.finished():
                if not self._step():  # nothing queued or active, yet req unfinished: its rows are lost
                    with self._cv:
                        req.error = RequestFailed("the engine lost this request's rows (a bug); it was not served")
                    return

    def _admit(self, room: int) -> list[_Row]:
        """Up to ``room`` queued rows for the next step. After a failed shared step, its requests
        are served one at a time and alone (once the batch has drained), until each succeeds or
        is shown to be the cause; new requests wait meanwhile."""
        with self._cv:
            if self._alone is not None and self._alone.finished() and not self._active:
                self._alone = None
                self._alone_rows.clear()
            if self._alone is None and self._suspects and not self._active:
                self._alone = self._suspects.popleft()
                self._alone_rows.extend(self._alone.rows)
            if self._alone is not None:
                source = self._alone_rows
            elif self._suspects:
                return []  # the batch drains before the next suspect is served alone
            else:
                source = self._queue
            return [source.popleft() for _ in range(min(room, len(source)))]

    def _step(self) -> bool:
        """One scheduling step (slot runner: admit + prefill, or one decode; otherwise one wave of
        the Hugging Face path). A failure is charged to the requests it touched (:meth:`_fault`),
        never raised to the driver. Returns False when there was nothing to do."""
        if self._runner is None:
            wave = self._admit(self.max_batch)
            if not wave:
                return False
            try:
                self._hf_wave(wave)
            except Exception as exc:  # noqa: BLE001 - charged to the rows' requests
                self._fault(wave, exc)
            return True
        new = self._admit(self.max_batch - len(self._active))
        if not new and not self._active:
            return False
        touched = new or list(self._active)
        try:
            if new:
                self._prefill(new)
            else:
                self._decode()
        except Exception as exc:  # noqa: BLE001 - charged to the rows' requests
            self._fault(touched, exc)
        return True

    def _prefill(self, new: list[_Row]) -> None:
        """Prefill ``new`` rows into the free slots after the active ones and sample their first token."""
        runner = self._runner
        assert runner is not None
        base = len(self._active)
        runner.refresh()
        runner.reserve(base + len(new), max(len(r.prompt_ids) + r.params.max_new_tokens for r in new))
        for r, u in zip(new, stream_uniforms([r.stream for r in new], max(r.params.max_new_tokens for r in new))):
            r.uniforms = u
        logits = runner.prefill(list(range(base, base + len(new))), [r.prompt_ids for r in new])
        self._active.extend(new)
        self._advance(logits, new)
        self._compact()

    def _decode(self) -> None:
        """Decode one token for every active row."""
        import torch

        runner = self._runner
        assert runner is not None
        act = self._active
        tokens = torch.tensor([r.tokens[-1] for r in act], device=runner.device)
        pos_l = [len(r.prompt_ids) + len(r.tokens) - 1 for r in act]
        positions = torch.tensor(pos_l, device=runner.device)
        self._advance(runner.decode(tokens, positions, max(pos_l) + 1), act)
        self._compact()

    def _fault(self, rows: list[_Row], exc: Exception) -> None:
        """A step over ``rows`` raised ``exc``. If they belong to one request, that request fails;
        otherwise the culprit is unknown, so each of their requests starts over and is served
        alone (sampling is a pure function of each row's stream, so the result is the same). Every
        row of the touched requests leaves the slots and the queue: nothing is lost or left half-done."""
        reqs = list(dict.fromkeys(r.req for r in rows if r.req is not None and not r.req.finished()))
        log.warning("rollout engine step failed for %d request(s): %s: %s", len(reqs), type(exc).__name__, exc,
                    exc_info=exc)
        with self._cv:
            if len(reqs) == 1:
                reqs[0].error = RequestFailed(f"the engine failed while serving this request: "
                                              f"{type(exc).__name__}: {exc}")
            drop = set(reqs)
            try:
                self._compact(lambda r: r.done or r.req in drop)
            except Exception:  # noqa: BLE001 - the cache cannot be trusted: every active request starts over
                drop |= {r.req for r in self._active if r.req is not None}
                self._active.clear()
            self._queue = deque(r for r in self._queue if r.req not in drop)
            if self._alone in drop:
                self._alone_rows.clear()
            for req in drop:
                if req.error is None:
                    for r in req.rows:
                        r.reset()
                    if req is not self._alone:
                        self._suspects.append(req)
                    else:
                        self._alone_rows.extend(req.rows)
            self._cv.notify_all()

    def _compact(self, drop: Callable[[_Row], bool] = lambda r: r.done) -> None:
        """Remove the rows ``drop`` selects (default: finished ones) from their slots: live rows
        beyond the new end move into the holes below it (one cache copy per moved row, all
        layers), so live slots stay packed at ``0..k-1``."""
        act = self._active
        gone = [drop(r) for r in act]
        if not any(gone):
            return
        k = len(act) - sum(gone)
        holes = [s for s in range(k) if gone[s]]
        movers = [s for s in range(k, len(act)) if not gone[s]]
        if movers:
            assert self._runner is not None
            length = max(len(act[s].prompt_ids) + len(act[s].tokens) for s in movers)
            self._runner.move(movers, holes, length)
            for h, m in zip(holes, movers):
                act[h] = act[m]
        del act[k:]
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ sampling
    def _advance(self, logits: "torch.Tensor", rows: list[_Row]) -> None:
        """Sample one token for each row from ``logits`` [len(rows), vocab]; record and stop."""
        nxt, lp = sample(logits, rows)
        for r, t, lpv in zip(rows, nxt, lp):
            r.tokens.append(t)
            r.logprobs.append(lpv)
            if t in r.stop_ids:
                r.reason, r.done = "stop", True
            elif r.multi_stops and self._hit_multi_stop(r):
                r.reason, r.done = "stop", True
            elif len(r.tokens) >= r.params.max_new_tokens:
                r.done = True

    def _hit_multi_stop(self, r: _Row) -> bool:
        tail = self.tokenizer.decode(r.tokens[-(max(len(s) for s in r.multi_stops) + 2):])
        return any(s in tail for s in r.multi_stops)

    def _stop_ids(self, stop: list[str]) -> frozenset[int]:
        """Token ids that end a completion: eos and every token whose text contains a stop string.

        Kept per stop list in an LRU of ``stop_cache_entries`` (stop lists come from requests, so
        the cache must not grow with them); the vocabulary's texts are decoded once."""
        key = tuple(stop)
        with self._stop_lock:
            hit = self._stop_cache.get(key)
            if hit is not None:
                self._stop_cache.move_to_end(key)
                return hit
            tok = self.tokenizer
            ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
            if stop:
                if self._token_texts is None:
                    self._token_texts = tok.batch_decode([[i] for i in range(len(tok))])
                ids |= {i for i, t in enumerate(self._token_texts) if any(s in t for s in stop)}
            found = self._stop_cache[key] = frozenset(ids)
            while len(self._stop_cache) > self._stop_cache_entries:
                self._stop_cache.popitem(last=False)
            return found

    def _text(self, token_ids: list[int], stop: list[str]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in stop if s and s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    # ------------------------------------------------------------------ fallback (other architectures)
    def _hf_wave(self, rows: list[_Row]) -> None:
        """Sample ``rows`` to the end with the model's own forward and a ``DynamicCache``."""
        import torch
        from transformers import DynamicCache

        dev = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        b, width = len(rows), max(len(r.prompt_ids) for r in rows)
        ids = torch.full((b, width), pad, dtype=torch.int64)
        mask = torch.zeros((b, width), dtype=torch.int64)
        for k, r in enumerate(rows):
            ids[k, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.int64)
            mask[k, width - len(r.prompt_ids):] = 1
            r.uniforms = stream_uniforms([r.stream], r.params.max_new_tokens)[0]
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        alive = list(range(b))
        last_pos = pos[:, -1]
        while True:
            live = [rows[a] for a in alive]
            self._advance(out.logits[:, -1, :].float(), live)
            keep = [s for s, r in enumerate(live) if not r.done]
            if not keep:
                return
            if len(keep) < len(alive):
                idx = torch.tensor(keep, dtype=torch.int64, device=dev)
                cache.batch_select_indices(idx)
                mask, last_pos = mask[idx], last_pos[idx]
                alive = [alive[s] for s in keep]
            nxt = torch.tensor([rows[a].tokens[-1] for a in alive], dtype=torch.int64, device=dev)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             use_cache=True, **{self._cache_kw: cache})


def sample(logits: "torch.Tensor", rows: list[Any]) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [k, vocab] under each row's temperature/top_p, using its
    uniform for this step (``row.uniforms[len(row.tokens)]``); returns (tokens, log-probs)."""
    import torch

    temps = [r.params.temperature for r in rows]
    greedy = [t == 0.0 for t in temps]
    if all(greedy):
        nxt = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits
        if any(t not in (0.0, 1.0) for t in temps):
            t = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits.device)
            scaled = logits / t[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        u = torch.tensor([r.uniforms[len(r.tokens)] for r in rows], dtype=logits.dtype, device=logits.device)
        # rows without nucleus filtering sample in vocabulary order, rows with it in sorted order;
        # each row's path depends only on its own parameters, never on its batch mates
        cdf = logp.exp().cumsum(-1)
        nxt = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)
        nucleus = [k for k, (r, g) in enumerate(zip(rows, greedy)) if not g and r.params.top_p < 1.0]
        if nucleus:
            idx = torch.tensor(nucleus, device=logits.device)
            sorted_lp, order = logp[idx].sort(dim=-1, descending=True)
            probs = sorted_lp.exp()
            tp = torch.tensor([rows[k].params.top_p for k in nucleus], device=logits.device)
            probs = probs.masked_fill(probs.cumsum(-1) - probs > tp[:, None], 0.0)
            c2 = probs.cumsum(-1)
            pick = torch.searchsorted(c2, (u[idx] * c2[:, -1])[:, None], right=True).clamp_max(c2.shape[-1] - 1)
            nxt[idx] = order.gather(1, pick)[:, 0]
        if any(greedy):
            nxt = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), nxt)
    lp = logp.gather(1, nxt[:, None])[:, 0]
    return nxt.tolist(), lp.tolist()
