"""Stub models: lookup tables behind the Hugging Face call conventions, thousands of times faster than a real model.

``StubCausalLM`` is a genuine causal LM: the next-token logits depend on the current token and the one before it,
it stores its tokens in a real ``DynamicCache`` (so caching and rollback are exercised) and it honours a custom 4D
attention mask with position ids (so tree-shaped multi-draft scoring is exercised). ``StubMaskedLM`` reads a canvas
like a same-position masked LM. Exact distributions are cheap to enumerate, which the statistical tests need.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import GenerationConfig, LlamaConfig


class StubCausalLM(torch.nn.Module):
    def __init__(self, vocab: int, seed: int, sharpness: float = 1.5):
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, max_position_embeddings=64)
        self.config._attn_implementation = "sdpa"
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab + 1, vocab, vocab, generator=generator,
                                                    dtype=torch.float64) * sharpness)  # [previous, current] -> next
        self.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)

    @property
    def dtype(self):
        return self.table.dtype

    def forward(self, input_ids, past_key_values=None, use_cache=True, attention_mask=None, position_ids=None, **kw):
        batch, n = input_ids.shape
        start = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + n)[None]
        new = torch.stack([input_ids.double(), position_ids.expand(batch, -1).double()], -1)[:, None]  # (B, 1, n, 2)
        keys = past_key_values.update(new, new, 0)[0] if past_key_values is not None else new
        tokens, positions = keys[:, 0, :, 0].long(), keys[:, 0, :, 1].long()  # (B, start + n)
        if attention_mask is not None and attention_mask.dim() == 4:
            visible = attention_mask[:, 0] == 0  # (1, n, start + n)
        else:
            visible = torch.arange(start + n)[None, None, :] <= (start + torch.arange(n))[None, :, None]
        before = visible & (positions[:, None, :] == position_ids[..., None] - 1)  # the visible predecessor
        previous = torch.where(before.any(-1), (before * tokens[:, None, :]).sum(-1), self.table.shape[0] - 1)
        return SimpleNamespace(logits=self.table[previous, input_ids])


class StubMaskedLM(torch.nn.Module):
    """Same-position logits from (token before, token here): a masked LM sees [MASK] at canvas positions."""

    def __init__(self, vocab: int, seed: int, sharpness: float = 1.5):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, vocab, generator=generator) * sharpness)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):
        previous = torch.cat([input_ids[:, :1], input_ids[:, :-1]], dim=1)
        return SimpleNamespace(logits=self.table[previous, input_ids])
