"""The verification engine is lossless: greedy output equals the verifier's own ``generate``, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import VOCAB, tiny_drafter, tiny_verifier
from align.drafters.diffusion import Drafter
from align.speculative import SpeculativeDecoder, greedy_accept, sampling_accept
from align.verifier import Verifier, ar_generate

FAMILIES = ("diffusiongemma", "mdlm", "dream")


class EchoDrafter(Drafter):
    """Proposes the verifier's own greedy continuation with some positions corrupted, as one-hot marginals.

    With it every acceptance path is exercised: whole blocks accepted, partial blocks, EOS inside a block.
    """

    family = "echo"

    def __init__(self, verifier_model, vocab: int, noise: float, seed: int):
        self.verifier_model, self.vocab_size, self.noise = verifier_model, vocab, noise
        self.rng = random.Random(seed)

    @property
    def device(self):
        return self.verifier_model.device

    def reset(self):
        pass

    def marginals(self, prefix, gamma, steps=1, temperature=0.0, generator=None):
        ids = self.verifier_model.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=gamma,
                                           min_new_tokens=gamma, do_sample=False, eos_token_id=None, pad_token_id=0)
        draft = ids[0, prefix.shape[1]:].tolist()
        draft = [self.rng.randrange(self.vocab_size) if self.rng.random() < self.noise else t for t in draft]
        logq = torch.full((1, gamma, self.vocab_size), -torch.inf, dtype=torch.float64)
        logq[0, torch.arange(gamma), torch.tensor(draft)] = 0.0
        return logq


def eos_for(verifier, prompt, mode: str, rng: random.Random) -> int:
    """An EOS id that the verifier's greedy output reaches at a random point ('inside'), or never reaches ('none')."""
    seq = ar_generate(verifier, prompt, 40, eos_token_ids=[])
    if mode == "inside":
        return seq[rng.randrange(1, 30)]
    unused = sorted(set(range(VOCAB)) - set(seq) - set(prompt))
    return unused[0]


def check_greedy(drafter, verifier_model, seed: int, gamma: int, steps: int, eos_mode: str, k: int = 1, **selection):
    rng = random.Random(seed * 1000 + gamma * 10 + steps)
    prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 10))]
    eos = eos_for(verifier_model, prompt, eos_mode, rng)
    expected = ar_generate(verifier_model, prompt, 40, eos_token_ids=[eos])
    decoder = SpeculativeDecoder(drafter, Verifier(verifier_model), eos)
    from align.selection import make_selection

    out = decoder.generate(prompt, 40, gamma, steps, temperature=0.0, seed=seed,
                           selection=make_selection(k, **selection))
    assert out.tokens == expected, (seed, gamma, steps, eos_mode, k)
    assert sum(b.accepted for b in out.stats.blocks) + len(out.stats.blocks) >= len(out.tokens)
    return out


