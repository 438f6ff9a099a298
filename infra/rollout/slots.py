"""SlotRunner: a decode-only forward pass over a slot-indexed KV cache, for continuous batching.

Why not call the Hugging Face model each step: at the batch sizes of a CPU rollout worker, a
step of a small model is dominated by per-call overhead (cache objects, mask construction, module
hooks, logits for every position) and by ``torch.cat`` growth of a dynamic cache. This runner
reads the weights of a Llama-family model (Llama, SmolLM2, Qwen2 without sliding window, Mistral
without sliding window) and runs the same arithmetic itself, with as few tensor ops per step as
it can (on a ~1M-parameter model each op costs more in dispatch than in arithmetic):

- one preallocated buffer for all layers' keys and values, ``[2, layers, slots, kv_heads,
  capacity, head_dim]``; a request occupies one slot and its token at position p lives at index
  p (no left padding), so a slot can be refilled by a new request of any length while the others
  keep decoding; a decode step writes each layer's new keys/values with one ``index_copy_``;
- active slots are kept packed at ``0..k-1`` (finished slots are overwritten by the last active
  ones, all layers and K/V in one copy per moved slot), so a decode step touches only live rows;
- q/k/v and gate/up projections are fused into one matmul each, residual adds are fused into the
  output matmuls (``addmm``); rebuilt when the model's parameters change in place, detected
  through tensor version counters;
- decode attention is two batched matmuls over ``[rows * kv_heads]`` (no SDPA dispatch, which on
  CPU costs more than the arithmetic for head dims like 32);
- prefill runs every matmul once per unique prompt prefix (a token's states depend only on its
  prefix: ``n`` samples of one prompt, prompts sharing their first tokens, the bos every prompt
  starts with), pads only inside attention, and runs the last layer's attention output and MLP
  for each prompt's last position only.

The arithmetic is the model's own (RMSNorm in fp32, rotary tables from the model's rotary module,
softmax attention with the model's scaling), so log-probs equal a teacher-forced forward pass up
to float rounding. Models of other architectures are served by LocalEngine's plain Hugging Face
path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

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


@dataclass
class PrefillPlan:
    """What a prefill computes once: the unique prompts (``uniq``; ``inverse[i]`` is prompt i's index
    in it), the slots they fill (``u_slots``), rows whose cache is copied from an identical prompt's
    slot (``dup_src`` -> ``dup_dst``), and the prefix nodes: one per distinct (prefix, token), with
    its token and position, the padded cell of every (row, position) (``cells``, ``n * width``;
    cells past a prompt's end repeat its last node: finite values that the masks never let
    through) and one cell where each node occurs (``first_cell``, its query row)."""

    inverse: list[int]
    u_slots: list[int]
    dup_src: list[int]
    dup_dst: list[int]
    uniq: list[tuple[int, ...]]
    node_tok: list[int]
    node_pos: list[int]
    cells: list[int]
    first_cell: list[int]


def plan_prefill(slot_ids: Sequence[int], prompts: Sequence[Sequence[int]]) -> PrefillPlan:
    """Deduplicate ``prompts`` and build their prefix nodes (see :class:`PrefillPlan`)."""
    first: dict[tuple[int, ...], int] = {}
    inverse = [first.setdefault(tuple(p), len(first)) for p in prompts]
    u_slots: list[int] = []
    dup_src: list[int] = []
    dup_dst: list[int] = []
    for s, g in zip(slot_ids, inverse):
        if g == len(u_slots):
            u_slots.append(s)
        else:
            dup_src.append(u_slots[g])
            dup_dst.append(s)
    uniq = list(first)  # unique prompts, in order of first appearance
    width = max(len(p) for p in uniq)
    node_of: dict[tuple[int, int], int] = {}
    node_tok: list[int] = []
    node_pos: list[int] = []
    cells: list[int] = []
    first_cell: list[int] = []
    for r, p in enumerate(uniq):
        parent = -1
        for pos, t in enumerate(p):
            nd = node_of.setdefault((parent, t), len(node_tok))
            if nd == len(node_tok):
                node_tok.append(t)
                node_pos.append(pos)
                first_cell.append(r * width + pos)
            cells.append(nd)
            parent = nd
        cells.extend([parent] * (width - len(p)))
    return PrefillPlan(inverse, u_slots, dup_src, dup_dst, uniq, node_tok, node_pos, cells, first_cell)


@dataclass
class _Layer:
    """One decoder layer's weights in the layout the runner uses (fused, output weights transposed)."""

    ln1: "torch.Tensor"
    ln2: "torch.Tensor"
    qkv: "torch.Tensor"  # [(hq + 2 hk) d, hidden]
    qkv_b: "torch.Tensor | None"
    o_t: "torch.Tensor"  # o_proj.weight.T: x + o @ o_t is one addmm
    o_b: "torch.Tensor | None"
    gu: "torch.Tensor"  # [2 intermediate, hidden]: gate rows, then up rows
    d_t: "torch.Tensor"  # down_proj.weight.T
    d_b: "torch.Tensor | None"
    act: Callable[["torch.Tensor"], "torch.Tensor"]
    scale: float


