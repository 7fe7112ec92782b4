"""A verifier-conditioned block-diffusion drafter (DFlash-style): a few transformer layers that draft a whole block
in one pass from the verifier's own hidden states.

The context is the verifier's residual stream after a few of its layers (``dflash_config.target_layer_ids``,
0-based), concatenated per position, projected to the drafter's width by ``fc`` and normalised by ``hidden_norm``;
in every drafter layer it becomes keys and values (that layer's ``k_proj`` / ``v_proj``, ``k_norm``, rotary
embedding at the context positions) and nothing else: the context never goes through a layer's norms or MLP. The
block is the verifier's last produced token followed by γ mask tokens, embedded with the verifier's own
embeddings, at the positions after the context; its rows attend to the context and to each other
(bidirectionally), and row j (1..γ) is read through the verifier's own LM head as the draft of position j.
Embeddings and head are the verifier's and are not part of this model: only the layers, ``fc`` and the norms train.

The layers are Qwen3's (per-head RMS norms on queries and keys, SwiGLU MLP), and the module names, the config
(``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``, ``dflash_config``) and this conditioning are those
vLLM's ``dflash`` speculative method loads (vllm/model_executor/models/qwen3_dflash.py), so a saved drafter is
served by vLLM as it is (docs/dflash.md). Written for this project from that description; it imports nothing from
``align``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

ARCHITECTURE = "DFlashDraftModel"


class DFlashConfig(Qwen3Config):
    """Qwen3's config plus what DFlash reads: ``dflash_config = {"mask_token_id", "target_layer_ids"}`` and
    ``target_hidden_size`` (the verifier's width)."""

    def __init__(self, dflash_config: dict | None = None, target_hidden_size: int | None = None, **kwargs):
        self.dflash_config = dict(dflash_config or {})
        self.target_hidden_size = target_hidden_size
        kwargs.setdefault("architectures", [ARCHITECTURE])
        super().__init__(**kwargs)

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config.get("target_layer_ids", []))

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @property
    def draft_vocab(self) -> list[int] | None:
        """The token ids the drafter proposes (its head: those rows of the verifier's), or None: all of them."""
        found = self.dflash_config.get("draft_vocab")
        return list(found) if found else None


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight · x / sqrt(mean(x²) + eps), the normalisation in float32 (at least), returned in x's dtype."""
        dtype = x.dtype
        x = F.rms_norm(x.to(torch.promote_types(dtype, torch.float32)), x.shape[-1:], eps=self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, 1, S, d) of the rotary embedding at ``positions`` (B, S), in ``dtype`` (at least float32):
    computed once per pass, shared by every layer's queries and keys."""
    dtype = torch.promote_types(dtype, torch.float32)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim))
    angles = positions[:, None, :, None].to(dtype) * inv  # (B, 1, S, d / 2)
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding (the half-split layout) of x (B, heads, S, d) by the ``table`` of :func:`rotary`."""
    cos, sin = table
    d = x.shape[-1]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return (x.to(cos.dtype) * cos + half.to(cos.dtype) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated by ``table``, :func:`rotary` at their positions) and values (B, kv_heads, S, d) of rows x
        (B, S, H)."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, table), v

    def forward(self, x, table, context, mask):
        b, s, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2), table)
        k, v = self.keys_values(x, table)
        if context is not None:
            k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)
        # each key-value head serves heads / kv_heads query heads, read in place (no repeated copy of the context)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(config), MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, table, context, mask):
        h = h + self.self_attn(self.input_layernorm(h), table, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(PreTrainedModel):
    """The drafter's layers; embeddings and head are the verifier's (see the module docstring).

    ``context(features, positions)`` turns the verifier's concatenated hidden states (B, C, n · H_verifier) into
    each layer's keys and values; ``forward(embeds, positions, context, mask)`` runs the block rows (B, Q, H) over
    them and returns the final hidden states (B, Q, H) for the verifier's head. ``mask`` (B, 1, Q, C + Q), True
    where a row may look, defaults to every row seeing everything.
    """

    config_class = DFlashConfig
    base_model_prefix = ""
    _no_split_modules = ["Layer"]

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        features = len(config.target_layer_ids) * (config.target_hidden_size or config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values (B, kv_heads, C, d) of the verifier's features (B, C, F) at ``positions``."""
        x = self.hidden_norm(self.fc(features))
        table = rotary(positions, self.config.head_dim, rope_theta(self.config), x.dtype)
        return [layer.self_attn.keys_values(x, table) for layer in self.layers]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, context=None, mask: torch.Tensor | None = None,
                features: torch.Tensor | None = None, feature_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of the block rows; the context as ``context`` (from :meth:`context`) or as raw
        ``features`` at ``feature_positions`` (one call: what training runs)."""
        if context is None and features is not None:
            context = self.context(features, feature_positions)
        h = embeds
        table = rotary(positions, self.config.head_dim, rope_theta(self.config), h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, table, None if context is None else context[i], mask)
        return self.norm(h)


def rope_theta(config) -> float:
    """θ of the rotary embedding, from transformers 5's ``rope_parameters`` or the older ``rope_theta``."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class DecodePass(nn.Module):
    """:meth:`DFlashDraftModel.context` and its forward as decoding runs them: one call per block, in fewer and
    larger matrix products. The new context rows' keys and values of every layer come from one linear (every layer
    reads the same projected features), each layer's queries, keys and values from one, its gate and up from one;
    the normalisations and rotations of the context keys run once for all layers. The same function as the model's
    (tests/test_dflash.py); built from a trained model's float or int8 weights, for decoding only, sharing its norms,
    ``fc``, ``o_proj`` and ``down_proj``."""

    def __init__(self, model: DFlashDraftModel):
        super().__init__()
        config = model.config
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.theta, self.eps = rope_theta(config), config.rms_norm_eps
        self.fc, self.hidden_norm, self.norm = model.fc, model.hidden_norm, model.norm
        attention = [layer.self_attn for layer in model.layers]
        self.context_kv = fused([linear for a in attention for linear in (a.k_proj, a.v_proj)])
        self.register_buffer("k_norms", torch.stack([a.k_norm.weight.detach() for a in attention])[:, None],
                             persistent=False)  # (L, 1, d)
        self.layers = nn.ModuleList()
        for layer, a in zip(model.layers, attention):
            fast = nn.Module()
            fast.qkv = fused([a.q_proj, a.k_proj, a.v_proj])
            fast.gate_up = fused([layer.mlp.gate_proj, layer.mlp.up_proj])
            fast.o_proj, fast.down_proj, fast.q_norm, fast.k_norm = a.o_proj, layer.mlp.down_proj, a.q_norm, a.k_norm
            fast.input_layernorm, fast.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
            self.layers.append(fast)

    def forward(self, features: torch.Tensor | None, feature_positions: torch.Tensor | None, embeds: torch.Tensor,
                positions: torch.Tensor, cache: "ContextCache") -> torch.Tensor:
        """The block rows' final hidden states (B, Q, H) over the context in ``cache``, which first grows by the
        verifier's ``features`` (B, C, F) at ``feature_positions`` (B, C) (None: no new context rows)."""
        count, heads, kv_heads, d = len(self.layers), self.heads, self.kv_heads, self.head_dim
        b, s, _ = embeds.shape
        c = 0 if features is None else features.shape[1]
        keys, values = cache.reserve(cache.length + c + s, (count, b, kv_heads, d), embeds.dtype, embeds.device)
        if c:
            x = self.hidden_norm(self.fc(features))
            kv = self.context_kv(x).view(b, c, count, 2, kv_heads, d).permute(3, 2, 0, 4, 1, 5)  # (2, L, B, kv, C, d)
            k = F.rms_norm(kv[0].to(torch.promote_types(kv.dtype, torch.float32)), (d,), eps=self.eps)
            k = rotate(self.k_norms[:, None, None] * k.to(kv.dtype), rotary(feature_positions, d, self.theta, x.dtype))
            keys[:, :, :, cache.length:cache.length + c] = k
            values[:, :, :, cache.length:cache.length + c] = kv[1]
            cache.length += c
        n = cache.length  # the block's own keys and values go after the context, uncommitted
        h = embeds
        table = rotary(positions, d, self.theta, h.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.input_layernorm(h)).split([heads * d, kv_heads * d, kv_heads * d], -1)
            q = rotate(layer.q_norm(q.view(b, s, heads, d)).transpose(1, 2), table)
            keys[i, :, :, n:n + s] = rotate(layer.k_norm(k.view(b, s, kv_heads, d)).transpose(1, 2), table)
            values[i, :, :, n:n + s] = v.view(b, s, kv_heads, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, keys[i, :, :, :n + s], values[i, :, :, :n + s],
                                                 enable_gqa=heads != kv_heads)
            h = h + layer.o_proj(out.transpose(1, 2).reshape(b, s, -1))
            gate, up = layer.gate_up(layer.post_attention_layernorm(h)).chunk(2, -1)
            h = h + layer.down_proj(F.silu(gate) * up)
        return self.norm(h)


