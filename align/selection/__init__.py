"""Self-selection: K drafts from one drafter pass, the likeliest verified (greedy), or all K verified together
by recursive rejection sampling (sampling). See candidates.py, scorers.py and multidraft.py.

| decoding        | candidates    | scorer                       | verification                          | lossless |
|-----------------|---------------|------------------------------|---------------------------------------|----------|
| greedy (T = 0)  | iid or swap   | verifier, drafter or oracle  | greedy on the selected draft          | exact    |
| sampling (T > 0)| iid only      | none: all K are verified     | recursive rejection sampling          | in distribution |

Scoring drafts by the verifier's probabilities and then verifying one of them with the single-draft rule is not
lossless when sampling, so that combination is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.config import SelectionConfig
from align.errors import AlignError
from align.selection.candidates import iid_candidates, swap_candidates
from align.selection.multidraft import multidraft_accept
from align.selection.scorers import drafter_score, oracle_score, select, verifier_score
from align.speculative import greedy_accept


SCORERS = ("verifier", "drafter", "oracle")
CANDIDATES = ("iid", "swap")
DEFAULTS = SelectionConfig()  # the measured defaults live in one place: the recipe's selection section


@dataclass
class Selection:
    """K candidates per block, how they are made and how one is chosen."""

    k: int
    drafter_temperature: float
    scorer: str
    candidates_from: str
    temperature: float = 0.0  # the decoding temperature, set by ``check``

    def check(self, temperature: float) -> None:
        """Refuse the combinations that would change the verifier's output distribution."""
        if temperature > 0 and self.candidates_from != "iid":
            raise AlignError(f"the '{self.candidates_from}' candidate generator is for greedy decoding only; at "
                             "temperature > 0 the K drafts must be i.i.d. samples (--candidates iid)")
        if temperature > 0 and self.scorer != "verifier":
            raise AlignError(f"selecting a draft with the {self.scorer} scorer and verifying it alone is not lossless "
                             "when sampling; at temperature > 0 all K drafts are verified together by recursive "
                             "rejection sampling (--scorer verifier)")
        self.temperature = temperature

    def candidates(self, logq: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The drafts the verifier will see, (K', γ): all candidates, or the drafter scorer's choice alone."""
        if self.temperature > 0:
            return iid_candidates(logq, self.k, self.drafter_temperature, generator, greedy=False)
        if self.candidates_from == "swap":
            drafts = swap_candidates(logq, self.k)
        else:
            drafts = iid_candidates(logq, self.k, self.drafter_temperature, generator)
        if self.scorer == "drafter":
            return drafts[select(drafter_score(drafts, logq))][None]
        return drafts

    def accept(self, drafts, logq, logits, temperature, generator) -> tuple[int, int, int]:
        """(index of the kept draft, accepted, next token) for the drafts the verifier scored."""
        if temperature > 0:
            q = (logq / self.drafter_temperature).softmax(-1)
            if q.shape[-1] < logits.shape[-1]:
                q = torch.nn.functional.pad(q, (0, logits.shape[-1] - q.shape[-1]))
            return multidraft_accept(drafts, q, (logits / temperature).softmax(-1), generator)
        score = oracle_score if self.scorer == "oracle" else verifier_score
        index = select(score(drafts, logits)) if drafts.shape[0] > 1 else 0
        accepted, token = greedy_accept(drafts[index][None], logits[index][None])
        return index, int(accepted[0]), int(token[0])


def make_selection(k: int, drafter_temperature: float = DEFAULTS.drafter_temperature, scorer: str = DEFAULTS.scorer,
                   candidates: str = DEFAULTS.candidates) -> Selection | None:
    """A :class:`Selection` for K > 1, or None (one draft per block)."""
    if k < 1:
        raise AlignError(f"k must be at least 1 draft per block, got {k}")
    if k == 1:
        return None
    if drafter_temperature is None or drafter_temperature <= 0:
        raise AlignError(f"the drafter temperature must be > 0, got {drafter_temperature}")
    if scorer not in SCORERS:
        raise AlignError(f"unknown scorer '{scorer}'; choose one of {', '.join(SCORERS)}")
    if candidates not in CANDIDATES:
        raise AlignError(f"unknown candidate generator '{candidates}'; choose one of {', '.join(CANDIDATES)}")
    return Selection(k, drafter_temperature, scorer, candidates)
