"""The feature-conditioned drafter (align.dflash): lossless decoding, what decoding drafts equals what training
computes, the verifier it reads, its trainable size."""

from __future__ import annotations

import json
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from align.drafters.dflash import DFlashDrafter, check_verifier, verifier_fingerprint
from align.dflash.batch import (chunks, drafted_logits, drafter_logits, make_batch, training_given, uncommitted,
                                verifier_pass)
from align.errors import AlignError
from align.lossless import chi_square_p
from align.metrics import walk_blocks
from align.selection import make_selection
from align.speculative import SpeculativeDecoder
from align.verifier import Verifier, ar_generate
from align.zoo.models import dflash_model, verifier_model
from test_sampling import exact_distribution

MASK = 3


def pair(seed: int, vocab: int = 64, layers=(0, 1), dtype=torch.float64, drafter_layers: int = 1):
    """A 3-layer random verifier and a random drafter of ``drafter_layers`` reading ``layers`` of it (grouped-query
    attention)."""
    verifier = verifier_model(vocab, hidden=32, layers=3, heads=2, max_len=256, seed=seed).to(dtype).eval()
    model = dflash_model(verifier.config, list(layers), MASK, layers=drafter_layers, intermediate=64, kv_heads=1,
                         seed=seed + 100).to(dtype).eval()
    return verifier, model


def recorded(drafter: DFlashDrafter) -> list[tuple[list[int], torch.Tensor, list[int] | None]]:
    """Every block ``drafter`` drafts from now on, as (prefix, its rows (γ, V), the draft the loop verifies when the
    drafter keeps one (T > 1), else None)."""
    drafted, original = [], drafter.marginals

    def recording(prefix, gamma, *args, **kwargs):
        logq = original(prefix, gamma, *args, **kwargs)
        draft = None if drafter.draft is None else drafter.draft[0].tolist()
        drafted.append((prefix[0].tolist(), logq[0], draft))
        return logq

    drafter.marginals = recording
    return drafted


def test_greedy_decoding_is_the_verifiers_own_output():
    """Random pairs, γ 1/4/16, one pass and T = 3 passes, K 1 and 4 (a tree pass), EOS inside and never reached; a
    small vocabulary so that blocks are accepted in part, and a larger one."""
    accepted = []
    for seed in range(2):
        for vocab in (8, 64):
            verifier, model = pair(seed, vocab)
            drafter, checker = DFlashDrafter(model, verifier, vocab), Verifier(verifier)
            for gamma in (1, 4, 16):
                rng = random.Random(seed * 100 + gamma + vocab)
                prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 9))]
                free = ar_generate(verifier, prompt, 32, eos_token_ids=[])
                eos = free[rng.randrange(1, 24)]
                for eos_ids, expected in (([eos], free[:free.index(eos) + 1]), ([], free)):
                    for k, steps in ((1, 1), (4, 1), (1, 3), (4, 3)):
                        selection = make_selection(k=k) if k > 1 else None
                        out = SpeculativeDecoder(drafter, checker, eos_ids).generate(prompt, 32, gamma, steps,
                                                                                     selection=selection)
                        assert out.tokens == expected, (seed, vocab, gamma, eos_ids, k, steps)
                        accepted += [b.accepted for b in out.stats.blocks if b.gamma]
            assert checker.tap is None  # the hooks are gone once a generation ends
    assert max(accepted) >= 2 and 0 in accepted


