"""Model configurations of the tiny zoo (and of the tiny random models the tests build).

Each builder takes flat sizes, so tests can make 16-wide versions of exactly the architectures the zoo trains.
All three use standard transformers classes, saved with ``save_pretrained`` and loaded with ``from_pretrained``
like any real model.
"""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
    LlamaConfig,
    LlamaForCausalLM,
)

# Gemma's special-token ids, which the tiny tokenizer follows
PAD, EOS, BOS = 0, 1, 2


def verifier_model(vocab_size: int, hidden: int = 256, layers: int = 4, heads: int = 4, max_len: int = 512,
                   seed: int = 0) -> LlamaForCausalLM:
    """The verifier: a causal Llama."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False, rope_theta=10000.0,
    )
    return LlamaForCausalLM(config)


def diffusiongemma_model(vocab_size: int, hidden: int = 128, layers: int = 3, heads: int = 4, experts: int = 4,
                         max_len: int = 512, seed: int = 0, sliding: int = 0) -> DiffusionGemmaForBlockDiffusion:
    """A text-only DiffusionGemma block-diffusion drafter (uniform-noise canvas); its vision tower is a stub.

    ``sliding``: the first layers that are sliding-window layers, as in the real model (its pattern is sliding
    layers then a full one). Their window is ``max_len``, so they see what a full layer sees, but they rotate every
    head dimension at θ = 10⁴, where full layers rotate a quarter at θ = 10⁶ (Gemma 4's proportional RoPE): the
    canvas positions tell the block's first token from its sixteenth more sharply."""
    torch.manual_seed(seed)
    head_dim = hidden // heads
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
        global_head_dim=head_dim, num_experts=experts, top_k_experts=2, moe_intermediate_size=hidden,
        max_position_embeddings=max_len, sliding_window=max_len,
        layer_types=["sliding_attention"] * min(sliding, layers) + ["full_attention"] * max(0, layers - sliding),
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
    )
    vision = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=8, position_embedding_size=16)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=32)
    return DiffusionGemmaForBlockDiffusion(config)


def mdlm_model(vocab_size: int, hidden: int = 128, layers: int = 3, heads: int = 4, max_len: int = 512,
               seed: int = 0) -> BertForMaskedLM:
    """A bidirectional masked-diffusion drafter with same-position logits (a BERT masked LM)."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, max_position_embeddings=max_len, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD, type_vocab_size=1,
    )
    return BertForMaskedLM(config)


def dflash_model(verifier_config, target_layer_ids: list[int], mask_token_id: int, layers: int = 1,
                 intermediate: int | None = None, heads: int | None = None, kv_heads: int | None = None,
                 head_dim: int | None = None, seed: int = 0):
    """A feature-conditioned drafter (``align.models.dflash``) for a verifier of ``verifier_config``: its width
    and rotary base (it shares the verifier's embeddings and head), reading the verifier's layers
    ``target_layer_ids``; heads default to the verifier's."""
    from align.models.dflash import DFlashConfig, DFlashDraftModel, rope_theta

    torch.manual_seed(seed)
    text = verifier_config.get_text_config()
    heads = heads or text.num_attention_heads
    config = DFlashConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=intermediate or text.hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        head_dim=head_dim or text.hidden_size // heads, max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta(text)},
        target_hidden_size=text.hidden_size,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    )
    return DFlashDraftModel(config)
