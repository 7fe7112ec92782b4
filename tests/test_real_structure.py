"""What only the real model structures show: towers, shared encoder/decoder weights, generation configs, bf16 ties,
EOS accounting, vocabularies that differ by a mask token, devices. Each test failed on the code before its fix."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from transformers import GenerationConfig

from conftest import ROOT, tiny_drafter, tiny_verifier
from align.distill.lora import add_lora, merge_lora
from align.drafters.diffusion import FAMILIES
from align.lossless import classify, lossless_counts
from align.metrics import Block, DecodeStats

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gemma4_with_towers():
    """A Gemma4ForConditionalGeneration with vision and audio towers, MoE, per-layer inputs and k = v attention."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], enable_moe_block=True, num_experts=4,
                top_k_experts=2, moe_intermediate_size=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
                attention_k_eq_v=True, num_global_key_value_heads=1)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=16)
    audio = dict(model_type="gemma4_audio", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 subsampling_conv_channels=[4, 4], output_proj_dims=16)
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=audio))


def adapted(model) -> list[str]:
    return sorted({n for n, _ in model.named_modules(remove_duplicate=False) if n.endswith(".lora_A")})


# ------------------------------------------------------------------------------------------------ LoRA


def test_lora_adapts_text_layers_never_towers():
    """Before: PEFT refused the towers' Gemma4ClippableLinear (ValueError) at LoRA set-up."""
    model = add_lora(gemma4_with_towers(), 4, 8, 0.0, TARGETS)
    names = adapted(model)
    assert names and all(".language_model.layers." in n for n in names)
    assert not any("vision" in n or "audio" in n for n in names)
    assert any("self_attn.q_proj" in n for n in names) and any("mlp.down_proj" in n for n in names)


def windows(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab, (3, 7), generator=g)
    mask = torch.ones_like(prefix)
    mask[0, :2] = 0  # left padding
    return prefix, mask, torch.randint(4, vocab, (3, 5), generator=g)


def test_shared_encoder_decoder_weights_get_one_adapter():
    """DiffusionGemma ties its encoder and decoder text layers: one module, one adapter, for both."""
    model = add_lora(tiny_drafter("diffusiongemma"), 4, 8, 0.0, TARGETS)
    inner = model.base_model.model.model
    for i, layer in enumerate(inner.decoder.layers):
        assert inner.encoder.language_model.layers[i].self_attn.q_proj is layer.self_attn.q_proj
    assert not any("vision" in n for n in adapted(model))


def test_merged_export_equals_the_trained_model(model_dirs, tmp_path):
    """Before: separate adapters on the shared encoder/decoder copies were both merged into the one weight, so the
    exported drafter's logits differed from the trained PEFT model's (and ClippableLinear stopped LoRA set-up)."""
    from align.config import build_recipe, save_recipe
    from align.export import export_checkpoint
    from align.loading import load_drafter_model

    base, _ = load_drafter_model(str(model_dirs["diffusiongemma"]), "diffusiongemma")
    torch.manual_seed(1)
    model = add_lora(base, 4, 8, 0.0, TARGETS).eval()
    for name, param in model.named_parameters():
        if "lora_B" in name:  # as after training: the adapters change the model
            torch.nn.init.normal_(param, std=0.2)
    family = FAMILIES["diffusiongemma"]
    prefix, mask, canvas = windows(64)
    with torch.no_grad():
        trained = family.canvas_logits(model, prefix, mask, canvas)

    checkpoint = tmp_path / "step-3"
    (checkpoint / "ds").mkdir(parents=True)
    torch.save({"module": model.state_dict()}, checkpoint / "ds" / "mp_rank_00_model_states.pt")
    save_recipe(build_recipe({"drafter": {"path": str(model_dirs["diffusiongemma"])},
                              "lora": {"r": 4, "alpha": 8}}), checkpoint / "recipe.yaml")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 3}))
    exported, _ = load_drafter_model(str(export_checkpoint(checkpoint, tmp_path / "final")), "diffusiongemma")
    with torch.no_grad():
        merged = family.canvas_logits(exported, prefix, mask, canvas)
    assert (trained - merged).abs().max() < 1e-5
    fresh, _ = load_drafter_model(str(model_dirs["diffusiongemma"]), "diffusiongemma")
    with torch.no_grad():
        assert (trained - family.canvas_logits(fresh, prefix, mask, canvas)).abs().max() > 1e-2  # it did change


def test_merge_keeps_updates_below_bf16_resolution():
    """Before: merged weights went back to the base weights' dtype, so a bf16 base (ZeRO's frozen weights of a bf16
    run) plus a small trained update rounded back to the base: the export had lost the training."""
    from align.distill.lora import update_kept

    w = torch.full((4, 8), 0.02).bfloat16()
    a, b = torch.full((2, 8), 0.1), torch.full((4, 2), 2e-4)
    state = {"base_model.model.x.base_layer.weight": w, "base_model.model.x.lora_A.default.weight": a,
             "base_model.model.x.lora_B.default.weight": b}
    merged = merge_lora(state, alpha=2, r=2)
    assert merged["x.weight"].dtype == torch.float32
    assert torch.allclose(merged["x.weight"], w.float() + b @ a, rtol=0, atol=1e-9)
    assert update_kept(state, merged, torch.float32) == pytest.approx(1.0)
    assert update_kept(state, merged, torch.bfloat16) < 0.5  # 4e-5 on 0.02: below bf16's resolution there