@pytest.mark.parametrize("drafter_layers", [1, 3])
def test_what_decoding_drafts_is_what_training_computes(drafter_layers):
    """Every block decoding drafted (its context cache grown block by block, rolled back, and handed over by tree
    passes; decoding's fused pass, align.models.dflash.DecodePass) equals the training pass over the same prefix:
    one teacher-forced verifier pass, all windows at once."""
    verifier, model = pair(1, vocab=8, drafter_layers=drafter_layers)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms other than ones, so that each layer's own weights must be the ones applied
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5, generator=generator)
    drafter = DFlashDrafter(model, verifier, 8)
    drafted = recorded(drafter)
    prompt, gamma = [4, 5, 6, 7], 4
    for k in (1, 3):
        SpeculativeDecoder(drafter, Verifier(verifier), []).generate(
            prompt, 30, gamma, selection=make_selection(k=k) if k > 1 else None)
    assert len(drafted) > 10
    for prefix, logq, _ in drafted:
        g = logq.shape[0]  # the last blocks are shorter
        rollouts = [{"prompt_ids": prompt, "response_ids": prefix[len(prompt):] + [0] * g}]
        batch = make_batch(rollouts, torch.tensor([[0, len(prefix) - len(prompt)]]), g)
        features, _ = verifier_pass(verifier, model.config.target_layer_ids, batch, 8)
        logits = drafter_logits(model, verifier.get_input_embeddings(), verifier.get_output_embeddings(), batch,
                                features, MASK, 8)
        torch.testing.assert_close(logits[0].float().log_softmax(-1), logq, atol=1e-6, rtol=0)  # float32 rows


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_what_decoding_drafts_in_passes_is_what_training_computes(temperature):
    """T > 1 passes: every block's rows equal the training pass that holds the drafted tokens before each chunk (the
    held-out evaluation's ``drafted_logits``), and the draft the loop verifies is the argmax of its rows at
    temperature 0."""
    verifier, model = pair(4, vocab=8)
    drafter = DFlashDrafter(model, verifier, 8)
    drafted = recorded(drafter)
    prompt, gamma, steps = [4, 5, 6], 7, 3
    SpeculativeDecoder(drafter, Verifier(verifier), []).generate(prompt, 40, gamma, steps, temperature, seed=1)
    assert len(drafted) > 5
    embed, head = verifier.get_input_embeddings(), verifier.get_output_embeddings()
    for prefix, logq, draft in drafted:
        g = logq.shape[0]
        if temperature == 0:
            assert draft == logq.argmax(-1).tolist()
        rollouts = [{"prompt_ids": prompt, "response_ids": prefix[len(prompt):] + draft}]
        batch = make_batch(rollouts, torch.tensor([[0, len(prefix) - len(prompt)]]), g)
        features, _ = verifier_pass(verifier, model.config.target_layer_ids, batch, 8)
        logits = drafted_logits(lambda b: drafter_logits(model, embed, head, b, features, MASK, 8), batch, steps)
        torch.testing.assert_close(logits[0].float().log_softmax(-1), logq, atol=1e-6, rtol=0)


