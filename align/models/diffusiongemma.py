"""DiffusionGemma with Gemma 3's value path: the block-diffusion drafter the zoo makes from Gemma 3.

transformers' ``DiffusionGemmaForBlockDiffusion`` is built on Gemma 4, which differs from Gemma 3 in three places no
weight mapping can bridge:

- full-attention layers take their values from the keys (they have no ``v_proj``);
- every layer normalises its values (``v_norm``, an RMSNorm without weights);
- the dense MLP's output is normalised twice (``post_feedforward_layernorm_1``, then, summed with the experts'
  branch, ``post_feedforward_layernorm``); Gemma 3 normalises it once. RMSNorm(RMSNorm(x)) is not RMSNorm(x) where
  the MLP's output is small beside the norm's eps: 1% apart on Gemma 3 270M's first full layer, 8% of next tokens
  changed after 18 layers.

Gemma 3 has a ``v_proj`` on every layer, no value norm and one norm after its MLP. :class:`Gemma3ValueDiffusionGemma`
is DiffusionGemma with those three: a ``v_proj`` on every layer, encoder and decoder (tied, as DiffusionGemma ties
all their weights), and no value norm or second MLP norm (:class:`Skipped`) — nothing else changed. With the weight
mapping of ``align/zoo/derive.py`` its encoder computes what Gemma 3 computes (``tests/test_derive.py``).

A folder saved from it records ``value_path: gemma3`` in its text config; :func:`drafter_class` picks the class a
DiffusionGemma folder needs (``align.loading`` loads through it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DiffusionGemmaForBlockDiffusion

VALUE_PATH = "gemma3"


class Skipped(nn.Module):
    """A norm DiffusionGemma has where Gemma 3 has none: its input, unchanged."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class Gemma3ValueDiffusionGemma(DiffusionGemmaForBlockDiffusion):
    """``DiffusionGemmaForBlockDiffusion`` whose attention layers compute values as Gemma 3's do."""

    def __init__(self, config: Any):
        super().__init__(config)
        text = config.text_config
        text.value_path = VALUE_PATH
        stacks = (self.model.encoder.language_model.layers, self.model.decoder.layers)
        for index, (encoder, decoder) in enumerate(zip(*stacks)):
            shared = None
            for layer in (encoder, decoder):
                attn = layer.self_attn
                if attn.v_proj is None:  # a full-attention layer: values of its own, one module for both stacks
                    kv_heads = attn.k_proj.out_features // attn.head_dim
                    shared = shared or nn.Linear(text.hidden_size, kv_heads * attn.head_dim, bias=text.attention_bias)
                    attn.v_proj = shared
                attn.v_norm = Skipped()
                layer.post_feedforward_layernorm_1 = Skipped()
        self.model.post_init()  # the weights to tie, found again (depth first, as __init__ found them)
        self.post_init()


def drafter_class(config: Any) -> type:
    """The class a DiffusionGemma folder with ``config`` loads into."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "value_path", None) == VALUE_PATH:
        return Gemma3ValueDiffusionGemma
    return DiffusionGemmaForBlockDiffusion