class SlotRunner:
    """Prefill/decode over ``slots`` cache rows of a supported model (see :func:`supports`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        cfg = model.config
        self.n_layers = len(model.model.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)
        self.max_position = getattr(cfg, "max_position_embeddings", 1 << 16)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.slots = 0
        self.capacity = 0
        self.kv_cache: torch.Tensor | None = None  # [2 (k, v), layers, slots, kv_heads, capacity, head_dim]
        self.k_cache: torch.Tensor | None = None  # views of kv_cache[0] and kv_cache[1]
        self.v_cache: torch.Tensor | None = None
        self._ar: torch.Tensor | None = None  # arange(max(capacity, slots)), sliced instead of rebuilt
        self._stamp: tuple[int, ...] | None = None
        self._w: list[_Layer] = []
        self._embed: torch.Tensor | None = None
        self._final_norm: torch.Tensor | None = None
        self._head_w: torch.Tensor | None = None
        self._head_b: torch.Tensor | None = None
        self._cos: torch.Tensor | None = None  # [capacity, head_dim]
        self._sin_signed: torch.Tensor | None = None  # sin with its first half negated (see _rope)

    # ------------------------------------------------------------------ weights
    def refresh(self) -> None:
        """(Re)build fused weights if any parameter was modified or replaced since the last call."""
        import torch
        import torch.nn.functional as F

        stamp = tuple(x for p in self.model.parameters() for x in (p._version, p.data_ptr()))
        if stamp == self._stamp:
            return
        w = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_b = None
            if a.q_proj.bias is not None:
                qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
            silu = isinstance(m.act_fn, torch.nn.SiLU) or type(m.act_fn).__name__ == "SiLUActivation"
            act = F.silu if silu else m.act_fn
            w.append(_Layer(
                ln1=layer.input_layernorm.weight.detach(),
                ln2=layer.post_attention_layernorm.weight.detach(),
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                qkv_b=qkv_b,
                o_t=a.o_proj.weight.detach().t(),
                o_b=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                gu=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                d_t=m.down_proj.weight.detach().t(),
                d_b=None if m.down_proj.bias is None else m.down_proj.bias.detach(),
                act=act,
                scale=float(getattr(a, "scaling", self.head_dim ** -0.5)),
            ))
        inner = self.model.model
        self._w = w
        self._embed = inner.embed_tokens.weight.detach()
        self._final_norm = inner.norm.weight.detach()
        self._head_w = self.model.lm_head.weight.detach()
        bias = getattr(self.model.lm_head, "bias", None)
        self._head_b = None if bias is None else bias.detach()
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
        shape = (2, self.n_layers, new_s, self.n_kv, new_t, self.head_dim)
        kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.kv_cache is not None:
            kv[:, :, : self.slots, :, : self.capacity] = self.kv_cache
        self.kv_cache, self.k_cache, self.v_cache = kv, kv[0], kv[1]
        self._ar = torch.arange(max(new_s, new_t, self.n_kv), device=self.device)
        if new_t > self.capacity or self._cos is None:
            pos = torch.arange(new_t, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.model.model.rotary_emb(probe, pos)
            half = self.head_dim // 2
            self._cos = cos[0].to(self.dtype)
            self._sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).to(self.dtype)
        self.slots, self.capacity = new_s, new_t

    def move(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        """Copy slots ``src[i]``'s first ``length`` cached positions into slots ``dst[i]`` (all
        layers, K and V: one strided copy per slot). ``dst`` must not overlap ``src``."""
        assert self.kv_cache is not None
        kv = self.kv_cache
        for s, d in zip(src, dst):
            kv[:, :, d, :, :length] = kv[:, :, s, :, :length]

    # ------------------------------------------------------------------ forward pieces
    def _norm(self, x: "torch.Tensor", w: "torch.Tensor") -> "torch.Tensor":
        import torch
        import torch.nn.functional as F

        if x.dtype == torch.float32:  # one fused op; same arithmetic as the model's RMSNorm
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _rope(x: "torch.Tensor", cos: "torch.Tensor", sin_signed: "torch.Tensor") -> "torch.Tensor":
        """``x * cos + rotate_half(x) * sin``: ``rotate_half(x) = cat(-x2, x1)``, which is
        ``roll(x, d/2) * [-1, +1]``; the sign is folded into ``sin_signed`` (exact)."""
        import torch

        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)

    def _residual(self, x: "torch.Tensor", a: "torch.Tensor", w_t: "torch.Tensor",
                  b: "torch.Tensor | None") -> "torch.Tensor":
        """``x + a @ w_t (+ b)``."""
        import torch

        out = torch.addmm(x, a, w_t)
        return out if b is None else out + b

    def _mlp(self, x: "torch.Tensor", w: _Layer) -> "torch.Tensor":
        import torch.nn.functional as F

        gu = F.linear(self._norm(x, w.ln2), w.gu)
        inter = gu.shape[-1] // 2
        return self._residual(x, w.act(gu[:, :inter]).mul_(gu[:, inter:]), w.d_t, w.d_b)

    def _head(self, h: "torch.Tensor") -> "torch.Tensor":
        import torch.nn.functional as F

        assert self._final_norm is not None and self._head_w is not None
        return F.linear(self._norm(h, self._final_norm), self._head_w, self._head_b).float()

    def _flat_index(self, slots: "torch.Tensor", positions: "torch.Tensor") -> "torch.Tensor":
        """Row indices into one layer's cache viewed as ``[slots * kv_heads * capacity, head_dim]``
        for (slot, head, position) of each token: ``[tokens * kv_heads]``, token-major."""
        assert self._ar is not None
        heads = self._ar[: self.n_kv] * self.capacity
        return ((slots * (self.n_kv * self.capacity) + positions)[:, None] + heads[None]).reshape(-1)

    def _attend(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", mask: "torch.Tensor",
                scale: float) -> "torch.Tensor":
        """Softmax attention of head-major ``q`` [hq, n, Lq, d] over ``k``/``v`` [hk, n, L, d] with
        an additive ``mask`` [hq * n, Lq, L]; returns [hq, n, Lq, d]. Batched matmuls over (head, row);
        query head j uses kv head j // (hq / hk), as Hugging Face's ``repeat_kv`` does."""
        import torch

        hq, n, lq, d = q.shape
        hk, length = k.shape[0], k.shape[2]
        if hq != hk:
            g = hq // hk
            k = k[:, None].expand(hk, g, n, length, d).reshape(hq, n, length, d)
            v = v[:, None].expand(hk, g, n, length, d).reshape(hq, n, length, d)
        keys = k.reshape(hq * n, length, d).transpose(1, 2)
        scores = torch.baddbmm(mask, q.reshape(hq * n, lq, d), keys, alpha=scale)
        return torch.bmm(torch.softmax(scores, dim=-1), v.reshape(hq * n, length, d)).view(hq, n, lq, d)

    # ------------------------------------------------------------------ prefill
    def prefill(self, slot_ids: list[int], prompts: list[list[int]]) -> "torch.Tensor":
        """Run ``prompts`` into ``slot_ids``; returns next-token logits [n, vocab] (fp32).

        Work is shared where it is provably identical: a prompt that several rows share is run
        once and its cache copied to the other slots, and a token whose whole prefix (itself
        included) occurs in several prompts — at least the leading bos — is computed once (a
        token's hidden states depend only on its prefix). Matmuls run on these unique prefix
        nodes; attention runs per prompt, padded, on keys/values gathered from the nodes; the
        last layer runs attention output and MLP for each prompt's last position only."""
        import torch
        import torch.nn.functional as F

        assert self.k_cache is not None and self.v_cache is not None and self._cos is not None
        plan = plan_prefill(slot_ids, prompts)
        inverse, u_slots, dup_src, dup_dst, uniq = plan.inverse, plan.u_slots, plan.dup_src, plan.dup_dst, plan.uniq
        node_tok, node_pos, cells, first_cell = plan.node_tok, plan.node_pos, plan.cells, plan.first_cell
        n, width = len(uniq), max(len(p) for p in uniq)
        dev = self.device
        hq, hk, d = self.n_heads, self.n_kv, self.head_dim
        m = len(node_tok)
        lens = torch.tensor([len(p) for p in uniq], device=dev)
        cells_t = torch.tensor(cells, device=dev)
        first_cell_t = torch.tensor(first_cell, device=dev)
        last_cell = torch.arange(n, device=dev) * width + lens - 1
        last_node = cells_t[last_cell]
        pos_t = torch.tensor(node_pos, device=dev)
        cos, sin = self._cos[pos_t][:, None], self._sin_signed[pos_t][:, None]  # [m, 1, d]
        ar = torch.arange(width, device=dev)
        key_ok = ar[None, :] < lens[:, None]  # [n, L]
        visible = (ar[None, :] <= ar[:, None])[None] & key_ok[:, None, :]  # [n, L(query), L(key)]
        causal = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
        last_mask = causal[torch.arange(n, device=dev), lens - 1][:, None]  # [n, 1, L]: the last query's row
        contiguous = u_slots == list(range(u_slots[0], u_slots[0] + n))
        slots_t = torch.tensor(u_slots, device=dev)
        causal = causal.expand(hq, n, width, width).reshape(hq * n, width, width)  # per (head, row) batch
        last_mask = last_mask.expand(hq, n, 1, width).reshape(hq * n, 1, width)
        x = F.embedding(torch.tensor(node_tok, device=dev), self._embed)  # [m, hidden]
        for i, w in enumerate(self._w):
            qkv = F.linear(self._norm(x, w.ln1), w.qkv, w.qkv_b).view(m, hq + 2 * hk, d)
            qkv[:, : hq + hk] = self._rope(qkv[:, : hq + hk], cos, sin)
            # head-major and padded: [heads, n, L, d], so each head's rows are one bmm batch
            heads = qkv.transpose(0, 1).contiguous().index_select(1, cells_t).view(hq + 2 * hk, n, width, d)
            kp, vp = heads[hq : hq + hk], heads[hq + hk :]  # [hk, n, L, d]
            if contiguous:
                self.k_cache[i, u_slots[0] : u_slots[0] + n, :, :width] = kp.transpose(0, 1)
                self.v_cache[i, u_slots[0] : u_slots[0] + n, :, :width] = vp.transpose(0, 1)
            else:
                self.k_cache[i][:, :, :width].index_copy_(0, slots_t, kp.transpose(0, 1))
                self.v_cache[i][:, :, :width].index_copy_(0, slots_t, vp.transpose(0, 1))
            if i < len(self._w) - 1:
                o = self._attend(heads[:hq], kp, vp, causal, w.scale)  # [hq, n, L, d]
                o = o.view(hq, n * width, d).index_select(1, first_cell_t).transpose(0, 1).reshape(m, hq * d)
                x = self._mlp(self._residual(x, o, w.o_t, w.o_b), w)
            else:  # only each prompt's last position feeds the logits
                q = qkv[last_node, :hq].transpose(0, 1)[:, :, None]  # [hq, n, 1, d]
                o = self._attend(q, kp, vp, last_mask, w.scale)  # [hq, n, 1, d]
                o = o.view(hq, n, d).transpose(0, 1).reshape(n, hq * d)
                x = self._mlp(self._residual(x[last_node], o, w.o_t, w.o_b), w)
        logits = self._head(x)
        self.move(dup_src, dup_dst, width)
        return logits if not dup_src else logits[torch.tensor(inverse, device=dev)]

    # ------------------------------------------------------------------ decode
    def decode(self, tokens: "torch.Tensor", positions: "torch.Tensor", span: int) -> "torch.Tensor":
        """One token for each of the first ``k = len(tokens)`` slots at ``positions``; attention
        reads positions ``< span`` (``span > max(positions)``). Returns logits [k, vocab] (fp32)."""
        import torch
        import torch.nn.functional as F

        assert self.k_cache is not None and self.v_cache is not None and self._cos is not None
        k = tokens.shape[0]
        hq, hk, d = self.n_heads, self.n_kv, self.head_dim
        g = hq // hk
        dev = self.device
        assert self._ar is not None
        write = self._flat_index(self._ar[:k], positions)  # [k * hk]
        # additive mask, one row per (slot, kv head): key j is visible iff j <= the slot's position
        visible = self._ar[:span][None, :] <= positions[:, None]
        mask = torch.zeros(k, span, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None, :].expand(k, hk, 1, span).reshape(k * hk, 1, span)
        cos, sin = self._cos[positions][:, None], self._sin_signed[positions][:, None]  # [k, 1, d]
        x = F.embedding(tokens, self._embed)  # [k, hidden]
        for i, w in enumerate(self._w):
            qkv = F.linear(self._norm(x, w.ln1), w.qkv, w.qkv_b).view(k, hq + 2 * hk, d)
            qk = self._rope(qkv[:, : hq + hk], cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.view(-1, d).index_copy_(0, write, qk[:, hq:].reshape(k * hk, d))
            vc.view(-1, d).index_copy_(0, write, qkv[:, hq + hk :].reshape(k * hk, d))
            q = qk[:, :hq].reshape(k * hk, g, d)  # q head j attends with kv head j // g (HF's repeat_kv)
            keys = kc[:k, :, :span].view(k * hk, span, d)  # a view: slots are the outer dimension
            scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=w.scale)  # [k hk, g, span]
            o = torch.bmm(torch.softmax(scores, dim=-1), vc[:k, :, :span].view(k * hk, span, d))
            x = self._mlp(self._residual(x, o.view(k, hq * d), w.o_t, w.o_b), w)
        return self._head(x)