def test_passes_fill_the_block_left_to_right_and_training_reads_the_rest():
    assert chunks(16, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert chunks(5, 2) == [(0, 3), (3, 5)] and chunks(2, 4) == [(0, 1), (1, 2)] and chunks(3, 1) == [(0, 3)]
    lengths = torch.tensor([16, 16, 3, 1, 9] * 40)
    given = training_given(lengths, 16, 4, torch.Generator().manual_seed(0))
    assert set(given[lengths == 16].tolist()) == {0, 4, 8, 12}  # every pass's chunk start is drawn
    assert (given < lengths).all() and set(given[lengths == 3].tolist()) <= {0, 2} and set(given[lengths == 9].tolist()) <= {0, 4, 8}
    labels = torch.tensor([[10, 11, 12, 13], [20, 21, -100, -100], [30, 31, 32, 33]])
    logits = torch.arange(12.0).view(3, 4, 1).expand(3, 4, 2)
    shifted, rows = uncommitted(torch.tensor([2, 1, 0]), labels, logits)
    assert shifted.tolist() == [[12, 13, -100, -100], [21, -100, -100, -100], [30, 31, 32, 33]]
    assert rows[0, :2, 0].tolist() == [2.0, 3.0] and rows[1, 0, 0] == 5.0 and torch.equal(rows[2], logits[2])


def test_the_training_pass_stops_after_the_deepest_layer_read():
    """Without teacher logits the training pass's verifier runs no deeper than the layers it reads (neither the layer
    above them nor the LM head), and gives the features of the whole pass."""
    verifier, model = pair(2, layers=(0, 1))
    rollouts = [{"prompt_ids": [4, 5, 6], "response_ids": list(range(8, 30))}]
    batch = make_batch(rollouts, torch.tensor([[0, t] for t in range(0, 20, 3)]), 4)
    ran = []
    for name, module in (("top layer", verifier.model.layers[2]), ("head", verifier.lm_head)):
        module.register_forward_hook(lambda *_, name=name: ran.append(name))
    stopped, _ = verifier_pass(verifier, [0, 1], batch, 64)
    assert ran == []
    full, teacher = verifier_pass(verifier, [0, 1], batch, 64, teacher=True)
    assert ran == ["top layer", "head"] and teacher.shape == (7, 4, 64)
    assert torch.equal(stopped, full)


def test_the_feature_caches_key_names_rollouts_verifier_and_layers():
    from align.dflash.cache import cache_key

    verifier, _ = pair(0)
    other, _ = pair(1)
    mine, theirs = verifier_fingerprint(verifier), verifier_fingerprint(other)
    seqs = [[4, 5, 6], [7, 8]]
    key = cache_key(mine, torch.float64, [0, 1], seqs)
    assert cache_key(mine, torch.float64, [0, 1], [[4, 5, 6], [7, 8]]) == key
    assert len({key, cache_key(theirs, torch.float64, [0, 1], seqs), cache_key(mine, torch.float64, [0], seqs),
                cache_key(mine, torch.float64, [0, 1], [[4, 5], [6, 7, 8]]),
                cache_key(mine, torch.float32, [0, 1], seqs)}) == 5
    # features stored in another dtype than the verifier's are a cache of their own; in its own, the same cache
    assert cache_key(mine, torch.float64, [0, 1], seqs, torch.float64) == key
    assert len({key, cache_key(mine, torch.float64, [0, 1], seqs, torch.bfloat16),
                cache_key(mine, torch.bfloat16, [0, 1], seqs)}) == 3


def test_a_bfloat16_feature_cache_holds_the_verifiers_features_rounded_in_half_the_bytes(tmp_path, monkeypatch):
    """data.feature_dtype: bfloat16 stores what the verifier computed, rounded (not a bfloat16 verifier's features),
    in half a float32 cache's bytes, and the training pass reads them in the drafter's dtype."""
    from align.dflash.cache import DATA, FeatureCache, build_cache

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path))
    verifier, model = pair(0, dtype=torch.float32)
    rng = random.Random(0)
    seqs = [[rng.randrange(4, 64) for _ in range(rng.randrange(3, 12))] for _ in range(12)]
    whole = build_cache(verifier, [0, 1], seqs, "float32", batch_tokens=24, progress=False)
    half = build_cache(verifier, [0, 1], seqs, "bfloat16", batch_tokens=24, progress=False, dtype=torch.bfloat16)
    assert (half / DATA).stat().st_size * 2 == (whole / DATA).stat().st_size
    exact, rounded = FeatureCache("float32"), FeatureCache("bfloat16")
    assert rounded.data.dtype == torch.bfloat16 and torch.equal(rounded.data, exact.data.to(torch.bfloat16))
    assert not torch.equal(rounded.data.float(), exact.data)  # rounded, not the same numbers
    batch = make_batch([{"prompt_ids": s[:2], "response_ids": s[2:]} for s in seqs[:2]],
                       torch.tensor([[0, 0], [1, 0]]), 4)
    a, b = (drafter_logits(model, verifier.get_input_embeddings(), verifier.get_output_embeddings(), batch,
                           cache.take([0, 1], batch.ids.shape[1]), MASK, 64) for cache in (exact, rounded))
    assert b.dtype == a.dtype == torch.float32 and torch.allclose(a, b, atol=0.05) and not torch.equal(a, b)


def test_a_feature_cache_cut_short_resumes_where_it_was(tmp_path, monkeypatch):
    """A build killed mid-way keeps what it had flushed: the rerun runs the verifier over the other rollouts only,
    and the file it ends with is the one an uncut build writes."""
    from align.dflash.cache import DONE, FeatureCache, build_cache
    from align.features import FeatureTap

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path))
    verifier, _ = pair(0)
    rng = random.Random(0)
    seqs = [[rng.randrange(4, 64) for _ in range(rng.randrange(3, 12))] for _ in range(24)]
    build_cache(verifier, [0, 1], seqs, "whole", batch_tokens=24, progress=False)
    whole = FeatureCache("whole").data.clone()
    ran, real = [], FeatureTap.run

    def cut(self, model, **inputs):
        if len(ran) == 3:
            raise KeyboardInterrupt
        ran.append(int(inputs["attention_mask"].shape[0]))
        return real(self, model, **inputs)

    monkeypatch.setattr(FeatureTap, "run", cut)
    with pytest.raises(KeyboardInterrupt):
        build_cache(verifier, [0, 1], seqs, "cut", batch_tokens=24, progress=False, checkpoint_s=0)
    held = json.loads((tmp_path / "features" / "cut" / DONE).read_text())["done"]
    assert len(held) == sum(ran) and not (tmp_path / "features" / "cut" / "index.json").exists()
    monkeypatch.setattr(FeatureTap, "run", lambda self, model, **inputs: ran.append(
        int(inputs["attention_mask"].shape[0])) or real(self, model, **inputs))
    build_cache(verifier, [0, 1], seqs, "cut", batch_tokens=24, progress=False)
    assert sum(ran) == len(seqs)  # every rollout run once over the two builds
    assert torch.equal(FeatureCache("cut").data, whole) and not (tmp_path / "features" / "cut" / DONE).exists()


