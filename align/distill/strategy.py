"""How each kind of drafter trains: its batches, its forward pass, what decoding drafts from it, and its teacher.

One class per way of training, behind one small interface; the trainer (``align/train.py``) and the benchmarks call
:func:`train_step` and :func:`heldout_metrics` with whichever the recipe needs (:func:`strategy_for`):

| strategy | drafters | a micro-batch |
|---|---|---|
| :class:`WindowStrategy` | bidirectional diffusion drafters (``mdlm``, ``dream``; ``diffusiongemma`` unpacked) | each window its own prefix and canvas, ordered by prefix length |
| :class:`PackedStrategy` | a causal prefix encoder (``diffusiongemma``) | every window of a rollout from one encoder pass (``align/distill/packing.py``) |
| :class:`FeatureStrategy` | drafters over the verifier's hidden states (``dflash``) | every window of a rollout in one drafter pass, the verifier's features from its pass or the cache |

A strategy's :meth:`~Strategy.train_logits` is the only part that differs in a training step; the objective, its
schedule against cross-entropy, the next-token term and exact accumulation are :meth:`Strategy.micro_loss`'s, the
same for all.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.profiler import record_function

from align.config import Recipe, packing_on
from align.distill.denoise import advance, denoise_step
from align.distill.distributed import all_finite, all_reduce
from align.distill.losses import OBJECTIVES, ce_loss, next_token_loss
from align.distill.packing import make_packed, next_token_labels, packed_logits, packed_teacher_logits
from align.distill.windows import by_prefix_length, make_windows, teacher_logits
from align.drafters.diffusion import FAMILIES
from align.errors import AlignError
from align.families import traits
from align.metrics import expected_streak, walk_blocks


def objective_share(recipe: Recipe, step: int) -> float:
    """Weight of the objective at ``step`` (cross-entropy gets one minus it): 1 throughout (constant), 0 before
    schedule_fraction · max_steps then 1 (switch), or rising linearly from 0 to 1 over that span (anneal)."""
    d, span = recipe.distill, recipe.distill.schedule_fraction * recipe.train.max_steps
    if d.schedule == "constant" or span <= 0:
        return 1.0
    if d.schedule == "switch":
        return 0.0 if step < span else 1.0
    return min(1.0, step / span)


class NonFiniteLoss(Exception):
    """The loss of a step was not finite on some process (every process raises it together, before any update)."""


class Strategy:
    """What a training step needs of a drafter kind. ``model`` is what runs the drafter (the DeepSpeed engine in
    training, the bare model in a benchmark); ``rows`` the rollouts (prompt_ids, response_ids); ``verifier`` the
    frozen verifier when the objective or the kind reads it, moved to ``device`` (default: where the model's weights
    are), where every batch is collated."""

    name: str
    packs = False  # the data order keeps each rollout's windows together (groups that share one pass)

    def __init__(self, recipe: Recipe, model: Any, rows: list[dict], vocab: int, mask_id: int | None,
                 verifier: Any = None, feature_cache: Any = None, device: Any = None):
        self.recipe, self.model, self.rows, self.vocab, self.mask_id = recipe, model, rows, vocab, mask_id
        self.feature_cache = feature_cache
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        # the frozen verifier runs where the drafter runs (the engine's device): its passes read the same batches
        self.verifier = None if verifier is None else verifier.to(self.device)
        self.lengths = [len(r["response_ids"]) for r in rows]
        self.gamma = recipe.distill.gamma
        self.objective = OBJECTIVES[recipe.distill.objective]
        self.loss_fn = self.objective.bind(recipe.distill)
        self.temperature = recipe.distill.temperature

    # ------------------------------------------------------------------------------------------ the kind's own

    @classmethod
    def needs_verifier(cls, recipe: Recipe) -> bool:
        """Whether training runs the verifier (loaded whole on every process, before ZeRO-3 could shard it): for an
        objective that reads its logits."""
        return OBJECTIVES[recipe.distill.objective].needs_teacher

    @classmethod
    def prepare(cls, recipe: Recipe, model: Any, verifier: Any, tokenizer: Any, rows: list[dict],
                lead: bool = True) -> dict[str, Any]:
        """What the kind settles before training, from the loaded drafter: ``mask_id`` (the recipe's, else the
        tokenizer's; refused where the family masks and there is none), ``fingerprint`` (what the run's data
        fingerprint adds) and ``feature_cache``."""
        d = recipe.drafter
        mask_id = d.mask_token_id if d.mask_token_id is not None else tokenizer.mask_token_id
        if traits(d.family).masked and mask_id is None:
            raise AlignError(f"the {d.family} drafter needs a mask token: its tokenizer has none; set "
                             "drafter.mask_token_id")
        return {"mask_id": mask_id, "fingerprint": {}, "feature_cache": None}

    def batch(self, pairs: torch.Tensor, given: torch.Tensor | None = None, train: bool = False) -> Any:
        """Windows ``pairs`` (rows of (rollout row, offset)) collated on the device; ``train``: the training layout."""
        raise NotImplementedError

    def logits(self, batch: Any, self_conditioning: torch.Tensor | None = None, next_token: bool = False) -> Any:
        """The drafter's logits (N, γ, V_model) for ``batch``'s windows; with ``next_token``, also its prefix pass's
        next-token logits: ``(logits, those)``."""
        raise NotImplementedError

    def drafted(self, batch: Any) -> torch.Tensor:
        """The logits decoding drafts each window's block from (N, γ, V_model)."""
        return self.logits(batch)

    def arrange(self, windows: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A global batch's windows in the order its micro-batches are cut, and per window the mask rows that hold
        their labels (a later pass of T; None: none)."""
        return windows, None

    def eval_order(self, pairs: torch.Tensor) -> torch.Tensor:
        """The held-out windows in the order their micro-batches are cut."""
        return pairs

    def targets(self, batch: Any) -> torch.Tensor:
        """The labels (N, γ) as indices into the drafted logits' last dimension (-100: none to learn)."""
        return batch.labels

    def train_logits(self, batch: Any, step: int, micro: int, next_token: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One micro-batch's training pass: (logits (N, γ, V), labels (N, γ), the verifier's logits at the same
        positions when the objective reads them (else None), the next-token logits with ``next_token``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ shared by all

    def denominators(self, windows: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
        """(den of the objective, den of cross-entropy) for a whole global batch, from the window lengths alone (less
        the rows that hold their labels, ``given``)."""
        valid = torch.tensor([self.label_count(row, t) for row, t in windows.tolist()], dtype=torch.float64,
                             device="cpu")
        if given is not None:
            valid = valid - given.double()
        windows_den = torch.tensor(float(len(windows)), device="cpu")
        return torch.stack([windows_den if self.objective.per_window else valid.sum(), valid.sum()]).float()

    def label_count(self, row: int, t: int) -> int:
        """How many of window (row, t)'s γ positions have a label: the response's tokens left."""
        return min(self.gamma, self.lengths[row] - t)

    def next_token_denominator(self, windows: torch.Tensor, micro_batch_size: int) -> float:
        """Response tokens the next-token term reads in a whole global batch: each micro-batch encodes each rollout
        it holds windows of once (a rollout split over two micro-batches counts twice)."""
        return float(sum(self.lengths[row] for lo in range(0, len(windows), micro_batch_size)
                         for row in set(windows[lo:lo + micro_batch_size, 0].tolist())))

    def share(self, step: int) -> float:
        return objective_share(self.recipe, step)

    def micro_loss(self, batch: Any, step: int, micro: int, dens: torch.Tensor, next_den: float) -> torch.Tensor:
        """One micro-batch's share of the global batch's loss:

            share · objective.num / dens[0] + (1 − share + ce_weight) · CE.num / dens[1]
              + next_token_weight · next-token CE.num / next_den

        whose sum over micro-batches and processes is the loss of the whole global batch (exact accumulation)."""
        d = self.recipe.distill
        share = self.share(step)
        ce_share = (1.0 - share) + d.ce_weight
        logits, labels, teacher, next_logits = self.train_logits(batch, step, micro, bool(d.next_token_weight))
        loss = torch.zeros((), device=logits.device)
        if d.next_token_weight:  # the prefix pass as a next-token predictor, every response token a label
            term = next_token_loss(next_logits[..., :self.vocab], next_token_labels(batch)[1], self.temperature)
            loss = loss + d.next_token_weight * term.num / next_den
        if share:
            loss = loss + share * self.loss_fn(logits, labels, self.temperature, teacher).num / dens[0]
        if ce_share:
            loss = loss + ce_share * ce_loss(logits, labels, self.temperature).num / dens[1]
        return loss


class WindowStrategy(Strategy):
    """Each window its own prefix and canvas (any diffusion family): micro-batches of near prefix lengths, T > 1
    trained at a step of the denoising schedule (``align/distill/denoise.py``)."""

    name = "window"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.family = FAMILIES[self.recipe.drafter.family]

    def batch(self, pairs, given=None, train=False):
        d = self.recipe
        return make_windows(self.rows, pairs, self.gamma, d.data.max_prefix_len, self.family.name, self.mask_id,
                            self.vocab, d.run.seed, canvas_seed=d.distill.canvas_seed).to(self.device)

    def logits(self, batch, self_conditioning=None, next_token=False):
        return self.family.canvas_logits(self.model, batch.prefix, batch.prefix_mask, batch.canvas,
                                         self_conditioning, next_token=next_token)

    def drafted(self, batch):
        """The canvas's logits; with ``distill.first_token: encoder`` the first row is the prefix pass's next-token
        prediction."""
        if self.recipe.distill.first_token == "canvas":
            return self.logits(batch)
        logits, first = self.logits(batch, next_token=True)
        return torch.cat([first[:, None], logits[:, 1:]], dim=1)

    def arrange(self, windows, step):
        # micro-batches of near prefix lengths pad less; the batch's sums stay the same
        return by_prefix_length(self.rows, windows, self.recipe.data.max_prefix_len), None

    def eval_order(self, pairs):
        return by_prefix_length(self.rows, pairs, self.recipe.data.max_prefix_len)

    def teacher_logits(self, batch) -> torch.Tensor:
        return teacher_logits(self.verifier, batch, self.vocab)

    def train_logits(self, batch, step, micro, next_token):
        d = self.recipe.distill
        k, self_conditioning = denoise_step(d.denoise_steps, self.recipe.run.seed, step, micro), None
        if k:  # T > 1: the canvases decoding has at step k (align/distill/denoise.py)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            noise = torch.Generator(self.device).manual_seed(
                zlib.crc32(f"{self.recipe.run.seed}/{step}/{micro}/{rank}".encode()))
            batch, self_conditioning = advance(lambda b, sc: self.logits(b, sc), batch, k, d.denoise_steps,
                                               self.family.masked, self.vocab, noise)
        out = self.logits(batch, self_conditioning, next_token=next_token)
        logits, next_logits = out if next_token else (out, None)
        teacher = self.teacher_logits(batch) if self.objective.needs_teacher and self.share(step) else None
        return logits[..., :self.vocab], batch.labels, teacher, next_logits


class PackedStrategy(WindowStrategy):
    """Every window of a rollout from one pass of a causal prefix encoder (``align/distill/packing.py``): training
    batches are packed, held-out windows stay one per window (as decoding drafts them)."""

    name = "packed"
    packs = True

    def batch(self, pairs, given=None, train=False):
        if not train:
            return super().batch(pairs)
        d = self.recipe
        return make_packed(self.rows, pairs, self.gamma, d.data.max_prefix_len, self.family.name, self.mask_id,
                           self.vocab, d.run.seed, canvas_seed=d.distill.canvas_seed).to(self.device)

    def logits(self, batch, self_conditioning=None, next_token=False):
        if hasattr(batch, "slots"):
            return packed_logits(self.model, batch, self_conditioning, next_token)
        return super().logits(batch, self_conditioning, next_token)

    def arrange(self, windows, step):
        return windows, None  # the order's groups share their rollout's encoder pass

    def teacher_logits(self, batch) -> torch.Tensor:
        return packed_teacher_logits(self.verifier, batch, self.vocab)


class FeatureStrategy(Strategy):
    """A drafter over the verifier's hidden states (``align/dflash/``): every window of a rollout in one drafter
    pass, training and evaluation alike; the features come from the verifier's pass over the micro-batch (which
    also gives the objective's teacher logits) or from the feature cache; T > 1 passes trained one pass per
    window, the rows before it holding their labels."""

    name = "dflash"
    packs = True

    @classmethod
    def needs_verifier(cls, recipe: Recipe) -> bool:
        return True  # its features are the drafter's context

    @classmethod
    def prepare(cls, recipe, model, verifier, tokenizer, rows, lead=True):
        """The drafter's own config names its mask token and the verifier layers it reads (refused where the verifier
        has no such layer); the run records the verifier's fingerprint (the export refuses any other verifier); with
        ``data.feature_cache``, every rollout's features are computed once (the lead process) and mapped."""
        from align.dflash.cache import FeatureCache, build_cache, cache_key, cache_setting, stored_dtype
        from align.distill.distributed import barrier
        from align.drafters.dflash import verifier_fingerprint
        from align.features import check_layers

        d, layers = recipe.drafter, model.config.target_layer_ids
        mask_id = model.config.mask_token_id if d.mask_token_id is None else d.mask_token_id
        check_layers(verifier, layers)
        fingerprint = {"verifier_fingerprint": verifier_fingerprint(verifier)}
        if d.draft_vocab is not None:  # the tokens the responses use most; the export records them in its config
            fingerprint["draft_vocab"] = draft_vocabulary(rows, d.draft_vocab)
            model.config.dflash_config["draft_vocab"] = fingerprint["draft_vocab"]
        feature_cache = None
        if recipe.data.feature_cache:
            sequences = [r["prompt_ids"] + r["response_ids"] for r in rows]
            dtype = next(verifier.parameters()).dtype
            stored = stored_dtype(recipe.data.feature_dtype, dtype)
            named = fingerprint["verifier_fingerprint"], dtype, layers
            key = cache_key(*named, sequences, stored)
            if lead:  # labelled text's features come from its labelling pass where it kept them, shared rows from
                # other caches of this verifier, layers and storage
                build_cache(verifier, layers, sequences, key, known=lambda: labelled_features(recipe, layers, rows),
                            dtype=stored, setting=cache_setting(*named, stored))
            barrier()
            feature_cache = FeatureCache(key)
        return {"mask_id": mask_id, "fingerprint": fingerprint, "feature_cache": feature_cache}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = getattr(self.model, "module", self.model).config
        self.layers = config.target_layer_ids
        self.embed = self.verifier.get_input_embeddings()
        self.head = self.verifier.get_output_embeddings()
        self.draft_vocab, self.lookup = None, None  # the head's rows drafted, and each token's index among them
        if config.draft_vocab:
            self.draft_vocab = torch.tensor(config.draft_vocab, device=self.device)
            self.lookup = torch.full((max(self.vocab, int(self.draft_vocab.max()) + 1) + 1,), -100, dtype=torch.long,
                                     device=self.device)
            self.lookup[self.draft_vocab] = torch.arange(len(self.draft_vocab), device=self.device)

    def label_count(self, row, t):
        """A window of labelled text may know fewer labels than tokens left (align.dflash.batch.window_labels)."""
        from align.dflash.batch import window_labels

        row_data = self.rows[row]
        if row_data.get("label_ids") is None:
            return super().label_count(row, t)
        return len(window_labels(row_data, t, self.gamma, self.recipe.data.text_labels))

    def targets(self, batch):
        """Labels as indices into the draft vocabulary (-100 for a token outside it: never drafted, so never learnt,
        and a miss in the held-out streaks)."""
        if self.lookup is None:
            return batch.labels
        return torch.where(batch.labels >= 0, self.lookup[batch.labels.clamp(min=0)], -100)

    def batch(self, pairs, given=None, train=False):
        from align.dflash.batch import make_batch

        return make_batch(self.rows, pairs, self.gamma, given, self.recipe.data.text_labels).to(self.device)

    def logits(self, batch, self_conditioning=None, next_token=False):
        """One verifier pass gives the features (and the objective's teacher logits: ``batch.teacher``), or the
        feature cache does; then the drafter's pass over every window of every rollout."""
        from align.dflash.batch import drafter_logits, verifier_pass

        if self.feature_cache is not None:
            hidden = self.feature_cache.take(batch.rollouts.tolist(), batch.ids.shape[1]).to(self.device)
        else:
            hidden, batch.teacher = verifier_pass(self.verifier, self.layers, batch, self.vocab,
                                                  self.objective.needs_teacher)
        return drafter_logits(self.model, self.embed, self.head, batch, hidden, self.mask_id, self.vocab,
                              self.draft_vocab)

    def drafted(self, batch):
        """Its T passes, left to right."""
        from align.dflash.batch import drafted_logits

        return drafted_logits(self.logits, batch, self.recipe.distill.denoise_steps)

    def arrange(self, windows, step):
        """Each window trains one of the T passes, drawn uniformly (seeded by run and step)."""
        steps = self.recipe.distill.denoise_steps
        if steps <= 1:
            return windows, None
        from align.dflash.batch import training_given

        valid = torch.tensor([self.label_count(row, t) for row, t in windows.tolist()], device="cpu")
        draw = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"given/{self.recipe.run.seed}/{step}".encode()))
        return windows, training_given(valid, self.gamma, steps, draw)

    def train_logits(self, batch, step, micro, next_token):
        from align.dflash.batch import uncommitted

        logits = self.logits(batch)[..., :self.vocab]
        teacher = batch.teacher if batch.teacher is None or self.draft_vocab is None else \
            batch.teacher[..., self.draft_vocab]
        # a later pass of T: the rows it drafts, as a block of their own
        labels, logits, teacher = uncommitted(batch.given, self.targets(batch), logits, teacher)
        return logits, labels, teacher, None


