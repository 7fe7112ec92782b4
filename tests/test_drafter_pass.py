"""The lean decoding passes compute what the models' own forwards compute.

DiffusionGemma (``align.drafter.DiffusionGemmaPass``): the prefix cache it writes and the canvas logits it returns
equal ``model.model.encoder(...)`` then ``model(cache=..., decoder_input_ids=...)``, within float tolerance, on random
drafters with sliding-window layers (prefixes longer than the window), GQA, a wider head on full layers, MoE,
self-conditioning (T > 1) and non-trivial norm weights, and on the real model's structure (the replica's
configuration with a small vocabulary). The verifier's lean scoring equals its plain call, and the minimal cached loop
gives ``generate``'s tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

from conftest import VOCAB, tiny_drafter, tiny_verifier
from align.drafters.diffusion import Drafter
from align.models.diffusiongemma_pass import DiffusionGemmaPass
from align.verifier import Verifier, ar_generate, verifier_alone

V = 96
VISION = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=1, num_key_value_heads=1, head_dim=8, position_embedding_size=16)


def perturb(model, seed: int, scalars: tuple[float, float] = (0.7, 0.7)):
    """Norm weights, router scales and layer scalars away from their initial ones (ones hide misordered norms);
    ``scalars``: the encoder's and the decoder's layer scalars (buffers, not tied)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for layer in model.model.encoder.language_model.layers:
            layer.layer_scalar.fill_(scalars[0])
        for layer in model.model.decoder.layers:
            layer.layer_scalar.fill_(scalars[1])
    return model.eval()


def sliding_drafter(seed: int = 0, window: int = 8, experts: int = 4, scalars=(0.7, 0.7)):
    """3 layers (sliding, sliding, full), window 8, 2 query heads on 1 KV head, head 16 (32 on the full layer)."""
    torch.manual_seed(seed)
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                num_experts=experts, top_k_experts=2, moe_intermediate_size=24, max_position_embeddings=256,
                sliding_window=window, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config = DiffusionGemmaConfig(text_config=text, vision_config=VISION, canvas_length=32)
    return perturb(DiffusionGemmaForBlockDiffusion(config), seed, scalars)


def replica_drafter(seed: int = 0):
    """The replica of diffusiongemma-26B-A4B-it (align/zoo/replicas.py, cpu scale: 5 sliding : 1 full layers, head
    256 / 512, 8 experts, soft-capping, bidirectional vision attention) with a 512-token vocabulary and window 8."""
    from align.zoo.replicas import SCALES, gemma_text, gemma_vision

    s = dict(SCALES["cpu"]["gemma"], sliding=8)
    text = {k: v for k, v in gemma_text(s).items()
            if k not in ("attention_k_eq_v", "enable_moe_block", "hidden_size_per_layer_input")}
    text.update(vocab_size=512)
    torch.manual_seed(seed)
    config = DiffusionGemmaConfig(text_config=text, vision_config=gemma_vision(s), canvas_length=256)
    return perturb(DiffusionGemmaForBlockDiffusion(config), seed)


MODELS = {
    "sliding": lambda: sliding_drafter(0),
    "sliding-rotary-table-rebuilt": lambda: sliding_drafter(0),  # a table 2 positions ahead: rebuilt on most calls
    "sliding-window-4-16-experts": lambda: sliding_drafter(1, window=4, experts=16),
    "untied-layer-scalars": lambda: sliding_drafter(2, scalars=(0.7, 1.3)),  # the two-pass lean path
    "zoo-structure": lambda: perturb(tiny_drafter("diffusiongemma", 3), 3),
    "replica": lambda: replica_drafter(4),
}

# prefix growth per call, as decoding sees it: the prompt, then accepted tokens + 1 (1 to γ + 1), or nothing new
# (a later denoising step); the prompt alone is longer than the sliding window
GROWTH = [20, 1, 5, 0, 17, 1, 0, 9]


