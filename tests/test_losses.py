"""Losses: analytic cases, the streak gradient's weighted log-likelihood form, exact accumulation, memory bound."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from align.distill.losses import (LOSSES, ce_loss, ce_streak_loss, first_failure_loss, greedy_margin, kd_loss,
                                  margin_loss, position_divergence, sampled_streak_loss, streak_ce_loss, streak_loss,
                                  token_logprobs, tv_loss)

torch.manual_seed(0)


def certain_logits(labels: torch.Tensor, vocab: int, margin: float = 1e4) -> torch.Tensor:
    logits = torch.zeros(*labels.shape, vocab, dtype=torch.float64)
    return logits.scatter(-1, labels.clamp(min=0)[..., None], margin)


def test_perfect_drafter_streak_is_gamma_and_hopeless_first_position_is_zero():
    labels = torch.randint(0, 11, (3, 6))
    term = streak_loss(certain_logits(labels, 11), labels)
    assert torch.allclose(-term.num / term.den, torch.tensor(6.0, dtype=torch.float64))
    logits = certain_logits(labels, 11)
    logits[:, 0] = certain_logits((labels[:, :1] + 1) % 11, 11)[:, 0]  # q_1(x_1) = 0
    term = streak_loss(logits, labels)
    assert abs(float(term.num)) < 1e-12


def test_streak_ends_at_the_rollout_end():
    labels = torch.tensor([[4, 5, -100, -100]])
    term = streak_loss(certain_logits(labels, 8), labels)
    assert torch.allclose(term.num, torch.tensor(-2.0, dtype=torch.float64)) and float(term.den) == 1


def test_streak_gradient_is_the_weighted_log_likelihood():
    """d E[streak] / d z = Σ_k w_k d log q_k / d z with w_k = Σ_{m≥k} Π_{j≤m} q_j (method.md)."""
    logits = torch.randn(4, 5, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (4, 5))
    (-streak_loss(logits, labels).num).backward()
    auto = logits.grad.clone()
    logits.grad = None
    logq = token_logprobs(logits, labels)
    q = logq.detach().exp()
    prefix = torch.cumprod(q, -1)
    weights = torch.flip(torch.cumsum(torch.flip(prefix, [-1]), -1), [-1])  # w_k = Σ_{m≥k} Π_{j≤m} q_j
    (weights * logq).sum().backward()
    assert torch.allclose(auto, logits.grad, atol=1e-10)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_numerator_and_denominator_accumulate_exactly(name):
    logits = torch.randn(6, 4, 7, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(6, 4, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (6, 4))
    labels[2, 2:] = -100
    labels[5, 1:] = -100
    loss = LOSSES[name]
    whole = loss(logits, labels, 0.8, teacher)
    (whole.num / whole.den).backward()
    full_grad = logits.grad.clone()
    logits.grad = None
    parts = [loss(logits[i:i + 2], labels[i:i + 2], 0.8, teacher[i:i + 2]) for i in (0, 2, 4)]
    den = sum(p.den for p in parts)
    assert torch.allclose(den, whole.den)
    for p in parts:
        (p.num / den).backward()
    assert torch.allclose(sum(p.num for p in parts) / den, whole.num / whole.den)
    assert torch.allclose(logits.grad, full_grad, atol=1e-12)


def test_fused_functions_match_plain_autograd():
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 4, 6, dtype=torch.float64)
    labels = torch.randint(0, 6, (3, 4))
    labels[1, 3] = -100
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, 0.7), (logits,))
    for kind in ("kl", "tv"):
        assert torch.autograd.gradcheck(lambda z: position_divergence(z, teacher, kind, 1.3), (logits,))
    plain = (logits / 0.7).log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)
    assert torch.allclose(token_logprobs(logits, labels, 0.7), plain)
    p, q = (teacher / 1.3).softmax(-1), (logits / 1.3).softmax(-1)
    assert torch.allclose(position_divergence(logits, teacher, "kl", 1.3), (p * (p.log() - q.log())).sum(-1))
    assert torch.allclose(position_divergence(logits, teacher, "tv", 1.3), 1 - torch.minimum(p, q).sum(-1))


def test_kd_and_tv_vanish_when_the_drafter_is_the_verifier():
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 3))
    for loss in (kd_loss, tv_loss):
        assert abs(float(loss(logits, labels, 1.0, logits.clone()).num)) < 1e-12


def test_ce_streak_weights_are_the_reach_probability():
    labels = torch.tensor([[1, 2, 3]])
    logits = torch.zeros(1, 3, 4, dtype=torch.float64, requires_grad=True)  # q = 1/4 everywhere
    term = ce_streak_loss(logits, labels)
    expected = -(1 + 0.25 + 0.0625) * torch.log(torch.tensor(0.25, dtype=torch.float64))
    assert torch.allclose(term.num, expected)
    assert torch.allclose(ce_loss(logits, labels).num, -3 * torch.log(torch.tensor(0.25, dtype=torch.float64)))


def test_streak_ce_at_lambda_one_points_where_the_streak_points():
    """λ = 1: the weights are the streak gradient's own, rescaled per window, so per window the two gradients are
    parallel (positive multiples of each other)."""
    logits = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (3, 5))
    labels[1, 3:] = -100
    (-streak_loss(logits, labels).num).backward()
    streak_grad = -logits.grad.clone()
    logits.grad = None
    streak_ce_loss(logits, labels, smoothing=1.0).num.backward()
    for w in range(3):
        a, b = streak_grad[w].flatten(), logits.grad[w].flatten()
        assert torch.allclose(torch.nn.functional.cosine_similarity(a, b, dim=0), torch.tensor(1.0, dtype=a.dtype))
        assert float((a * b).sum()) > 0


def test_streak_ce_at_lambda_zero_is_position_decayed_cross_entropy():
    labels = torch.tensor([[1, 2, 3, 0], [1, 2, -100, -100]])
    logits = torch.zeros(2, 4, 4, dtype=torch.float64)  # q = 1/4 everywhere
    term = streak_ce_loss(logits, labels, smoothing=0.0)
    log4 = torch.log(torch.tensor(4.0, dtype=torch.float64))
    # window 1: w = [4, 3, 2, 1] · 4/10, sum 4; window 2: w = [2, 1] · 2/3, sum 2; every -log q = log 4
    assert torch.allclose(term.num, 6 * log4) and float(term.den) == 6


def test_decayed_ce_weighs_position_k_by_exp_minus_k_minus_1_over_decay():
    from align.distill.losses import decayed_ce_loss

    labels = torch.tensor([[1, 2, 3, 0], [1, 2, -100, -100]])
    logits = torch.randn(2, 4, 4, dtype=torch.float64)
    term = decayed_ce_loss(logits, labels, decay=2.0)
    logq = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    w = torch.exp(-torch.arange(4, dtype=torch.float64) / 2.0)
    expected = -(w * logq[0]).sum() - (w[:2] * logq[1, :2]).sum()
    assert torch.allclose(term.num, expected) and float(term.den) == 6
    assert not torch.allclose(decayed_ce_loss(logits, labels, decay=1e6).num, expected)  # the decay matters


def test_first_failure_weighs_positions_after_the_first_greedy_miss_by_epsilon():
    labels = torch.tensor([[1, 2, 3, 0]])
    logits = torch.zeros(1, 4, 4, dtype=torch.float64)
    logits[0, 0, 1] = logits[0, 1, 3] = logits[0, 2, 3] = logits[0, 3, 0] = 1.0  # greedy: hit, miss, hit, hit
    logq = token_logprobs(logits, labels)
    term = first_failure_loss(logits, labels, after_failure=0.25)
    assert torch.allclose(term.num, -(logq[0, 0] + logq[0, 1] + 0.25 * (logq[0, 2] + logq[0, 3])))
    assert float(term.den) == 4
    perfect = first_failure_loss(certain_logits(labels, 4, 5.0), labels, after_failure=0.0)
    assert torch.allclose(perfect.num, ce_loss(certain_logits(labels, 4, 5.0), labels).num)


def test_greedy_margin_is_positive_exactly_where_greedy_verification_accepts():
    logits = torch.randn(4, 6, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (4, 6))
    labels[0, 4:] = -100
    margin = greedy_margin(logits, labels, 0.5)
    accepted = logits.argmax(-1) == labels
    valid = labels >= 0
    assert torch.equal((margin > 0)[valid], accepted[valid]) and float(margin[~valid].abs().sum()) == 0
    assert torch.autograd.gradcheck(lambda z: greedy_margin(z, labels, 0.5), (logits,))
    top2 = logits.detach().topk(2, -1).values
    assert torch.allclose(greedy_margin(logits, logits.argmax(-1), 1.0), top2[..., 0] - top2[..., 1])


def test_margin_loss_reach_weights_and_value():
    labels = torch.tensor([[0, 0]])
    logits = torch.zeros(1, 2, 3, dtype=torch.float64)
    logits[0, 0, 0], logits[0, 1, 1] = 2.0, 1.0  # m = [2, -1]
    term = margin_loss(logits, labels, smoothing=1.0)
    sp = torch.nn.functional.softplus
    a1 = torch.sigmoid(torch.tensor(2.0, dtype=torch.float64))
    w = torch.stack([torch.tensor(1.0, dtype=torch.float64), a1]) * 2 / (1 + a1)  # reach [1, σ(2)], mean 1
    expected = w[0] * sp(torch.tensor(-2.0, dtype=torch.float64)) + w[1] * sp(torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(term.num, expected) and float(term.den) == 2


def test_sampled_streak_is_gamma_when_the_drafter_is_the_verifier_and_matches_plain_autograd():
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (3, 4))
    labels[2, 2:] = -100
    same = sampled_streak_loss(logits, labels, 0.9, logits.detach().clone())
    assert torch.allclose(-same.num / same.den, torch.tensor((4 + 4 + 2) / 3, dtype=torch.float64))
    teacher = torch.randn(3, 4, 6, dtype=torch.float64)
    sampled_streak_loss(logits, labels, 0.9, teacher).num.backward()
    fused = logits.grad.clone()
    logits.grad = None
    p, q = (teacher / 0.9).softmax(-1), (logits / 0.9).softmax(-1)
    accept = torch.minimum(p, q).sum(-1) * (labels >= 0)
    (-torch.cumprod(accept, -1).sum()).backward()
    assert torch.allclose(fused, logits.grad, atol=1e-12)


class LargeTensors(TorchDispatchMode):
    """Counts how many tensors of at least ``size`` elements are alive at once (inputs excluded)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.alive, self.peak = size, 0, 0

    def _release(self):
        self.alive -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= self.size
                    and t.untyped_storage().data_ptr() not in inputs):  # a new allocation, not a view or alias
                self.alive += 1
                self.peak = max(self.peak, self.alive)
                weakref.finalize(t, self._release)
        return out


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_no_loss_builds_a_second_batch_by_vocab_tensor(name, monkeypatch):
    """Forward and backward together hold at most one new (B, γ, V) float tensor: the gradient itself."""
    import align.distill.losses as losses

    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 4 * 8 * 1000)  # chunks of 4 rows: a quarter of the batch
    b, g, v = 16, 8, 1000
    logits = torch.randn(b, g, v, requires_grad=True)
    teacher = torch.randn(b, g, v)
    labels = torch.randint(0, v, (b, g))
    with LargeTensors(b * g * v // 2) as tracker:
        term = LOSSES[name](logits, labels, 0.9, teacher)
        (term.num / term.den).backward()
    assert tracker.peak <= 1, f"{name}: {tracker.peak} large tensors alive at once"
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
