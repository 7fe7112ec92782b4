"""Diffusion drafters made from autoregressive verifiers, the way real diffusion LMs are made (Dream-7B from
Qwen2.5-7B, DiffusionGemma from Gemma): the verifier's own weights in a diffusion architecture, keeping only its
first ``layers`` layers (then its final norm and its tied head), so that the drafter costs less than the verifier.

- :func:`dream_from_llama` — a Llama verifier (SmolLM2) as a Dream-style masked-diffusion LM
  (``align/models/dream.py``): every weight maps 1:1; attention becomes bidirectional, position i predicts token
  i + 1 (as the causal model's did), and a mask token is added after the vocabulary (one embedding row, the mean of
  the others). With all layers and a lower-triangular mask it *is* the verifier (``tests/test_derive.py``).
- :func:`diffusiongemma_from_gemma3` — a Gemma 3 verifier as a DiffusionGemma block-diffusion drafter
  (``align/models/diffusiongemma.py``: DiffusionGemma with Gemma 3's value path). Its encoder computes what Gemma 3
  computes: RMSNorm weights w become 1 + w (Gemma 3 scales by 1 + w, Gemma 4 by w); q_norm becomes (1 + w) / 16,
  which folds Gemma 3's query scaling (query_pre_attn_scalar^-½) into DiffusionGemma's scaling of 1; full layers
  rotate every dimension at θ 10⁶ as Gemma 3's do (not a quarter, as Gemma 4's); the always-present mixture of
  experts is neutralised (two small experts whose down projections are zero: their branch adds exactly 0) and the
  logit soft-cap made neutral (``NEUTRAL_SOFTCAP``; Gemma 3 has none); the vision tower is a stub. The decoder shares every weight with the
  encoder, as DiffusionGemma's does; it has to learn to fill a canvas (adaptation pretraining, ``align/zoo/adapt.py``).
- :func:`early_exit_from_llama` — a Llama verifier's first layers, final norm and head as a causal LM: the
  autoregressive assistant a user would make from it (trained by ``python -m align.baseline train --init``).

Every derive function takes ``(verifier, tokenizer, layers)`` and returns ``(drafter, its tokenizer)``, on the CPU
in float32: a real pair's build spec names one (``align/zoo/pairs.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from align.errors import AlignError

MASK_TOKEN = "<|mask|>"  # what Dream calls its mask token
#: DiffusionGemma's forward always soft-caps its logits, tanh(x / c) · c; Gemma 3 has no cap. At c = 2^20 the cap
#: changes nothing: x / c and · c are exact (a power of two) and tanh(y) rounds to y for |y| < 2^-10 in float32 and
#: bfloat16, i.e. for every logit below 1024 (checked bitwise in tests/test_derive.py)
NEUTRAL_SOFTCAP = 2.0 ** 20


def keep_layers(total: int, layers: int | None, valid: list[int] | None = None) -> int:
    """The number of layers to keep (None: all), refused when out of range or not in ``valid``."""
    layers = total if layers is None else layers
    if not 1 <= layers <= total:
        raise AlignError(f"a drafter can keep 1 to {total} of the verifier's layers, not {layers}")
    if valid is not None and layers not in valid:
        raise AlignError(f"a drafter made from this verifier keeps {', '.join(map(str, valid))} layers (its last "
                         f"layer must be a full-attention layer), not {layers}")
    return layers


# ------------------------------------------------------------------------------------------------ Dream from Llama


def dream_from_llama(verifier: Any, tokenizer: Any, layers: int | None = None) -> tuple[Any, Any]:
    """(Dream-style drafter, its tokenizer: the verifier's plus the mask token) from a ``LlamaForCausalLM``."""
    from align.models.dream import DreamLlamaConfig, DreamLlamaModel

    source = verifier.config
    n = keep_layers(source.num_hidden_layers, layers)
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    mask_id = tokenizer.mask_token_id
    vocab = max(source.vocab_size, mask_id + 1)
    fields = source.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "auto_map", "_name_or_path", "dtype"):
        fields.pop(key, None)
    fields.update(num_hidden_layers=n, vocab_size=vocab, mask_token_id=mask_id, use_cache=False)
    config = DreamLlamaConfig(**fields)
    config.auto_map = {"AutoConfig": "dream.DreamLlamaConfig", "AutoModel": "dream.DreamLlamaModel"}
    drafter = DreamLlamaModel(config)
    weights = {k: v for k, v in verifier.state_dict().items() if _layer_of(k) is None or _layer_of(k) < n}
    embed = weights["model.embed_tokens.weight"]
    rows = torch.cat([embed, embed.mean(0, keepdim=True).expand(vocab - embed.shape[0], -1)])
    weights["model.embed_tokens.weight"] = rows
    weights["lm_head.weight"] = rows if config.tie_word_embeddings else torch.cat(
        [weights["lm_head.weight"], torch.zeros(vocab - embed.shape[0], embed.shape[1], device="cpu")])
    _load(drafter, weights, "Dream")
    return drafter.eval(), tokenizer