class Agreeing:
    """A family's canvas reader whose rows agree with the verifier on part of each block: the first m rows (m drawn
    per prefix from 0..γ, the same for every denoising step of a block) are pushed to the verifier's greedy tokens,
    the others are the model's own. Decoding then accepts whole blocks, parts of blocks and nothing, through every
    family's real canvas, commit schedule and self-conditioning."""

    def __init__(self, reader, verifier):
        self.reader, self.verifier = reader, verifier

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def canvas_logits(self, model, prefix, prefix_mask, canvas, self_conditioning=None, state=None,
                      next_token=False):
        out = self.reader.canvas_logits(model, prefix, prefix_mask, canvas, self_conditioning, state, next_token)
        logits = (out[0] if next_token else out).clone()
        gamma = canvas.shape[1]
        ids = prefix[0].tolist()
        agree = random.Random(hash(tuple(ids))).randrange(gamma + 1)
        greedy = ar_generate(self.verifier, ids, gamma, eos_token_ids=[])
        for j in range(min(agree, len(greedy))):
            logits[0, j, greedy[j]] += 1e4
        return (logits, out[1]) if next_token else logits


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_lossless_every_family(family):
    """Random tiny models of each family, several seeds, γ ∈ {1, 4, 16}, T ∈ {1, 4}, EOS inside and outside blocks:
    random drafters (nearly every block rejected at its first token) and drafters that agree with the verifier on a
    random part of each block, so that every family at every T accepts whole blocks and parts of blocks too."""
    accepted: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for seed in range(3):
        verifier = tiny_verifier(seed)
        for agreeing in (False, True):
            drafter = Drafter(tiny_drafter(family, seed + 10), family, VOCAB, mask_token_id=3)
            if agreeing:
                drafter.reader = Agreeing(drafter.reader, verifier)
            for gamma in (1, 4, 16):
                for steps in (1, 4):
                    for eos_mode in ("inside", "none"):
                        out = check_greedy(drafter, verifier, seed, gamma, steps, eos_mode)
                        if agreeing:
                            accepted.setdefault((gamma, steps), []).extend(
                                (b.accepted, b.gamma) for b in out.stats.blocks if b.gamma)
    for (gamma, steps), blocks in accepted.items():
        if gamma > 1:
            assert any(0 < a < g for a, g in blocks), (gamma, steps)  # part of a block
        assert any(a == g for a, g in blocks) and any(a == 0 for a, g in blocks), (gamma, steps)


def test_greedy_lossless_with_accepting_drafter():
    """A drafter that is often right: whole, partial and EOS-ending blocks all decode exactly (60 random cases)."""
    accepted = []
    for seed in range(10):
        verifier = tiny_verifier(seed)
        for gamma in (1, 4, 16):
            for eos_mode in ("inside", "none"):
                drafter = EchoDrafter(verifier, VOCAB, noise=0.15, seed=seed)
                out = check_greedy(drafter, verifier, seed, gamma, 1, eos_mode)
                accepted += [b.accepted for b in out.stats.blocks]
    assert max(accepted) == 16 and 0 in accepted and any(0 < a < 16 for a in accepted)


def test_max_new_tokens_and_context_limit():
    verifier = tiny_verifier(0)
    drafter = EchoDrafter(verifier, VOCAB, noise=0.0, seed=0)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    for n in (1, 2, 5, 17, 33):
        out = decoder.generate([5, 6, 7], n, gamma=16)
        assert out.tokens == ar_generate(verifier, [5, 6, 7], n, eos_token_ids=[])
        assert len(out.tokens) == n


# ------------------------------------------------------------------------------------------------ stub cases


