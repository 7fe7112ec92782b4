"""Sampling is lossless in distribution: the engine's first tokens follow the verifier's own sampling distribution.

The reference is exact: P(x_1..x_n) = Π_i softmax(logits_i / T)[x_i], enumerated over all V^n continuations of a
tiny vocabulary. The engine's samples are compared with a chi-square test (cells with expected count < 5 merged,
p-value from the Wilson-Hilferty approximation); the threshold is p > 1e-3 for the engine and p < 1e-6 for a
deliberately broken acceptance rule, which shows the test can fail.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import align.speculative as speculative
from align.drafters.diffusion import Drafter
from align.lossless import chi_square_p  # noqa: F401 (the other sampling tests import it from here)
from align.speculative import SpeculativeDecoder
from align.verifier import Verifier

V, PROMPT, N_TOKENS = 8, [4, 5, 6], 3


def models(real: bool = False):
    """Stub models (fast, peaked, different from each other) or real tiny transformers models."""
    if real:
        from align.zoo.models import mdlm_model, verifier_model

        verifier = verifier_model(V, hidden=16, layers=1, heads=2, max_len=64, seed=3).double().eval()
        drafter = mdlm_model(V, hidden=16, layers=1, heads=2, max_len=64, seed=4).eval()
    else:
        from stubs import StubCausalLM, StubMaskedLM

        verifier, drafter = StubCausalLM(V, seed=3), StubMaskedLM(V, seed=4)
    return verifier, Drafter(drafter, "mdlm", V, mask_token_id=3)


@torch.no_grad()
def exact_distribution(verifier, temperature: float, prompt: list[int] = PROMPT, vocab: int = V,
                       n_tokens: int = N_TOKENS) -> dict[tuple[int, ...], float]:
    """The verifier's probability of every continuation of ``n_tokens`` after ``prompt``, by enumeration."""
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=n_tokens)))
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    logp = (verifier(input_ids=ids).logits[:, len(prompt) - 1:-1] / temperature).log_softmax(-1)
    probs = logp.gather(-1, seqs[..., None])[..., 0].sum(-1).exp()
    return {tuple(s): float(p) for s, p in zip(seqs.tolist(), probs)}


def sample(decoder, n: int, temperature: float, steps: int, **selection) -> Counter:
    from align.selection import make_selection

    chosen = make_selection(**selection) if selection else None
    return Counter(tuple(decoder.generate(PROMPT, N_TOKENS, gamma=2, steps=steps, temperature=temperature, seed=s,
                                          selection=chosen).tokens) for s in range(n))


@pytest.mark.parametrize("temperature, steps", [(1.0, 1), (0.7, 2)])
def test_engine_samples_match_the_verifier(temperature, steps):
    verifier, drafter = models()
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    n = 6_000  # about 12 per outcome on average (cells under 5 expected are merged); the broken rule below fails
    # at p < 1e-30 with 5,000
    counts = sample(decoder, n, temperature, steps)
    probs = exact_distribution(verifier, temperature)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in probs.items())
    assert chi_square_p(counts, probs, n) > 1e-3, f"TV {tv:.4f}"


def broken_accept(draft, q, p, generator=None):
    """A classic bug: on rejection, resample from p instead of the residual max(0, p - q)."""
    batch, gamma = draft.shape
    px = p[:, :-1].gather(-1, draft[..., None])[..., 0]
    qx = q.gather(-1, draft[..., None])[..., 0]
    u = torch.rand((batch, gamma), generator=generator)
    accepted = (u * qx <= px).long().cumprod(-1).sum(-1)
    target = p[torch.arange(batch), accepted]
    return accepted, torch.multinomial(target, 1, generator=generator)[:, 0]


def test_real_transformers_models_sample_the_verifier_distribution():
    """The same check through real Llama / BERT classes (fewer samples: they are slower)."""
    verifier, drafter = models(real=True)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    n = 4_000
    assert chi_square_p(sample(decoder, n, 1.0, 1), exact_distribution(verifier, 1.0), n) > 1e-3


def test_the_same_test_rejects_a_broken_acceptance_rule(monkeypatch):
    verifier, drafter = models()
    monkeypatch.setattr(speculative, "sampling_accept", broken_accept)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    n = 5_000
    counts = sample(decoder, n, 1.0, 1)
    assert chi_square_p(counts, exact_distribution(verifier, 1.0), n) < 1e-6


