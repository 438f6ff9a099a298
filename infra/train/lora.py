"""LoRA adapters (peft) on the policy, and the adapter-only tensors that weight sync moves.

With ``trainer.lora.enabled`` the trainer wraps the policy with ``peft.get_peft_model``: the base
weights are frozen and only the low-rank factors train. Publishing then sends only the adapters
(:func:`publishable_adapter_state`), a few percent of the model, instead of
:func:`infra.model.publishable_state`:

- names are the adapted layer's Hugging Face name plus ``.lora_A`` / ``.lora_B``
  (e.g. ``model.layers.0.self_attn.q_proj.lora_A``), bf16;
- ``lora_B`` is **pre-scaled** by ``alpha / rank``, so a reader needs no config:
  ``W = W_base + B @ A``.

A rollout worker keeps a copy of its base weights for the adapted layers (:func:`base_weights`) and
applies each new version with :func:`load_published_adapters` (merge into the served weights; no
peft at inference). :func:`is_adapter_state` tells the two kinds of published state apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from infra.config import LoraConfig

_PEFT_PREFIX = "base_model.model."


def apply_lora(model: "torch.nn.Module", lcfg: "LoraConfig") -> "torch.nn.Module":
    """Wrap ``model`` with LoRA adapters on ``lcfg.target_modules`` (base weights frozen)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    cfg = PeftLoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                         target_modules=list(lcfg.target_modules), bias="none")
    return get_peft_model(model, cfg)


def _split(name: str) -> tuple[str, str] | None:
    """peft parameter name -> (HF module name, 'lora_A'|'lora_B'), or None for other parameters."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    for kind in ("lora_A", "lora_B"):
        marker = f".{kind}."
        if marker in name:
            return name.split(marker)[0], kind
    return None


def hf_name(name: str) -> str:
    """peft parameter name of a base weight -> its Hugging Face name."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def publishable_adapter_state(named: dict[str, "torch.Tensor"], scale: float) -> dict[str, "torch.Tensor"]:
    """Adapter factors from a peft model's named parameters, bf16, ``lora_B`` pre-scaled by ``scale``."""
    import torch

    out = {}
    for name, t in named.items():
        split = _split(name)
        if split is None:
            continue
        module, kind = split
        t = t.detach().float() * (scale if kind == "lora_B" else 1.0)
        out[f"{module}.{kind}"] = t.to(device="cpu", dtype=torch.bfloat16).contiguous()
    return out


def is_adapter_state(tensors: dict[str, "torch.Tensor"]) -> bool:
    """True if ``tensors`` were made by :func:`publishable_adapter_state`."""
    return bool(tensors) and all(k.endswith((".lora_A", ".lora_B")) for k in tensors)


def base_weights(model: "torch.nn.Module", tensors: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """fp32 copies of the base weights of the layers adapted in ``tensors`` (keep them once)."""
    params = dict(model.named_parameters())
    modules = {k.rsplit(".", 1)[0] for k in tensors}
    return {m: params[f"{m}.weight"].detach().float().clone() for m in sorted(modules)}


def load_published_adapters(model: "torch.nn.Module", base: dict[str, "torch.Tensor"],
                            tensors: dict[str, "torch.Tensor"]) -> None:
    """Set every adapted layer of a plain model to ``W_base + B @ A`` (in place)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for module, w0 in base.items():
            a = tensors[f"{module}.lora_A"].float()
            b = tensors[f"{module}.lora_B"].float()
            p = params[f"{module}.weight"]
            p.copy_((w0 + b @ a).to(dtype=p.dtype, device=p.device))


def merged_state(named: dict[str, "torch.Tensor"], scale: float) -> dict[str, "torch.Tensor"]:
    """Full Hugging Face state (fp32) of a peft model with the adapters merged in (for export)."""
    adapters = {}
    for name, t in named.items():
        split = _split(name)
        if split is not None:
            adapters[split] = t.detach().float()
    out = {}
    for name, t in named.items():
        if _split(name) is not None:
            continue
        key = hf_name(name)
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and (module, "lora_A") in adapters:
            t = t.float() + scale * adapters[(module, "lora_B")] @ adapters[(module, "lora_A")]
        out[key] = t.detach().float()
    return out