def one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.full((1, len(tokens), vocab), -5.0)
    logits[0, torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accept_all_reject_first_partial():
    verifier_says = one_hot_logits([3, 4, 5, 6, 7])  # argmax after each prefix of a 4-token draft, + bonus
    cases = {  # draft -> (accepted, next token)
        (3, 4, 5, 6): (4, 7),  # all accepted, bonus token 7
        (0, 4, 5, 6): (0, 3),  # first rejected: correction 3
        (3, 4, 0, 6): (2, 5),  # partial: two accepted, correction 5
        (3, 4, 5, 0): (3, 6),
    }
    for draft, (n, token) in cases.items():
        accepted, next_token = greedy_accept(torch.tensor([draft]), verifier_says)
        assert (int(accepted), int(next_token)) == (n, token)


def test_sampling_accept_stub_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(one_hot_logits([3, 4, 5]) * 10, -1)  # verifier certain of 3, 4, then bonus 5
    q = p[:, :2].clone()
    accepted, token = sampling_accept(torch.tensor([[3, 4]]), q, p, g)
    assert (int(accepted), int(token)) == (2, 5)  # p = q: everything accepted, bonus from p
    q_wrong = torch.softmax(one_hot_logits([6, 4]) * 10, -1)
    accepted, token = sampling_accept(torch.tensor([[6, 4]]), q_wrong, p, g)
    assert (int(accepted), int(token)) == (0, 3)  # p(6) ~ 0: rejected, residual puts its mass on 3
    q_mid = torch.softmax(one_hot_logits([3, 6]) * 10, -1)
    accepted, token = sampling_accept(torch.tensor([[3, 6]]), q_mid, p, g)
    assert (int(accepted), int(token)) == (1, 4)


def test_sampling_accept_batched_rows_are_independent():
    """Each row of a batch is verified on its own: a row's outcome does not depend on the other rows (the same
    row alone, with the same random numbers, gives the same result), and rows that differ get their own results."""
    p = torch.softmax(torch.randn(64, 5, 8, generator=torch.Generator().manual_seed(0)) * 2, -1)
    q = torch.softmax(torch.randn(64, 4, 8, generator=torch.Generator().manual_seed(1)) * 2, -1)
    draft = torch.multinomial(q.view(-1, 8), 1, generator=torch.Generator().manual_seed(2)).view(64, 4)
    accepted, token = sampling_accept(draft, q, p, torch.Generator().manual_seed(3))
    assert accepted.shape == (64,) and token.shape == (64,)
    assert int(accepted.min()) >= 0 and int(accepted.max()) <= 4 and len(set(accepted.tolist())) > 2
    other = p.clone()  # row 5's verifier changed: rows 0 and 9 keep their outcomes
    other[5] = torch.softmax(torch.randn(5, 8), -1)
    again, again_token = sampling_accept(draft, q, other, torch.Generator().manual_seed(3))
    keep = [r for r in range(64) if r != 5]
    assert torch.equal(again[keep], accepted[keep]) and torch.equal(accepted, sampling_accept(
        draft, q, p, torch.Generator().manual_seed(3))[0])
    u = torch.rand((64, 4), generator=torch.Generator().manual_seed(3))  # the rule row by row, by hand
    px, qx = p[:, :-1].gather(-1, draft[..., None])[..., 0], q.gather(-1, draft[..., None])[..., 0]
    by_hand = [next((j for j in range(4) if u[r, j] * qx[r, j] > px[r, j]), 4) for r in range(64)]
    assert accepted.tolist() == by_hand


# ------------------------------------------------------------------------------------------------ lean passes


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_lossless_with_sliding_window_drafter_lean_and_plain(steps):
    """A DiffusionGemma drafter with sliding-window layers (window 8, shorter than the prompts), MoE and GQA: through
    the lean pass and through the model's own forward, decoding gives the verifier's tokens, and the two paths
    propose the same drafts (the same accepted lengths, the same verifier ranks of the rejected tokens)."""
    from test_drafter_pass import sliding_drafter

    model = sliding_drafter(3)
    for seed in range(2):
        verifier = tiny_verifier(seed)
        runs = {}
        for lean in (True, False):
            drafter = Drafter(model, "diffusiongemma", VOCAB, lean=lean)
            runs[lean] = [check_greedy(drafter, verifier, seed, gamma, steps, eos_mode)
                          for gamma in (4, 16) for eos_mode in ("inside", "none")]
        for a, b in zip(runs[True], runs[False]):
            assert [(x.accepted, x.rejected_rank) for x in a.stats.blocks] == \
                [(x.accepted, x.rejected_rank) for x in b.stats.blocks]


def test_blocks_carry_their_time_split():
    verifier = tiny_verifier(0)
    drafter = Drafter(tiny_drafter("diffusiongemma", 1), "diffusiongemma", VOCAB)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    out = decoder.generate([5, 6, 7, 8], 30, gamma=4)
    assert len(out.stats.blocks) >= 6
    for block in out.stats.blocks:
        assert 0 < block.drafter_s and 0 < block.verifier_s and block.drafter_s + block.verifier_s <= block.total_s
    assert sum(b.total_s for b in out.stats.blocks) <= out.stats.total_s + 1e-9


def test_a_drafter_with_a_canvas_seed_drafts_from_that_one_canvas_losslessly():
    """canvas_seed: every block starts from fixed_canvas (whatever the generator), the logits are the family's on that
    canvas, and decoding stays the verifier's own; without it, each block draws its own canvas."""
    from align.drafters.diffusion import FAMILIES as families, fixed_canvas

    model = tiny_drafter("diffusiongemma", 2)
    prefix = torch.tensor([[5, 6, 7, 8, 9]])
    fixed = Drafter(model, "diffusiongemma", VOCAB, canvas_seed=7)
    a = fixed.marginals(prefix, 6, generator=torch.Generator().manual_seed(0))
    fixed.reset()
    b = fixed.marginals(prefix, 6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    canvas = fixed_canvas(families["diffusiongemma"], 6, None, VOCAB, 7)
    with torch.no_grad():
        expected = families["diffusiongemma"].canvas_logits(model, prefix, None, canvas[None])
    assert (a - expected[..., :VOCAB].float().log_softmax(-1)).abs().max() < 1e-4
    free = Drafter(model, "diffusiongemma", VOCAB)
    c = free.marginals(prefix, 6, generator=torch.Generator().manual_seed(0))
    free.reset()
    assert not torch.equal(c, free.marginals(prefix, 6, generator=torch.Generator().manual_seed(1)))
    for seed in range(3):
        for steps in (1, 3):
            check_greedy(Drafter(model, "diffusiongemma", VOCAB, canvas_seed=seed), tiny_verifier(seed), seed, 8,
                         steps, "inside")


@pytest.mark.parametrize("lean", [True, False])
def test_a_drafter_drafting_its_first_token_from_the_encoder_losslessly(lean):
    """first_token "encoder": the block's first row is the log-softmax of the encoder's own next-token logits after
    the prefix (lm_head on its last hidden state) at T = 1 and T = 3, every later row the canvas's at T = 1 (at T > 1
    later steps condition on the encoder's token: the next test), in decoding (prefix cache: lean pass or the model's
    forward) and on a left-padded batch alike; decoding stays the verifier's own, and a bidirectional family is
    refused."""
    from align.models.diffusiongemma_pass import lm_logits
    from align.errors import AlignError

    model = tiny_drafter("diffusiongemma", 2)
    prefix = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        encoded = model.model.encoder(input_ids=prefix, position_ids=torch.arange(5)[None])
        expected = lm_logits(model, encoded.last_hidden_state[:, -1])[:, :VOCAB].log_softmax(-1)
    for steps in (1, 3):
        first = Drafter(model, "diffusiongemma", VOCAB, canvas_seed=3, first_token="encoder", lean=lean)
        canvas = Drafter(model, "diffusiongemma", VOCAB, canvas_seed=3, lean=lean)
        got = first.marginals(prefix, 6, steps, generator=torch.Generator().manual_seed(0))
        plain = canvas.marginals(prefix, 6, steps, generator=torch.Generator().manual_seed(0))
        assert (got[:, 0] - expected).abs().max() < 1e-4
        assert not torch.allclose(got[:, 0], plain[:, 0], atol=1e-2)  # the canvas's first row is another one
        if steps == 1:
            torch.testing.assert_close(got[:, 1:], plain[:, 1:], atol=1e-4, rtol=0)
        again = first.marginals(prefix, 6, steps, generator=torch.Generator().manual_seed(1))  # nothing new: kept
        assert (again[:, 0] - expected).abs().max() < 1e-4
    padded = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11]])
    batch = Drafter(model, "diffusiongemma", VOCAB, canvas_seed=3, first_token="encoder")
    with torch.no_grad():
        _, after = batch.reader.canvas_logits(model, padded, (padded > 0).long(), torch.zeros(2, 6, dtype=torch.long),
                                              next_token=True)
    assert (after[:1, :VOCAB].log_softmax(-1) - expected).abs().max() < 1e-4
    for seed in range(3):
        for steps in (1, 3):
            check_greedy(Drafter(model, "diffusiongemma", VOCAB, canvas_seed=seed, first_token="encoder", lean=lean),
                         tiny_verifier(seed), seed, 8, steps, "inside")
    with pytest.raises(AlignError, match="first_token"):
        Drafter(tiny_drafter("mdlm", 2), "mdlm", VOCAB, mask_token_id=3, first_token="encoder")


