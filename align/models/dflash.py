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
