"""Self-selection: scorers and selector on stub tensors, one drafter pass per block, and losslessness kept."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, tiny_drafter, tiny_verifier
from test_sampling import PROMPT, chi_square_p, exact_distribution, models
from test_speculative import EchoDrafter, check_greedy
from align.drafters.diffusion import Drafter
from align.errors import AlignError
from align.selection import make_selection
from align.selection.candidates import iid_candidates, swap_candidates, unique_rows
from align.selection.scorers import drafter_score, oracle_score, select, verifier_score
from align.speculative import SpeculativeDecoder
from align.verifier import Verifier


def peaked(tokens: list[list[int]], vocab: int = 6, high: float = 8.0) -> torch.Tensor:
    logits = torch.zeros(len(tokens), len(tokens[0]), vocab)
    for k, row in enumerate(tokens):
        for j, t in enumerate(row):
            logits[k, j, t] = high
    return logits


def test_the_known_best_draft_is_chosen_by_every_scorer():
    # the verifier will say 1, 2, 3, then 4 (bonus) whatever the draft
    logits = peaked([[1, 2, 3, 4]] * 3)
    drafts = torch.tensor([[1, 5, 3], [1, 2, 3], [0, 2, 3]])  # draft 1 is accepted in full
    assert select(verifier_score(drafts, logits)) == 1
    assert select(oracle_score(drafts, logits)) == 1
    assert oracle_score(drafts, logits).tolist() == [1.0, 3.0, 0.0]
    logq = torch.log_softmax(peaked([[1, 2, 3]])[0], -1)
    assert select(drafter_score(drafts, logq)) == 1


def test_ties_go_to_the_lowest_index():
    assert select(torch.tensor([0.5, 2.0, 2.0, 1.0])) == 1
    assert select(torch.tensor([3.0, 3.0])) == 0


def test_candidates_come_from_one_set_of_marginals():
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.randn(5, 9), -1)
    drafts = iid_candidates(logq, 8, 1.5, g)
    assert torch.equal(drafts[0], logq.argmax(-1))  # the argmax draft is candidate 0
    assert len(unique_rows(drafts)) == len(drafts) <= 8
    iid = iid_candidates(logq, 8, 1.5, g, greedy=False)
    assert iid.shape == (8, 5)  # kept as drawn for sampling
    swaps = swap_candidates(logq, 4)
    least = logq.max(-1).values.argsort()[:3]
    assert torch.equal(swaps[0], logq.argmax(-1))
    for row, position in zip(swaps[1:], least):
        changed = (row != swaps[0]).nonzero().flatten().tolist()
        assert changed == [int(position)] and row[position] == logq[position].topk(2).indices[1]


def test_tree_scoring_equals_one_pass_per_draft():
    verifier = tiny_verifier(1)
    drafts = torch.randint(4, VOCAB, (4, 5))
    tree = Verifier(verifier)
    tree.start([5, 6, 7, 8])
    together = tree.score(drafts)
    for k in range(4):
        alone = Verifier(verifier)
        alone.start([5, 6, 7, 8])
        assert torch.allclose(together[k], alone.score(drafts[k:k + 1])[0], atol=1e-9)


class CountingDrafter(Drafter):
    calls = 0

    def marginals(self, *args, **kwargs):
        CountingDrafter.calls += 1
        return super().marginals(*args, **kwargs)


def test_one_drafter_pass_per_block_whatever_k():
    verifier = tiny_verifier(0)
    drafter = CountingDrafter(tiny_drafter("mdlm", 3), "mdlm", VOCAB, mask_token_id=3)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    CountingDrafter.calls = 0
    out = decoder.generate([5, 6, 7], 20, gamma=4, selection=make_selection(8))
    assert CountingDrafter.calls == sum(b.gamma > 0 for b in out.stats.blocks)  # gamma 0: a plain verifier step


@pytest.mark.parametrize("scorer, candidates", [("verifier", "iid"), ("drafter", "iid"), ("oracle", "iid"),
                                                ("verifier", "swap")])
def test_greedy_with_selection_stays_lossless(scorer, candidates):
    accepted = {}
    for seed in range(4):
        verifier = tiny_verifier(seed)
        for k in (2, 4, 8):
            for family in ("diffusiongemma", "mdlm"):
                drafter = Drafter(tiny_drafter(family, seed + 20), family, VOCAB, mask_token_id=3)
                check_greedy(drafter, verifier, seed, 4, 1, "inside", k=k, scorer=scorer, candidates=candidates)
            out = check_greedy(EchoDrafter(verifier, VOCAB, 0.3, seed), verifier, seed, 8, 1, "none", k=k,
                               scorer=scorer, candidates=candidates, drafter_temperature=1.0)
            accepted[k] = accepted.get(k, 0) + out.stats.summary()["accepted_mean"]
    if scorer == "oracle":  # more candidates can only help the oracle (candidate 0 is always the argmax draft)
        assert accepted[8] >= accepted[2]


def test_multidraft_sampling_matches_the_verifier():
    """K = 4 i.i.d. drafts verified by recursive rejection sampling: the output still follows the verifier."""
    verifier, drafter = models()
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    n = 6_000  # as tests/test_sampling.py: its broken rule fails this check at p < 1e-30 with 5,000
    selection = make_selection(4, drafter_temperature=1.0)
    counts = {}
    for s in range(n):
        key = tuple(decoder.generate(PROMPT, 3, gamma=2, temperature=1.0, seed=s, selection=selection).tokens)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, exact_distribution(verifier, 1.0), n) > 1e-3


def test_unsafe_sampling_combinations_are_refused():
    verifier, drafter = models()
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    for scorer, candidates in (("drafter", "iid"), ("oracle", "iid"), ("verifier", "swap")):
        with pytest.raises(AlignError, match="temperature > 0"):
            decoder.generate(PROMPT, 3, gamma=2, temperature=0.8, selection=make_selection(4, 1.0, scorer, candidates))
    with pytest.raises(AlignError, match="unknown scorer"):
        make_selection(4, 1.0, "best")


def broken_multidraft(drafts, q, p, generator=None):
    """A classic bug of recursive rejection: after a draft's rejection the next draft is tested against p itself,
    not against the residual norm(max(0, p - q))."""
    k, gamma = drafts.shape
    alive = list(range(k))
    for j in range(gamma):
        target = p[alive[0], j]
        token = None
        for c in alive:
            x = int(drafts[c, j])
            if float(torch.rand((), generator=generator)) * float(q[j, x]) <= float(target[x]):
                token = x
                break
        if token is None:
            residual = (target - q[j]).clamp(min=0)
            return alive[0], j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        alive = [c for c in alive if int(drafts[c, j]) == token]
    return alive[0], gamma, int(torch.multinomial(p[alive[0], gamma], 1, generator=generator))


def test_the_multidraft_check_rejects_a_broken_recursion(monkeypatch):
    """The chi-square check of K = 4 drafts sees that path: the same check fails when the recursion is broken."""
    import align.selection as selection_module

    monkeypatch.setattr(selection_module, "multidraft_accept", broken_multidraft)
    verifier, drafter = models()
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    n = 6_000
    selection = make_selection(4, drafter_temperature=1.0)
    counts = {}
    for s in range(n):
        key = tuple(decoder.generate(PROMPT, 3, gamma=2, temperature=1.0, seed=s, selection=selection).tokens)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, exact_distribution(verifier, 1.0), n) < 1e-6