def draft_vocabulary(rows: list[dict], size: int) -> list[int]:
    """The ``size`` token ids the rollouts' responses use most (ties: the lower id first), sorted."""
    counts = torch.bincount(torch.tensor([t for r in rows for t in r["response_ids"]], dtype=torch.long, device="cpu"))
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))
    return sorted(order[:size])


#: the ways of training, by name
STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (WindowStrategy, PackedStrategy, FeatureStrategy)}


def labelled_features(recipe: Recipe, layers: list[int], rows: list[dict]) -> dict[int, torch.Tensor]:
    """The features the labelling pass kept for the rows of labelled text among ``rows``, by row index (an id that
    two rows share names neither: those are run again)."""
    from collections import Counter

    text = [(i, r["prompt_id"]) for i, r in enumerate(rows) if "label_ids" in r]
    if not text:
        return {}
    from align.labels import text_features

    stored, seen = text_features(recipe, layers), Counter(name for _, name in text)
    return {i: stored[name] for i, name in text if name in stored and seen[name] == 1}


def strategy_for(recipe: Recipe) -> type[Strategy]:
    """The strategy a recipe trains with: a drafter that reads the verifier's features, a packed one, or per window."""
    if traits(recipe.drafter.family).reads_features:
        return FeatureStrategy
    return PackedStrategy if packing_on(recipe) else WindowStrategy