def close(a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """Equal within float rounding. ``first``: the first call of a pass, what its check at run time compares, within
    that check's own bound (``DiffusionGemmaPass.TOLERANCE``, relative to 1 + the largest value). Later calls (a
    cache grown over several calls, self-conditioning on the previous logits) within ``LATER`` of 1 + the largest
    value: on the replica of diffusiongemma-26B-A4B (6 layers, 8 experts, logits up to 0.7) the model's own forward
    on 1 and on 2 threads differs by up to 1.1e-3 a few calls in, 7e-4 of 1 + its largest logit, and the lean pass by
    up to 1.7e-3 (1.1e-3 of it); ``LATER`` is twice the latter. A misordered norm, a wrong window or a missing row
    moves logits by a tenth or more."""
    table = DiffusionGemmaPass.TOLERANCE
    tolerance = table.get(b.dtype, table[None]) if first or b.dtype != torch.float32 else LATER
    assert a.shape == b.shape, (a.shape, b.shape)
    worst, allowed = float((a - b).abs().max()), tolerance * (1 + float(b.abs().max()))
    assert worst <= allowed, f"differs by {worst:.3g}, more than {allowed:.3g}"


LATER = 2.2e-3


def encoder_next(model, encoded) -> torch.Tensor:
    """What the encoder predicts after its last token: ``lm_head`` of its last hidden state, soft-capped."""
    from align.models.diffusiongemma_pass import lm_logits

    return lm_logits(model, encoded.last_hidden_state[:, -1])


@pytest.mark.parametrize("next_token", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_lean_pass_equals_the_model_forward(name, next_token):
    """With ``next_token`` the lean pass also returns the encoder's next-token logits at the last new token (the
    first token ``first_token: encoder`` drafts), computed past the last layer's keys and values for that row only."""
    model = MODELS[name]()
    lean = DiffusionGemmaPass(model)
    if name == "sliding-rotary-table-rebuilt":
        lean.AHEAD = 2
    assert DiffusionGemmaPass.supported(model) is None
    assert lean.fused == (name != "untied-layer-scalars")
    vocab = model.config.text_config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (1, sum(GROWTH)), generator=g)
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    length, previous = 0, None
    for step, grow in enumerate(GROWTH):
        new = ids[:, length:length + grow]
        canvas = torch.randint(0, vocab, (1, 6), generator=g)
        self_conditioning = previous if grow == 0 else None  # T > 1: the previous step's logits
        with torch.no_grad():
            if grow:
                encoded = model.model.encoder(input_ids=new, cache=theirs,
                                              position_ids=torch.arange(length, length + grow)[None])
            expected = model(cache=theirs, decoder_input_ids=canvas, self_conditioning_logits=self_conditioning).logits
        got = lean.logits(ours, length, new if grow else None, canvas, self_conditioning, next_token)
        length += grow
        if next_token:
            got, after = got
            if grow:
                close(after, encoder_next(model, encoded), first=step == 0)
            else:
                assert after is None
        close(got, expected, first=step == 0)
        for mine, reference in zip(ours.layers, theirs.layers):  # the same keys and values, the same window
            assert mine.keys.shape == reference.keys.shape
            close(mine.keys, reference.keys, first=step == 0)
            close(mine.values, reference.values, first=step == 0)
        previous = expected
    text = model.config.text_config
    assert "sliding_attention" not in text.layer_types or length > 2 * text.sliding_window


# several sequences decoded side by side (vLLM's batch): per step, how much each one's prefix grew; they start at
# different times (0 before the prompt arrives), so lengths differ, and some rows add nothing (a later denoising step)
GROWTHS = [[20, 1, 0, 5, 17], [0, 11, 3, 0, 1], [9, 0, 16, 1, 0]]


@pytest.mark.parametrize("next_token", [False, True])
@pytest.mark.parametrize("name", ["sliding", "untied-layer-scalars", "replica"])
def test_one_pass_for_many_sequences_equals_each_alone(name, next_token):
    """``logits_many``: rows of sequences of different lengths, each with its own cache, through the layers together
    give each sequence the logits and cache it gets alone (sliding windows crossed, new tokens mixed with rows that
    add none, self-conditioning; fused and two-pass), and, with ``next_token``, each its encoder's next-token
    logits."""
    model = MODELS[name]()
    batched, alone = DiffusionGemmaPass(model), DiffusionGemmaPass(model)
    vocab = model.config.text_config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(4, vocab, (1, sum(growth)), generator=g) for growth in GROWTHS]
    ours = [DynamicCache(config=model.config) for _ in GROWTHS]
    theirs = [DynamicCache(config=model.config) for _ in GROWTHS]
    lengths, previous = [0] * len(GROWTHS), None
    for step in range(len(GROWTHS[0])):
        active = [b for b, growth in enumerate(GROWTHS) if lengths[b] + growth[step] > 0]
        canvas = torch.randint(0, vocab, (len(active), 6), generator=g)
        self_conditioning = previous if previous is not None and previous.shape[0] == len(active) else None
        parts, expected = [], []
        for row, b in enumerate(active):
            grow, start = GROWTHS[b][step], lengths[b]
            new = ids[b][:, start:start + grow] if grow else None
            parts.append((ours[b], start, new))
            expected.append(alone.logits(theirs[b], start, new, canvas[row:row + 1],
                                         None if self_conditioning is None else self_conditioning[row:row + 1],
                                         next_token))
            lengths[b] += grow
        got = batched.logits_many(parts, canvas, self_conditioning, next_token)
        if next_token:
            got, after = got
            expected, expected_after = [e[0] for e in expected], [e[1] for e in expected]
            for mine, reference in zip(after, expected_after):
                assert (mine is None) == (reference is None)
                if mine is not None:
                    close(mine, reference)
        close(got, torch.cat(expected))
        for b in active:
            for mine, reference in zip(ours[b].layers, theirs[b].layers):
                assert mine.keys.shape == reference.keys.shape
                close(mine.keys, reference.keys)
                close(mine.values, reference.values)
        previous = got
    assert max(lengths) > 2 * model.config.text_config.sliding_window