def test_a_feature_cache_copies_the_rows_another_cache_of_its_setting_holds(tmp_path, monkeypatch):
    """More sequences after fewer: the verifier runs only over those no built cache of the same setting (verifier,
    dtype, layers, storage) holds, whatever their order or repeats: their rows are copied bit for bit, the others
    computed (equal to a build from nothing but for the last bits batching moves); a cache of another setting gives
    nothing."""
    from align.dflash.cache import FeatureCache, build_cache, cache_setting
    from align.features import FeatureTap

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path))
    verifier, _ = pair(0)
    rng = random.Random(0)
    seqs = [[rng.randrange(4, 64) for _ in range(rng.randrange(3, 12))] for _ in range(24)]
    build_cache(verifier, [0, 1], seqs, "whole", batch_tokens=24, progress=False)  # their indexes name no rows...
    build_cache(verifier, [0, 1], [[60, 61, 62, 63]], "legacy", batch_tokens=24, progress=False)
    whole = FeatureCache("whole")
    ran, real = [], FeatureTap.run

    def run(self, model, input_ids, attention_mask, **inputs):
        ran.extend(ids[:int(n)] for ids, n in zip(input_ids.tolist(), attention_mask.sum(1)))
        return real(self, model, input_ids=input_ids, attention_mask=attention_mask, **inputs)

    monkeypatch.setattr(FeatureTap, "run", run)
    mine = cache_setting(verifier_fingerprint(verifier), torch.float64, [0, 1])
    build_cache(verifier, [0, 1], seqs[:10], "first", batch_tokens=24, progress=False, setting=mine)
    build_cache(verifier, [0, 1], seqs[10:16], "another", batch_tokens=24, progress=False,
                setting=cache_setting("another verifier", torch.float64, [0, 1]))
    ran.clear()
    grown = seqs[5:] + [seqs[0], seqs[0]]
    build_cache(verifier, [0, 1], grown, "grown", batch_tokens=24, progress=False, setting=mine)
    assert sorted(ran) == sorted(seqs[10:])  # the new ones, the other setting's and the unnamed's included, once
    build_cache(verifier, [0, 1], [[60, 61, 62, 63]], "legacy", batch_tokens=24, progress=False, setting=mine)
    ran.clear()  # ...until a build of the setting opens them
    build_cache(verifier, [0, 1], [[5, 6, 7], [60, 61, 62, 63]], "later", batch_tokens=24, progress=False,
                setting=mine)
    assert ran == [[5, 6, 7]]
    got, first = FeatureCache("grown"), FeatureCache("first")
    for r, i in enumerate([*range(5, 24), 0, 0]):  # the shared rows copied bit for bit, the others computed
        row = got.data[got.offsets[r]:got.offsets[r + 1]]
        assert torch.allclose(row, whole.data[whole.offsets[i]:whole.offsets[i + 1]], rtol=0, atol=1e-12)
        assert i >= 10 or torch.equal(row, first.data[first.offsets[i]:first.offsets[i + 1]])


