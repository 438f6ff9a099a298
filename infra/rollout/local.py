"""LocalEngine: a torch sampler with a KV cache for any Hugging Face causal LM (CPU or GPU).

How it works: prompts are left-padded into one batch (attention mask + explicit position ids, so
padding changes nothing), prefilled once into a ``DynamicCache``, then decoded one token per step
for all rows together. Each step samples with the Gumbel-max trick using *counter-based* noise — a
hash of (row seed, step, token id) — so every request has its own reproducible random stream that
does not depend on which other requests share the batch, without a Python loop over rows.

Log-probs are taken from the same logits that were sampled (``log_softmax(logits / T)``; raw
logits when greedy), so they equal a teacher-forced forward pass of the same weights up to float
rounding — they are GRPO's old log-probs. Stopping: eos, any token whose text contains a stop
string (precomputed per vocabulary), or a multi-token stop string found in the decoded text.
Rows that finish early are dropped from the batch (and the cache) once enough of them are done.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from infra.rollout.engine import Completion, SamplingParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

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


def gumbel_noise(seeds: "torch.Tensor", step: int, vocab: int) -> "torch.Tensor":
    """Gumbel(0,1) noise [rows, vocab], a pure function of (row seed, step, token id)."""
    import torch

    k = _mix(_mix(seeds + _mix_int(step + 0x9E37)))  # [B]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix(_mix(k[:, None] ^ _mix(v * 0x2545F491 + 0x1234567)[None, :]))
    u = (h.to(torch.float64) + 0.5) / 4294967296.0
    return (-torch.log(-torch.log(u))).to(torch.float32)


class LocalEngine:
    """Batched KV-cached sampler over ``model`` (which it puts in eval mode and uses in place)."""

    def __init__(self, model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", max_batch: int = 256) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.version = 0
        self._stop_cache: dict[tuple[str, ...], Any] = {}
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ weights
    def load_weights(self, tensors: dict, version: int) -> None:
        """Copy a published state into the served model and record its version."""
        from infra.model import load_published_state

        load_published_state(self.model, tensors)
        self.version = version

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` completions per prompt, grouped by prompt."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        enc = self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        out: list[Completion] = []
        for start in range(0, len(rows), self.max_batch):
            chunk = rows[start : start + self.max_batch]
            out += self._generate_rows([enc[i] for i, _ in chunk], chunk, params)
        return out

    def greedy(self, prompts: list[str], max_new_tokens: int, stop: list[str] | None = None) -> list[str]:
        """Greedy completions' text (evaluation path)."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop or ["\n"])
        return [c.text for c in self.generate(prompts, 1, params)]

    def _stop_ids(self, stop: list[str]) -> "torch.Tensor":
        """Token ids that end a completion: eos and every token whose text contains a stop string."""
        import torch

        key = tuple(stop)
        if key not in self._stop_cache:
            tok = self.tokenizer
            ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
            if stop:
                texts = tok.batch_decode([[i] for i in range(len(tok))])
                ids |= {i for i, t in enumerate(texts) if any(s in t for s in stop)}
            self._stop_cache[key] = torch.tensor(sorted(ids), dtype=torch.int64)
        return self._stop_cache[key]

    def _generate_rows(
        self, prompt_ids: list[list[int]], rows: list[tuple[int, int]], params: SamplingParams
    ) -> list[Completion]:
        import torch
        from transformers import DynamicCache

        dev = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        b = len(prompt_ids)
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((b, width), pad, dtype=torch.int64)
        mask = torch.zeros((b, width), dtype=torch.int64)
        for r, p in enumerate(prompt_ids):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.int64)
            mask[r, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        seeds = torch.tensor([row_seed(params.seed, i, j) for i, j in rows], dtype=torch.int64, device=dev)
        stop_ids = self._stop_ids(params.stop).to(dev)
        multi_stops = [s for s in params.stop if len(s) > 1]
        greedy = params.temperature == 0.0

        alive = torch.arange(b, device=dev)  # original row index of each batch slot
        tokens: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        reason = ["length"] * b
        cache = DynamicCache()
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{self._cache_kw: cache},
            )
            logits = out.logits[:, -1, :].float()
            last_pos = pos[:, -1]
            for step in range(params.max_new_tokens):
                if greedy:
                    logp_all = torch.log_softmax(logits, dim=-1)
                    nxt = logits.argmax(dim=-1)
                else:
                    scaled = logits / params.temperature
                    logp_all = torch.log_softmax(scaled, dim=-1)
                    scores = scaled
                    if params.top_p < 1.0:
                        scores = _top_p_filter(scaled, params.top_p)
                    nxt = (scores + gumbel_noise(seeds[alive], step, scores.shape[-1])).argmax(dim=-1)
                lp = logp_all.gather(1, nxt[:, None])[:, 0]
                done = torch.isin(nxt, stop_ids)
                nxt_l, lp_l, done_l, alive_l = nxt.tolist(), lp.tolist(), done.tolist(), alive.tolist()
                for slot, r in enumerate(alive_l):
                    tokens[r].append(nxt_l[slot])
                    logps[r].append(lp_l[slot])
                    if done_l[slot]:
                        reason[r] = "stop"
                    elif multi_stops:
                        text = self.tokenizer.decode(tokens[r][-8:])
                        if any(s in text for s in multi_stops) and any(
                            s in self.tokenizer.decode(tokens[r]) for s in multi_stops
                        ):
                            done_l[slot] = True
                            reason[r] = "stop"
                keep = [s for s, d in enumerate(done_l) if not d]
                if not keep or step == params.max_new_tokens - 1:
                    break
                if len(keep) < len(alive_l):
                    idx = torch.tensor(keep, dtype=torch.int64, device=dev)
                    cache.batch_select_indices(idx)
                    mask, last_pos, nxt, alive = mask[idx], last_pos[idx], nxt[idx], alive[idx]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                last_pos = last_pos + 1
                out = self.model(
                    input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    use_cache=True, **{self._cache_kw: cache},
                )
                logits = out.logits[:, -1, :].float()
        return [
            Completion(
                prompt_index=i,
                text=self._text(tokens[r], params.stop),
                token_ids=tokens[r],
                logprobs=logps[r],
                finish_reason=reason[r],
                version=self.version,
            )
            for r, (i, _) in enumerate(rows)
        ]

    def _text(self, token_ids: list[int], stop: list[str]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in stop if s and s in text), default=-1)
        return text[:cut] if cut >= 0 else text


def _top_p_filter(scaled: "torch.Tensor", top_p: float) -> "torch.Tensor":
    """``scaled`` with tokens outside the nucleus set to -inf (the top token is always kept)."""
    import torch

    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(dim=-1) - probs > top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
