"""Token trees (align/trees.py): the tree grown from the marginals, one verifier pass over its nodes, and the longest
path the verifier agrees with — the verifier's own output token for token (greedy) and in distribution (sampling),
over many random cases; a broken mask and a broken sibling rule are caught."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

import align.speculative as speculative
from align.drafters.base import DrafterKind
from align.speculative import SpeculativeDecoder
from align.errors import AlignError
from align.trees import (CostCurve, Tree, TreeShape, TreeSizer, accept_greedy, accept_sampling, sized_tree,
                         tree_from_marginals)
from align.verifier import GQA_SDPA, SKINNY_ROWS, Verifier, ar_generate
from conftest import MASK, VOCAB, tiny_drafter, tiny_verifier
from test_sampling import PROMPT, V, chi_square_p, exact_distribution


def log_rows(*rows: dict[int, float], vocab: int = 6) -> torch.Tensor:
    """Marginals (γ, V) from {token: probability} rows (the rest share what is left)."""
    out = []
    for row in rows:
        p = torch.full((vocab,), (1 - sum(row.values())) / (vocab - len(row)), dtype=torch.float64)
        for token, prob in row.items():
            p[token] = prob
        out.append(p.log())
    return torch.stack(out)


def test_the_tree_is_the_likeliest_paths_best_first():
    logq = log_rows({1: 0.6, 2: 0.3}, {3: 0.9}, {4: 0.55, 5: 0.4})
    tree = tree_from_marginals(logq, TreeShape(nodes=5, depth=3, branching=2))
    # path probabilities: 1 0.6, 1-3 0.54, 2 0.3, 1-3-4 0.297, 2-3 0.27, 1-3-5 0.216, ...
    assert tree.tokens.tolist() == [1, 3, 2, 4, 3]
    assert tree.parents.tolist() == [-1, 0, -1, 1, 2] and tree.depth.tolist() == [1, 2, 1, 3, 2]
    assert tree.ancestors().tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                                         [False, False, True, False, False], [True, True, False, True, False],
                                         [False, False, True, False, True]]
    assert tree.path(3) == [0, 1, 3] and tree.children()[-1] == [0, 2]
    chain = tree_from_marginals(logq, TreeShape(nodes=10, depth=3, branching=1))
    assert chain.tokens.tolist() == [1, 3, 4] and chain.parents.tolist() == [-1, 0, 1]  # the argmax draft
    one_hot = torch.full((2, 6), float("-inf")).index_put_((torch.tensor([0, 1]), torch.tensor([2, 5])),
                                                           torch.zeros(2))
    assert tree_from_marginals(one_hot, TreeShape(16, 2, 4)).tokens.tolist() == [2, 5]  # no zero-probability node


def test_acceptance_walks_the_agreed_path():
    tree = tree_from_marginals(log_rows({1: 0.6, 2: 0.3}, {3: 0.9}, {4: 0.5, 5: 0.4}), TreeShape(6, 3, 2))
    tokens = tree.tokens.tolist()
    logits = torch.zeros(len(tree) + 1, 6)
    want = {-1: 2, tokens.index(2): 3}  # the verifier's argmax: 2 at the root (the second candidate), then 3
    for node, token in want.items():
        logits[node + 1, token] = 5.0
    logits[tree.children()[tokens.index(2)][0] + 1, 0] = 5.0  # after 2-3: 0, no candidate
    path, token = accept_greedy(tree, logits)
    assert [tokens[i] for i in path] == [2, 3] and token == 0
    probs = logits.softmax(-1)
    walked = Counter(tuple(tokens[i] for i in accept_sampling(tree, probs, torch.Generator().manual_seed(s))[0])
                     for s in range(400))
    assert walked[(2, 3)] > 250  # p(2) at the root and p(3) after it are both ≈ 0.97


class Ranked(DrafterKind):
    """Rows that hold the verifier's greedy continuation at a random rank (0 = the argmax, 3, or not at all): a
    chain accepts part of a block, a tree that branches far enough more of it."""

    family = "ranked"

    def __init__(self, verifier_model, seed: int):
        self.verifier_model, self.vocab_size, self.rng = verifier_model, VOCAB, random.Random(seed)

    @property
    def device(self):
        return self.verifier_model.device

    def reset(self):
        pass

    def marginals(self, prefix, gamma, steps=1, temperature=0.0, generator=None):
        greedy = ar_generate(self.verifier_model, prefix[0].tolist(), gamma, eos_token_ids=[])
        logits = torch.randn(1, gamma, self.vocab_size, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(self.rng.randrange(1 << 30)))
        for j, token in enumerate(greedy):
            rank = self.rng.choice([0, 0, 1, 2, 3, None])
            if rank is not None:
                order = logits[0, j].argsort(descending=True).tolist()
                logits[0, j, token] = logits[0, j, order[rank]] + (1e-3 if rank == 0 else -1e-3)
        return logits.log_softmax(-1)


SHAPES = ("1x1", "4x1", "4x2", "8x4", "24x4", "64x8", "8x4/0.05", "24x4/auto")  # no node below 0.05; sized here


def check_greedy_tree(drafter, model, seed: int, gamma: int, shape: str, eos_inside: bool):
    rng = random.Random(seed * 100 + gamma)
    prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 10))]
    seq = ar_generate(model, prompt, 40, eos_token_ids=[])
    eos = seq[rng.randrange(1, 30)] if eos_inside else sorted(set(range(VOCAB)) - set(seq) - set(prompt))[0]
    decoder = SpeculativeDecoder(drafter, Verifier(model), eos)
    out = decoder.generate(prompt, 40, gamma, tree=TreeShape.parse(shape))
    assert out.tokens == ar_generate(model, prompt, 40, eos_token_ids=[eos]), (seed, gamma, shape, eos_inside)
    return out


def test_greedy_trees_are_the_verifiers_output_token_for_token():
    """Eight tree shapes (a single node to 64 nodes of branching 8, one that leaves out nodes below a path
    probability, one sized by the verifier's cost), γ 1, 4 and 8, EOS inside and outside, against drafters that hold
    the verifier's tokens at random ranks (192 cases): every output is generate's; trees that branch accept more
    than the chain of the same drafter; whole, partial and empty paths all occur, and blocks whose every candidate
    falls below the floor score the verifier's one position (an empty tree)."""
    accepted: dict[str, list[tuple[int, int]]] = {}
    nodes: list[int] = []
    for seed in range(4):
        model = gqa_verifier(seed) if seed == 3 else tiny_verifier(seed)  # the last with grouped-query attention
        for gamma in (1, 4, 8):
            for shape in SHAPES:
                for eos_inside in (False, True):
                    out = check_greedy_tree(Ranked(model, seed), model, seed, gamma, shape, eos_inside)
                    accepted.setdefault(shape, []).extend((b.accepted, b.gamma) for b in out.stats.blocks if b.gamma)
                    if "/0" in shape:
                        nodes.extend(b.nodes for b in out.stats.blocks if b.gamma)
    mean = {shape: sum(a for a, _ in blocks) / len(blocks) for shape, blocks in accepted.items()}
    assert 0 in nodes and max(nodes) > 1, nodes
    assert mean["64x8"] > mean["8x4"] > mean["4x1"], mean
    blocks = accepted["64x8"]
    assert any(a == g > 1 for a, g in blocks) and any(0 < a < g for a, g in blocks) and any(a == 0 for a, _ in blocks)


@pytest.mark.parametrize("family", ("diffusiongemma", "mdlm", "dream"))
def test_greedy_trees_of_every_diffusion_family_and_the_feature_conditioned_drafter(family):
    from align.drafters.diffusion import Drafter

    for seed in range(2):
        model = tiny_verifier(seed)
        drafter = Drafter(tiny_drafter(family, seed + 10), family, VOCAB, mask_token_id=MASK)
        for gamma, shape in ((4, "8x4"), (8, "32x4")):
            check_greedy_tree(drafter, model, seed, gamma, shape, eos_inside=seed == 1)


def test_greedy_trees_with_the_feature_conditioned_and_lookup_drafters():
    """dflash reads the features of the accepted path, which the tree pass keeps (no second pass); prompt lookup's
    one-hot rows make a chain, and its fallback a tree where nothing matches."""
    from align.drafters.dflash import DFlashDrafter
    from align.drafters.diffusion import Drafter
    from align.drafters.ngram import FallbackDrafter, NGramDrafter
    from align.zoo.models import dflash_model

    for seed in range(3):
        model = tiny_verifier(seed)
        kinds = [DFlashDrafter(dflash_model(model.config, [0], MASK, layers=1, intermediate=32, seed=seed),
                               model, VOCAB),
                 FallbackDrafter(NGramDrafter(VOCAB), Drafter(tiny_drafter("mdlm", seed), "mdlm", VOCAB, MASK)),
                 FallbackDrafter(NGramDrafter(VOCAB), Drafter(tiny_drafter("mdlm", seed), "mdlm", VOCAB, MASK), 0.5),
                 FallbackDrafter(NGramDrafter(VOCAB), Drafter(tiny_drafter("mdlm", seed), "mdlm", VOCAB, MASK), 0.5, 2)]
        for drafter in kinds:
            for gamma, shape in ((4, "8x4"), (8, "24x4")):
                out = check_greedy_tree(drafter, model, seed, gamma, shape, eos_inside=seed == 2)
                assert all(b.nodes and b.nodes <= 24 for b in out.stats.blocks if b.gamma)
                if isinstance(drafter, DFlashDrafter):  # after the prompt's pass every block drafts from features
                    assert all(b.gamma for b in out.stats.blocks[1:-2]), [b.gamma for b in out.stats.blocks]


def gqa_verifier(seed: int = 0, spread: float = 0.02):
    """A tiny Llama whose 4 query heads share 2 key/value heads (grouped-query attention, as SmolLM2's 9 share 3);
    ``spread``: its weights' standard deviation (wider: sharper attention, heads that differ more)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.zoo.models import BOS, EOS, PAD

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, initializer_range=spread)
    return LlamaForCausalLM(config).double().eval()


@pytest.mark.parametrize("grouped", (False, True))
def test_the_tree_pass_is_what_sequential_passes_give(grouped, monkeypatch):
    """Each node's row equals the verifier's logits after the node's own path run in sequence (the mask shows it its
    ancestors only, at its depth's position), and after the commit the cache holds what a sequential pass made; with
    grouped-query attention the masked passes read each key/value head in place (align.verifier.gqa_sdpa)."""
    model = gqa_verifier() if grouped else tiny_verifier(0)
    sdpa, in_place = torch.nn.functional.scaled_dot_product_attention, []

    def counted(*args, **kwargs):
        in_place.append(kwargs.get("enable_gqa", False) and kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    verifier = Verifier(model)
    prompt = [5, 6, 7, 8, 9]
    tree = tree_from_marginals(torch.randn(4, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
                                           ).log_softmax(-1), TreeShape(12, 4, 3))
    verifier.start(prompt)
    logits = verifier.score_tree(tree)
    tokens = tree.tokens.tolist()
    with torch.no_grad():
        for node in range(len(tree)):
            ids = prompt + [tokens[i] for i in tree.path(node)]
            alone = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            assert torch.allclose(logits[node + 1], alone, atol=1e-6), node
    deepest = int(tree.depth.argmax())
    path = tree.path(deepest)
    verifier.commit_tree(path, 11)
    after = verifier.score(torch.tensor([[12, 13]]))
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([prompt + [tokens[i] for i in path] + [11, 12, 13]])).logits[0, -3:]
    assert torch.allclose(after[0], alone.float(), atol=1e-6)
    assert any(in_place) == grouped and model.config._attn_implementation == GQA_SDPA


@pytest.mark.parametrize("positions", (1, 5))
def test_folded_attention_is_grouped_query_attention(positions):
    """align.verifier.folded_sdpa (each key/value head's query heads stacked as the rows of one head, the mask
    repeated for each group's rows) gives what transformers' grouped-query attention gives (every key/value head
    copied once per query head of its group, repeat_kv): one position without a mask, several under a tree mask."""
    from align.verifier import folded_sdpa

    g = torch.Generator().manual_seed(positions)
    heads, kv, keys, d = 6, 2, 40, 8
    q = torch.randn(1, heads, positions, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, kv, keys, d, generator=g, dtype=torch.float64) for _ in range(2))
    mask = None
    if positions > 1:
        allowed = torch.rand(positions, keys, generator=g) > 0.4
        allowed[:, 0] = True
        mask = torch.zeros(1, 1, positions, keys, dtype=torch.float64).masked_fill(~allowed, torch.finfo(
            torch.float64).min)
    repeat = heads // kv
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), attn_mask=mask, scale=0.3).transpose(1, 2)
    assert torch.allclose(folded_sdpa(q, k, v, mask, scaling=0.3), expected, atol=1e-12)


def test_a_bfloat16_verifier_folds_its_grouped_heads_in_its_own_passes_only(monkeypatch):
    """In bfloat16 the verifier's one-position steps, and its passes over a tree after FOLD_KEYS keys, fold grouped
    query heads into rows (align.verifier.folded_sdpa: PyTorch's one-position bfloat16 kernel is slow on the CPU):
    the logits of the unfolded passes to bfloat16 rounding, row by row; transformers' generate on the same model,
    outside the verifier's passes, never folds."""
    import align.verifier as verifier_module

    monkeypatch.setattr(verifier_module, "FOLD_KEYS", 16)
    real, folded_rows = verifier_module.folded_sdpa, []

    def counted(query, *args, **kwargs):
        folded_rows.append(query.shape[2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(verifier_module, "folded_sdpa", counted)
    model = gqa_verifier(0, spread=0.3).to(torch.bfloat16)
    folded, plain = Verifier(model), Verifier(model)
    plain.fold = False
    prompt = list(range(5, 19))
    marginals = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)).log_softmax(-1)
    tree = tree_from_marginals(marginals, TreeShape(6, 4, 3))
    rows = {}
    for name, verifier in (("folded", folded), ("plain", plain)):
        verifier.start(prompt)
        first = verifier.score_tree(tree)  # the prompt and the tree: 20 positions over 20 keys
        verifier.commit_tree(tree.path(0), 7)
        step = verifier.score(torch.zeros((1, 0), dtype=torch.long))  # one position
        rows[name] = torch.cat([first, step[0]])
        if name == "folded":
            assert folded_rows == [len(prompt) + len(tree)] * 2 + [1] * 2  # 2 layers a pass
            folded_rows.clear()
    assert folded_rows == []  # fold False: never
    scale = rows["plain"].abs().max()
    gap = (rows["folded"] - rows["plain"]).abs().max()
    assert gap <= 0.02 * scale, gap  # a head read against another's keys: about 1.0 × the scale
    ar_generate(model, prompt, 4)
    assert folded_rows == []


def test_the_skinny_product_scores_as_nn_linear_inside_the_verifiers_passes_only(monkeypatch):
    """A float32 verifier on the CPU scores a pass over 2 to SKINNY_ROWS positions as W x^T
    (align.verifier.skinny_linear), its rows padded to a power of two: the same logits as nn.Linear's x W^T to float32
    rounding, the same greedy output as generate token for token over random trees; a longer pass, and the model
    outside the verifier's passes (generate, a direct call), run nn.Linear's own product, bit for bit."""
    mm, calls = torch.mm, []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[-1])  # the product's columns: the rows, padded
        return mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", counted)
    model, plain = tiny_verifier(0, dtype=torch.float32), tiny_verifier(0, dtype=torch.float32)
    model.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.randn(32))  # a layer with a bias too
    plain.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(model.model.layers[0].self_attn.q_proj.bias.data)
    skinny, stock = Verifier(model), Verifier(plain)
    assert skinny.skinny and stock.skinny
    stock.skinny = False  # nn.Linear's product in its passes: the reference
    marginals = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    for verifier in (skinny, stock):
        verifier.start([5, 6, 7, 8, 9])
        verifier.score(torch.zeros((1, 0), dtype=torch.long))
        verifier.commit(0, 0, 10)
    layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    for nodes, width in ((1, 2), (2, 4), (4, 8), (SKINNY_ROWS - 1, SKINNY_ROWS), (SKINNY_ROWS, None)):
        tree = tree_from_marginals(marginals, TreeShape(nodes, 4, 3))  # 2, 3 (padded to 4), 5, the most, one more
        calls.clear()
        rows = skinny.score_tree(tree)
        assert calls == ([width] * layers if width else []), nodes  # every layer, the head included
        calls.clear()
        assert torch.allclose(rows, stock.score_tree(tree), atol=1e-5) and not calls
        skinny.commit_tree([], 11)
        stock.commit_tree([], 11)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits) and not calls
    for seed in range(3):
        model = tiny_verifier(seed, dtype=torch.float32)
        for gamma in (4, 8):
            for shape in ("6x3", "3x2", "16x4/auto"):
                check_greedy_tree(Ranked(model, seed), model, seed, gamma, shape, eos_inside=False)
    assert calls