def train_step(strategy: Strategy, engine: Any, windows: torch.Tensor, step: int, micro_batch_size: int,
               rank: int = 0, world: int = 1) -> float:
    """One optimizer step over the global batch ``windows``: its micro-batches (this process's share, the
    strategy's layout) through forward, the loss and backward, DeepSpeed's accumulation and step. Returns the global
    batch's loss (summed over processes); raises :class:`NonFiniteLoss`, on every process together, before a
    non-finite loss updates anything."""
    windows, given = strategy.arrange(windows, step)
    dens = strategy.denominators(windows, given).to(strategy.device)  # from the labels alone, for the whole batch
    next_den = strategy.next_token_denominator(windows, micro_batch_size) if \
        strategy.recipe.distill.next_token_weight else 1.0
    accumulation = engine.accumulation
    total = torch.zeros(1, dtype=torch.float64, device="cpu")
    for micro in range(accumulation):
        lo = (micro * world + rank) * micro_batch_size
        part = slice(lo, lo + micro_batch_size)
        with record_function("align.batch"):  # the phases a profile shows (bench/gpu_check.py)
            batch = strategy.batch(windows[part], None if given is None else given[part], train=True)
        with record_function("align.forward"):
            loss = strategy.micro_loss(batch, step, micro, dens, next_den)
        if not all_finite(loss):
            raise NonFiniteLoss(step)
        with record_function("align.backward"):
            engine.backward(loss * accumulation * world)  # DeepSpeed averages over micro-batches and processes
        with record_function("align.step"):
            engine.step()
        total += float(loss.detach())
    all_reduce(total)
    return float(total[0])