@pytest.mark.parametrize("family, lean", [("diffusiongemma", True), ("diffusiongemma", False), ("mdlm", True),
                                          ("dream", True)])
def test_drafting_many_sequences_in_one_call_gives_each_its_own_logits(family, lean):
    """``Family.canvas_logits_many`` (what ``Drafter.marginals_many`` calls per denoising step) against each row
    alone: DiffusionGemma through the lean pass (each row's own cache) or row by row, bidirectional families as one
    left-padded batch. The rows' states follow their prefixes, a row that starts over too."""
    from align.drafters.diffusion import FAMILIES

    drafter = Drafter(tiny_drafter(family, 3), family, VOCAB, mask_token_id=3, lean=lean)
    fam, g = FAMILIES[family], torch.Generator().manual_seed(2)
    states = [drafter.new_state() for _ in range(3)]
    prefixes = [torch.randint(4, VOCAB, (1, n), generator=g) for n in (7, 19, 12)]
    for step, grow in enumerate([(0, 0, 0), (3, 0, 1), (0, 0, 0), (17, 2, 5)]):
        if step == 2:  # a request that comes back (preempted, then resumed) with no state
            states[1] = drafter.new_state()
        prefixes = [torch.cat([p, torch.randint(4, VOCAB, (1, n), generator=g)], 1) for p, n in zip(prefixes, grow)]
        canvas = torch.randint(4, VOCAB, (3, 5), generator=g)
        with torch.inference_mode():
            got = fam.canvas_logits_many(drafter.model, prefixes, canvas, None, states)
            for b, prefix in enumerate(prefixes):
                alone = Drafter(drafter.model, family, VOCAB, mask_token_id=3, lean=lean)
                expected = fam.canvas_logits(drafter.model, prefix, None, canvas[b:b + 1], None, alone.state)
                close(got[b:b + 1], expected)
        if family == "diffusiongemma":
            assert [s.ids for s in states] == [p[0].tolist() for p in prefixes]
    if family == "diffusiongemma" and lean:
        assert drafter.lean_pass.checked and drafter.lean_pass.usable


@pytest.mark.parametrize("fused", [True, False])
def test_one_pass_and_no_work_past_the_encoders_last_keys(fused, monkeypatch):
    """Tied layers: the new tokens and the canvas share each layer's matmuls (one pass, not an encoder pass and a
    decoder pass). Either way the last layer's queries, attention output and feed-forward see the canvas rows only:
    the encoder's last hidden states are never computed."""
    model = sliding_drafter(0)
    lean = DiffusionGemmaPass(model)
    lean.fused = fused
    rows: dict[int, list[int]] = {}
    linear = F.linear

    def counting(x, weight, bias=None):
        rows.setdefault(id(weight), []).append(x.shape[-2])
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", counting)
    lean.logits(DynamicCache(config=model.config), 0, torch.randint(4, V, (1, 12)), torch.randint(0, V, (1, 5)))
    first, last = model.model.decoder.layers[0], model.model.decoder.layers[-1]
    assert rows[id(first.self_attn.q_proj.weight)] == ([17] if fused else [12, 5])
    assert rows[id(last.self_attn.k_proj.weight)] == ([17] if fused else [12, 5])  # keys of every row...
    for module in (last.self_attn.q_proj, last.self_attn.o_proj, last.mlp.down_proj):
        assert rows[id(module.weight)] == [5]  # ...the rest for the canvas only


