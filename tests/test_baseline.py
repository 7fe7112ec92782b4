"""The AR baseline: same-size autoregressive drafter, trained on a run's rollouts, decoded by the same loop."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from conftest import VOCAB, tiny_verifier
from align.baseline import ar_model, diffusion_train_seconds, llama_parameters, main, matched_intermediate
from align.drafters.ar import ARDrafter
from align.errors import run_cli
from align.speculative import SpeculativeDecoder
from align.verifier import Verifier, ar_generate
from test_sampling import exact_distribution


def copy_of(verifier, noise: float = 0.0, seed: int = 0):
    """The verifier's own weights as an AR drafter, optionally perturbed (partial acceptance)."""
    model = tiny_verifier(0)
    model.load_state_dict(verifier.state_dict())
    if noise:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * noise * p.std())
    return model.eval()


def random_ar(seed: int):
    return ar_model(VOCAB, hidden=16, layers=2, heads=2, intermediate=32, max_len=256, seed=seed).double().eval()


def test_greedy_speculative_decoding_with_the_ar_drafter_is_lossless():
    """Random, perturbed-copy and exact-copy AR drafters; γ ∈ {1, 4, 16}; EOS inside and never reached."""
    accepted = []
    for seed in range(2):
        verifier = tiny_verifier(seed)
        decoder_verifier = Verifier(verifier)
        drafters = [("random", ARDrafter(random_ar(seed + 10), VOCAB)),
                    ("perturbed", ARDrafter(copy_of(verifier, 0.3, seed), VOCAB)),
                    ("copy", ARDrafter(copy_of(verifier), VOCAB))]
        for gamma in (1, 4, 16):
            rng = random.Random(seed * 100 + gamma)
            prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 10))]
            free = ar_generate(verifier, prompt, 40, eos_token_ids=[])
            eos = free[rng.randrange(1, 30)]  # reached inside the text (and a token that never comes: the free run)
            for eos_ids, expected in (([eos], free[:free.index(eos) + 1]), ([], free)):
                for kind, drafter in drafters:
                    out = SpeculativeDecoder(drafter, decoder_verifier, eos_ids).generate(prompt, 40, gamma)
                    assert out.tokens == expected, (seed, kind, gamma, eos_ids)
                    accepted += [(kind, b.accepted, b.gamma) for b in out.stats.blocks if b.gamma]
                    if kind == "copy":  # the verifier drafting for itself: every block is accepted whole
                        assert all(b.accepted == b.gamma for b in out.stats.blocks if b.gamma)
    partial = [a for kind, a, g in accepted if kind == "perturbed"]
    assert 0 in partial and any(a == 16 for a in partial) and any(0 < a < 16 for a in partial)


def cache_free_draft(model, prefix: list[int], gamma: int) -> tuple[list[int], torch.Tensor]:
    """The greedy draft and its rows, recomputed from scratch at every position (no cache)."""
    ids, rows = list(prefix), []
    for _ in range(gamma):
        logq = model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        rows.append(logq)
        ids.append(int(logq.argmax()))
    return ids[len(prefix):], torch.stack(rows)


@torch.no_grad()
def test_cache_reuse_across_blocks_matches_a_cache_free_recompute():
    verifier = tiny_verifier(1)
    model = copy_of(verifier, 0.3, seed=1)
    drafter = ARDrafter(model, VOCAB)
    fed = []
    forward = model.forward
    model.forward = lambda *a, **kw: (fed.append(kw["input_ids"].shape[1]), forward(*a, **kw))[1]
    calls = []
    marginals = drafter.marginals
    drafter.marginals = lambda prefix, gamma, *a: calls.append((prefix[0].tolist(), gamma, marginals(prefix, gamma, *a),
                                                                drafter.draft[0].tolist())) or calls[-1][2]
    prompt = [5, 9, 17, 33, 8]
    out = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None).generate(prompt, 60, gamma=6)
    assert out.tokens == ar_generate(verifier, prompt, 60, eos_token_ids=[])
    assert len(calls) > 3 and any(0 < b.accepted < 6 for b in out.stats.blocks)  # rejections: crops happened
    model.forward = forward
    for prefix, gamma, rows, draft in calls:
        expected, expected_rows = cache_free_draft(model, prefix, gamma)
        assert draft == expected == rows[0].argmax(-1).tolist()
        torch.testing.assert_close(rows[0], expected_rows, atol=1e-6, rtol=0)
    # the prefix is never re-encoded: tokens run = the prompt, then at most (new tokens + γ) per block
    assert sum(fed) <= len(prompt) + len(out.tokens) + sum(g for _, g, _, _ in calls)
    assert sum(fed) < sum(len(p) for p, _, _, _ in calls)  # far below re-running every prefix