@torch.no_grad()
def heldout_metrics(strategy: Strategy, pairs: torch.Tensor, micro_batch_size: int, rank: int = 0,
                    world: int = 1) -> dict:
    """Held-out windows ``pairs``, drafted as decoding drafts them: E[streak] under q at the deployment temperature,
    the greedy streak, mean q per position, and (every offset of whole rollouts) ``decoded_accepted``, the windows
    walked as greedy decoding walks them."""
    recipe, gamma, vocab = strategy.recipe, strategy.gamma, strategy.vocab
    mine = pairs[rank::world]
    sums = torch.zeros(3 + gamma, dtype=torch.float64, device="cpu")
    streaks = torch.zeros(len(pairs), dtype=torch.float64, device="cpu")  # each window's greedy streak, for walk_blocks
    for lo in range(0, len(mine), micro_batch_size):
        batch = strategy.batch(mine[lo:lo + micro_batch_size])
        logits = strategy.drafted(batch)[..., :vocab].float()
        labels = strategy.targets(batch)
        valid = labels >= 0
        logq = (logits / strategy.temperature).log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        q = logq.exp() * valid
        greedy = ((logits.argmax(-1) == labels) & valid).long().cumprod(-1).sum(-1)
        sums[0] += len(labels)
        sums[1] += float(expected_streak(q).sum())
        sums[2] += float(greedy.sum())
        sums[3:] += q.sum(0).double().cpu()
        streaks[rank::world][lo:lo + len(greedy)] = greedy.double().cpu()
    all_reduce(sums)
    all_reduce(streaks)
    n = max(1.0, float(sums[0]))
    result = {"expected_streak": float(sums[1]) / n, "greedy_streak": float(sums[2]) / n,
              "q_per_position": [round(float(x) / n, 4) for x in sums[3:]]}
    if recipe.distill.stride == 1:  # every offset of each held-out rollout: walk them as greedy decoding does
        from align.distill.data import streaks_by_rollout

        first = 1 if traits(recipe.drafter.family).reads_features else 0  # its first block follows the prompt pass
        blocks = [walk_blocks(s, first, recipe.data.max_new_tokens) for s in streaks_by_rollout(pairs, streaks)]
        result["decoded_accepted"] = sum(a for _, a in blocks) / max(1, sum(b for b, _ in blocks))
    return result