def test_merge_lora_is_w_plus_scaled_ba():
    a, b, w = torch.randn(2, 5), torch.randn(3, 2), torch.randn(3, 5)
    state = {"base_model.model.x.base_layer.weight": w, "base_model.model.x.lora_A.default.weight": a,
             "base_model.model.x.lora_B.default.weight": b, "base_model.model.y.weight": w}
    merged = merge_lora(state, alpha=8, r=2)
    assert set(merged) == {"x.weight", "y.weight"}
    assert torch.allclose(merged["x.weight"], w + 4 * b @ a) and torch.equal(merged["y.weight"], w)


def test_export_ignores_a_live_zero3_config(model_dirs, tmp_path):
    """Before: the trainer exported while its ZeRO-3 HfDeepSpeedConfig was alive, so the drafter was built with
    partitioned parameters of shape [0] and loading the consolidated weights failed."""
    from transformers.integrations import HfDeepSpeedConfig

    from align.config import build_recipe, save_recipe
    from align.export import export_checkpoint
    from align.loading import load_drafter_model

    model, _ = load_drafter_model(str(model_dirs["mdlm"]), "mdlm")
    checkpoint = tmp_path / "step-1"
    (checkpoint / "ds").mkdir(parents=True)
    torch.save({"module": model.state_dict()}, checkpoint / "ds" / "mp_rank_00_model_states.pt")
    save_recipe(build_recipe({"drafter": {"path": str(model_dirs["mdlm"]), "family": "mdlm"}}),
                checkpoint / "recipe.yaml")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1}))
    zero3 = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    final = export_checkpoint(checkpoint, tmp_path / "final", "bfloat16")
    del zero3
    from safetensors.torch import load_file

    weights = load_file(final / "model.safetensors")
    assert len(weights) >= len(model.state_dict()) - 2 and all(v.dtype == torch.bfloat16 for v in weights.values())
    for name, value in weights.items():
        assert torch.equal(value, model.state_dict()[name].bfloat16()), name
    load_drafter_model(str(final), "mdlm")


# ------------------------------------------------------------------------------------------------ generation


def greedy_loop(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def opinionated_verifier():
    """A verifier whose generation_config would change generate's output if it leaked in."""
    model = tiny_verifier(0, dtype=torch.float32)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=3, repetition_penalty=1.8,
                                               no_repeat_ngram_size=2, pad_token_id=0)
    return model


def test_reference_decoder_uses_an_explicit_generation_config():
    """Before: ar_generate left processors unset and transformers filled them from the model's generation_config."""
    from align.verifier import ar_generate

    model = opinionated_verifier()
    for prompt in ([5, 6, 7], [9, 4, 4, 12, 30]):
        assert ar_generate(model, prompt, 24, eos_token_ids=[]) == greedy_loop(model, prompt, 24)
    firsts = {ar_generate(model, [5, 6, 7], 1, temperature=1.0, eos_token_ids=[], seed=s)[0] for s in range(60)}
    top3 = set(model(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1].topk(3).indices.tolist())
    assert firsts - top3, "temperature sampling must not be cut to the generation_config's top_k"
    assert model.generation_config.repetition_penalty == 1.8  # the model's own config is left as it was


def test_hf_rollouts_use_the_recipe_sampling_only(model_dirs, world_prompts, tmp_path):
    """Before: the hf rollout backend sampled from a repetition-penalised, n-gram-banned distribution."""
    from align.config import load_recipe
    from align.rollouts import HFBackend

    path = tmp_path / "verifier"
    opinionated_verifier().save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_dirs["verifier"]).save_pretrained(path)
    recipe = load_recipe(None, [f"verifier.path={path}", "data.max_new_tokens=20", "data.temperature=0"])
    backend = HFBackend(recipe)
    backend.eos = []
    prompts = [[2, 5, 6, 7], [2, 9, 4, 4, 12, 30]]
    rows = backend.generate(prompts, seed=0)
    for prompt, samples in zip(prompts, rows):
        assert samples[0] == greedy_loop(backend.model, prompt, 20)


# ------------------------------------------------------------------------------------------------ losslessness


def test_lossless_verdicts_exact_near_tie_mismatch():
    """A true tie (two identical output rows) is a near-tie; a token far below the top is a mismatch."""
    model = tiny_verifier(0, dtype=torch.float32)
    prompt = [5, 6, 7]
    reference = greedy_loop(model, prompt, 12)
    assert classify(model, prompt, reference, reference)[0] == "exact"
    i = 4
    twin = 63 if reference[i] != 63 else 62
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[reference[i]]
    reference = greedy_loop(model, prompt, 12)
    output = reference[:i] + [twin] + reference[i + 1:]
    assert classify(model, prompt, output, reference)[0] == "near-tie"
    worst = int(model(input_ids=torch.tensor([prompt + reference[:i]])).logits[0, -1].argmin())
    wrong = reference[:i] + [worst] + reference[i + 1:]
    verdict, gap = classify(model, prompt, wrong, reference)
    assert verdict == "mismatch" and gap > 0.1
    assert classify(model, prompt, reference[:6], reference)[0] == "mismatch"  # stopped early
    counts = lossless_counts(model, [prompt] * 3, [reference, output, wrong], [reference] * 3)
    assert counts == {"exact": 1, "near_tie": 1, "mismatch": 1}