def test_a_feature_cache_without_room_on_its_disk_is_refused_before_the_verifier_runs(tmp_path, monkeypatch):
    """The cache is written through a shared memory map, where a full disk kills the process with a bus error: a disk
    without room for the whole file is refused first, in one line naming the ways out, the verifier never run and
    nothing written; a build cut short needs room only for what its file lacks, and resumes with none to spare."""
    from align.dflash import cache
    from align.features import FeatureTap

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path))
    verifier, _ = pair(0)
    rng = random.Random(0)
    seqs = [[rng.randrange(4, 64) for _ in range(rng.randrange(3, 12))] for _ in range(24)]
    size = sum(map(len, seqs)) * 2 * verifier.config.hidden_size * verifier.dtype.itemsize  # two layers a token
    disk = SimpleNamespace(free=size - 1)
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: disk)
    ran, real, cut = [], FeatureTap.run, [None]

    def run(self, model, **inputs):
        if len(ran) == cut[0]:
            raise KeyboardInterrupt
        ran.append(1)
        return real(self, model, **inputs)

    monkeypatch.setattr(FeatureTap, "run", run)
    with pytest.raises(AlignError, match=r"^the feature cache needs \d+\.\d MB more in .* and that disk has \d+\.\d MB "
                                         r"free: .* set ALIGN_CACHE .* \(data\.feature_cache: false"):
        cache.build_cache(verifier, [0, 1], seqs, "full", batch_tokens=24, progress=False)
    assert not ran and not (tmp_path / "features" / "full" / cache.PARTIAL).exists()

    disk.free, cut[0] = size, 3  # room for it: a build cut short after three batches...
    with pytest.raises(KeyboardInterrupt):
        cache.build_cache(verifier, [0, 1], seqs, "full", batch_tokens=24, progress=False, checkpoint_s=0)
    disk.free, cut[0] = 0, None  # ...resumes on a full disk: its file holds the space already
    cache.build_cache(verifier, [0, 1], seqs, "full", batch_tokens=24, progress=False)
    assert len(ran) > 3 and cache.FeatureCache("full").data.shape[0] == sum(map(len, seqs))


def test_walking_the_training_passs_streaks_gives_greedy_decodings_blocks():
    """The trainer's held-out ``decoded_accepted``: the greedy streak of every window of the verifier's own text,
    walked block by block (align.metrics.walk_blocks), is what the greedy decoder accepted, block for block."""
    accepted = []
    for seed, gamma in ((0, 4), (1, 8), (2, 16), (3, 4), (4, 8), (5, 16)):
        verifier, model = pair(seed, vocab=8)
        prompt = [4, 5, 6, 7][:seed % 3 + 2]
        out = SpeculativeDecoder(DFlashDrafter(model, verifier, 8), Verifier(verifier), []).generate(prompt, 40, gamma)
        decoded = [b.accepted for b in out.stats.blocks if b.gamma]
        response = out.tokens
        rollouts = [{"prompt_ids": prompt, "response_ids": response}]
        batch = make_batch(rollouts, torch.tensor([[0, t] for t in range(len(response))]), gamma)
        features, _ = verifier_pass(verifier, model.config.target_layer_ids, batch, 8)
        logits = drafter_logits(model, verifier.get_input_embeddings(), verifier.get_output_embeddings(), batch,
                                features, MASK, 8)
        streaks = ((logits.argmax(-1) == batch.labels) & (batch.labels >= 0)).long().cumprod(-1).sum(-1).tolist()
        walked = walk_blocks(streaks, start=1, limit=40)  # the prompt pass first; the length limit of 40
        assert walked == (len(decoded), sum(decoded)), (seed, gamma, decoded)
        accepted += decoded
    assert max(accepted) >= 2 and 0 in accepted  # partly accepted: the walk has jumps to get right


def test_all_windows_of_a_rollout_in_one_pass_equal_each_window_alone():
    """The training mask shows each block only its context and its own rows: windows of several rollouts in one
    batch give what each gives alone, and the teacher logits are the verifier's at the block positions."""
    verifier, model = pair(2)
    rng = random.Random(0)
    rollouts = [{"prompt_ids": [rng.randrange(4, 64) for _ in range(n)],
                 "response_ids": [rng.randrange(4, 64) for _ in range(m)]} for n, m in ((3, 20), (7, 12))]
    pairs = torch.tensor([[0, 0], [1, 5], [0, 7], [0, 15], [1, 0], [1, 11]])
    embed, head = verifier.get_input_embeddings(), verifier.get_output_embeddings()
    batch = make_batch(rollouts, pairs, 6)
    features, teacher = verifier_pass(verifier, [0, 1], batch, 64, teacher=True)
    together = drafter_logits(model, embed, head, batch, features, MASK, 64)
    for n, (row, t) in enumerate(pairs.tolist()):
        alone = make_batch(rollouts, pairs[n:n + 1], 6)
        f, _ = verifier_pass(verifier, [0, 1], alone, 64)
        torch.testing.assert_close(together[n], drafter_logits(model, embed, head, alone, f, MASK, 64)[0])
        item = rollouts[row]
        ids = torch.tensor([item["prompt_ids"] + item["response_ids"]])
        full = verifier(input_ids=ids).logits[0]
        s = len(item["prompt_ids"]) + t - 1
        valid = min(6, len(item["response_ids"]) - t)
        torch.testing.assert_close(teacher[n, :valid], full[s:s + valid].float())
        assert (batch.labels[n, :valid] == torch.tensor(item["response_ids"][t:t + valid])).all()
        assert (batch.labels[n, valid:] == -100).all()


