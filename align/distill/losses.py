"""Distillation losses: pure functions of the drafter's canvas logits and the verifier's tokens (or logits).

Notation: a window has block positions j = 1..γ, labels x_j (the verifier's rollout tokens, -100 past its end),
and the drafter's distribution at the deployment temperature τ, q_j = softmax(z_j / τ). Each loss returns a
:class:`LossTerm` ``(num, den)``: the loss is ``num / den``, and summing ``num`` and ``den`` over micro-batches and
processes before dividing gives exactly the loss of the whole batch (gradient accumulation normalises exactly).
``den`` depends only on the labels, so it is known before the forward pass.

Memory: the vocabulary can be 262,144 wide, so no loss here builds a second (B, γ, V) tensor beside the logits:
:func:`token_logprobs` and :func:`position_divergence` are autograd functions that work through the batch in row
chunks and write the gradient straight into one (B, γ, V) buffer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from align.metrics import expected_streak

CHUNK_ELEMENTS = 1 << 24  # at most this many floats of temporaries per chunk (64 MB)


@dataclass
class LossTerm:
    """A loss as ``num / den``; ``num`` carries the gradient, ``den`` is a count known from the labels alone."""

    num: torch.Tensor
    den: torch.Tensor


def _precision(t: torch.Tensor) -> torch.dtype:
    """Compute in float32, or float64 when the logits are float64."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunks(rows: int, per_row: int):
    size = max(1, CHUNK_ELEMENTS // max(1, per_row))
    return [(i, min(rows, i + size)) for i in range(0, rows, size)]


class _TokenLogProb(torch.autograd.Function):
    """log softmax(z / τ)[x] per position, computed in row chunks; gradient (onehot(x) - q) / τ written in place."""

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        b, g, v = logits.shape
        dtype = _precision(logits)
        out = torch.zeros((b, g), dtype=dtype, device=logits.device)
        safe = labels.clamp(min=0)
        for lo, hi in _chunks(b, g * v):
            z = logits[lo:hi].to(dtype) / temperature
            out[lo:hi] = z.gather(-1, safe[lo:hi, :, None])[..., 0] - z.logsumexp(-1)
        out = out.masked_fill(labels < 0, 0.0)
        ctx.save_for_backward(logits, labels)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels = ctx.saved_tensors
        b, g, v = logits.shape
        grad = torch.empty_like(logits)
        dtype = _precision(logits)
        weight = grad_out.to(dtype).masked_fill(labels < 0, 0.0) / ctx.temperature
        safe = labels.clamp(min=0)
        for lo, hi in _chunks(b, g * v):
            q = (logits[lo:hi].to(dtype) / ctx.temperature).softmax(-1)
            q.neg_().scatter_add_(-1, safe[lo:hi, :, None], torch.ones_like(q[..., :1]))
            grad[lo:hi] = (q * weight[lo:hi, :, None]).to(grad.dtype)
        return grad, None, None


class _PositionDivergence(torch.autograd.Function):
    """Per position KL(p || q) or TV(p, q) = 1 - Σ min(p, q), q = softmax(z / τ), p = softmax(t / τ); chunked."""

    @staticmethod
    def forward(ctx, logits, teacher, temperature, kind):
        b, g, v = logits.shape
        dtype = _precision(logits)
        out = torch.zeros((b, g), dtype=dtype, device=logits.device)
        for lo, hi in _chunks(b, g * v):
            logq = (logits[lo:hi].to(dtype) / temperature).log_softmax(-1)
            logp = (teacher[lo:hi].to(dtype) / temperature).log_softmax(-1)
            if kind == "kl":
                out[lo:hi] = (logp.exp() * (logp - logq)).sum(-1)
            else:
                out[lo:hi] = 1.0 - torch.minimum(logp.exp(), logq.exp()).sum(-1)
        ctx.save_for_backward(logits, teacher)
        ctx.temperature, ctx.kind = temperature, kind
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, teacher = ctx.saved_tensors
        b, g, v = logits.shape
        grad = torch.empty_like(logits)
        dtype = _precision(logits)
        weight = grad_out.to(dtype) / ctx.temperature
        for lo, hi in _chunks(b, g * v):
            q = (logits[lo:hi].to(dtype) / ctx.temperature).softmax(-1)
            p = (teacher[lo:hi].to(dtype) / ctx.temperature).softmax(-1)
            if ctx.kind == "kl":  # d KL / d z = (q - p) / τ
                d = q - p
            else:  # d TV / d z_y = -(1[q_y < p_y] q_y - q_y Σ_x 1[q_x < p_x] q_x) / τ
                below = (q < p).to(q.dtype) * q
                d = q * below.sum(-1, keepdim=True) - below
            grad[lo:hi] = (d * weight[lo:hi, :, None]).to(grad.dtype)
        return grad, None, None, None


class _GreedyMargin(torch.autograd.Function):
    """m = (z[x] - max_{y≠x} z[y]) / τ per position, in row chunks; gradient +1/τ at x, -1/τ at the competitor."""

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        safe = labels.clamp(min=0)
        dtype = _precision(logits)
        values, indices = logits.detach().topk(2, dim=-1)  # (B, γ, 2): no (B, γ, V) temporary
        top_is_label = indices[..., 0] == safe
        competitor = torch.where(top_is_label, indices[..., 1], indices[..., 0])
        margin = (logits.detach().gather(-1, safe[..., None])[..., 0].to(dtype)
                  - torch.where(top_is_label, values[..., 1], values[..., 0]).to(dtype)) / temperature
        ctx.save_for_backward(labels, competitor)
        ctx.shape, ctx.dtype, ctx.temperature = logits.shape, logits.dtype, temperature
        return margin.masked_fill(labels < 0, 0.0)

    @staticmethod
    def backward(ctx, grad_out):
        labels, competitor = ctx.saved_tensors
        weight = (grad_out.masked_fill(labels < 0, 0.0) / ctx.temperature).to(ctx.dtype)[..., None]
        grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=labels.device)
        grad.scatter_add_(-1, labels.clamp(min=0)[..., None], weight)
        grad.scatter_add_(-1, competitor[..., None], -weight)
        return grad, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log q_j(x_j) = log softmax(z_j / τ)[x_j] for logits (B, γ, V) and labels (B, γ); 0 where the label is -100."""
    return _TokenLogProb.apply(logits, labels, temperature)


def position_divergence(logits: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence (B, γ) between the verifier's p = softmax(t / τ) and q = softmax(z / τ)."""
    return _PositionDivergence.apply(logits, teacher, temperature, kind)


