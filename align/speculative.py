"""Speculative decoding with a diffusion drafter: the output is exactly the verifier's own.

Each block: (1) the drafter fills γ positions after the prefix in T denoising steps (one pass when T = 1; a
drafter may stop short of γ, or draft nothing: then the block is one plain verifier step);
(2) one draft (or K candidates, see ``align.selection``) is taken from its marginals; (3) the verifier scores the
draft(s) in one forward pass; (4) the acceptance rule keeps the longest valid prefix and adds one token of the
verifier's own (the correction, or the bonus after a fully accepted block); (5) the verifier's cache is rolled
back to what was kept. Generation ends exactly where the verifier's ``generate`` would: at its first EOS token
(included) or after ``max_new_tokens``.

The acceptance rules are pure functions over tensors with a leading batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from align.drafters.base import DrafterKind
from align.errors import AlignError
from align.inference import grad_free
from align.metrics import Block, DecodeStats, now
from align.trees import TreeSizer, accept_greedy, accept_sampling, tree_from_marginals
from align.verifier import Verifier


# ------------------------------------------------------------------------------------------------ acceptance rules


def greedy_accept(draft: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact match with the verifier's argmax.

    draft (B, γ), logits (B, γ + 1, V) -> accepted (B,) in 0..γ, next token (B,): the verifier's argmax at the first
    mismatch (the correction) or after the last draft token (the bonus).
    """
    target = logits.argmax(-1)  # (B, γ + 1)
    accepted = (draft == target[:, :-1]).long().cumprod(-1).sum(-1)
    return accepted, target.gather(1, accepted[:, None])[:, 0]