@pytest.mark.parametrize("k,steps", [(1, 1), (1, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_sampling_is_the_verifiers_distribution(k, steps):
    """Speculative sampling's first three tokens against the verifier's exact distribution (chi-square), with one
    draft, with K = 2 candidates (recursive rejection), and drafted in two passes (the second row drawn given the
    first drafted token)."""
    vocab, prompt = 8, [4, 5, 6]
    verifier, model = pair(3, vocab)
    decoder = SpeculativeDecoder(DFlashDrafter(model, verifier, vocab), Verifier(verifier), [])
    selection = make_selection(k=k, drafter_temperature=1.0) if k > 1 else None
    n = 3_000
    counts = Counter(tuple(decoder.generate(prompt, 3, gamma=2, steps=steps, temperature=1.0, seed=s,
                                            selection=selection).tokens) for s in range(n))
    assert chi_square_p(counts, exact_distribution(verifier, 1.0, prompt, vocab), n) > 1e-3


def test_the_check_rejects_a_draft_drawn_at_another_temperature():
    """Two passes keep the drafter's own draft, drawn row by row at the decoding temperature from the rows it
    returns. A drafter that draws its draft at temperature 1 whatever the decoding temperature (the rows then are
    not the q its tokens were drawn from) leaves the verifier's distribution, and the same check sees it."""
    vocab, prompt = 8, [4, 5, 6]
    verifier, model = pair(3, vocab)
    with torch.no_grad():  # peaked rows (a random drafter's are nearly flat): the temperature of q then matters
        model.norm.weight.mul_(60)

    class Temperature1(DFlashDrafter):
        def marginals(self, prefix, gamma, steps=1, temperature=0.0, generator=None):
            return super().marginals(prefix, gamma, steps, 1.0, generator)  # the bug: the temperature ignored

    for drafter, expected in ((DFlashDrafter(model, verifier, vocab), "lossless"),
                              (Temperature1(model, verifier, vocab), "broken")):
        decoder = SpeculativeDecoder(drafter, Verifier(verifier), [])
        n = 3_000
        counts = Counter(tuple(decoder.generate(prompt, 3, gamma=2, steps=2, temperature=0.5, seed=s).tokens)
                         for s in range(n))
        p = chi_square_p(counts, exact_distribution(verifier, 0.5, prompt, vocab), n)
        assert p > 1e-3 if expected == "lossless" else p < 1e-6, (expected, p)


def test_a_different_verifier_is_refused(tmp_path):
    verifier, _ = pair(0)
    other, _ = pair(1)
    assert verifier_fingerprint(verifier) == verifier_fingerprint(verifier.to(torch.bfloat16).double())
    assert verifier_fingerprint(verifier) != verifier_fingerprint(other)
    (tmp_path / "meta.json").write_text(json.dumps({"verifier": "zoo:a", "verifier_fingerprint":
                                                    verifier_fingerprint(verifier)}))
    check_verifier(tmp_path, verifier, "zoo:a")
    with pytest.raises(AlignError, match="reads the hidden states of the verifier zoo:a"):
        check_verifier(tmp_path, other, "zoo:b")


def test_layers_the_verifier_cannot_hand_over_are_refused():
    verifier, _ = pair(0)
    for layers in ([2], [0, 5], [-1]):
        with pytest.raises(AlignError, match="target_layer_ids"):
            Verifier(verifier).record(layers)


def test_trained_exported_evaluated_and_refused_against_another_verifier(model_dirs, world_prompts, tmp_path, capsys):
    """The real CLI end to end: two steps of align/train.py for drafting in two passes, the export's meta naming the
    verifier's layers, its fingerprint and T, eval.acceptance and align.decode decoding losslessly with it in its T
    passes, and the same export refused against another verifier (with the same tokenizer) before any
    decoding."""
    from transformers import AutoTokenizer

    from align.decode import main as decode
    from conftest import tiny_verifier
    from eval.acceptance import main as acceptance
    from test_train import overrides, run_main

    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, "dflash", **{"train.max_steps": 2,
                                                                           "distill.denoise_steps": 2})) == 0
    meta = json.loads((out / "final" / "meta.json").read_text())
    assert meta["family"] == "dflash" and meta["verifier_layers"] == [0] and len(meta["verifier_fingerprint"]) == 16
    assert meta["denoise_steps"] == 2
    common = ["--ckpt", str(out / "final"), "--prompts", str(world_prompts), "--limit", "3", "--gamma", "4",
              "--max-new-tokens", "12", "--baseline", "none"]
    threads = torch.get_num_threads()
    try:
        assert acceptance([*common, "--out", str(tmp_path / "eval")]) == 0
        results = json.loads((tmp_path / "eval" / "acceptance.json").read_text())["results"]
        assert results and all(r["lossless"] for r in results) and results[0]["label"] == "aligned"
        assert [r["steps"] for r in results] == [2]  # the T it was trained for (--steps sets the other drafters')
        import align.machine
        import eval.acceptance as module  # a bfloat16 verifier beside a float32 drafter: the drafter loads in float32

        loaded, original = [], module.load_drafter
        with pytest.MonkeyPatch.context() as patch:  # auto, on a device that computes in bfloat16: the report says so
            patch.setattr(module, "load_drafter", lambda *a, **k: loaded.append(k["dtype"]) or original(*a, **k))
            patch.setattr(align.machine, "native_bf16", lambda device=None: True)
            assert acceptance([*common, "--dtype", "auto", "--drafter-dtype", "float32",
                               "--out", str(tmp_path / "eval-mixed")]) == 0
        document = json.loads((tmp_path / "eval-mixed" / "acceptance.json").read_text())
        assert loaded == ["float32"] and document["environment"]["dtype"] == "bfloat16"
        assert document["environment"]["drafter_dtype"] == "float32"
        assert all(r["lossless_counts"]["mismatch"] == 0 for r in document["results"])
        assert decode(["--drafter", str(out / "final"), "--verifier", str(model_dirs["verifier"]), "--prompt",
                       "The capital of France is", "--gamma", "4", "--max-new-tokens", "10", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert stats["lossless"] is True and stats["new_tokens"] == 10
        other = tmp_path / "other-verifier"
        tiny_verifier(seed=7, vocab=len(AutoTokenizer.from_pretrained(model_dirs["verifier"])),
                      dtype=torch.float32).save_pretrained(other)
        AutoTokenizer.from_pretrained(model_dirs["verifier"]).save_pretrained(other)
        with pytest.raises(AlignError, match="reads the hidden states of the verifier"):
            acceptance([*common, "--verifier", str(other), "--out", str(tmp_path / "eval-other")])
    finally:
        torch.set_num_threads(threads)
    assert not (tmp_path / "eval-other" / "acceptance.json").exists()


def test_a_draft_vocabulary_drafts_only_its_tokens_and_decodes_exactly():
    """A drafter whose head is some rows of the verifier's (``drafter.draft_vocab``) never proposes another token;
    its rows are the full head's renormalised over those tokens, and greedy output is still the verifier's."""
    verifier, model = pair(5)
    full = DFlashDrafter(model, verifier, 64)
    model.config.dflash_config["draft_vocab"] = list(range(0, 64, 2))  # the even tokens
    small = DFlashDrafter(model, verifier, 64)
    prompt = [7, 9, 11, 4]
    for drafter in (full, small):
        out = SpeculativeDecoder(drafter, Verifier(verifier), []).generate(prompt, 30, 6)
        assert out.tokens == ar_generate(verifier, prompt, 30, eos_token_ids=[])
    drafted = recorded(small)
    SpeculativeDecoder(small, Verifier(verifier), []).generate(prompt, 20, 6)
    for _, rows, _ in drafted:
        assert torch.isinf(rows[:, 1::2]).all() and rows[:, 0::2].isfinite().all()
    full_rows = recorded(full)
    SpeculativeDecoder(full, Verifier(verifier), []).generate(prompt, 20, 6)
    (_, a, _), (_, b, _) = drafted[0], full_rows[0]  # the first block: the same prefix for both
    torch.testing.assert_close(a[:, 0::2], b[:, 0::2].log_softmax(-1))  # the same rows, over the even tokens


def test_an_int8_drafter_drafts_near_its_float_rows_and_decodes_exactly():
    """``--drafter-dtype int8`` (align.loading.int8_linears): every linear layer of the drafter and its
    draft-vocabulary head run in int8, the verifier's layers stay as they are; the rows stay close to float32's and
    greedy output is still the verifier's."""
    import copy

    from align.loading import int8_linears, is_int8

    verifier, model = pair(3, dtype=torch.float32)
    model.config.dflash_config["draft_vocab"] = list(range(0, 64, 2))
    exact = DFlashDrafter(model, verifier, 64)
    quantized = DFlashDrafter(int8_linears(copy.deepcopy(model)), verifier, 64)
    assert is_int8(quantized.model) and is_int8(quantized.draft_head) and not is_int8(exact.model)
    assert not is_int8(verifier)  # the drafter shares the verifier's embeddings and head rows: copies, untouched
    prompt = [7, 9, 11, 4, 21, 30]
    rows = []
    for drafter in (exact, quantized):
        drafted = recorded(drafter)
        out = SpeculativeDecoder(drafter, Verifier(verifier), []).generate(prompt, 30, 6)
        assert out.tokens == ar_generate(verifier, prompt, 30, eos_token_ids=[])
        rows.append(drafted[0][1])  # the first block: the same prefix for both
    a, b = rows
    assert torch.isinf(b[:, 1::2]).all()
    assert (a[:, 0::2].exp() - b[:, 0::2].exp()).abs().max() < 0.01
    assert not torch.equal(a, b)  # int8 arithmetic, not the float32 layers


def test_the_drafter_pass_bench_times_every_dtype(model_dirs, tmp_path):
    """bench/drafter_pass.py (the int8 drafter's figure in docs/results.md) runs on a tiny pair, every dtype."""
    import subprocess
    import sys

    out = tmp_path / "pass.json"
    subprocess.run([sys.executable, "bench/drafter_pass.py", "--drafter", str(model_dirs["dflash"]), "--verifier",
                    str(model_dirs["verifier"]), "--verifier-dtype", "float32", "--dtype", "float32,int8",
                    "--prefix", "6,20", "--reps", "4", "--trim", "1", "--warmup", "1", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    table = json.loads(out.read_text())["ms_per_pass"]
    assert set(table) == {"6", "20"} and all(set(row) == {"float32", "int8"} for row in table.values())
    assert all(ms > 0 for row in table.values() for ms in row.values())


def test_the_kept_features_are_one_pass_over_the_kept_sequence():
    """``Verifier.record`` keeps, block after block — chains, trees, rejected drafts, past its buffer's first 256
    rows — exactly the hidden states one pass over the kept sequence gives (what the drafter reads as its context)."""
    from align.features import FeatureTap
    from align.trees import TreeShape

    verifier = verifier_model(64, hidden=32, layers=3, heads=2, max_len=1024, seed=4).double().eval()
    model = dflash_model(verifier.config, [0, 1], MASK, layers=1, intermediate=64, kv_heads=1, seed=104).double()
    drafter = DFlashDrafter(model.eval(), verifier, 64)
    checker = Verifier(verifier)
    snapshots = []
    original = drafter.marginals

    def snapshot(prefix, gamma, *args, **kwargs):
        snapshots.append((prefix[0].tolist(), checker.features.clone()))
        return original(prefix, gamma, *args, **kwargs)

    drafter.marginals = snapshot
    rng = random.Random(0)
    for tree in (None, TreeShape(6, 4, 2)):
        prompt = [rng.randrange(4, 64) for _ in range(240)]
        SpeculativeDecoder(drafter, checker, []).generate(prompt, 60, 4, tree=tree)
    assert max(features.shape[0] for _, features in snapshots) > 256
    for prefix, features in snapshots[::7] + snapshots[-1:]:
        with FeatureTap(verifier, [0, 1]) as tap, torch.no_grad():
            verifier(input_ids=torch.tensor([prefix[:-1]]))
            expected = tap.take()[0]
        torch.testing.assert_close(features[:len(prefix) - 1], expected)
