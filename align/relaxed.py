"""Relaxed (lossy) acceptance rules: accept a draft token the verifier would not have chosen but finds plausible.

Exact greedy verification counts a synonym as a miss ("Two young lovers" against "Two star-crossed lovers"). These
rules accept more of each block at a cost in output quality, which the evaluation measures beside them; they are for
evaluation and decoding only. Nothing in training, rollouts or serving reads this module (tests/test_structure.py
checks it), no default names a rule, and every result decoded with one is labelled lossy, with its rule and
parameters, wherever it is reported.

With p the verifier's distribution at a block position (temperature 1) and x the draft token there:

| rule | accepts x when | parameters |
|---|---|---|
| ``typical`` | p(x) > min(ε, δ · exp(−H(p))) (Medusa's typical acceptance) | ε, δ |
| ``topk`` | x is among the k tokens p ranks highest | k |
| ``ratio`` | p(x) / max p ≥ r | r |

A block keeps the longest prefix of its draft the rule accepts, then adds the verifier's own likeliest token (at
the first position the rule refused, or after the whole block): greedy decoding's correction, so that with the rule
accepting only the argmax (``topk:1``, ``ratio:1``) the output is the verifier's greedy output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from align.errors import AlignError

#: rule -> its parameters, in the order a spec gives them
RULES = {"typical": ("epsilon", "delta"), "topk": ("k",), "ratio": ("r",)}


@dataclass(frozen=True)
class Relaxed:
    """A relaxed acceptance rule and its parameters (``parse("typical:0.3,0.09")``)."""

    rule: str
    params: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """How every report names it: lossy, the rule and its parameters."""
        return f"LOSSY {self.rule}(" + ", ".join(f"{k}={v:g}" for k, v in self.params.items()) + ")"

    def to_dict(self) -> dict:
        return {"lossy": True, "rule": self.rule, **self.params}

    def accept(self, draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
        """What the decoding loop calls (:func:`relaxed_accept`): (accepted, next token)."""
        return relaxed_accept(draft, logits, self)

    def accepts(self, logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        """Whether the rule accepts each draft token: logits (γ, V) of the verifier at the draft's positions, draft
        (γ,) -> (γ,) booleans."""
        logp = logits.float().log_softmax(-1)
        chosen = logp.gather(-1, draft[:, None])[:, 0]
        if self.rule == "typical":
            entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
            threshold = torch.minimum(torch.full_like(entropy, self.params["epsilon"]),
                                      self.params["delta"] * torch.exp(-entropy))
            return chosen.exp() > threshold
        if self.rule == "topk":
            return (logp > chosen[:, None]).sum(-1) < int(self.params["k"])
        return chosen - logp.max(-1).values >= math.log(self.params["r"])


def relaxed_accept(draft: torch.Tensor, logits: torch.Tensor, rule: Relaxed) -> tuple[int, int]:
    """The longest prefix of ``draft`` (γ,) that ``rule`` accepts, and the verifier's likeliest token after it:
    logits (γ + 1, V) -> (accepted, next token)."""
    ok = rule.accepts(logits[:-1], draft).long().cumprod(0)
    accepted = int(ok.sum())
    return accepted, int(logits[accepted].argmax())


def parse(spec: str) -> Relaxed:
    """``typical:EPSILON,DELTA``, ``topk:K`` or ``ratio:R`` as a rule, or one error that names the forms."""
    name, _, values = spec.partition(":")
    if name not in RULES:
        raise AlignError(f"unknown relaxed rule '{spec}'; write typical:EPSILON,DELTA, topk:K or ratio:R")
    keys = RULES[name]
    try:
        numbers = [float(v) for v in values.split(",")] if values else []
    except ValueError:
        numbers = []
    if len(numbers) != len(keys):
        raise AlignError(f"relaxed rule '{spec}' takes {len(keys)} number(s): {name}:{','.join(k.upper() for k in keys)}")
    params = dict(zip(keys, numbers))
    if name == "topk" and (params["k"] < 1 or params["k"] != int(params["k"])):
        raise AlignError(f"relaxed rule '{spec}': k must be a whole number of at least 1")
    if name == "ratio" and not 0 < params["r"] <= 1:
        raise AlignError(f"relaxed rule '{spec}': r must be in (0, 1]")
    if name == "typical" and not (0 < params["epsilon"] <= 1 and params["delta"] > 0):
        raise AlignError(f"relaxed rule '{spec}': epsilon must be in (0, 1] and delta positive")
    return Relaxed(name, params)