def test_a_mask_that_lets_siblings_see_each_other_is_caught(monkeypatch):
    """The greedy check fails when a node also sees the nodes beside it (a classic tree-mask bug)."""
    def leaky(self):
        seen = torch.zeros(len(self), len(self), dtype=torch.bool)
        for i, d in enumerate(self.depth.tolist()):
            seen[i] = self.depth <= d  # every node of its depth and above, not only its ancestors
        return seen

    monkeypatch.setattr(Tree, "ancestors", leaky)
    with pytest.raises(AssertionError):
        for seed in range(4):
            model = tiny_verifier(seed)
            for gamma in (4, 8):
                check_greedy_tree(Ranked(model, seed), model, seed, gamma, "24x4", eos_inside=False)


def sampling_models():
    from align.drafters.diffusion import Drafter
    from stubs import StubCausalLM, StubMaskedLM

    return StubCausalLM(V, seed=3), Drafter(StubMaskedLM(V, seed=4), "mdlm", V, mask_token_id=3)


def sample_trees(shape: str, n: int, temperature: float = 1.0) -> Counter:
    verifier, drafter = sampling_models()
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    return Counter(tuple(decoder.generate(PROMPT, 3, gamma=2, temperature=temperature, seed=s,
                                          tree=TreeShape.parse(shape)).tokens) for s in range(n))


