"""Random-weight replicas of the shipped recipes' models: transformers' own classes, the real configurations shrunk.

``recipes/gemma.yaml`` aligns google/diffusiongemma-26B-A4B-it to google/gemma-4-26B-A4B-it and
``recipes/qwen-diffucoder.yaml`` aligns apple/DiffuCoder-7B-Instruct to Qwen/Qwen2.5-7B-Instruct. No weights can be
downloaded here, so these replicas keep everything structural — model classes, vocabulary size and special-token
ids, chat-template shape, generation config, towers, MoE, sliding/full layer pattern, k = v attention, tied and
shared weights, logit soft-capping — and shrink only depth and width (``scale``: ``cpu`` for rehearsals on two
cores, ``gpu`` for about 1B parameters each). Weights are random: the replicas test the code path, not acceptance.

Sources of the real values (checked 2026-11):
- Gemma 4 26B-A4B: transformers ``models/gemma4/convert_gemma4_weights.py`` (variant ``gemma-4-26b-a4b``) and the
  checkpoint's config.json: vocabulary 262,144, hidden 2816, 30 layers (5 sliding : 1 full), 16 heads, 8 KV heads,
  head_dim 256, global_head_dim 512 with 2 global KV heads, attention_k_eq_v, sliding window 1024, MoE 128 experts
  top-8 of width 704 beside a dense MLP of 2112, no per-layer input embeddings (hidden_size_per_layer_input 0), no
  audio tower, final_logit_softcapping 30, tied embeddings; vision tower gemma4_vision (hidden 1152, 27 layers);
  special ids pad 0, eos 1, bos 2, unk 3, mask 4, ``<|turn>`` 105, ``<turn|>`` 106, image 258880;
  generation_config eos [1, 106], temperature 1.0, top_k 64, top_p 0.95.
- DiffusionGemma 26B-A4B: transformers ``models/diffusion_gemma`` (checkpoint google/diffusiongemma-26B-A4B-it):
  the same text and vision configuration, encoder and decoder text layers tied, canvas_length 256.
- Qwen2.5-7B-Instruct: its config.json and generation_config.json: vocabulary 152,064 rows, tokenizer of 151,665
  (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645 ... ``<|file_sep|>`` 151664), hidden 3584,
  28 layers, 28 heads, 4 KV heads, rope_theta 1e6, untied; generation_config repetition_penalty 1.05,
  temperature 0.7, top_p 0.8, top_k 20, eos [151645, 151643].
- DiffuCoder-7B-Instruct (Dream): the Qwen2.5 dimensions, ``auto_map`` DreamConfig / DreamModel, mask 151666,
  tokenizer adding ``<|beginoftext|>`` 151665, ``<|mask|>`` 151666, ``<|dlm_pad|>`` 151667, eos and pad 151643.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, PreTrainedTokenizerFast

#: scale -> pair -> the shrunk sizes (the real ones are in the module docstring). Head sizes stay real (Gemma 4:
#: 256, 512 on full layers; Qwen2.5: 128, which vLLM derives as hidden / heads): kernels are chosen by them.
SCALES = {
    "cpu": {"gemma": {"hidden": 64, "layers": 6, "heads": 4, "kv": 2, "experts": 8, "top_k": 2, "expert": 32,
                      "sliding": 32},
            "qwen": {"hidden": 256, "layers": 4, "heads": 2, "kv": 1}},
    "gpu": {"gemma": {"hidden": 1024, "layers": 12, "heads": 8, "kv": 4, "experts": 32, "top_k": 4, "expert": 512,
                      "sliding": 1024},
            "qwen": {"hidden": 1536, "layers": 24, "heads": 12, "kv": 2}},
}

#: zoo name -> (pair, role)
REPLICAS = {
    "replica-gemma4-verifier": ("gemma", "verifier"),
    "replica-diffusiongemma": ("gemma", "drafter"),
    "replica-qwen2.5-verifier": ("qwen", "verifier"),
    "replica-diffucoder": ("qwen", "drafter"),
}

GEMMA_SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|tool_response>": 50,
                  "<|think|>": 98, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106,
                  "<start_of_image>": 255999, "<start_of_audio>": 256000, "<image_soft_token>": 258880,
                  "<audio_soft_token>": 258881, "<end_of_image>": 258882, "<end_of_audio>": 258883,
                  "<video_soft_token>": 258884}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n<|channel>thought\n"
    "<channel|>{% endif %}"
)
QWEN_SPECIALS = {name: 151643 + i for i, name in enumerate([
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"])}
DREAM_SPECIALS = {**QWEN_SPECIALS, "<|beginoftext|>": 151665, "<|mask|>": 151666, "<|dlm_pad|>": 151667}
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------------------ tokenizers


def replica_tokenizer(base: Any, size: int, specials: dict[str, int], first_regular: int,
                      **tokens: str) -> PreTrainedTokenizerFast:
    """The tiny world's BPE (``base``) laid out like a real tokenizer: ``specials`` at their real ids, the BPE's
    own tokens from ``first_regular`` on, and ``<unusedN>`` filling every other id below ``size``."""
    spec = json.loads(base.backend_tokenizer.to_str())
    own = {t: i for t, i in spec["model"]["vocab"].items() if t not in {a["content"] for a in spec["added_tokens"]}}
    vocab: dict[str, int] = dict(specials)
    taken = set(specials.values())
    next_id = first_regular
    for token, _ in sorted(own.items(), key=lambda kv: kv[1]):
        while next_id in taken:
            next_id += 1
        vocab[token] = next_id
        taken.add(next_id)
    free = (i for i in range(size) if i not in taken)
    for n, i in enumerate(free):
        vocab[f"<unused{n}>"] = i
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t, i in specials.items()]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), padding_side="left",
                                        model_max_length=1 << 17, **tokens)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in tokens.values()]})
    return tokenizer


def gemma_tokenizer(base: Any) -> PreTrainedTokenizerFast:
    tok = replica_tokenizer(base, 262_144, GEMMA_SPECIALS, 256, pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>", unk_token="<unk>", mask_token="<mask>")
    tok.chat_template = GEMMA_TEMPLATE
    return tok


def qwen_tokenizer(base: Any, dream: bool = False) -> PreTrainedTokenizerFast:
    if dream:
        tok = replica_tokenizer(base, 151_643, DREAM_SPECIALS, 0, pad_token="<|dlm_pad|>", eos_token="<|endoftext|>",
                                bos_token="<|beginoftext|>", mask_token="<|mask|>")
    else:
        tok = replica_tokenizer(base, 151_643, QWEN_SPECIALS, 0, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tok.chat_template = QWEN_TEMPLATE
    return tok


# ------------------------------------------------------------------------------------------------ models


def gemma_text(s: dict) -> dict:
    """Gemma 4 26B-A4B's text configuration, shrunk (the pattern keeps its 5 sliding : 1 full layers)."""
    layers = s["layers"]
    return dict(
        vocab_size=262_144, hidden_size=s["hidden"], intermediate_size=3 * s["hidden"] // 4,
        num_hidden_layers=layers, num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
        head_dim=256, global_head_dim=512, num_global_key_value_heads=max(1, s["kv"] // 4),
        attention_k_eq_v=True, sliding_window=s["sliding"], max_position_embeddings=262_144,
        layer_types=["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                     for i in range(layers)],
        enable_moe_block=True, num_experts=s["experts"], top_k_experts=s["top_k"],
        moe_intermediate_size=s["expert"], hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
        use_bidirectional_attention="vision", hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    )


def gemma_vision(s: dict) -> dict:
    """The gemma4_vision tower, shrunk (its linear layers are Gemma4ClippableLinear, as in the real one)."""
    width = max(16, s["hidden"] // 4)
    return dict(model_type="gemma4_vision", hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, head_dim=width // 2, patch_size=16,
                pooling_kernel_size=3, position_embedding_size=64, standardize=True)


def gemma4_verifier(s: dict) -> torch.nn.Module:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = Gemma4Config(text_config=gemma_text(s), vision_config=gemma_vision(s), audio_config=None,
                          tie_word_embeddings=True)
    model = Gemma4ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(bos_token_id=2, pad_token_id=0, eos_token_id=[1, 106], do_sample=True,
                                               temperature=1.0, top_k=64, top_p=0.95)
    return model


def diffusiongemma_drafter(s: dict) -> torch.nn.Module:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = {k: v for k, v in gemma_text(s).items()
            if k not in ("attention_k_eq_v", "enable_moe_block", "hidden_size_per_layer_input")}
    config = DiffusionGemmaConfig(text_config=text, vision_config=gemma_vision(s), canvas_length=256)
    return DiffusionGemmaForBlockDiffusion(config)


def qwen_config(s: dict) -> dict:
    hidden = s["hidden"]
    return dict(vocab_size=152_064, hidden_size=hidden, intermediate_size=hidden * 37 // 7,
                num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                max_position_embeddings=32_768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, sliding_window=131_072,
                use_sliding_window=False, max_window_layers=s["layers"], tie_word_embeddings=False,
                bos_token_id=151643, eos_token_id=151645)


def qwen_verifier(s: dict) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**qwen_config(s)))
    model.generation_config = GenerationConfig(bos_token_id=151643, pad_token_id=151643, eos_token_id=[151645, 151643],
                                               do_sample=True, repetition_penalty=1.05, temperature=0.7, top_p=0.8,
                                               top_k=20)
    return model


def dream_drafter(s: dict) -> torch.nn.Module:
    from align.models.dream import DreamConfig, DreamModel

    config = DreamConfig(mask_token_id=151666, pad_token_id=151643, **{**qwen_config(s), "eos_token_id": 151643})
    config.auto_map = {"AutoConfig": "dream.DreamConfig", "AutoModel": "dream.DreamModel"}
    return DreamModel(config)


def build_replica(name: str, base_tokenizer: Any, scale: str = "cpu", seed: int = 0) -> tuple[Any, Any, list[Path]]:
    """(model with random weights, tokenizer, files of its own modelling code) of zoo model ``name`` (a key of
    REPLICAS), built from the tiny world's BPE ``base_tokenizer``."""
    pair, role = REPLICAS[name]
    s = SCALES[scale][pair]
    torch.manual_seed(seed)
    if pair == "gemma":
        model = gemma4_verifier(s) if role == "verifier" else diffusiongemma_drafter(s)
        tokenizer = gemma_tokenizer(base_tokenizer)
    else:
        model = qwen_verifier(s) if role == "verifier" else dream_drafter(s)
        tokenizer = qwen_tokenizer(base_tokenizer, dream=role == "drafter")
    code = [Path(__file__).parents[1] / "models" / "dream.py"] if pair == "qwen" and role == "drafter" else []
    return model, tokenizer, code
