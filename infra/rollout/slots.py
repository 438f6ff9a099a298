"""SlotRunner: a decode-only forward pass over a slot-indexed KV cache, for continuous batching.

Why not call the Hugging Face model each step: at the batch sizes of a CPU rollout worker, a
step of a small model is dominated by per-call overhead (cache objects, mask construction, module
hooks, logits for every position) and by ``torch.cat`` growth of a dynamic cache. This runner
reads the weights of a Llama-family model (Llama, SmolLM2, Qwen2 without sliding window, Mistral
without sliding window) and runs the same arithmetic itself:

- one preallocated K/V buffer per layer, ``[slots, kv_heads, capacity, head_dim]``; a request
  occupies one slot and its token at position p lives at index p (no left padding), so a slot can
  be refilled by a new request of any length while the others keep decoding;
- active slots are kept packed at ``0..k-1`` (a finished slot is overwritten by the last active
  one), so a decode step touches only live rows;
- q/k/v and gate/up projections are fused into one matmul each (rebuilt when the model's
  parameters change in place, detected through tensor version counters);
- prefill computes logits for each prompt's last position only.

The arithmetic is the model's own (RMSNorm in fp32, rotary tables from the model's rotary module,
SDPA with the model's scaling), so log-probs equal a teacher-forced forward pass up to float
rounding. Models of other architectures are served by LocalEngine's plain Hugging Face path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")
_GROW = 128  # capacity granularity (positions)


def supports(model: Any) -> bool:
    """True iff ``model`` has the Llama decoder layout this runner implements."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or not layers or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return False
    need_attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    need_mlp = ("gate_proj", "up_proj", "down_proj", "act_fn")
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or any(not hasattr(attn, n) for n in need_attn):
            return False
        if any(not hasattr(mlp, n) for n in need_mlp) or hasattr(attn, "q_norm"):
            return False
    return True