def test_the_two_sample_check_tells_one_distribution_from_another():
    """homogeneity (serving's check of vLLM with and without speculation, where no exact distribution is at hand):
    two samples of one distribution pass, a distribution moved by 0.1 in total variation is rejected."""
    from align.lossless import homogeneity

    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.03, 0.02])
    q = torch.tensor([0.3, 0.4, 0.2, 0.05, 0.03, 0.02])  # TV 0.1

    def sample(probs, n=2000):
        return Counter(torch.multinomial(probs, n, replacement=True, generator=gen).tolist())

    same = [homogeneity(sample(p), sample(p)) for _ in range(20)]
    assert all(cells == 6 for _, cells in same)
    assert min(v for v, _ in same) > 1e-3 and sum(v < 0.05 for v, _ in same) <= 4, same
    assert homogeneity(sample(p), sample(q))[0] < 1e-6
    assert homogeneity(Counter({0: 50}), Counter({0: 70}))[1] == 1  # one outcome: one cell, no evidence either way
    assert homogeneity(Counter({0: 3, 1: 2}), Counter({0: 2, 1: 3}))[1] == 1  # too few samples: merged into one


@pytest.mark.parametrize("mixed, tree", [(False, None), (True, None), (True, "4x2")])
def test_prompt_lookup_samples_match_the_verifier(mixed, tree):
    """Sampling with prompt lookup (one-hot rows: the draft is deterministic given the prefix) follows the
    verifier's distribution, and drafts were made: the prompt repeats, so lookup proposes at every step. So does
    the match mixed into a drafter's rows (ngram@W+PATH: the draft drawn from the mixture), as a chain and a tree."""
    from align.drafters.ngram import FallbackDrafter, NGramDrafter
    from align.trees import TreeShape
    from stubs import StubCausalLM

    verifier = StubCausalLM(V, seed=3)
    prompt = [4, 5, 6, 4, 5, 6, 4, 5, 6]
    probs = exact_distribution(verifier, 1.0, prompt)
    drafter = FallbackDrafter(NGramDrafter(V, 3), models()[1], 0.6) if mixed else NGramDrafter(V, 3)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    shape = tree and TreeShape.parse(tree)
    outs = [decoder.generate(prompt, N_TOKENS, gamma=2, temperature=1.0, seed=s, tree=shape) for s in range(6000)]
    counts = Counter(tuple(o.tokens) for o in outs)
    assert chi_square_p(counts, probs, len(outs)) > 1e-3
    assert sum(b.gamma for o in outs for b in o.stats.blocks) > len(outs)  # lookup drafted


def test_the_check_rejects_drafting_in_steps_with_a_q_its_draft_was_not_drawn_from(monkeypatch):
    """T > 1: the check sees that q must be the distribution each draft token was drawn from. A drafter that
    drafts the tokens it committed at an earlier step (drawn from that step's rows) but reports the last step's
    rows as q leaves the verifier's distribution, and the same check as test_engine_samples_match_the_verifier
    fails."""
    import align.drafters.diffusion as diffusion

    verifier, drafter = models()

    def soft(logq, canvas, committed):  # the bug: committed rows are not one-hot at what was committed
        drawn = torch.multinomial((logq[0] / 0.7).softmax(-1), 1, generator=torch.Generator().manual_seed(
            int(canvas.sum())))[:, 0]
        drafter.draft = torch.where(committed, canvas, drawn[None])
        return logq

    monkeypatch.setattr(diffusion, "as_drawn", soft)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    n = 6_000
    counts = sample(decoder, n, 0.7, 2)
    assert chi_square_p(counts, exact_distribution(verifier, 0.7), n) < 1e-6


def test_the_stop_rule_samples_the_verifier():
    """The stop rule reads the drafter's rows only, so sampling stays the verifier's distribution."""
    verifier, drafter = models()
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    n = 6_000
    outs = [decoder.generate(PROMPT, N_TOKENS, gamma=2, temperature=1.0, seed=s, stop_below=0.3) for s in range(n)]
    counts = Counter(tuple(o.tokens) for o in outs)
    assert chi_square_p(counts, exact_distribution(verifier, 1.0), n) > 1e-3
    drafted = Counter(b.gamma for o in outs for b in o.stats.blocks)
    assert drafted[1] and drafted[2]  # blocks stopped after one position, and blocks of two