@torch.no_grad()
def test_cache_survives_reset_and_unrelated_prefixes():
    model = random_ar(3)
    drafter = ARDrafter(model, VOCAB)
    for prefix in ([4, 5, 6, 7], [4, 5, 6, 7, 8, 9], [4, 5, 11], [20, 21], [20, 21]):
        rows = drafter.marginals(torch.tensor([prefix]), 5)
        draft, expected = drafter.draft[0].tolist(), cache_free_draft(model, prefix, 5)
        assert draft == expected[0]
        torch.testing.assert_close(rows[0], expected[1], atol=1e-6, rtol=0)
    drafter.reset()
    assert drafter.state.cache is None and drafter.draft is None
    batch = drafter.marginals(torch.tensor([[4, 5, 6], [7, 8, 9]]), 3)  # batches: no state, the same drafts
    for row, prefix in enumerate(([4, 5, 6], [7, 8, 9])):
        assert drafter.draft[row].tolist() == cache_free_draft(model, prefix, 3)[0]
        torch.testing.assert_close(batch[row], cache_free_draft(model, prefix, 3)[1], atol=1e-6, rtol=0)


V, PROMPT, N_TOKENS = 6, [4, 5, 2], 3


def test_sampling_with_its_own_draft_is_lossless_and_accepts_more():
    """With the loop verifying the draft the AR drafter drew, sampled output follows the verifier's distribution
    (exact enumeration, chi-square), and a drafter equal to the verifier has every token accepted; redrawing from the
    rows (``expose_draft=False``) is lossless too, but accepts less."""
    from stubs import StubCausalLM
    from test_sampling import chi_square_p

    verifier = StubCausalLM(V, seed=3)
    probs = exact_distribution(verifier, 0.8, PROMPT, V, N_TOKENS)
    n = 2000  # a deliberately wrong q (rows at the wrong temperature) gives p ~ 1e-10 here
    for resample in (False, True):
        drafter = ARDrafter(StubCausalLM(V, seed=4, sharpness=1.0), V, expose_draft=not resample)
        decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
        counts = Counter(tuple(decoder.generate(PROMPT, N_TOKENS, gamma=2, temperature=0.8, seed=s).tokens)
                         for s in range(n))
        tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in probs.items())
        assert chi_square_p(counts, probs, n) > 1e-3, (resample, tv)
    accepted = {}
    for resample in (False, True):
        drafter = ARDrafter(StubCausalLM(V, seed=3), V, expose_draft=not resample)  # the verifier's own table
        decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
        blocks = [b for s in range(40) for b in decoder.generate(PROMPT, 9, gamma=4, temperature=1.0, seed=s).stats.blocks
                  if b.gamma]
        accepted[resample] = sum(b.accepted for b in blocks) / sum(b.gamma for b in blocks)
    assert accepted[False] > 0.99 and accepted[True] < 0.9


def test_size_matching():
    target = 1_400_000
    width = matched_intermediate(target, 2048, 128, 3)
    assert abs(llama_parameters(2048, 128, 3, width) - target) < 3 * 128 * 3 * 8
    model = ar_model(2048, 128, 3, 4, width, 64)
    assert sum(p.numel() for p in model.parameters()) == llama_parameters(2048, 128, 3, width)


def test_the_drafter_it_matches_is_counted_for_every_kind(model_dirs, tmp_path):
    """The AR drafter is sized from the recipe's drafter, whatever its kind: a saved feature-conditioned drafter reads
    its own config (its layers read), which the generic config class does not carry (make real's assistant stage)."""
    from align.baseline import count_parameters, drafter_shape
    from align.zoo.models import dflash_model, verifier_model

    verifier = verifier_model(VOCAB, hidden=32, layers=3, heads=2, max_len=256, seed=0)
    model = dflash_model(verifier.config, [0, 2], 3, layers=2, intermediate=64, kv_heads=1, seed=1)
    model.save_pretrained(tmp_path / "dflash")
    shape = drafter_shape(str(tmp_path / "dflash"), "dflash")
    assert shape["parameters"] == count_parameters(model) and shape["layers"] == 2 and shape["hidden"] == 32
    shape = drafter_shape(str(model_dirs["diffusiongemma"]), "diffusiongemma")
    assert shape["parameters"] > 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, model_dirs, world_prompts):
    """A run folder as align/train.py leaves it: recipe.yaml (+ metrics.jsonl), its rollouts made."""
    from align.config import load_recipe, save_recipe
    from align.rollouts import generate_rollouts

    run = tmp_path_factory.mktemp("run")
    recipe = load_recipe("recipes/tiny.yaml", [
        f"verifier.path={model_dirs['verifier']}", f"drafter.path={model_dirs['diffusiongemma']}",
        f"data.prompts={world_prompts}", "data.num_prompts=24", "data.max_new_tokens=20", "data.batch_size=12",
        "data.heldout_fraction=0.25", "distill.gamma=8", f"run.output_dir={run}"])
    generate_rollouts(recipe, progress=False)
    save_recipe(recipe, run / "recipe.yaml")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "split": "eval", "expected_streak": 0.1},
        {"step": 10, "split": "train", "loss": 1.0, "windows_per_s": 640.0},
        {"step": 20, "split": "train", "loss": 1.0, "windows_per_s": 320.0}]))
    return run, recipe