def greedy_margin(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """m_j = (z_j[x_j] - max_{y≠x_j} z_j[y]) / τ for logits (B, γ, V): greedy verification accepts x_j iff m_j > 0."""
    return _GreedyMargin.apply(logits, labels, temperature)


def smoothed_weights(q: torch.Tensor, valid: torch.Tensor, smoothing: float, kind: str) -> torch.Tensor:
    """Detached per-position weights from per-position acceptance probabilities q (B, γ), s_i = λ q_i + (1 - λ):

        suffix:  w_k = Σ_{j≥k} Π_{i≤j} s_i        (the streak objective's own weight on log q_k when λ = 1)
        reach:   w_k = Π_{i<k} s_i                  (the probability that the streak reaches position k)

    then scaled per window to mean 1 over its valid positions, so that the loss keeps cross-entropy's scale and
    λ = 0 is position-decayed (suffix) or plain (reach) cross-entropy.
    """
    s = (smoothing * q.detach() + (1.0 - smoothing)) * valid
    prefix = torch.cumprod(s, -1)
    if kind == "suffix":
        w = torch.flip(torch.cumsum(torch.flip(prefix, [-1]), -1), [-1])
    else:
        w = torch.cat([torch.ones_like(s[:, :1]), prefix[:, :-1]], dim=-1) * valid
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    return w * count / w.sum(-1, keepdim=True).clamp(min=1e-30)


def _windows(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 0] >= 0).sum().double()


def streak_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None) -> LossTerm:
    """Maximise the expected accepted streak (SpecDiff-2):

        L = -(1/N) Σ_windows Σ_{m=1..γ} Π_{j≤m} q_j(x_j)

    Its gradient w.r.t. log q_k is -w_k with w_k = Σ_{m≥k} Π_{j≤m} q_j: a weighted log-likelihood in which early
    positions dominate and positions after an improbable one get nothing. den = N windows.
    """
    valid = labels >= 0
    q = token_logprobs(logits, labels, temperature).exp() * valid
    return LossTerm(-expected_streak(q).sum(), _windows(labels))