class SlotRunner:
    """Prefill/decode over ``slots`` cache rows of a supported model (see :func:`supports`)."""

    def __init__(self, model: Any) -> None:
        import torch

        self.model = model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)
        self.max_position = getattr(cfg, "max_position_embeddings", 1 << 16)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.slots = 0
        self.capacity = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self._stamp: tuple[int, ...] | None = None
        self._w: list[dict[str, Any]] = []
        self._cos = self._sin = None

    # ------------------------------------------------------------------ weights
    def _params(self) -> list["torch.Tensor"]:
        return list(self.model.parameters())

    def refresh(self) -> None:
        """(Re)build fused weights if any parameter was modified or replaced since the last call."""
        import torch

        stamp = tuple(x for p in self._params() for x in (p._version, p.data_ptr()))
        if stamp == self._stamp:
            return
        w = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_b = None
            if a.q_proj.bias is not None:
                qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
            w.append({
                "ln1": layer.input_layernorm.weight.detach(),
                "ln2": layer.post_attention_layernorm.weight.detach(),
                "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                "qkv_b": qkv_b,
                "o": a.o_proj.weight.detach(), "o_b": a.o_proj.bias,
                "gu": torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                "d": m.down_proj.weight.detach(),
                "act": m.act_fn,
                "scale": getattr(a, "scaling", self.head_dim ** -0.5),
            })
        self._w = w
        self._stamp = stamp

    # ------------------------------------------------------------------ cache
    def reserve(self, slots: int, length: int) -> None:
        """Make room for ``slots`` rows of ``length`` positions (keeps the live contents)."""
        import torch

        if length > self.max_position:
            raise ValueError(f"sequence of {length} tokens exceeds the model's {self.max_position} positions")
        if slots <= self.slots and length <= self.capacity:
            return
        new_s = max(slots, self.slots)
        new_t = max(self.capacity, -(-length // _GROW) * _GROW)
        shape = (new_s, self.n_kv, new_t, self.head_dim)
        for cache in (self.k_cache, self.v_cache):
            for i in range(len(self.model.model.layers)):
                buf = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(cache):
                    buf[: self.slots, :, : self.capacity] = cache[i]
                    cache[i] = buf
                else:
                    cache.append(buf)
        if new_t > self.capacity or self._cos is None:
            pos = torch.arange(new_t, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.model.model.rotary_emb(probe, pos)
            self._cos, self._sin = cos[0], sin[0]  # [T, D]
        self.slots, self.capacity = new_s, new_t

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` cached positions into slot ``dst``."""
        for cache in (self.k_cache, self.v_cache):
            for buf in cache:
                buf[dst, :, :length] = buf[src, :, :length]

    # ------------------------------------------------------------------ forward
    def _norm(self, x: "torch.Tensor", w: "torch.Tensor") -> "torch.Tensor":
        import torch
        import torch.nn.functional as F

        if x.dtype == torch.float32:  # one fused op; same arithmetic as the model's RMSNorm
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
        import torch

        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _head(self, h: "torch.Tensor") -> "torch.Tensor":
        return self.model.lm_head(self._norm(h, self.model.model.norm.weight)).float()

    def prefill(self, slot_ids: list[int], prompts: list[list[int]]) -> "torch.Tensor":
        """Run ``prompts`` into ``slot_ids``; returns next-token logits [n, vocab] (fp32)."""
        import torch
        import torch.nn.functional as F

        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((n, width), dtype=torch.int64)
        lens = torch.tensor([len(p) for p in prompts])
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(p, dtype=torch.int64)
        ids, lens = ids.to(self.device), lens.to(self.device)
        ar = torch.arange(width, device=self.device)
        mask = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < lens[:, None, None])  # [n, L, L]
        mask = mask[:, None]
        cos, sin = self._cos[:width][None, None], self._sin[:width][None, None]
        slots = torch.tensor(slot_ids, device=self.device)
        hq, hk, d = self.n_heads, self.n_kv, self.head_dim
        x = self.model.model.embed_tokens(ids)
        for i, w in enumerate(self._w):
            h = self._norm(x, w["ln1"])
            qkv = F.linear(h, w["qkv"], w["qkv_b"]).view(n, width, hq + 2 * hk, d).transpose(1, 2)
            qk = self._rope(qkv[:, : hq + hk], cos, sin)
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hk :]
            self.k_cache[i][slots, :, :width] = k
            self.v_cache[i][slots, :, :width] = v
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=w["scale"], enable_gqa=hq != hk)
            x = x + F.linear(o.transpose(1, 2).reshape(n, width, hq * d), w["o"], w["o_b"])
            gu = F.linear(self._norm(x, w["ln2"]), w["gu"])
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(w["act"](g) * u, w["d"])
        last = x[torch.arange(n, device=self.device), lens - 1]
        return self._head(last)

    def decode(self, tokens: "torch.Tensor", positions: "torch.Tensor", span: int) -> "torch.Tensor":
        """One token for each of the first ``k = len(tokens)`` slots at ``positions``; attention
        reads positions ``< span`` (``span > max(positions)``). Returns logits [k, vocab] (fp32)."""
        import torch
        import torch.nn.functional as F

        k_rows = tokens.shape[0]
        hq, hk, d = self.n_heads, self.n_kv, self.head_dim
        rows = torch.arange(k_rows, device=self.device)
        mask = (torch.arange(span, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # [k, 1, D]
        x = self.model.model.embed_tokens(tokens)  # [k, hidden]
        for i, w in enumerate(self._w):
            h = self._norm(x, w["ln1"])
            qkv = F.linear(h, w["qkv"], w["qkv_b"]).view(k_rows, hq + 2 * hk, d)
            qk = self._rope(qkv[:, : hq + hk], cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[rows, :, positions] = qk[:, hq:]
            vc[rows, :, positions] = qkv[:, hq + hk :]
            o = F.scaled_dot_product_attention(
                qk[:, :hq, None], kc[:k_rows, :, :span], vc[:k_rows, :, :span], attn_mask=mask,
                scale=w["scale"], enable_gqa=hq != hk,
            )
            x = x + F.linear(o.reshape(k_rows, hq * d), w["o"], w["o_b"])
            gu = F.linear(self._norm(x, w["ln2"]), w["gu"])
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(w["act"](g) * u, w["d"])
        return self._head(x)