def test_at_t_over_1_the_encoders_first_token_is_what_later_steps_condition_on():
    """first_token "encoder", T > 1: when the confidence schedule commits the block's first position before the last
    step, it commits the encoder's token (from the encoder's row, the row the draft reads), so every later step's
    canvas holds the draft's own first token there; the first row is then one-hot at that token (as every committed
    row is). Once it committed the canvas's own row-0 token, which the draft did not contain."""
    from align.drafters.diffusion import DiffusionGemmaFamily
    from align.models.diffusiongemma_pass import lm_logits

    model = tiny_drafter("diffusiongemma", 2)
    fed: list[torch.Tensor] = []
    original = DiffusionGemmaFamily.canvas_logits

    def recording(self, model, prefix, prefix_mask, canvas, *args, **kwargs):
        fed.append(canvas.clone())
        return original(self, model, prefix, prefix_mask, canvas, *args, **kwargs)

    committed_first = 0
    for seed in range(12):
        prefix = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            encoded = model.model.encoder(input_ids=prefix, position_ids=torch.arange(6)[None])
            encoder_token = int(lm_logits(model, encoded.last_hidden_state[:, -1])[0, :VOCAB].argmax())
        drafter = Drafter(model, "diffusiongemma", VOCAB, canvas_seed=seed, first_token="encoder")
        fed.clear()
        DiffusionGemmaFamily.canvas_logits = recording
        try:
            logq = drafter.marginals(prefix, 4, steps=4, generator=torch.Generator().manual_seed(seed))
        finally:
            DiffusionGemmaFamily.canvas_logits = original
        first_row = logq[0, 0]
        if torch.isinf(first_row).sum() == first_row.numel() - 1:  # one-hot: committed before the last step
            committed_first += 1
            assert int(first_row.argmax()) == encoder_token
            later = [c[0, 0].item() for c in fed[1:]]
            assert later and later[-1] == encoder_token, (later, encoder_token)
    assert committed_first >= 2  # the schedule commits the first position early in some blocks


