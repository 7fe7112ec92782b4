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

import heapq
import math
from dataclasses import dataclass

import torch

from align.errors import AlignError


@dataclass(frozen=True)
class TreeShape:
    """How big a tree is and how it branches: at most ``nodes`` nodes, ``depth`` levels (γ), each node's children
    among the ``branching`` likeliest tokens of the next position, none whose path probability is below
    ``min_probability``."""

    nodes: int
    depth: int
    branching: int = 4
    min_probability: float = 0.0

    def __post_init__(self):
        if self.nodes < 1 or self.depth < 1 or self.branching < 1:
            raise AlignError(f"a token tree needs at least one node, one level and one branch; got nodes "
                             f"{self.nodes}, depth {self.depth}, branching {self.branching}")

    @classmethod
    def parse(cls, spec: str) -> "TreeShape":
        """``NODES[xBRANCHING][/P]``, e.g. ``16x4``: 16 nodes, the 4 likeliest tokens per position (depth: γ);
        ``11x3/0.1``: only nodes whose path probability is at least 0.1 (a block whose every candidate is less
        likely scores the verifier's one position: a pass over one position is the cheapest, docs/results.md)."""
        shape, _, floor = spec.partition("/")
        head, _, branching = shape.partition("x")
        try:
            made = cls(int(head), 1 << 30, int(branching) if branching else 4, float(floor) if floor else 0.0)
        except ValueError:
            raise AlignError(f"--tree {spec!r}: write NODES, NODESxBRANCHING or NODESxBRANCHING/P, e.g. 16x4 or "
                             "11x3/0.1") from None
        if not 0 <= made.min_probability < 1:
            raise AlignError(f"--tree {spec!r}: /P is the least path probability a node needs, a number in [0, 1)")
        return made

    def at_depth(self, depth: int) -> "TreeShape":
        return TreeShape(self.nodes, min(self.depth, depth), self.branching, self.min_probability)


@dataclass
class Tree:
    """Nodes in topological order (a parent before its children): ``tokens`` (N,), ``parents`` (N,) (−1: a child of
    the root, the last token the verifier has), ``depth`` (N,) from 1. Siblings carry distinct tokens."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor

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
    tokens, parents, depths = [], [], []
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
        if level + 1 < gamma:
            for r in range(len(values[level + 1])):
                heapq.heappush(heap, (score - values[level + 1][r], level + 1, r, node))
    device = logq.device
    return Tree(torch.tensor(tokens, dtype=torch.long, device=device),
                torch.tensor(parents, dtype=torch.long, device=device),
                torch.tensor(depths, dtype=torch.long, device=device))


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
