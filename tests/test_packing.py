"""Packed windows equal per-window windows: logits, every loss and its gradient (fp32, 1e-5)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from align.drafters.diffusion import FAMILIES
from align.distill.losses import LOSSES
from align.distill.packing import make_packed, next_token_labels, packed_logits, packed_teacher_logits
from align.distill.windows import make_windows, window_index
from align.errors import AlignError
from conftest import tiny_drafter, tiny_verifier

VOCAB = 64


def sliding_drafter(window: int = 5, attention: str = "sdpa", seed: int = 0) -> DiffusionGemmaForBlockDiffusion:
    """A random DiffusionGemma with MoE and sliding layers whose window is shorter than most prefixes."""
    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=8, num_experts=4, top_k_experts=2,
                moe_intermediate_size=32, max_position_embeddings=256, sliding_window=window,
                layer_types=["sliding_attention", "full_attention", "full_attention"], pad_token_id=0,
                eos_token_id=1, bos_token_id=2)
    vision = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=8, position_embedding_size=16)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=8)
    config.text_config._attn_implementation = attention
    return DiffusionGemmaForBlockDiffusion(config).float()


def rollouts(count: int = 5, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 9))],
             "response_ids": [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 23))]} for _ in range(count)]


def both(model, rows, pairs, gamma, max_prefix_len=512):
    args = (rows, pairs, gamma, max_prefix_len, "diffusiongemma", None, VOCAB, 0)
    windows, packed = make_windows(*args), make_packed(*args)
    per_window = FAMILIES["diffusiongemma"].canvas_logits(model, windows.prefix, windows.prefix_mask, windows.canvas)
    return windows, packed, per_window, packed_logits(model, packed)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_per_window_logits(attention):
    model = sliding_drafter(attention=attention).eval()
    rows = rollouts()
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    pairs = pairs[torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1))]  # any order, rollouts mixed
    with torch.no_grad():
        windows, packed, per_window, packed_out = both(model, rows, pairs, gamma=6)
    assert torch.equal(packed.labels, windows.labels)
    assert packed_out.shape == per_window.shape
    assert (packed_out - per_window).abs().max() < 1e-5
    assert packed.canvas.shape[1] > 1 or packed.canvas.shape[2] > 1  # several offsets per decoder call


def test_sliding_window_matters_so_the_parity_is_not_vacuous():
    """The same weights with a wider window give different logits: the packed mask really applies the window."""
    rows, gamma = rollouts(), 4
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    narrow, wide = sliding_drafter(window=3).eval(), sliding_drafter(window=64).eval()
    with torch.no_grad():
        a = packed_logits(narrow, make_packed(rows, pairs, gamma, 512, "diffusiongemma", None, VOCAB, 0))
        b = packed_logits(wide, make_packed(rows, pairs, gamma, 512, "diffusiongemma", None, VOCAB, 0))
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("objective", sorted(LOSSES))
def test_packed_loss_and_gradient_equal_per_window(objective):
    rows, gamma = rollouts(seed=2), 5
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    teacher = tiny_verifier(vocab=VOCAB, dtype=torch.float32)
    grads = []
    for packed_path in (False, True):
        model = sliding_drafter(seed=3).train()
        args = (rows, pairs, gamma, 512, "diffusiongemma", None, VOCAB, 0)
        if packed_path:
            batch = make_packed(*args)
            logits = packed_logits(model, batch)
            target = packed_teacher_logits(teacher, batch, VOCAB)
        else:
            from align.distill.windows import teacher_logits

            batch = make_windows(*args)
            logits = FAMILIES["diffusiongemma"].canvas_logits(model, batch.prefix, batch.prefix_mask, batch.canvas)
            target = teacher_logits(teacher, batch, VOCAB)
        term = LOSSES[objective](logits, batch.labels, 1.0, target)
        loss = term.num / term.den
        loss.backward()
        grads.append((float(loss), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (loss_w, grad_w), (loss_p, grad_p) = grads
    assert abs(loss_p - loss_w) <= 1e-5 * max(1.0, abs(loss_w))
    assert grad_w.abs().max() > 0
    assert (grad_p - grad_w).abs().max() <= 1e-5 * max(1.0, float(grad_w.abs().max()))


def test_packing_sees_the_whole_response_and_cuts_only_the_prompt():
    """A prefix longer than max_prefix_len: per-window cuts the window's prefix, packed only the prompt."""
    model = sliding_drafter(window=64).eval()
    rows = [{"prompt_ids": list(range(4, 10)), "response_ids": list(range(10, 30))}]
    pairs = torch.tensor([[0, 0], [0, 15]])
    with torch.no_grad():
        windows, packed, per_window, packed_out = both(model, rows, pairs, gamma=4, max_prefix_len=8)
    assert (packed_out[0] - per_window[0]).abs().max() < 1e-5  # prefix 6 tokens: nothing cut either way
    assert (packed_out[1] - per_window[1]).abs().max() > 1e-4  # 21 tokens: per-window keeps 8, packed all 21


def test_packing_refuses_a_drafter_without_an_encoder():
    rows = rollouts(2)
    pairs = window_index([len(r["response_ids"]) for r in rows], [0, 1])
    batch = make_packed(rows, pairs, 4, 512, "mdlm", 3, VOCAB, 0)
    with pytest.raises(AlignError, match="data.packing"):
        packed_logits(tiny_drafter("mdlm"), batch)