@pytest.mark.parametrize("shape, temperature", [("6x3", 1.0), ("3x2", 0.7), ("6x3/0.3", 1.0), ("8x3/auto", 1.0)])
def test_sampled_trees_follow_the_verifiers_distribution(shape, temperature):
    n = 6_000
    counts = sample_trees(shape, n, temperature)
    assert chi_square_p(counts, exact_distribution(sampling_models()[0], temperature), n) > 1e-3


def broken_sampling(tree, probs, generator=None):
    """A plausible bug: try the children in order, each accepted with its own p, never renormalised after a
    rejection; the next token from p without the tried children."""
    tokens = tree.tokens.tolist()
    children = tree.children()
    node, path = -1, []
    while True:
        p = probs[node + 1].clone()
        step = None
        for c in children[node]:
            if float(torch.rand((), generator=generator)) < float(probs[node + 1][tokens[c]]):
                step = c
                break
            p[tokens[c]] = 0
        if step is None:
            return path, int(torch.multinomial(p / p.sum(), 1, generator=generator))
        path.append(step)
        node = step


def test_the_same_check_rejects_a_broken_sibling_rule(monkeypatch):
    monkeypatch.setattr(speculative, "accept_sampling", broken_sampling)
    n = 5_000
    counts = sample_trees("6x3", n)
    assert chi_square_p(counts, exact_distribution(sampling_models()[0], 1.0), n) < 1e-6


