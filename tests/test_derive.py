"""Drafters made from verifiers (align/zoo/derive.py), on tiny random Llama and Gemma 3 models: the mapped weights
compute what the verifier computes where the architectures agree, they save and load through align's loader, and
they decode losslessly."""

from __future__ import annotations

import pytest
import torch

from align.errors import AlignError


def tiny_llama(vocab: int = 96, layers: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(vocab: int = 96, layers: int = 6):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=8, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                              bos_token_id=2, layer_types=["sliding_attention"] * 2 + ["full_attention"]
                              + ["sliding_attention"] * 2 + ["full_attention"])
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma 3 initialises norms at 0 (a scale of 1); give them values to map
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return model


def tokenizer_for(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w2")


def test_dream_from_llama_is_the_verifier_under_a_causal_mask_and_adds_a_mask_token():
    from align.zoo.derive import dream_from_llama

    verifier = tiny_llama()
    drafter, tokenizer = dream_from_llama(verifier, tokenizer_for(96))
    assert tokenizer.mask_token_id == 96 and drafter.config.vocab_size == 97
    ids = torch.randint(3, 96, (2, 11))
    causal = torch.ones(11, 11, dtype=torch.bool).tril()[None, None].expand(2, -1, -1, -1)
    with torch.no_grad():
        expected = verifier(input_ids=ids).logits
        got = drafter(input_ids=ids, attention_mask=causal).logits
        kept = drafter(input_ids=ids, attention_mask=causal, logits_to_keep=3).logits
    assert torch.allclose(got[..., :96], expected, atol=1e-5)  # position i predicts token i + 1, as before
    assert torch.allclose(kept, got[:, -3:], atol=1e-6)
    assert drafter.lm_head.weight is drafter.model.embed_tokens.weight  # tied, as SmolLM2's are
    assert torch.allclose(drafter.model.embed_tokens.weight[96], verifier.model.embed_tokens.weight.mean(0))
    with torch.no_grad():  # bidirectional otherwise: an early position sees a later token
        a = drafter(input_ids=ids).logits[:, 2]
        b = drafter(input_ids=torch.cat([ids[:, :-1], (ids[:, -1:] + 1) % 96], dim=1)).logits[:, 2]
    assert not torch.allclose(a, b)


def test_dream_from_llama_keeps_the_first_layers():
    from align.zoo.derive import dream_from_llama

    verifier = tiny_llama(layers=3)
    drafter, _ = dream_from_llama(verifier, tokenizer_for(96), layers=2)
    assert len(drafter.model.layers) == 2 and drafter.config.num_hidden_layers == 2
    assert torch.equal(drafter.model.layers[1].mlp.up_proj.weight, verifier.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(drafter.model.norm.weight, verifier.model.norm.weight)
    with pytest.raises(AlignError, match="1 to 3 of the verifier's layers, not 4"):
        dream_from_llama(tiny_llama(layers=3), tokenizer_for(96), layers=4)


def encoder_logits(drafter, ids):
    from transformers import DynamicCache

    from align.models.diffusiongemma_pass import lm_logits

    hidden = drafter.model.encoder(input_ids=ids, cache=DynamicCache(config=drafter.config),
                                   position_ids=torch.arange(ids.shape[1])[None]).last_hidden_state
    return lm_logits(drafter, hidden)


def test_diffusiongemma_from_gemma3_encodes_exactly_as_gemma3():
    """Norms 1 + w, the query scaling folded into q_norm, full layers' own values, no value norm, one MLP norm,
    experts that add 0: the encoder's next-token logits are Gemma 3's, across sliding and full layers (the window of
    8 is shorter than the sequence)."""
    from align.models.diffusiongemma import Gemma3ValueDiffusionGemma
    from align.zoo.derive import diffusiongemma_from_gemma3

    verifier = tiny_gemma3()
    drafter, _ = diffusiongemma_from_gemma3(verifier)
    assert isinstance(drafter, Gemma3ValueDiffusionGemma)
    ids = torch.randint(3, 96, (1, 21))
    with torch.no_grad():
        assert torch.allclose(encoder_logits(drafter, ids), verifier(input_ids=ids).logits, atol=1e-4)
    enc, dec = drafter.model.encoder.language_model.layers[2], drafter.model.decoder.layers[2]
    assert enc.self_attn.v_proj.weight is dec.self_attn.v_proj.weight  # the full layer's values, tied


def test_the_neutral_soft_cap_changes_no_logit():
    from align.zoo.derive import NEUTRAL_SOFTCAP

    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(200_000) * 60).clamp(-1000, 1000).to(dtype).float()
        assert torch.equal(torch.tanh(x / NEUTRAL_SOFTCAP) * NEUTRAL_SOFTCAP, x)


def test_stock_diffusiongemma_cannot_match_gemma3_so_the_value_path_is_needed():
    """The control: the same mapping into transformers' own DiffusionGemma (values from the keys on full layers, a
    value norm, two MLP norms) computes something else."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from align.zoo.derive import diffusiongemma_config

    verifier = tiny_gemma3()
    config = diffusiongemma_config(verifier.config, 6)
    stock = DiffusionGemmaForBlockDiffusion(config)
    assert stock.model.decoder.layers[2].self_attn.v_proj is None  # no place for Gemma 3's full-layer v_proj


def test_diffusiongemma_from_gemma3_saves_loads_and_decodes_losslessly(tmp_path):
    """Through align's loader (which picks the value-path class from the config), the lean decoding pass (checked
    against the model's own forward on its first call) and speculative decoding against Gemma 3 itself."""
    from align.drafters.diffusion import Drafter
    from align.loading import load_drafter_model
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate
    from align.zoo.derive import diffusiongemma_from_gemma3

    verifier = tiny_gemma3()
    drafter, _ = diffusiongemma_from_gemma3(verifier, layers=3)
    assert len(drafter.model.decoder.layers) == 3
    tokenizer = tokenizer_for(96)
    drafter.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_drafter_model(str(tmp_path), "diffusiongemma")
    assert type(loaded).__name__ == "Gemma3ValueDiffusionGemma"
    ids = torch.randint(3, 96, (1, 9))
    with torch.no_grad():
        assert torch.allclose(encoder_logits(loaded, ids), encoder_logits(drafter, ids), atol=1e-6)
    for first_token in ("canvas", "encoder"):
        d = Drafter(loaded, "diffusiongemma", 96, first_token=first_token)
        assert d.lean_pass is not None
        decoder = SpeculativeDecoder(d, Verifier(verifier), [1])
        for seed in range(3):
            prompt = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
            out = decoder.generate(prompt, 20, gamma=4)
            assert out.tokens == ar_generate(verifier, prompt, 20, eos_token_ids=[1])
        assert d.lean_pass.usable  # the lean pass agreed with the model's own forward


def test_gemma3_drafters_end_on_a_full_attention_layer():
    from align.zoo.derive import diffusiongemma_from_gemma3

    with pytest.raises(AlignError, match="keeps 3, 6 layers"):
        diffusiongemma_from_gemma3(tiny_gemma3(), layers=4)
