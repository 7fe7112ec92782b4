"""The training strategies (align/distill/strategy.py): one step of each on a tiny batch, through the real Engine."""

from __future__ import annotations

import pytest
import torch

from align.config import load_recipe
from align.distill.backend import Engine
from align.distill.distributed import init_distributed
from align.distill.strategy import FeatureStrategy, PackedStrategy, WindowStrategy, strategy_for, train_step
from align.distill.windows import window_index
from align.loading import load_drafter_model, load_verifier_model
from conftest import MASK

CASES = {  # case -> (strategy, family, objective: one that reads the verifier's logits where the kind allows, more)
    "window": ("window", "mdlm", "kd", []),
    "packed": ("packed", "diffusiongemma", "streak_ce", []),
    "dflash": ("dflash", "dflash", "tv", []),
    "dflash-draft-vocabulary": ("dflash", "dflash", "streak_ce", ["drafter.draft_vocab=40"]),
}


def rollouts(vocab: int, count: int = 4, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(4, vocab, (5 + i,), generator=generator).tolist(),
             "response_ids": torch.randint(4, vocab, (6 + 2 * i,), generator=generator).tolist()}
            for i in range(count)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_step_of_each_strategy_is_the_whole_batch_loss_exactly_accumulated(name, model_dirs, tmp_path):
    """One optimizer step of two micro-batches: the step's loss equals the loss of the same windows in one pass
    (exact accumulation: numerators summed, denominators of the whole batch), and the drafter's weights move."""
    kind, family, objective, more = CASES[name]
    recipe = load_recipe("recipes/tiny.yaml", [*more,
        f"verifier.path={model_dirs['verifier']}", f"drafter.path={model_dirs[family]}", f"drafter.family={family}",
        f"distill.objective={objective}", "distill.gamma=4", "distill.next_token_weight=0",
        "distill.first_token=canvas", "distill.canvas_seed=null" if family == "dflash" else "distill.canvas_seed=0",
        "train.micro_batch_size=6", "train.global_batch_size=12", "train.lr=1e-2", "train.warmup_steps=0",
        "data.group_size=3", f"run.output_dir={tmp_path}"])
    Strategy = strategy_for(recipe)
    assert Strategy.name == kind
    init_distributed()
    verifier, _ = load_verifier_model(str(model_dirs["verifier"]))
    verifier.requires_grad_(False)
    model, tokenizer = load_drafter_model(str(model_dirs[family]), family)
    vocab = verifier.config.vocab_size
    rows = rollouts(vocab)
    prepared = Strategy.prepare(recipe, model, verifier, tokenizer, rows)
    assert prepared["mask_id"] == (MASK if family == "dflash" else tokenizer.mask_token_id)
    engine = Engine(model, recipe, 1)
    strategy = Strategy(recipe, engine.engine, rows, vocab, prepared["mask_id"], verifier, None, engine.device)
    assert isinstance(strategy, {"window": WindowStrategy, "packed": PackedStrategy, "dflash": FeatureStrategy}[kind])
    if recipe.drafter.draft_vocab:  # the rollouts' 40 most used tokens: the head's rows the drafter proposes
        assert len(prepared["fingerprint"]["draft_vocab"]) == 40 and strategy.draft_vocab is not None
    windows = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))[:12]
    arranged, given = strategy.arrange(windows, 0)
    dens = strategy.denominators(arranged, given)
    engine.train(True)
    with torch.no_grad():  # the whole global batch in one pass, before the step
        whole = float(strategy.micro_loss(strategy.batch(arranged, given, train=True), 0, 0, dens, 1.0))
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    loss = train_step(strategy, engine, windows, 0, recipe.train.micro_batch_size)
    assert engine.accumulation == 2
    assert loss == pytest.approx(whole, rel=1e-5, abs=1e-6)
    after = [p for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