def test_a_tree_refuses_what_it_cannot_combine_with():
    from align.selection import make_selection

    verifier, drafter = sampling_models()
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), eos_token_ids=None)
    with pytest.raises(AlignError, match="one draft per block"):
        decoder.generate(PROMPT, 3, 2, tree=TreeShape.parse("4x2"), selection=make_selection(2))
    with pytest.raises(AlignError, match="NODESxBRANCHING"):
        TreeShape.parse("many")
    with pytest.raises(AlignError, match="NODESxBRANCHING/P"):
        TreeShape.parse("11x3/often")
    with pytest.raises(AlignError, match=r"a number in \[0, 1\)"):
        TreeShape.parse("11x3/1.5")
    assert TreeShape.parse("11x3/0.1") == TreeShape(11, 1 << 30, 3, 0.1)
    assert TreeShape.parse("16x3/auto") == TreeShape(16, 1 << 30, 3, 0.0, sized=True)


def test_a_floor_leaves_out_the_unlikely_nodes():
    logq = log_rows({1: 0.6, 2: 0.3}, {3: 0.9}, {4: 0.55, 5: 0.4})
    # path probabilities: 1 0.6, 1-3 0.54, 2 0.3, 1-3-4 0.297, 2-3 0.27, 1-3-5 0.216, ...
    assert tree_from_marginals(logq, TreeShape(8, 3, 2, 0.28)).tokens.tolist() == [1, 3, 2, 4]
    assert len(tree_from_marginals(logq, TreeShape(8, 3, 2, 0.7))) == 0  # nothing as likely: the root alone