def sampling_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection sample from
    norm(max(0, p_j - q_j)); if all γ are kept sample the bonus token from p_{γ+1}. The output is distributed as p.

    draft (B, γ) drawn from q (B, γ, V); p (B, γ + 1, V) the verifier's probabilities -> accepted (B,), next (B,).
    """
    batch, gamma = draft.shape
    px = p[:, :-1].gather(-1, draft[..., None])[..., 0]
    qx = q.gather(-1, draft[..., None])[..., 0]
    u = torch.rand((batch, gamma), generator=generator, device=draft.device)
    accepted = (u * qx <= px).long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=draft.device)
    target = p[rows, accepted]  # (B, V)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted]  # q is 0 after the block: bonus = p
    residual = (target - q_pad).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target)
    return accepted, torch.multinomial(residual, 1, generator=generator)[:, 0]


# ------------------------------------------------------------------------------------------------ the decoder


@dataclass
class Generation:
    """The new tokens of one generation, block by block, and its statistics."""

    tokens: list[int]
    pieces: list[tuple[list[int], int]] = field(default_factory=list)  # (accepted draft tokens, verifier's token)
    stats: DecodeStats = field(default_factory=DecodeStats)


class SpeculativeDecoder:
    """A drafter (any :class:`~align.drafters.base.DrafterKind`) and a verifier that share a vocabulary, decoding
    one sequence at a time."""

    def __init__(self, drafter: DrafterKind, verifier: Verifier, eos_token_ids: set[int] | list[int] | int | None):
        if drafter.device != verifier.device:  # the loop hands tensors between them without copies
            raise AlignError(f"the drafter is on {drafter.device} and the verifier on {verifier.device}: load both on "
                             "one device (--device)")
        self.drafter = drafter
        self.verifier = verifier
        if eos_token_ids is None:
            eos_token_ids = []
        self.eos = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
        self.sizers: dict[tuple[int, int], TreeSizer] = {}  # sized trees (NODESxB/auto): what each shape earned

    def generate(self, prompt: list[int], max_new_tokens: int, gamma: int, steps: int = 1, temperature: float = 0.0,
                 seed: int = 0, selection=None, stop_below: float = 0.0, relaxed=None, tree=None) -> Generation:
        """Decode up to ``max_new_tokens`` after ``prompt`` with γ-token blocks of ``steps`` denoising steps.

        ``temperature`` 0 is greedy (token for token the verifier's greedy output); above 0 the output is
        distributed as the verifier's temperature sampling. ``selection`` (an ``align.selection.Selection``)
        turns on K drafts per block. ``stop_below`` (a stop rule): a block ends before the first position whose
        likeliest token the drafter gives less than this probability (at least one position is drafted); a rule on
        the drafter's own rows alone, so the output stays the verifier's. ``relaxed`` (``align.relaxed.Relaxed``,
        evaluation only, never a default) accepts draft tokens the verifier finds plausible but would not have
        chosen: the output is then *not* the verifier's (lossy), greedy only. ``tree`` (an
        ``align.trees.TreeShape``) verifies a token tree grown from the marginals instead of one draft: its nodes in
        one pass, the longest path the verifier agrees with kept (greedy and sampling alike, exactly).
        """
        reads = self.drafter.verifier_layers  # a feature-conditioned drafter's (align.drafters.dflash)
        if reads:  # the verifier's passes hand over their hidden states; only while this generation runs
            self.verifier.record(reads)
        self.drafter.bind(self.verifier)
        try:
            with grad_free(self.verifier.lean):
                return self._generate(prompt, max_new_tokens, gamma, steps, temperature, seed, selection,
                                      stop_below, relaxed, tree)
        finally:
            if reads:
                self.verifier.record(None)

    def _generate(self, prompt, max_new_tokens, gamma, steps, temperature, seed, selection, stop_below,
                  relaxed, tree) -> Generation:
        if gamma <= 0:
            raise AlignError(f"gamma must be a positive number of draft tokens, got {gamma}")
        if steps <= 0:
            raise AlignError(f"steps must be a positive number of denoising steps, got {steps}")
        if temperature < 0:
            raise AlignError(f"temperature must be >= 0, got {temperature}")
        if selection is not None:
            selection.check(temperature)
        if relaxed is not None and (temperature > 0 or selection is not None):
            raise AlignError("a relaxed acceptance rule replaces greedy verification: use it at temperature 0 with "
                             "one draft per block (k 1)")
        if tree is not None and (selection is not None or relaxed is not None):
            raise AlignError("a token tree verifies its own candidates: use it with one draft per block (k 1) and "
                             "exact acceptance (no relaxed rule)")
        generator = torch.Generator(device=self.verifier.device).manual_seed(seed)
        device = self.verifier.device
        self.verifier.start(prompt)
        self.drafter.reset()
        out = Generation(tokens=[])
        stats = out.stats
        start = mark = now(device)
        limit = self.verifier.max_length
        while len(out.tokens) < max_new_tokens:
            block_start = mark
            room = max_new_tokens - len(out.tokens) - 1
            if limit is not None:
                if self.verifier.length >= limit:
                    break
                room = min(room, limit - self.verifier.length - 1)
            g = min(gamma, room)
            prefix = torch.tensor([prompt + out.tokens], device=device)
            if g and self.drafter.needs_features(prefix.shape[1]):
                g = 0  # the verifier runs the prompt first: its features are the drafter's context
            t0 = now(device)
            logq = self.drafter.marginals(prefix, g, steps, temperature, generator)[0] if g else None  # (γ', V)
            context, matched = prefix.shape[1], self.drafter.matched if g else None  # where the block stands
            if logq is None or logq.shape[0] == 0:  # no room for a draft, or none drafted: a plain verifier step
                logq, drafts, g = None, torch.zeros((1, 0), dtype=torch.long, device=device), 0
            else:
                if stop_below > 0 and logq.shape[0] > 1:  # the stop rule: where the drafter is unsure
                    sure = (logq.max(-1).values.exp() >= stop_below).long().cumprod(0)
                    logq = logq[:max(1, int(sure.sum()))]
                g = logq.shape[0]  # a drafter may stop short of γ (prompt lookup, the stop rule)
                own = self.drafter.draft  # a draft the drafter drew itself: its rows are conditioned on it
                if tree is not None:
                    drafts = None  # the tree's nodes are the candidates
                elif own is not None and selection is None:
                    drafts = own[:1, :g]
                else:
                    drafts = self._drafts(logq, temperature, generator, selection)  # (K, γ')
            if drafts is None:  # a token tree: grown, scored in one pass, its longest agreed path kept
                t2 = now(device)
                out.tokens, block, next_token = self._tree_block(logq, tree.at_depth(g), temperature, generator,
                                                                 out, t2 - t0, g)
                mark = now(device)
                block.total_s = mark - block_start
                block.context, block.matched = context, matched
                stats.drafter_s += block.drafter_s
                stats.verifier_s += block.verifier_s
                if next_token is None or next_token in self.eos:
                    break
                continue
            t2 = now(device)
            logits = self.verifier.score(drafts)  # (K, γ + 1, V)
            t3 = now(device)
            if relaxed is not None and drafts.shape[1]:  # lossy: evaluation only
                index, (accepted, next_token) = 0, relaxed.accept(drafts[0], logits[0])
            else:
                index, accepted, next_token = self._accept(drafts, logq, logits, temperature, generator, selection)
            t4 = now(device)
            kept = drafts[index, :accepted].tolist()
            self.verifier.commit(index, accepted, next_token)
            stats.drafter_s += t2 - t0
            stats.verifier_s += (t3 - t2) + (t4 - t3)
            stop = next((i for i, t in enumerate(kept) if t in self.eos), None)
            if stop is None:
                block = _block(g, accepted, drafts[index], logits[index])
            else:  # an accepted EOS ends the generation right there: positions after it were never in play
                kept, next_token = kept[:stop + 1], None
                block = _block(len(kept), len(kept), drafts[index], logits[index], produced=len(kept))
            stats.blocks.append(block)
            new = kept + ([] if next_token is None else [next_token])
            out.pieces.append((kept, next_token))
            out.tokens += new
            mark = now(device)
            block.drafter_s, block.verifier_s, block.total_s = t2 - t0, t3 - t2, mark - block_start
            block.context, block.matched = context, matched
            if next_token is None or next_token in self.eos:
                break
        out.tokens = out.tokens[:max_new_tokens]
        stats.new_tokens = len(out.tokens)
        stats.total_s = now(device) - start
        return out

    def _tree_block(self, logq, shape, temperature, generator, out: Generation, drafter_s: float,
                    g: int) -> tuple[list[int], Block, int | None]:
        """One block as a token tree: (the generation's tokens after it, the block's statistics, the verifier's
        next token or None where an accepted EOS ended the text)."""
        device = self.verifier.device
        t2 = now(device)
        tree = grown = tree_from_marginals(logq, shape)
        sizer = None
        if shape.sized and self.verifier.cached:  # the prompt's block scores the whole tree: its pass is a prefill
            key = (shape.nodes, shape.branching)
            if key not in self.sizers:
                self.sizers[key] = TreeSizer(self.verifier.tree_cost(shape.nodes))
                t2 = now(device)  # the measurement, once per verifier, is not this block's
            sizer = self.sizers[key]
            tree = sizer.size(grown)
        logits = self.verifier.score_tree(tree)  # (N + 1, V)
        if temperature > 0:
            path, next_token = accept_sampling(tree, (logits / temperature).softmax(-1), generator)
        else:
            path, next_token = accept_greedy(tree, logits)
        self.verifier.commit_tree(path, next_token)
        t4 = now(device)
        verified = next_token  # the verifier's token after the path, even where an accepted EOS ends the text
        kept = tree.tokens[path].tolist()
        rows = logits[[0] + [i + 1 for i in path]]  # the verifier after each accepted prefix
        children = tree.children()[path[-1] if path else -1]
        best = int(tree.tokens[children[0]]) if children else None  # the likeliest candidate it did not take
        rank = None if best is None else int((rows[-1] > rows[-1, best]).sum())
        stop = next((i for i, t in enumerate(kept) if t in self.eos), None)
        if stop is not None:  # an accepted EOS ends the generation right there
            kept, next_token = kept[:stop + 1], None
        produced = len(kept) + (next_token is not None)
        logp = rows[:max(1, produced)].log_softmax(-1)
        entropy = float(-(logp.exp() * logp).nan_to_num().sum(-1).mean())
        block = Block(g, len(kept), rank, entropy, produced, nodes=len(tree))
        block.drafter_s, block.verifier_s = drafter_s, t4 - t2
        if sizer is not None:
            sizer.observe(grown, len(tree), path, verified, produced, drafter_s + t4 - t2)
        out.stats.blocks.append(block)
        out.pieces.append((kept, next_token))
        return out.tokens + kept + ([] if next_token is None else [next_token]), block, next_token

    @staticmethod
    def _drafts(logq, temperature, generator, selection) -> torch.Tensor:
        """The draft(s) from the marginals: K candidates, a sample at the decoding temperature, or the argmax."""
        if selection is not None:
            return selection.candidates(logq, generator)
        if temperature > 0:
            return torch.multinomial((logq / temperature).softmax(-1), 1, generator=generator).T
        return logq.argmax(-1)[None]

    def _accept(self, drafts, logq, logits, temperature, generator, selection) -> tuple[int, int, int]:
        """Pick the draft to keep (K > 1) and apply the acceptance rule: (index, accepted, next token)."""
        if drafts.shape[1] == 0:
            if temperature > 0:
                p = (logits[0, -1] / temperature).softmax(-1)
                return 0, 0, int(torch.multinomial(p, 1, generator=generator))
            return 0, 0, int(logits[0, -1].argmax())
        if selection is not None:
            return selection.accept(drafts, logq, logits, temperature, generator)
        if temperature > 0:
            q = _pad_vocab((logq / temperature).softmax(-1), logits.shape[-1])
            accepted, token = sampling_accept(drafts, q[None], (logits / temperature).softmax(-1), generator)
        else:
            accepted, token = greedy_accept(drafts, logits)
        return 0, int(accepted[0]), int(token[0])


def _block(gamma: int, accepted: int, draft: torch.Tensor, logits: torch.Tensor, produced: int | None = None) -> Block:
    """A block's statistics: the rejected draft token's rank under the verifier (None when nothing in play was
    rejected), the verifier's mean entropy over the positions the block produced."""
    rank = None
    if accepted < gamma:
        row = logits[accepted]
        rank = int((row > row[draft[accepted]]).sum())
    produced = accepted + 1 if produced is None else produced
    logp = logits[:max(1, produced)].log_softmax(-1)
    entropy = float(-(logp.exp() * logp).nan_to_num().sum(-1).mean())
    return Block(gamma, accepted, rank, entropy, produced)


def _pad_vocab(probs: torch.Tensor, width: int) -> torch.Tensor:
    """The drafter's probabilities over the verifier's logit rows (rows it cannot propose get 0)."""
    if probs.shape[-1] == width:
        return probs
    if probs.shape[-1] > width:
        raise AlignError(f"the drafter proposes {probs.shape[-1]} tokens but the verifier scores only {width}")
    return torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))