# ------------------------------------------------------------------------------------------------ an early exit


def early_exit_from_llama(verifier: Any, tokenizer: Any, layers: int | None = None) -> tuple[Any, Any]:
    """(autoregressive drafter, the verifier's tokenizer) from a ``LlamaForCausalLM``: its first ``layers`` layers,
    its final norm and its (tied) head, as a causal LM of its own: the assistant a user of assisted generation would
    make from the verifier (an early exit), for ``align.baseline train --init`` to train on the verifier's rollouts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = verifier.config
    n = keep_layers(source.num_hidden_layers, layers)
    fields = source.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "_name_or_path", "dtype"):
        fields.pop(key, None)
    fields.update(num_hidden_layers=n)
    drafter = LlamaForCausalLM(LlamaConfig(**fields))
    drafter.generation_config = verifier.generation_config
    weights = {k: v for k, v in verifier.state_dict().items() if _layer_of(k) is None or _layer_of(k) < n}
    _load(drafter, weights, "early-exit")
    return drafter.eval(), tokenizer


def dflash_layers_from(drafter: Any, verifier: Any, layers: list[int]) -> Any:
    """A feature-conditioned drafter (``align.models.dflash``) whose layer i starts as the verifier's layer
    ``layers[i]`` (a Llama's: attention and MLP projections, both norms; the per-head query and key norms, which a
    Llama does not have, stay at 1). ``fc``, ``hidden_norm`` and the final norm keep their own weights."""
    source = verifier.model.layers
    if len(layers) != len(drafter.layers) or not all(0 <= i < len(source) for i in layers):
        raise AlignError(f"the drafter's {len(drafter.layers)} layers cannot start as the verifier's layers {layers} "
                         f"(it has {len(source)})")
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, (source[i] for i in layers)):
            for name in names:
                a, b = mine.get_submodule(name), theirs.get_submodule(name)
                if a.weight.shape != b.weight.shape:
                    raise AlignError(f"the drafter's {name} is {tuple(a.weight.shape)}, the verifier's "
                                     f"{tuple(b.weight.shape)}: it must have the verifier's shape to start as it")
                a.weight.copy_(b.weight)
    return drafter


# ------------------------------------------------------------------------------------------------ DiffusionGemma from Gemma 3


def gemma3_layers(config: Any) -> list[int]:
    """The depths a DiffusionGemma made from Gemma 3 may have: its last layer must be a full-attention layer."""
    return [i + 1 for i, kind in enumerate(config.layer_types) if kind == "full_attention"]


def diffusiongemma_config(source: Any, layers: int, experts: int = 2, expert_size: int = 64) -> Any:
    """The DiffusionGemma configuration of a drafter made from Gemma 3 text config ``source``, ``layers`` deep."""
    from transformers import DiffusionGemmaConfig

    rope = source.rope_parameters
    text = dict(
        vocab_size=source.vocab_size, hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads, head_dim=source.head_dim, global_head_dim=source.head_dim,
        num_global_key_value_heads=source.num_key_value_heads, hidden_activation=source.hidden_activation,
        max_position_embeddings=source.max_position_embeddings, rms_norm_eps=source.rms_norm_eps,
        sliding_window=source.sliding_window, layer_types=list(source.layer_types[:layers]),
        rope_parameters={kind: {"rope_type": "default", "rope_theta": rope[kind]["rope_theta"]}
                         for kind in ("sliding_attention", "full_attention")},
        final_logit_softcapping=NEUTRAL_SOFTCAP, attention_bias=source.attention_bias,
        num_experts=experts, top_k_experts=1, moe_intermediate_size=expert_size,
        pad_token_id=source.pad_token_id, eos_token_id=source.eos_token_id, bos_token_id=source.bos_token_id,
        tie_word_embeddings=True, value_path="gemma3",
    )
    vision = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=8, position_embedding_size=16)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=256)


def diffusiongemma_from_gemma3(verifier: Any, tokenizer: Any = None, layers: int | None = None) -> tuple[Any, Any]:
    """(DiffusionGemma drafter with Gemma 3's value path, its tokenizer: the verifier's) from a ``Gemma3ForCausalLM``;
    see the module docstring."""
    from align.models.diffusiongemma import Gemma3ValueDiffusionGemma

    source = verifier.config
    if getattr(source, "attn_logit_softcapping", None) or getattr(source, "final_logit_softcapping", None):
        raise AlignError("this Gemma 3 soft-caps its attention or its logits, which a DiffusionGemma drafter made "
                         "from it cannot reproduce")
    n = keep_layers(source.num_hidden_layers, layers, gemma3_layers(source))
    drafter = Gemma3ValueDiffusionGemma(diffusiongemma_config(source, n))
    scale = source.query_pre_attn_scalar ** -0.5
    weights: dict[str, torch.Tensor] = {}
    for key, value in verifier.state_dict().items():
        layer = _layer_of(key)
        if layer is not None and layer >= n:
            continue
        name = key.replace("model.layers.", "model.decoder.layers.").replace("model.norm.", "model.decoder.norm.")
        name = name.replace("model.embed_tokens.", "model.decoder.embed_tokens.")
        if key.endswith("norm.weight"):  # Gemma 3's RMSNorm scales by 1 + w
            value = 1.0 + value.float()
            if key.endswith("q_norm.weight"):
                value = value * scale
        weights[name] = value
    for i, layer in enumerate(drafter.model.decoder.layers):
        prefix = f"model.decoder.layers.{i}."
        width = layer.post_feedforward_layernorm_2.weight.shape[0]
        for norm in ("post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            weights[prefix + norm + ".weight"] = torch.ones(width, device="cpu")
        weights[prefix + "experts.down_proj"] = torch.zeros_like(layer.experts.down_proj)
        weights[prefix + "layer_scalar"] = torch.ones_like(layer.layer_scalar)
    _load(drafter, weights, "DiffusionGemma", shared=("model.encoder.", "lm_head.", "model.decoder.self_conditioning",
                                                       "model.vision", "model.embed_vision", "experts.gate_up_proj",
                                                       "router."))
    return drafter.eval(), tokenizer


def _layer_of(key: str) -> int | None:
    """The layer index in a state-dict key ``model.layers.N. ...`` (None for other keys)."""
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return None


def _load(model: Any, weights: dict[str, torch.Tensor], what: str, shared: tuple[str, ...] = ()) -> None:
    """Load ``weights`` into ``model``; every tensor must land, and every tensor left out must be tied to one that
    did or be one of ``shared`` (weights of the new architecture that nothing maps to)."""
    with torch.no_grad():
        own = model.state_dict()
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise AlignError(f"the {what} drafter has no tensor {unknown[0]} to map the verifier's onto")
        for name, value in weights.items():
            if own[name].shape != value.shape:
                raise AlignError(f"the verifier's {name} has shape {tuple(value.shape)}, the {what} drafter's "
                                 f"{tuple(own[name].shape)}")
            own[name].copy_(value.to(own[name].dtype))
        left = [k for k in own if k not in weights and not any(s in k for s in shared)]
        if left:
            raise AlignError(f"no verifier weight maps to the {what} drafter's {left[0]}")