def test_a_sized_tree_keeps_the_nodes_that_pay():
    """Dinkelbach's rule on a best-first tree: a node stays while what it earns (α p) beats what its position costs at
    the rate so far (R Δc); the positions a pass gets for free are always filled, a dear slope keeps the sure nodes
    only, and an overconfident drafter (α < 1) gets fewer."""
    logq = log_rows({1: 0.6, 2: 0.3}, {3: 0.9}, {4: 0.55, 5: 0.4})
    tree = tree_from_marginals(logq, TreeShape(8, 3, 2))
    # path probabilities, best-first: 0.6, 0.54, 0.3, 0.297, 0.27, 0.216, ...
    assert [round(math.exp(x), 3) for x in tree.logp[:6]] == [0.6, 0.54, 0.3, 0.297, 0.27, 0.216]
    flat = CostCurve([0, 4, 8], [0.05, 0.05, 0.05])
    assert len(sized_tree(tree, flat, rate=30.0, alpha=1.0)) == len(tree)  # nothing to pay: every node
    steep = CostCurve([0, 2, 8], [0.05, 0.05, 0.08])  # 5 ms a node past 2; at 30 tok/s a node costs 0.15 tokens
    kept = sized_tree(tree, steep, rate=30.0, alpha=1.0)
    assert kept.tokens.tolist() == tree.tokens[:6].tolist()  # 0.216 > 0.15 stays, 0.1485 does not
    assert len(sized_tree(tree, steep, rate=30.0, alpha=0.6)) == 5  # α p: … 0.162 stays, 0.1296 does not
    assert len(sized_tree(tree, steep, rate=300.0, alpha=1.0)) == 2  # a fast run pays 1.5 tokens a node
    dear = CostCurve([0, 1, 8], [0.05, 0.09, 0.30])  # at 30 tok/s the first node costs 1.2 tokens, each next 0.9
    assert len(sized_tree(tree, dear, rate=30.0, alpha=1.0)) == 0 and len(sized_tree(tree, dear, 30.0, 2.0)) == 2
    with pytest.raises(AlignError, match="increasing"):
        CostCurve([4, 2], [0.1, 0.2])
    curve = CostCurve([0, 4, 8], [0.04, 0.03, 0.06])  # noise below the first size is not a saving
    assert curve(2) == 0.04 and curve(6) == 0.05 and curve(12) == pytest.approx(0.08)