def ce_streak_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None) -> LossTerm:
    """Cross-entropy weighted by the (stop-gradient) probability that the streak reaches each position:

        L = -(1/N) Σ_windows Σ_j sg(Π_{i<j} q_i(x_i)) · log q_j(x_j)          den = N windows.
    """
    logq = token_logprobs(logits, labels, temperature)
    q = (logq.detach().exp() * (labels >= 0))
    reach = torch.cat([torch.ones_like(q[:, :1]), torch.cumprod(q, -1)[:, :-1]], dim=-1)
    return LossTerm(-(reach * logq).sum(), _windows(labels))


def ce_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None) -> LossTerm:
    """Plain cross-entropy on the rollout tokens:  L = -(1/M) Σ_{valid (window, j)} log q_j(x_j)   den = M positions."""
    return LossTerm(-token_logprobs(logits, labels, temperature).sum(), (labels >= 0).sum().double())


def decayed_ce_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None,
                    decay: float = 7.0) -> LossTerm:
    """Cross-entropy with fixed weights that decay with the block position (the open DFlash trainers'):

        L = -(1/M) Σ_{valid (window, k)} w_k · log q_k(x_k),   w_k = exp(-(k - 1) / γ'),  γ' = ``decay``
                                                                            den = M positions.

    Early positions, which every accepted streak needs, weigh most; γ' = 7 for blocks of 16.
    """
    valid = labels >= 0
    k = torch.arange(labels.shape[1], device=labels.device, dtype=torch.float64)
    weights = torch.exp(-k / decay)[None] * valid
    return LossTerm(-(weights.to(logits.dtype) * token_logprobs(logits, labels, temperature)).sum(),
                    valid.sum().double())


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> LossTerm:
    """Next-token cross-entropy on the drafter's prefix pass (packed training; logits (P, V), labels (P,)):

        L = -(1/P) Σ_{response positions i} log softmax(e_{i-1} / τ)[x_i],  e: the encoder's logits, den = P.
    """
    return ce_loss(logits[None], labels[None], temperature)


def kd_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None) -> LossTerm:
    """Forward KL to the verifier at every block position (DistillSpec, uniform weights):

        L = (1/M) Σ_{valid (window, j)} KL(p_j || q_j),  p_j = softmax(t_j / τ) from a teacher-forced verifier pass.
    """
    kl = position_divergence(logits, teacher, "kl", temperature) * (labels >= 0)
    return LossTerm(kl.sum(), (labels >= 0).sum().double())


def tv_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None) -> LossTerm:
    """Total variation to the verifier, i.e. one minus the expected acceptance rate of sampling verification:

        L = (1/M) Σ_{valid (window, j)} (1 - Σ_x min(p_j(x), q_j(x)))
    """
    tv = position_divergence(logits, teacher, "tv", temperature) * (labels >= 0)
    return LossTerm(tv.sum(), (labels >= 0).sum().double())


def streak_ce_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None,
                   smoothing: float = 0.5) -> LossTerm:
    """Cross-entropy with detached, smoothed streak suffix weights (D-PACE):

        L = -(1/M) Σ_{valid (window, k)} w̃_k · log q_k(x_k),   w_k = Σ_{j≥k} Π_{i≤j} (λ q_i(x_i) + 1 - λ),
        w̃ = w scaled to mean 1 over each window's valid positions          den = M positions.

    λ = 1 gives the streak objective's gradient direction with cross-entropy's scale; λ = 0, CE decayed linearly
    with the position; the default λ = 0.5 keeps a gradient on the token that breaks the streak.
    """
    valid = labels >= 0
    logq = token_logprobs(logits, labels, temperature)
    weights = smoothed_weights(logq.detach().exp(), valid, smoothing, "suffix")
    return LossTerm(-(weights * logq).sum(), valid.sum().double())