# ------------------------------------------------------------------------------------------------ prompt lookup


def test_lookup_takes_the_most_recent_match_of_the_longest_suffix():
    from align.drafters.ngram import lookup

    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(ids, 3, max_ngram=3) == [7, 8, 5]  # "2 3" last seen before "7 8 5" (no earlier "5 2 3")
    assert lookup(ids, 2, max_ngram=1) == [7, 8]  # "3": its most recent earlier occurrence
    assert lookup([1, 2, 3, 4], 4) == [] and lookup([5], 4) == []  # nothing repeats
    assert lookup([4, 4, 4], 5) == [4]  # the occurrence just before the suffix: one token follows it


def test_lookup_spec_names_the_shortest_and_longest_ngram():
    from align.drafters.ngram import lookup, parse
    from align.errors import AlignError

    assert parse("ngram") == (1, 3, None, 1.0, None) and parse("ngram:5") == (1, 5, None, 1.0, None)
    assert parse("ngram:2-3+runs/x/final") == (2, 3, "runs/x/final", 1.0, None)
    assert parse("ngram:3@0.25+runs/x/final") == (1, 3, "runs/x/final", 0.25, None)
    assert parse("ngram:3@0.7/2+runs/x/final") == (1, 3, "runs/x/final", 0.7, 2)
    for bad in ("ngram:3-2", "ngram:0-2", "ngram:a-3"):
        with pytest.raises(AlignError, match="n-gram lengths"):
            parse(bad)
    for bad in ("ngram@0.5", "ngram:3@0+x", "ngram@1.5+x", "ngram@half+x"):  # no drafter to mix into, W out of (0, 1]
        with pytest.raises(AlignError, match="@W"):
            parse(bad)
    for bad in ("ngram:3@0.7/1+x", "ngram:3@0.7/4+x", "ngram:2-3@0.7/2+x", "ngram:3@0.7/two+x"):  # S in (MIN, MAX]
        with pytest.raises(AlignError, match="@W/S"):
            parse(bad)
    ids = [1, 2, 3, 9, 5, 6, 3]  # only "3" repeats: a one-token match
    assert lookup(ids, 2, max_ngram=3) == [9, 5] and lookup(ids, 2, max_ngram=3, min_ngram=2) == []