def test_rms_norm_is_the_modules_arithmetic_bitwise():
    """The lean pass uses F.rms_norm for DiffusionGemmaRMSNorm: in float32 they agree to the bit."""
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaRMSNorm

    g = torch.Generator().manual_seed(0)
    for shape in [(1, 17, 32), (1, 9, 2, 16), (40, 64)]:
        for scale in (1e-3, 1.0, 1e3):
            x = torch.randn(shape, generator=g) * scale
            norm = DiffusionGemmaRMSNorm(shape[-1], eps=1e-6)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.5 * torch.randn(shape[-1], generator=g))
                assert torch.equal(norm(x), F.rms_norm(x, (shape[-1],), norm.weight, 1e-6))
                bare = DiffusionGemmaRMSNorm(shape[-1], eps=1e-6, with_scale=False)
                assert torch.equal(bare(x), F.rms_norm(x, (shape[-1],), None, 1e-6))


@pytest.mark.parametrize("steps", [1, 3])
def test_drafter_marginals_lean_equal_plain(steps):
    """Through Drafter.marginals (batch 1, the prefix cache kept across calls): the same draft distributions."""
    model = sliding_drafter(5)
    lean, plain = Drafter(model, "diffusiongemma", V, lean=True), Drafter(model, "diffusiongemma", V, lean=False)
    assert lean.state.lean is lean.lean_pass and plain.state.lean is None
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(4, V, (1, 14), generator=g)
    for grow in (0, 3, 1, 10):
        prefix = torch.cat([prefix, torch.randint(4, V, (1, grow), generator=g)], 1)
        a = lean.marginals(prefix, 6, steps, generator=torch.Generator().manual_seed(grow))
        b = plain.marginals(prefix, 6, steps, generator=torch.Generator().manual_seed(grow))
        assert torch.equal(a.isinf(), b.isinf())
        close(a[a.isfinite()], b[b.isfinite()])
    assert lean.lean_pass.checked and lean.lean_pass.usable


