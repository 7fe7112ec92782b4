"""Token trees: many candidate continuations of a block, verified in one pass of the verifier.

A drafter's marginals q_1..q_γ (one pass) say more than their argmax: where q_j is unsure, its second and third
tokens are often the verifier's. A tree keeps several candidates where the drafter is unsure and one where it is
sure (a spine), sharing every common prefix. The verifier scores all its nodes in one forward pass: each node
attends to the cache, the pending tokens and its own ancestors (a tree attention mask), at the position its depth
gives it. The longest path the verifier agrees with is kept (SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024).

**Shape** (:class:`TreeShape`): a node's score is its path probability Π q_j(x_j) under the drafter's marginals —
the drafter's own estimate that the verifier keeps the whole path — and the tree is the ``nodes`` highest-scoring
nodes, each node's children drawn from the ``branching`` likeliest tokens of the next position (a node's score never
exceeds its parent's, so the best nodes form a tree: best-first expansion). A confident drafter grows a long spine,
an unsure one a bush; ``nodes`` is what the verifier pays for.

**Size, by the machine** (``NODESxB/auto``, :class:`TreeSizer`): what a node costs is the verifier's, on this
machine, in this dtype — flat for a few positions, then a slope that AMX halves — and what it earns is the chance the
verifier keeps it. Each block keeps the first n nodes of its best-first tree that maximise α Σ_{i≤n} p_i − R c(n)
(Dinkelbach's rule for the best ratio of tokens to seconds): p_i the nodes' path probabilities, α the drafter's
calibration (tokens accepted per token it predicted, so far), R the tokens per second decoded so far, c(n) the
verifier's measured seconds for a pass over n nodes (:class:`CostCurve`, probed once per verifier). A sure block
grows a long spine, an unsure one a few first tokens, and a slow CPU smaller trees than a fast one.

**Acceptance, exact.** Greedy: from the root (the last token the verifier has), move to the child whose token is the
verifier's argmax there, while there is one; the verifier's argmax at the last node reached is the next token. The
output is the verifier's greedy output token for token. Sampling: at each node draw x from the verifier's
distribution p there (at the decoding temperature); move to the child carrying x if there is one, else x is the next
token. The siblings are a fixed set of distinct tokens chosen before the verifier is read, so every token is emitted
with exactly p's probability (this is recursive rejection sampling over siblings with one-hot drafts: accept child c
with p'(c), remove it from p' on rejection, renormalise — which draws x ~ p and checks it against the children),
and the path accepted with probability Σ_children p, the most any lossless rule can take from a fixed set.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

import torch

from align.errors import AlignError


@dataclass(frozen=True)
class TreeShape:
    """How big a tree is and how it branches: at most ``nodes`` nodes, ``depth`` levels (γ), each node's children
    among the ``branching`` likeliest tokens of the next position, none whose path probability is below
    ``min_probability``; ``sized``: each block keeps as many of them as pay on this machine (:class:`TreeSizer`)."""

    nodes: int
    depth: int
    branching: int = 4
    min_probability: float = 0.0
    sized: bool = False

    def __post_init__(self):
        if self.nodes < 1 or self.depth < 1 or self.branching < 1:
            raise AlignError(f"a token tree needs at least one node, one level and one branch; got nodes "
                             f"{self.nodes}, depth {self.depth}, branching {self.branching}")

    @classmethod
    def parse(cls, spec: str) -> "TreeShape":
        """``NODES[xBRANCHING][/P|/auto]``, e.g. ``16x4``: 16 nodes, the 4 likeliest tokens per position (depth: γ);
        ``11x3/0.1``: only nodes whose path probability is at least 0.1 (a block whose every candidate is less
        likely scores the verifier's one position: a pass over one position is the cheapest, docs/results.md);
        ``16x3/auto``: at most 16, each block as many as pay for their positions on this machine (TreeSizer)."""
        shape, _, floor = spec.partition("/")
        head, _, branching = shape.partition("x")
        sized = floor == "auto"
        try:
            made = cls(int(head), 1 << 30, int(branching) if branching else 4,
                       float(floor) if floor and not sized else 0.0, sized)
        except ValueError:
            raise AlignError(f"--tree {spec!r}: write NODES, NODESxBRANCHING, NODESxBRANCHING/P or "
                             "NODESxBRANCHING/auto, e.g. 16x4, 11x3/0.1 or 16x3/auto") from None
        if not 0 <= made.min_probability < 1:
            raise AlignError(f"--tree {spec!r}: /P is the least path probability a node needs, a number in [0, 1)")
        return made

    def at_depth(self, depth: int) -> "TreeShape":
        return TreeShape(self.nodes, min(self.depth, depth), self.branching, self.min_probability, self.sized)


@dataclass
class Tree:
    """Nodes in topological order (a parent before its children): ``tokens`` (N,), ``parents`` (N,) (−1: a child of
    the root, the last token the verifier has), ``depth`` (N,) from 1. Siblings carry distinct tokens. ``logp``: the
    nodes' log path probabilities under the drafter, where it grew them (best-first: never increasing)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    logp: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def children(self) -> list[list[int]]:
        """Per node, and last for the root (index −1), its children's indices."""
        found: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents.tolist()):
            found[parent].append(i)
        return found

    def ancestors(self) -> torch.Tensor:
        """(N, N) boolean: node i sees node j (j is i or one of its ancestors): the tree attention mask."""
        n = len(self)
        seen = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        for i, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                seen[i] |= seen[parent]
        return seen

    def first(self, n: int) -> "Tree":
        """The first ``n`` nodes: a tree too (a parent comes before its children)."""
        return Tree(self.tokens[:n], self.parents[:n], self.depth[:n], self.logp[:n])

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (−1: none)."""
        out = []
        parents = self.parents.tolist()
        while node >= 0:
            out.append(node)
            node = parents[node]
        return out[::-1]


def tree_from_marginals(logq: torch.Tensor, shape: TreeShape) -> Tree:
    """The ``shape.nodes`` nodes of highest path probability under the marginals ``logq`` (γ, V) (log-probabilities;
    a row of one-hot rows gives a chain): best-first, each node's children among the ``shape.branching`` likeliest
    tokens of the next row. Nodes of probability 0 (or below ``shape.min_probability``) are left out."""
    gamma = min(shape.depth, logq.shape[0])
    if gamma == 0:
        return Tree(*(torch.zeros(0, dtype=torch.long, device=logq.device) for _ in range(3)))
    top = logq[:gamma].float().topk(min(shape.branching, logq.shape[-1]), dim=-1)
    values, indices = top.values.tolist(), top.indices.tolist()  # (γ, b): the candidates of each depth
    floor = float("-inf") if shape.min_probability <= 0 else math.log(shape.min_probability)
    tokens, parents, depths, logp = [], [], [], []
    heap = [(-values[0][r], 0, r, -1) for r in range(len(values[0]))]  # (−log path probability, depth − 1, rank, parent)
    heapq.heapify(heap)
    while heap and len(tokens) < shape.nodes:
        score, level, rank, parent = heapq.heappop(heap)
        if -score == float("-inf") or -score < floor:
            break  # best-first: every node left is as unlikely
        node = len(tokens)
        tokens.append(indices[level][rank])
        parents.append(parent)
        depths.append(level + 1)
        logp.append(-score)
        if level + 1 < gamma:
            for r in range(len(values[level + 1])):
                heapq.heappush(heap, (score - values[level + 1][r], level + 1, r, node))
    device = logq.device
    return Tree(torch.tensor(tokens, dtype=torch.long, device=device),
                torch.tensor(parents, dtype=torch.long, device=device),
                torch.tensor(depths, dtype=torch.long, device=device), logp)


@dataclass
class CostCurve:
    """The verifier's seconds for one pass over ``nodes[i]`` tree nodes (after its pending tokens): ``seconds[i]``,
    measured; between two measured sizes linear, past the last one its slope, never decreasing."""

    nodes: list[int]
    seconds: list[float]

    def __post_init__(self):
        if not self.nodes or sorted(self.nodes) != self.nodes or len(self.nodes) != len(self.seconds):
            raise AlignError("a cost curve needs one time per size, the sizes increasing")
        self.seconds = [max(self.seconds[:i + 1]) for i in range(len(self.seconds))]  # timing noise is not a saving

    def __call__(self, n: int) -> float:
        if len(self.nodes) == 1:
            return self.seconds[0]
        i = min(max(bisect.bisect_left(self.nodes, n), 1), len(self.nodes) - 1)
        (n0, n1), (s0, s1) = self.nodes[i - 1:i + 1], self.seconds[i - 1:i + 1]
        return s0 + (s1 - s0) * max(n - n0, 0) / (n1 - n0)


def sized_tree(tree: Tree, cost: CostCurve, rate: float, alpha: float) -> Tree:
    """The first n nodes of ``tree`` (best-first) that maximise α Σ_{i≤n} p_i − R c(n), none where no node pays (the
    block is then one plain step of the verifier: on a machine whose multi-position passes are dear, the loop runs no
    slower than the verifier alone).

    Σ_{i≤n} p_i is what the n likeliest nodes add to the tokens a block keeps (a node is kept with its path's
    probability, when the drafter is calibrated: α rescales it), R c(n) what their pass costs in tokens at the rate
    R decoded so far (tokens per second): the block that maximises it moves the whole run's tokens per second up
    (Dinkelbach, 1967)."""
    best, best_gain, earned = 0, -rate * cost(0), 0.0
    for n, logp in enumerate(tree.logp, start=1):
        earned += math.exp(logp)
        gain = alpha * earned - rate * cost(n)
        if gain > best_gain:
            best, best_gain = n, gain
    return tree.first(best)


class TreeSizer:
    """What a tree of the shape earned so far on one verifier: the drafter's calibration α (tokens accepted per
    token its path probabilities predicted) and the rate R (tokens per second), the two numbers
    :func:`sized_tree` needs beside the verifier's :class:`CostCurve`. Both start from a prior of one block (α 1,
    R one token per plain verifier step) and follow the blocks it sees."""

    def __init__(self, cost: CostCurve):
        self.cost = cost
        self.predicted = self.accepted = 1.0
        self.tokens, self.seconds = 1.0, cost(0)

    @property
    def alpha(self) -> float:
        return self.accepted / self.predicted

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def size(self, tree: Tree) -> Tree:
        return sized_tree(tree, self.cost, self.rate, self.alpha)

    def observe(self, tree: Tree, scored: int, path: list[int], next_token: int | None, produced: int,
                seconds: float) -> None:
        """A block verified: the first ``scored`` nodes of the grown ``tree`` scored, ``path`` (its nodes) kept, the
        verifier's ``next_token`` after it, ``produced`` tokens in ``seconds``.

        α counts every node whose fate the block settles, a set fixed before the verifier is read (so the count is
        unbiased): the scored nodes, and the unscored children of the root and of scored nodes. Such a child would
        have been kept exactly when its parent ends the kept path and it carries the verifier's next token (greedy:
        the argmax there; sampling: the draw, which picks a child with the verifier's probability of it). So a block
        sized to no node, a plain verifier step, still tells α what its first tokens would have earned: α cannot
        freeze where it stopped the scoring, and the sizer scores again once the drafter has earned it."""
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        end = path[-1] if path else -1
        settled = [i for i in range(len(tree)) if i < scored or parents[i] < scored]
        self.predicted += sum(math.exp(tree.logp[i]) for i in settled)
        self.accepted += len(path) + any(i >= scored and parents[i] == end and tokens[i] == next_token
                                         for i in settled)
        self.tokens += produced
        self.seconds += seconds


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """The longest path whose every token is the verifier's argmax after the path before it, and the verifier's
    argmax after it. ``logits`` (N + 1, V): row 0 after the root, row i + 1 after node i."""
    target = logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    children = tree.children()
    node, path = -1, []
    while True:
        want = target[node + 1]
        step = next((c for c in children[node] if tokens[c] == want), None)
        if step is None:
            return path, want
        path.append(step)
        node = step


def accept_sampling(tree: Tree, probs: torch.Tensor, generator: torch.Generator | None = None
                    ) -> tuple[list[int], int]:
    """Draw from the verifier at each node reached: follow the child carrying the draw, or stop with it as the next
    token. ``probs`` (N + 1, V): the verifier's distributions at the decoding temperature, row 0 after the root."""
    tokens = tree.tokens.tolist()
    children = tree.children()
    node, path = -1, []
    while True:
        x = int(torch.multinomial(probs[node + 1], 1, generator=generator))
        step = next((c for c in children[node] if tokens[c] == x), None)
        if step is None:
            return path, x
        path.append(step)
        node = step