class ContextCache:
    """Every layer's keys and values of the context, (L, B, kv_heads, capacity, d) each, ``length`` positions of them
    kept, with room after them for a block's own rows: a block writes only its new rows, never copies the context.
    A rolled-back or new sequence sets ``length`` lower."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def reserve(self, size: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, grown (doubling) to hold at least ``size`` positions of (L, B, kv_heads, ·, d)."""
        if self.keys is None or self.keys.shape[3] < size:
            count, b, kv_heads, d = shape
            capacity = max(size, 256, 0 if self.keys is None else 2 * self.keys.shape[3])
            keys, values = (torch.empty(count, b, kv_heads, capacity, d, dtype=dtype, device=device) for _ in "kv")
            if self.length:
                keys[:, :, :, :self.length] = self.keys[:, :, :, :self.length]
                values[:, :, :, :self.length] = self.values[:, :, :, :self.length]
            self.keys, self.values = keys, values
        return self.keys, self.values


def fused(layers: list[nn.Module]) -> nn.Linear:
    """One float linear layer whose output is the given linear layers' outputs side by side (an int8 layer's
    weights dequantized: its weight and bias are methods)."""
    weights, biases = zip(*((layer.weight().dequantize(), layer.bias()) if callable(layer.weight)
                            else (layer.weight, layer.bias) for layer in layers))
    weight = torch.cat([w.detach() for w in weights])
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device=weight.device,
                      dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if layer.bias is not None:
            layer.bias.copy_(torch.cat([bias.detach() for bias in biases]))
    return layer.requires_grad_(False)