def first_failure_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None,
                       after_failure: float = 0.1) -> LossTerm:
    """Cross-entropy up to and including the drafter's first greedy failure in each window, ε after it (Spec-AUF):

        f = min{j : argmax_y z_j[y] ≠ x_j},  w_j = 1 for j ≤ f, ε for j > f
        L = -(1/M) Σ_{valid (window, j)} w_j · log q_j(x_j)                 den = M positions.

    Positions after the first failure are never reached by greedy verification of this draft; ε keeps them learning.
    """
    valid = labels >= 0
    logq = token_logprobs(logits, labels, temperature)
    with torch.no_grad():
        hit = ((logits.argmax(-1) == labels) | ~valid).long()
        before = torch.cat([torch.ones_like(hit[:, :1]), torch.cumprod(hit, -1)[:, :-1]], dim=-1).bool()
        weights = torch.where(before, 1.0, after_failure).to(logq.dtype) * valid
    return LossTerm(-(weights * logq).sum(), valid.sum().double())


def margin_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None,
                smoothing: float = 0.5) -> LossTerm:
    """A greedy-acceptance surrogate: a logistic ranking of the verifier's token over the drafter's strongest
    competitor, weighted by the (smoothed, detached) probability that greedy verification reaches the position:

        m_j = (z_j[x_j] - max_{y≠x_j} z_j[y]) / τ,   a_j = σ(m_j)   (greedy accepts x_j iff m_j > 0)
        L = (1/M) Σ_{valid (window, j)} w̃_j · softplus(-m_j),   w_j = Π_{i<j} (λ a_i + 1 - λ), mean 1 per window.

    Its gradient touches two logits per position; mix it with cross-entropy (``distill.ce_weight``) to keep the
    rest of the distribution trained.                                        den = M positions.
    """
    valid = labels >= 0
    margin = greedy_margin(logits, labels, temperature)
    weights = smoothed_weights(torch.sigmoid(margin.detach()), valid, smoothing, "reach")
    return LossTerm((weights * torch.nn.functional.softplus(-margin) * valid).sum(), valid.sum().double())


def sampled_streak_loss(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, teacher=None
                        ) -> LossTerm:
    """The expected accepted streak of speculative sampling, given the teacher-forced verifier p:

        L = -(1/N) Σ_windows Σ_{m=1..γ} Π_{j≤m} (1 - TV(p_j, q_j))      den = N windows.

    1 - TV(p_j, q_j) = Σ_x min(p_j(x), q_j(x)) is the probability that position j's draft token is accepted.
    """
    accept = (1.0 - position_divergence(logits, teacher, "tv", temperature)) * (labels >= 0)
    return LossTerm(-expected_streak(accept).sum(), _windows(labels))


@dataclass(frozen=True)
class Objective:
    """A training objective (``distill.objective``): its loss function and what the trainer must know of it."""

    fn: Callable[..., LossTerm]
    per_window: bool = False  # den = windows (else positions)
    needs_teacher: bool = False  # reads the verifier's logits at every block position
    options: tuple[str, ...] = ()  # the ``distill.*`` keys it takes as keyword arguments

    def bind(self, distill: Any) -> Callable[..., LossTerm]:
        """``fn(logits, labels, temperature, teacher) -> LossTerm`` with its options read from ``distill``."""
        return functools.partial(self.fn, **{key: getattr(distill, key) for key in self.options})


#: every objective a recipe may name; ``align.config`` takes its choices from here
OBJECTIVES: dict[str, Objective] = {
    "streak": Objective(streak_loss, per_window=True),
    "ce_streak": Objective(ce_streak_loss, per_window=True),
    "ce": Objective(ce_loss),
    "kd": Objective(kd_loss, needs_teacher=True),
    "tv": Objective(tv_loss, needs_teacher=True),
    "streak_ce": Objective(streak_ce_loss, options=("smoothing",)),
    "first_failure": Objective(first_failure_loss, options=("after_failure",)),
    "margin": Objective(margin_loss, options=("smoothing",)),
    "sampled_streak": Objective(sampled_streak_loss, per_window=True, needs_teacher=True),
    "decayed_ce": Objective(decayed_ce_loss, options=("decay",)),
}
LOSSES = {name: objective.fn for name, objective in OBJECTIVES.items()}  # name -> loss function
