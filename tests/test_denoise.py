"""Training for T > 1 denoising steps (align/distill/denoise.py): windows at step k of the confidence schedule."""

from __future__ import annotations

import pytest
import torch

from align.distill.denoise import advance, denoise_step
from align.distill.packing import make_packed, packed_logits
from align.distill.windows import make_windows, window_index
from align.drafters.diffusion import FAMILIES
from test_packing import VOCAB, rollouts, sliding_drafter
from test_train import overrides, run_main


def forwards(model):
    def per_window(batch, self_conditioning):
        return FAMILIES["diffusiongemma"].canvas_logits(model, batch.prefix, batch.prefix_mask, batch.canvas,
                                                        self_conditioning)

    def packed(batch, self_conditioning):
        return packed_logits(model, batch, self_conditioning)

    return per_window, packed


def test_step_k_commits_the_drafters_most_confident_tokens_and_self_conditions_on_its_logits():
    model = sliding_drafter(seed=1).eval()
    rows, gamma = rollouts(seed=2), 8
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    windows = make_windows(rows, pairs, gamma, 512, "diffusiongemma", None, VOCAB, 0)
    per_window, _ = forwards(model)
    same, none = advance(per_window, windows, 0, 2, False, VOCAB)
    assert same is windows and none is None
    later, conditioning = advance(per_window, windows, 1, 2, False, VOCAB, torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = per_window(windows, None)
    torch.testing.assert_close(conditioning, first)
    logq = first.float().log_softmax(-1)
    top = logq.max(-1).values.argsort(-1, descending=True)[:, :gamma // 2]  # half the block at step 1 of 2
    kept = torch.zeros_like(later.canvas, dtype=torch.bool).scatter_(1, top, True)
    assert torch.equal(later.canvas[kept], logq.argmax(-1)[kept])
    assert (later.canvas[~kept] != windows.canvas[~kept]).float().mean() > 0.5, "the rest re-noised"
    assert torch.equal(later.labels, windows.labels) and torch.equal(later.prefix, windows.prefix)


def test_packed_windows_reach_the_same_step_k():
    model = sliding_drafter(seed=3).eval()
    rows, gamma = rollouts(seed=5), 4
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    args = (rows, pairs, gamma, 512, "diffusiongemma", None, VOCAB, 0)
    windows, packed = make_windows(*args), make_packed(*args)
    torch.testing.assert_close(packed.window_canvases(), windows.canvas)
    per_window, packed_forward = forwards(model)
    a, sa = advance(per_window, windows, 2, 4, False, VOCAB, torch.Generator().manual_seed(1))
    b, sb = advance(packed_forward, packed, 2, 4, False, VOCAB, torch.Generator().manual_seed(1))
    assert torch.equal(a.canvas, b.window_canvases())
    assert (sa - sb).abs().max() < 1e-5
    with torch.no_grad():
        assert (per_window(a, sa) - packed_forward(b, sb)).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["diffusiongemma", "mdlm"])
def test_steps_are_drawn_per_micro_batch_and_the_trainer_runs_them(family, model_dirs, world_prompts, tmp_path,
                                                                    monkeypatch):
    """Each micro-batch trains at a step of the schedule drawn from its run, step and micro-batch; the trainer runs
    the drawn steps' passes (advance at k = 1 and 2, on the family's canvases), and the export says its T."""
    import json

    import align.distill.strategy as strategy

    drawn = [denoise_step(3, 0, step, micro) for step in range(4) for micro in range(2)]
    assert set(drawn) == {0, 1, 2} and drawn == [denoise_step(3, 0, s, m) for s in range(4) for m in range(2)]
    assert denoise_step(1, 0, 5, 0) == 0
    ran = []
    real = strategy.advance

    def spy(forward, batch, k, steps, masked, *args, **kwargs):
        ran.append((k, steps, masked))
        return real(forward, batch, k, steps, masked, *args, **kwargs)

    monkeypatch.setattr(strategy, "advance", spy)
    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, family, **{"distill.denoise_steps": 3})) == 0
    trained = [denoise_step(3, 0, step, micro) for step in range(4) for micro in range(2)]
    assert sorted(k for k, _, _ in ran) == sorted(k for k in trained if k)  # every drawn k > 0, run once
    assert {(steps, masked) for _, steps, masked in ran} == {(3, family == "mdlm")}
    assert json.loads((out / "final" / "meta.json").read_text())["denoise_steps"] == 3