# ------------------------------------------------------------------------------------------------ accounting


def test_eos_block_counts_only_what_it_produced():
    """Before: a block that accepted EOS counted τ = kept + 1 and a rejection at position kept + 1."""
    from test_speculative import EchoDrafter

    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate

    verifier = tiny_verifier(0)
    seq = ar_generate(verifier, [5, 6, 7], 40, eos_token_ids=[])
    eos = seq[5]
    decoder = SpeculativeDecoder(EchoDrafter(verifier, 64, noise=0.0, seed=0), Verifier(verifier), eos)
    out = decoder.generate([5, 6, 7], 40, gamma=16)
    last = out.stats.blocks[-1]
    assert out.tokens[-1] == eos and last.rejected_rank is None
    assert last.accepted == last.gamma == last.produced == len(out.tokens)
    summary = out.stats.summary(16)
    assert summary["tau"] * summary["n_blocks"] == pytest.approx(len(out.tokens))
    assert all(a in (None, 1.0) for a in summary["per_position"])


def test_zero_draft_blocks_are_not_averaged_into_acceptance():
    stats = DecodeStats(blocks=[Block(4, 4), Block(0, 0)])
    summary = stats.summary(4)
    assert summary["accepted_mean"] == 4.0 and summary["n_drafted"] == 1
    assert summary["tau"] == 3.0 and summary["acceptance_rate"] == 1.0


def test_training_softmax_spans_the_shared_vocabulary(model_dirs, world_prompts, tmp_path):
    """A Dream-style drafter whose tokenizer adds <|mask|> after the verifier's vocabulary, with that row made to
    dominate: decoding never proposes it, and training's distribution must not contain it either (before: it took
    all the mass, so the held-out q of every label was ~0)."""
    from transformers import AutoTokenizer

    from conftest import save_tinydream
    from test_train import overrides, run_main
    from tinydream import TinyDreamConfig, TinyDreamModel

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["verifier"])
    vocab = len(tokenizer)
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    assert tokenizer.mask_token_id == vocab
    torch.manual_seed(0)
    model = TinyDreamModel(TinyDreamConfig(vocab_size=vocab + 1, hidden_size=32, mask_token_id=vocab))
    with torch.no_grad():  # every position's hidden state becomes h; the mask row's logit is 10 |h|^2
        last = model.layers[-1].norm2
        last.weight.zero_()
        last.bias.fill_(1.0)
        model.lm_head.weight[vocab] = 10.0
    path = tmp_path / "dream-mask"
    save_tinydream(model, path)
    tokenizer.save_pretrained(path)
    dirs = {**model_dirs, "dream": path}
    out = tmp_path / "run"
    assert run_main(overrides(dirs, world_prompts, out, family="dream", **{"train.max_steps": 1})) == 0
    before = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert before["split"] == "eval" and min(before["q_per_position"]) > 1e-5


def test_rollout_tokens_past_the_shared_vocabulary_end_the_rollout():
    """Qwen2.5's 152,064 logit rows exceed its 151,665 tokens: a random-weight verifier samples those ids, and
    training indexed the drafter's distribution with them (before: an index error in the rehearsal)."""
    from align.distill.data import within_vocab

    rows = [{"response_ids": [5, 6, 70, 7]}, {"response_ids": [5, 6]}, {"response_ids": [64]}]
    rows, cut = within_vocab(rows, 64)
    assert cut == 2 and [r["response_ids"] for r in rows] == [[5, 6], [5, 6], []]


# ------------------------------------------------------------------------------------------------ devices


def test_every_random_draw_names_its_device():
    """A generator lives on a device; a draw without ``device=`` lands on the CPU and fails with a CUDA generator
    (before: multi-draft sampling drew its uniforms that way, so every K > 1, temperature > 0 decode raised)."""
    draws = {"rand", "randn", "randint"}
    missing = []
    for path in sorted((ROOT / "align").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in draws
                    and any(k.arg == "generator" for k in node.keywords)
                    and not any(k.arg == "device" for k in node.keywords)):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, missing


def test_models_are_placed_on_the_requested_device(model_dirs):
    from align.drafters import load_pair
    from align.loading import default_device

    drafter, verifier, _ = load_pair(str(model_dirs["mdlm"]), str(model_dirs["verifier"]), "mdlm", "bfloat16",
                                     device="cpu")
    assert drafter.device.type == verifier.device.type == "cpu" and verifier.model.dtype == torch.bfloat16
    assert default_device() == ("cuda:0" if torch.cuda.is_available() else "cpu")