def test_adapters_and_other_models_take_the_models_forward():
    from align.distill.lora import add_lora

    wrapped = add_lora(tiny_drafter("diffusiongemma", 0), 4, 8, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert "peft" in DiffusionGemmaPass.supported(wrapped.base_model.model)
    assert "not a DiffusionGemma" in DiffusionGemmaPass.supported(tiny_drafter("mdlm", 0))
    drafter = Drafter(wrapped.base_model.model, "diffusiongemma", VOCAB)
    assert drafter.lean_pass is None and drafter.state.lean is None
    assert drafter.marginals(torch.randint(4, VOCAB, (1, 9)), 4).shape == (1, 4, VOCAB)


def test_a_lean_pass_that_differs_is_caught_on_its_first_call():
    """The first lean call is compared with the model's forward: a wrong pass (here: no attention mask, so the
    prompt's tokens see the ones after them) warns, is switched off, and decoding returns the model's own logits
    from then on."""
    model = sliding_drafter(6)
    drafter, plain = Drafter(model, "diffusiongemma", V), Drafter(model, "diffusiongemma", V, lean=False)
    drafter.lean_pass._mask = lambda *args: None
    prefix = torch.randint(4, V, (1, 12))
    with pytest.warns(RuntimeWarning, match="differs from the model's own forward"):
        first = drafter.marginals(prefix, 5, generator=torch.Generator().manual_seed(0))
    assert not drafter.lean_pass.usable
    close(first, plain.marginals(prefix, 5, generator=torch.Generator().manual_seed(0)))
    longer = torch.cat([prefix, torch.randint(4, V, (1, 4))], 1)
    close(drafter.marginals(longer, 5, generator=torch.Generator().manual_seed(1)),
          plain.marginals(longer, 5, generator=torch.Generator().manual_seed(1)))


def test_the_check_catches_a_difference_far_below_one_percent():
    """The check's bound is what float32 rounding needs (1e-4 of the largest logit), not 1%: a lean pass whose head
    is off by one part in a thousand, which a 1% bound let through, is caught."""
    model = sliding_drafter(6)
    drafter = Drafter(model, "diffusiongemma", V)
    head = drafter.lean_pass._head
    drafter.lean_pass._head = lambda h: head(h) * 1.001
    with pytest.warns(RuntimeWarning, match="differs from the model's own forward"):
        drafter.marginals(torch.randint(4, V, (1, 12)), 5)
    assert not drafter.lean_pass.usable


def test_a_correct_lean_pass_passes_its_check_silently():
    drafter = Drafter(sliding_drafter(7), "diffusiongemma", V)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        drafter.marginals(torch.randint(4, V, (1, 12)), 5)
    assert drafter.lean_pass.checked and drafter.lean_pass.usable


def test_align_lean_0_selects_the_models_forwards(monkeypatch):
    monkeypatch.setenv("ALIGN_LEAN", "0")
    drafter, verifier = Drafter(sliding_drafter(0), "diffusiongemma", V), Verifier(tiny_verifier(0))
    assert not drafter.lean and drafter.state.lean is None and not verifier.lean
    monkeypatch.setenv("ALIGN_LEAN", "1")
    assert Drafter(sliding_drafter(0), "diffusiongemma", V).state.lean is not None and Verifier(tiny_verifier(0)).lean


# ------------------------------------------------------------------------------------------------ the verifier


def test_verifier_lean_scoring_equals_plain():
    """One draft, K drafts in a tree, and no draft: the same logits, and the same cache after each commit."""
    model = tiny_verifier(1)
    lean, plain = Verifier(model, lean=True), Verifier(model, lean=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, VOCAB, (11,), generator=g).tolist()
    for v in (lean, plain):
        v.start(prompt)
    for k, gamma, index, accepted in [(1, 5, 0, 2), (3, 4, 1, 4), (1, 0, 0, 0), (2, 6, 0, 0), (1, 3, 0, 3)]:
        drafts = torch.randint(4, VOCAB, (k, gamma), generator=g)
        a, b = lean.score(drafts), plain.score(drafts)
        assert a.shape == b.shape == (k, gamma + 1, VOCAB)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        token = int(a[index, accepted].argmax())
        lean.commit(index, accepted, token)
        plain.commit(index, accepted, token)
        assert lean.length == plain.length and lean.cached == plain.cached
        for x, y in zip(lean.cache.layers, plain.cache.layers):
            torch.testing.assert_close(x.keys, y.keys, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("lean", [True, False])
def test_verifier_alone_is_generate(lean):
    """The minimal cached loop gives generate's greedy tokens (EOS inside and never reached, a length limit)."""
    model = tiny_verifier(2)
    verifier = Verifier(model, lean=lean)
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 30):
        prompt = torch.randint(4, VOCAB, (int(torch.randint(3, 12, (), generator=g)),), generator=g).tolist()
        seq = ar_generate(model, prompt, 30, eos_token_ids=[])
        for eos in ([seq[n // 2]], []):
            run = verifier_alone(verifier, prompt, n, eos)
            assert run.tokens == ar_generate(model, prompt, n, eos_token_ids=eos)
            assert len(run.times) == len(run.tokens) and len(run.step_times) == len(run.tokens) - 1
            assert run.total_s == pytest.approx(sum(run.times)) and min(run.times) > 0


def test_verifier_alone_sampling_is_seeded():
    verifier = Verifier(tiny_verifier(3))
    a = verifier_alone(verifier, [5, 6, 7], 20, [], temperature=1.0, seed=4).tokens
    assert a == verifier_alone(verifier, [5, 6, 7], 20, [], temperature=1.0, seed=4).tokens
    assert a != verifier_alone(verifier, [5, 6, 7], 20, [], temperature=1.0, seed=5).tokens


@pytest.mark.parametrize("make", [lambda: sliding_drafter(8), lambda: replica_drafter(9)], ids=["sliding", "replica"])
def test_half_precision_keeps_to_the_models_rounding(make):
    """bfloat16: the lean pass takes two passes (one pass rounds differently, enough to move the router's top-k)
    and matches the model's forward closely; its first-call check passes."""
    model = make().to(torch.bfloat16)
    vocab = model.config.text_config.vocab_size
    lean, plain = Drafter(model, "diffusiongemma", vocab), Drafter(model, "diffusiongemma", vocab, lean=False)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(4, vocab, (1, 20), generator=g)
    for grow in (0, 1, 5, 9):
        prefix = torch.cat([prefix, torch.randint(4, vocab, (1, grow), generator=g)], 1)
        a = lean.marginals(prefix, 6, generator=torch.Generator().manual_seed(grow))
        b = plain.marginals(prefix, 6, generator=torch.Generator().manual_seed(grow))
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    assert lean.lean_pass.checked and lean.lean_pass.usable