def test_a_sizer_that_stopped_scoring_still_learns_from_plain_steps():
    """A block sized to no node is a plain verifier step, and its next token settles what the tree's first tokens
    would have earned: an underconfident drafter (the verifier keeps its first token, which it gave 0.3) earns its
    nodes back within a few plain steps; one the verifier never agrees with stays at none. α counts the scored nodes
    and the unscored children of the root and of scored nodes, nothing deeper (their fate was not read)."""
    logq = log_rows({1: 0.3, 2: 0.2}, {3: 0.9})
    tree = tree_from_marginals(logq, TreeShape(8, 2, 2))
    # best-first: 1 (0.3), 1-3 (0.27), 2 (0.2), 2-3 (0.18), 1-0 (0.006), 2-0 (0.004)
    assert tree.tokens.tolist()[:4] == [1, 3, 2, 3] and tree.parents.tolist()[:4] == [-1, 0, -1, 2]
    curve = CostCurve([0, 1, 8], [1.0, 1.4, 3.5])  # at 1 token a second a first node costs 0.4 tokens: α 1 keeps none
    for verifier_token, earns in ((1, True), (4, False)):
        sizer = TreeSizer(curve)
        plain = 0
        while plain < 10 and len(sizer.size(tree)) == 0:
            sizer.observe(tree, 0, [], verifier_token, 1, 1.0)
            plain += 1
        assert (plain < 10) == earns, (verifier_token, plain, sizer.alpha)
        assert sizer.alpha > 4 / 3 if earns else sizer.alpha < 1
    sizer = TreeSizer(curve)
    sizer.observe(tree, 1, [0], 3, 2, 1.0)  # node 1 scored and kept; the verifier's next token is its child's
    assert sizer.accepted == 1 + 1 + 1 and sizer.predicted == pytest.approx(1 + 0.3 + 0.27 + 0.2 + 0.006)
    assert sizer.tokens == 3 and sizer.seconds == 2.0
    sizer.observe(tree, 1, [], 3, 1, 1.0)  # node 1 rejected: its child carrying the next token is no longer in play
    assert sizer.accepted == 3 and sizer.predicted == pytest.approx(2 * (1.776 - 1) + 1)