def test_packed_self_conditioning_equals_per_window():
    model = sliding_drafter().eval()
    rows, gamma = rollouts(seed=4), 4
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    args = (rows, pairs, gamma, 512, "diffusiongemma", None, VOCAB, 0)
    windows, packed = make_windows(*args), make_packed(*args)
    previous = torch.randn(len(pairs), gamma, VOCAB, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        per_window = FAMILIES["diffusiongemma"].canvas_logits(model, windows.prefix, windows.prefix_mask,
                                                             windows.canvas, previous)
        plain = packed_logits(model, packed)
        conditioned = packed_logits(model, packed, previous)
    assert (conditioned - per_window).abs().max() < 1e-5
    assert (conditioned - plain).abs().max() > 1e-3


def test_next_token_logits_are_the_encoders_own_at_every_response_token():
    """The packed prefix pass's next-token logits equal a plain causal encoder pass over prompt ‖ response[:j], read
    at its last position, for every response token j of every rollout (the label it is scored against)."""
    model = sliding_drafter().eval()
    rows = rollouts(count=4, seed=3)
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    packed = make_packed(rows, pairs, 4, 512, "diffusiongemma", None, VOCAB, 0)
    with torch.no_grad():
        _, next_logits = packed_logits(model, packed, next_token=True)
    labels = next_token_labels(packed)[1]
    expected_labels, expected_logits = [], []
    with torch.no_grad():
        for row in rows:  # make_packed keeps the rollouts' order
            tokens = row["prompt_ids"] + row["response_ids"]
            hidden = model.model.encoder(input_ids=torch.tensor([tokens])).last_hidden_state[0]
            for j in range(len(row["response_ids"])):
                expected_labels.append(row["response_ids"][j])
                expected_logits.append(model.lm_head(hidden[len(row["prompt_ids"]) + j - 1]))
    expected, cap = torch.stack(expected_logits), model.final_logit_softcapping
    expected = expected if cap is None else torch.tanh(expected / cap) * cap
    assert labels.tolist() == expected_labels
    assert (next_logits - expected).abs().max() < 1e-4 * expected.abs().max()


def test_a_canvas_seed_gives_every_window_the_same_canvas_packed_or_not():
    from align.drafters.diffusion import fixed_canvas

    model = sliding_drafter().eval()
    rows, gamma = rollouts(seed=4), 5
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    args = (rows, pairs, gamma, 512, "diffusiongemma", None, VOCAB, 0)
    windows, packed = make_windows(*args, canvas_seed=3), make_packed(*args, canvas_seed=3)
    canvas = fixed_canvas(FAMILIES["diffusiongemma"], gamma, None, VOCAB, 3)
    assert torch.equal(windows.canvas, canvas.expand(len(pairs), -1))
    assert torch.equal(packed.window_canvases(), windows.canvas)
    assert not torch.equal(make_windows(*args).canvas[0], make_windows(*args).canvas[1])  # without: a draw each
    with torch.no_grad():
        per_window = FAMILIES["diffusiongemma"].canvas_logits(model, windows.prefix, windows.prefix_mask,
                                                              windows.canvas)
        assert (packed_logits(model, packed) - per_window).abs().max() < 1e-5


def test_small_groups_take_one_decoder_call_without_empty_slots_and_still_equal_per_window():
    """data.group_size: the trainer's order cuts each rollout's windows into groups of g, so a micro-batch of
    groups holds more rollouts with at most g windows each; the decoder call then has g offset slots per rollout (not
    256 / γ, mostly empty), and the logits still equal the per-window path's."""
    from align.distill.data import WindowOrder, rollout_spans

    model = sliding_drafter().eval()
    rows = rollouts(8, seed=3)
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    order = WindowOrder(len(pairs), 0, rollout_spans(pairs), group=3)
    batch = pairs[order.take(0, 12)]
    chunks = batch.view(4, 3, 2)[:, :, 0] if len(batch) == 12 else None
    assert chunks is not None and all(len(set(c.tolist())) == 1 for c in chunks)  # each group: one rollout
    with torch.no_grad():
        windows, packed, per_window, packed_out = both(model, rows, batch, gamma=6)
    _, calls, per_call, _ = packed.canvas.shape
    assert (calls, per_call) == (1, 3)  # 256 / γ would be 42 slots per rollout
    assert (packed_out - per_window).abs().max() < 1e-5


def test_the_packing_ceiling_counts_the_positions_each_path_collates():
    """bench/throughput.py's ceiling: per-window positions (each window alone, so no padding) over packed positions
    (each rollout read once, one decoder call of all its offsets), from the collated batches themselves; and by hand
    for one rollout whose prefix data.max_prefix_len cuts."""
    from conftest import script_module

    bench = script_module("bench/throughput.py")

    rows, gamma, cut = rollouts(5, seed=6), 4, 512
    per_window = packed = 0
    for row, item in enumerate(rows):
        pairs = window_index([len(r["response_ids"]) for r in rows], [row])
        args = (rows, pairs, gamma, cut, "diffusiongemma", None, VOCAB, 0)
        for one in pairs.split(1):
            w = make_windows(rows, one, *args[2:])
            per_window += w.prefix.numel() + w.canvas.numel()
        p = make_packed(*args)
        assert p.offsets.shape[:2] == (1, 1)  # every offset in one call
        packed += p.seq.numel() + p.canvas.numel()
    assert bench.packing_ceiling(rows, gamma, cut) == pytest.approx(per_window / packed)
    one = [{"prompt_ids": [5] * 6, "response_ids": [7] * 3}]  # prefixes 6, 7, 8 cut to 7: (6+7+7 + 3·2) / (6+3+3·2)
    assert bench.packing_ceiling(one, 2, 7) == pytest.approx(26 / 15)