def test_prompt_lookup_and_its_fallback_decode_exactly_what_the_verifier_does():
    """Prompt lookup (drafts of any length, none where nothing matches) and lookup falling back to a trained
    drafter, over random pairs whose prompts repeat themselves: every output is the verifier's, and the drafts
    took every length (full, short, none) and were accepted in part and whole."""
    from align.drafters.ngram import FallbackDrafter, NGramDrafter

    lengths, accepted = set(), []
    for seed in range(6):
        verifier = tiny_verifier(seed)
        greedy = ar_generate(verifier, [5, 9, 17], 30, eos_token_ids=[])
        for gamma in (1, 4, 16):
            for drafter in (NGramDrafter(VOCAB, 3),
                            FallbackDrafter(NGramDrafter(VOCAB, 2), EchoDrafter(verifier, VOCAB, 0.3, seed)),
                            FallbackDrafter(NGramDrafter(VOCAB, 2), EchoDrafter(verifier, VOCAB, 0.3, seed), 0.4),
                            FallbackDrafter(NGramDrafter(VOCAB, 3), EchoDrafter(verifier, VOCAB, 0.3, seed), 0.4, 2)):
                rng = random.Random(seed * 31 + gamma)
                prompt = greedy[:rng.randrange(8, 20)] + [5, 9, 17]  # the verifier's own text: lookup can hit
                expected = ar_generate(verifier, prompt, 40, eos_token_ids=[])
                out = SpeculativeDecoder(drafter, Verifier(verifier), None).generate(prompt, 40, gamma)
                assert out.tokens == expected, (seed, gamma, type(drafter).__name__)
                lengths |= {b.gamma for b in out.stats.blocks}
                accepted += [(b.accepted, b.gamma) for b in out.stats.blocks if b.gamma]
    assert 0 in lengths and 16 in lengths and any(0 < g < 16 for g in lengths)
    assert any(a == g for a, g in accepted) and any(a < g for a, g in accepted)


class FixedRows:
    """A drafter whose rows are given (independent given the prefix); counts its calls."""

    family, verifier_layers, draft, device = "fixed", None, None, torch.device("cpu")

    def __init__(self, logq: torch.Tensor):
        self.logq, self.vocab_size, self.calls = logq, logq.shape[-1], 0

    def reset(self):
        pass

    def marginals(self, prefix, gamma, steps=1, temperature=0.0, generator=None):
        self.calls += 1
        return self.logq[None, :gamma]