def test_the_cost_probe_times_every_size_in_each_round(monkeypatch):
    """tree_cost times the sizes round by round (a warm-up round, then each round one pass at every size), so that
    a machine whose speed drifts over the probe moves every size alike; one size timed after another read a slope
    up to twice decoding's."""
    verifier = Verifier(tiny_verifier(1))
    verifier.start([5, 6, 7])
    verifier.commit(0, 0, int(verifier.score(torch.zeros((1, 0), dtype=torch.long))[0, -1].argmax()))
    score_tree, sizes = verifier.score_tree, []
    monkeypatch.setattr(verifier, "score_tree", lambda tree: sizes.append(len(tree)) or score_tree(tree))
    cost = verifier.tree_cost(8, rounds=3)
    per_round = len(cost.nodes)
    assert len(sizes) == 4 * per_round
    assert all(sorted(sizes[i:i + per_round]) == cost.nodes for i in range(0, len(sizes), per_round))


def test_the_cost_probe_leaves_the_verifier_as_it_was():
    """tree_cost times passes of 0..N nodes from the decoding state and crops them away: the generation that measured
    it is the verifier's own, and a sized tree's decoder learns its calibration and rate from the blocks it sees."""
    model = tiny_verifier(1)
    verifier = Verifier(model)
    verifier.start([5, 6, 7])
    with pytest.raises(AlignError, match="score the prompt first"):
        verifier.tree_cost(8)
    before = verifier.score(torch.tensor([[8, 9]]))
    verifier.commit(0, 2, 10)
    cost = verifier.tree_cost(8)
    assert cost.nodes[0] == 0 and cost.nodes[-1] == 8 and all(s > 0 for s in cost.seconds)
    assert verifier.tree_cost(8) is cost  # once per verifier
    after = verifier.score(torch.tensor([[11]]))
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11]])).logits[0, -2:].float()
    assert torch.allclose(after[0], alone, atol=1e-6) and before.shape == (1, 3, VOCAB)
    decoder = SpeculativeDecoder(Ranked(model, 1), Verifier(model), eos_token_ids=[])
    out = decoder.generate([5, 6, 7], 40, 4, tree=TreeShape.parse("16x4/auto"))
    assert out.tokens == ar_generate(model, [5, 6, 7], 40, eos_token_ids=[])
    sizer = decoder.sizers[(16, 4)]
    plain = SpeculativeDecoder(Ranked(model, 1), Verifier(model), eos_token_ids=[])  # where no node can pay, none is
    plain.verifier.tree_cost = lambda nodes: CostCurve([0, 1, nodes], [0.01, 1.0, 2.0])  # scored: plain steps
    out = plain.generate([5, 6, 7], 40, 4, tree=TreeShape.parse("16x4/auto"))
    assert out.tokens == ar_generate(model, [5, 6, 7], 40, eos_token_ids=[])
    sized = [b.nodes for b in out.stats.blocks[1:] if b.nodes is not None]  # the trees after the prompt's block
    assert len(sized) > 10 and set(sized) == {0}
    assert sizer.tokens > 1 + 20 and sizer.accepted > 1 and sizer.rate > 0
