"""The replicas of the shipped recipes' models keep the real structure (the GPU check that times them:
tests/test_gpu_check.py)."""

from __future__ import annotations

import torch



def test_replicas_keep_the_real_structure():
    from align.loading import load_drafter_model, load_verifier_model, shared_vocab_size
    from align.prompts import encode_prompt
    from align.zoo import model_dir
    from align.zoo.build import build

    names = ["replica-gemma4-verifier", "replica-diffusiongemma", "replica-qwen2.5-verifier", "replica-diffucoder"]
    build(names)
    gemma, gemma_tok = load_verifier_model(str(model_dir(names[0])))
    text = gemma.config.text_config
    assert type(gemma).__name__ == "Gemma4ForConditionalGeneration" and len(gemma_tok) == text.vocab_size == 262_144
    assert text.enable_moe_block and text.attention_k_eq_v and text.final_logit_softcapping == 30.0
    assert text.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert gemma.config.vision_config.model_type == "gemma4_vision"
    assert (gemma_tok.pad_token_id, gemma_tok.eos_token_id, gemma_tok.bos_token_id) == (0, 1, 2)
    ids = encode_prompt(gemma_tok, "hello")
    assert ids[:2] == [2, 105] and gemma_tok.convert_ids_to_tokens(ids[-1]) == "<channel|>"
    assert gemma.generation_config.eos_token_id == [1, 106]

    drafter, drafter_tok = load_drafter_model(str(model_dir(names[1])), "diffusiongemma")
    inner = drafter.model
    assert inner.encoder.language_model.layers[0].self_attn.q_proj.weight is inner.decoder.layers[0].self_attn.q_proj.weight
    assert shared_vocab_size(drafter_tok, gemma_tok, "d", "v") == 262_144

    qwen, qwen_tok = load_verifier_model(str(model_dir(names[2])))
    assert qwen.config.vocab_size == 152_064 and len(qwen_tok) == 151_665 and qwen_tok.eos_token_id == 151645
    assert qwen.generation_config.repetition_penalty == 1.05
    dream, dream_tok = load_drafter_model(str(model_dir(names[3])), "dream", trust_remote_code=True)
    assert type(dream).__name__ == "DreamModel" and dream_tok.mask_token_id == 151666 and len(dream_tok) == 151_668
    assert shared_vocab_size(dream_tok, qwen_tok, "d", "v") == 151_665
    with torch.no_grad():  # bidirectional: the first position sees the last
        x = torch.tensor([[10, 11, 12, 13]])
        a, b = dream(input_ids=x).logits, dream(input_ids=torch.tensor([[10, 11, 12, 14]])).logits
        assert (a[0, 0] - b[0, 0]).abs().max() > 0