def test_a_mixed_match_is_a_distribution_whose_tree_holds_the_match_and_the_drafters_guess():
    """ngram@W+PATH: where the context matches, row j is W·onehot(match_j) + (1 − W)·q_j (each row sums to 1), the
    rows after the match are the drafter's own, and an 8-node tree holds the whole match as a path and the drafter's
    likeliest first token beside it; W 1 drafts the match alone without asking the drafter, and so does @W/S for a
    match after an n-gram of S tokens or more (a shorter one mixed); a drafter whose rows hang on its own draft
    (steps > 1) is refused."""
    from align.drafters.ngram import FallbackDrafter, NGramDrafter
    from align.errors import AlignError
    from align.trees import TreeShape, tree_from_marginals

    q = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)).mul(3).log_softmax(-1)
    prefix = torch.tensor([[7, 8, 9, 10, 11, 7, 8]])  # "7 8" occurred before: the match is 9 10 11 7 8
    match = [9, 10, 11, 7, 8]
    mixed = FallbackDrafter(NGramDrafter(VOCAB, 3), FixedRows(q), 0.7)
    rows = mixed.marginals(prefix, 6)[0]
    assert torch.allclose(rows.exp().sum(-1), torch.ones(6), atol=1e-5)
    for j, token in enumerate(match):
        assert torch.isclose(rows[j, token].exp(), 0.7 + 0.3 * q[j, token].exp(), atol=1e-6)
        other = torch.arange(VOCAB) != token
        assert torch.allclose(rows[j, other].exp(), 0.3 * q[j, other].exp(), atol=1e-6)
    assert torch.equal(rows[5], q[5]) and mixed.looked_up == 1 and mixed.draft is None
    tree = tree_from_marginals(rows, TreeShape(8, 6, 2))
    paths = [tree.tokens[tree.path(i)].tolist() for i in range(len(tree))]
    assert match in paths
    guess = int(q[0].argmax()) if int(q[0].argmax()) != match[0] else int(q[0].topk(2).indices[1])
    assert [guess] in paths  # the drafter's likeliest other first token
    alone = FallbackDrafter(NGramDrafter(VOCAB, 3), FixedRows(q))
    assert alone.marginals(prefix, 6)[0].exp().max(-1).values.tolist() == [1.0] * 5 and alone.drafter.calls == 0
    nothing = torch.tensor([[1, 2, 3, 4]])  # no repeat: the drafter's rows as they are
    assert torch.equal(mixed.marginals(nothing, 6)[0], q)
    sure = FallbackDrafter(NGramDrafter(VOCAB, 3), FixedRows(q), 0.7, sure=2)  # ngram@0.7/2: a 2-gram match alone
    assert sure.marginals(prefix, 6)[0].exp().max(-1).values.tolist() == [1.0] * 5 and sure.drafter.calls == 0
    single = torch.tensor([[7, 9, 10, 11, 12, 7]])  # only "7" occurred before: a 1-gram match, mixed
    assert torch.isclose(sure.marginals(single, 6)[0, 0, 9].exp(), 0.7 + 0.3 * q[0, 9].exp(), atol=1e-6)
    assert sure.drafter.calls == 1 and sure.lookup.matched == 1
    drawn = FixedRows(q)
    drawn.draft = q.argmax(-1)[None]
    with pytest.raises(AlignError, match="steps 1"):
        FallbackDrafter(NGramDrafter(VOCAB, 3), drawn, 0.5).marginals(prefix, 6)


def test_the_stop_rule_ends_blocks_where_the_drafter_is_unsure_and_decodes_exactly():
    """A block ends before the first position whose likeliest token the drafter gives less than the threshold:
    blocks of every length come out, at least one position each, and the output is still the verifier's."""
    lengths = set()
    for seed in range(3):
        verifier = tiny_verifier(seed)
        for family in FAMILIES:
            drafter = Drafter(tiny_drafter(family, seed + 20), family, VOCAB, mask_token_id=3)
            drafter.reader = Agreeing(drafter.reader, verifier)  # agreeing rows are sure, the others are not
            rng = random.Random(seed)
            prompt = [rng.randrange(4, VOCAB) for _ in range(6)]
            expected = ar_generate(verifier, prompt, 40, eos_token_ids=[])
            for steps in (1, 4):
                out = SpeculativeDecoder(drafter, Verifier(verifier), None).generate(prompt, 40, 8, steps,
                                                                                    stop_below=0.5)
                assert out.tokens == expected, (seed, family, steps)
                room = [min(8, 40 - sum(b.produced for b in out.stats.blocks[:i]) - 1)
                        for i in range(len(out.stats.blocks))]
                lengths |= {(b.gamma, r) for b, r in zip(out.stats.blocks, room)}
    assert all(g >= 1 for g, r in lengths if r >= 1)
    assert any(g < r for g, r in lengths) and any(g == r == 8 for g, r in lengths)  # stopped short, and not