def test_cli_trains_saves_and_loads(tiny_run, tmp_path):
    from align.rollouts import load_rollouts
    from align.distill.data import heldout_rows
    from align.drafters import load_drafter

    run, recipe = tiny_run
    batch = recipe.train.global_batch_size
    assert diffusion_train_seconds(run, recipe) == pytest.approx(10 * batch / 640 + 10 * batch / 320)
    out = tmp_path / "ar"
    assert main(["train", "--run", str(run), "--out", str(out), "--steps", "3", "--batch-size", "4",
                 "--warmup", "1", "--eval-every", "2"]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "meta.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    assert not out.with_name("ar.partial").exists()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["family"] == "ar" and meta["steps"] == 3 and meta["verifier"] == recipe.verifier.path
    rows = load_rollouts(recipe).to_list()
    held = heldout_rows(rows, recipe.data.heldout_fraction)
    assert meta["heldout_sequences"] == sum(held) > 0 and meta["train_sequences"] == len(rows) - sum(held)
    assert 0.7 < meta["parameters"] / meta["diffusion_drafter_parameters"] < 1.3
    assert {"ce", "accuracy", "greedy_streak"} <= set(meta["heldout"]["after"])
    drafter = load_drafter(str(out), recipe.verifier.path, device="cpu")  # its meta.json: family ar
    vocab = drafter.model.config.vocab_size  # the verifier's tokenizer's: the shared vocabulary
    assert isinstance(drafter, ARDrafter) and drafter.vocab_size == vocab and drafter.model.config.tie_word_embeddings
    assert drafter.marginals(torch.tensor([[2, 7, 9]]), 4).shape == (1, 4, vocab)
    # a second run replaces the first, atomically
    assert main(["train", "--run", str(run), "--out", str(out), "--steps", "1", "--batch-size", "4",
                 "--eval-every", "0"]) == 0
    assert json.loads((out / "meta.json").read_text())["steps"] == 1


def test_bad_run_folder_is_one_error_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for run, expected in [(tmp_path / "empty", "holds no recipe.yaml"), (tmp_path / "missing", "does not exist")]:
        with pytest.raises(SystemExit) as stop:
            run_cli(main, ["train", "--run", str(run), "--out", str(tmp_path / "ar"), "--steps", "1"])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and expected in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit):
        run_cli(main, ["eval", "--drafter", str(tmp_path / "empty"), "--verifier", str(tmp_path / "missing")])
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "ar").exists()


def test_the_loop_verifies_the_ar_drafters_own_draft():
    from stubs import StubCausalLM

    verifier = StubCausalLM(V, seed=3)
    decoder = SpeculativeDecoder(ARDrafter(StubCausalLM(V, seed=3), V), Verifier(verifier), eos_token_ids=None)
    blocks = [b for s in range(30) for b in decoder.generate(PROMPT, 9, gamma=4, temperature=1.0, seed=s).stats.blocks
              if b.gamma]
    assert sum(b.accepted for b in blocks) / sum(b.gamma for b in blocks) > 0.99


def test_eval_acceptance_measures_the_ar_drafter_beside_the_diffusion_drafter(model_dirs, world_prompts, tmp_path):
    from transformers import AutoTokenizer

    from align.baseline import save
    from eval.acceptance import main as evaluate

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["verifier"])
    model = ar_model(len(tokenizer), 16, 2, 2, 32, 256).eval()
    save(model, tokenizer, {"family": "ar", "verifier": str(model_dirs["verifier"])}, [], tmp_path / "ar")
    out = tmp_path / "eval"
    assert evaluate(["--ckpt", str(model_dirs["mdlm"]), "--verifier", str(model_dirs["verifier"]), "--baseline",
                     "none", "--ar-drafter", str(tmp_path / "ar"), "--prompts", str(world_prompts), "--limit", "3",
                     "--gamma", "4", "--max-new-tokens", "10", "--out", str(out)]) == 0
    results = json.loads((out / "acceptance.json").read_text())["results"]
    assert {r["label"] for r in results} == {"aligned", "ar"} and all(r["lossless"] for r in results)
    assert "| ar |" in (out / "report.md").read_text()


@torch.no_grad()
def test_no_deprecated_cache_keyword_reaches_the_models():
    """transformers 5 names the KV cache ``cache`` and warns on ``past_key_values`` until it removes it: the AR
    drafter, the verifier and the lossless checker pass it by the name the model's forward takes."""
    import warnings

    from align.lossless import classify

    verifier = tiny_verifier(2)
    drafter = ARDrafter(copy_of(verifier, 0.3, seed=2), VOCAB)
    prompt = [5, 9, 17, 33, 8]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = SpeculativeDecoder(drafter, Verifier(verifier, lean=True), eos_token_ids=None).generate(prompt, 30, 6)
        reference = ar_generate(verifier, prompt, 30, eos_token_ids=[])
        flipped = reference[:10] + [(reference[10] + 1) % VOCAB] + reference[11:]
        verdict, _ = classify(verifier, prompt, flipped, reference)
    assert out.tokens == reference and verdict == "mismatch"
    deprecated = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not deprecated, deprecated[0]
