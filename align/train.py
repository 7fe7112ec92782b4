"""Streak distillation: fine-tune a diffusion drafter on verifier rollouts so the verifier accepts more of each block.

    python align/train.py recipes/tiny.yaml [section.key=value ...]                # one process (still DeepSpeed)
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 align/train.py recipes/tiny.yaml    # two CPU processes
    deepspeed --num_gpus 8 align/train.py recipes/gemma.yaml                      # eight GPUs

Running the same command again resumes from the newest checkpoint (weights, optimizer, schedule, data position).
Writes into ``run.output_dir``: ``recipe.yaml``, ``metrics.jsonl``, ``checkpoints/step-N/`` and ``final/`` (the
aligned drafter, exported for ``from_pretrained``, with ``meta.json``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the package, not this folder's modules by their bare names
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import dataclasses
import datetime
import functools
import json
import socket
import time
import zlib

import torch
import torch.distributed as dist
import yaml
from tqdm.auto import tqdm

from align.config import NEEDS_TEACHER, Recipe, build_recipe, load_recipe, packing_on, save_recipe
from align.distill.backend import Engine, deepspeed_config, list_checkpoints
from align.distill.denoise import advance, denoise_step
from align.distill.losses import LOSSES, PER_WINDOW, ce_loss, next_token_loss
from align.distill.packing import (make_packed, next_token_labels, offsets_per_call, packed_logits,
                                   packed_teacher_logits)
from align.distill.windows import by_prefix_length, make_windows, window_index
from align.errors import AlignError, run_cli
from align.distill.lora import add_lora
from align.export import export_checkpoint
from align.files import discard_partial, write_text
from align.locks import hold_folder
from align.loading import (check_model_folder, default_device, load_drafter_model, load_tokenizer, load_verifier_model,
                           shared_vocab_size, usable_cores)
from align.metrics import expected_streak, walk_blocks
from align.rollouts import generate_rollouts, rollout_meta
from align.dflash import FAMILY as DFLASH, verifier_fingerprint
from align.dflash.batch import drafted_logits as dflash_drafted, drafter_logits as dflash_logits
from align.dflash.batch import make_batch as make_dflash_batch, training_given, uncommitted
from align.dflash.batch import verifier_pass as dflash_verifier_pass
from align.dflash.cache import FeatureCache, build_cache, cache_key
from align.drafter import FAMILIES
from align.features import check_layers
from align.zoo import check_prompts, resolve

# keys that may change between a run and its resumption; everything else must match
# keys a rerun may change without changing the run (micro_batch_size: the same global batch, exactly accumulated)
RESUMABLE = {"train": {"max_steps", "save_every", "eval_every", "eval_windows", "keep_checkpoints", "micro_batch_size"},
             "data": {"feature_cache"}, "log": "*"}


def main(argv: list[str]) -> int:
    # ----------------------------------------------------------------------------------------- recipe
    parser = argparse.ArgumentParser(prog="align/train.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    out = Path(recipe.run.output_dir)
    check_model_folder(recipe.drafter.path, "drafter")  # every input before anything is started, built or loaded
    check_model_folder(recipe.verifier.path, "verifier")
    check_prompts(recipe.data.prompts)

    # ----------------------------------------------------------------------------------------- processes
    rank, world = init_distributed(recipe.deepspeed.timeout_minutes)
    lead = rank == 0
    recipe = fit_micro_batch(recipe, world, lead)  # before anything costs time
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, usable_cores() // local_world))
    check_run_folder(out, recipe)
    if lead:  # one run per output folder: held until this process exits
        hold_folder(out, "a training run")

    # ----------------------------------------------------------------------------------------- rollouts -> windows
    d = recipe.drafter
    drafter_tokenizer = load_tokenizer(resolve(d.path), "drafter", d.trust_remote_code)
    verifier_tokenizer = load_tokenizer(resolve(recipe.verifier.path), "verifier")
    vocab = shared_vocab_size(drafter_tokenizer, verifier_tokenizer, d.path, recipe.verifier.path)  # what decoding drafts
    rollouts = generate_rollouts(recipe, rank, world, barrier=barrier, progress=lead)
    rows, cut = within_vocab(rollouts.select_columns(["prompt_id", "prompt_ids", "response_ids"]).to_list(), vocab)
    lengths = [len(r["response_ids"]) for r in rows]
    if cut and lead:
        print(f"{cut} rollouts hold tokens past the shared vocabulary of {vocab} (verifier logit rows no tokenizer "
              "names, which the drafter cannot propose): each is cut before its first such token", flush=True)
    held = heldout_rows(rows, recipe.data.heldout_fraction)
    heldout = [i for i in range(len(rows)) if held[i]]
    train_rows = [i for i in range(len(rows)) if not held[i]]
    gamma = recipe.distill.gamma
    if max(lengths, default=0) < gamma:
        raise AlignError(f"distill.gamma ({gamma}) is longer than every rollout (the longest has {max(lengths, default=0)} "
                         "tokens); lower distill.gamma or raise data.max_new_tokens")
    train_pairs = window_index(lengths, train_rows, recipe.distill.stride)
    eval_pairs = whole_rollouts(window_index(lengths, heldout or train_rows[:1], recipe.distill.stride),
                                recipe.train.eval_windows, recipe.run.seed)
    if d.family != DFLASH:  # per window: micro-batches of near prefix lengths (dflash: a rollout's windows together)
        eval_pairs = by_prefix_length(rows, eval_pairs, recipe.data.max_prefix_len)
    data_fingerprint = {"rollouts": rollout_meta(recipe), "windows": len(train_pairs), "heldout_windows": len(eval_pairs)}
    if lead:
        how = "packed: each rollout's windows from one encoder pass" if packing_on(recipe) else "one pass per window"
        print(f"{len(rows)} rollouts: {len(train_pairs)} training windows ({how}), {len(eval_pairs)} held-out "
              f"windows (gamma {gamma})", flush=True)

    # ----------------------------------------------------------------------------------------- models
    teacher = None
    dflash = d.family == DFLASH  # the drafter reads the verifier's hidden states: the verifier runs every batch
    if recipe.distill.objective in NEEDS_TEACHER or dflash:  # whole on every process, before ZeRO-3 could shard it
        teacher, _ = load_verifier_model(recipe.verifier.path, recipe.verifier.dtype, default_device())
        teacher.requires_grad_(False)
    zero3 = Engine.prepare(recipe, world)  # ZeRO-3: parameters are sharded while the model loads
    weights_dtype = "bfloat16" if recipe.deepspeed.bf16 else "float32"
    model, _ = load_drafter_model(d.path, d.family, weights_dtype, d.trust_remote_code)
    mask_id = d.mask_token_id if d.mask_token_id is not None else drafter_tokenizer.mask_token_id
    if dflash:  # the drafter's own config names its mask token and the verifier layers it reads
        mask_id = model.config.mask_token_id if d.mask_token_id is None else d.mask_token_id
        check_layers(teacher, model.config.target_layer_ids)
        data_fingerprint["verifier_fingerprint"] = verifier_fingerprint(teacher)
    elif FAMILIES[d.family].masked and mask_id is None:
        raise AlignError(f"the {d.family} drafter needs a mask token: its tokenizer has none; set drafter.mask_token_id")
    feature_cache = None  # data.feature_cache: every rollout's verifier features, computed once (lead) and mapped
    if dflash and recipe.data.feature_cache:
        sequences = [r["prompt_ids"] + r["response_ids"] for r in rows]
        key = cache_key(data_fingerprint["verifier_fingerprint"], next(teacher.parameters()).dtype,
                        model.config.target_layer_ids, sequences)
        if lead:
            build_cache(teacher, model.config.target_layer_ids, sequences, key)
        barrier()
        feature_cache = FeatureCache(key)
    if d.freeze_embeddings:
        freeze_embeddings(model)
    if recipe.lora.r:
        torch.manual_seed(recipe.run.seed)
        lora = recipe.lora
        model = add_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules)
    if lead:  # the inputs are good: from here on the folder holds this recipe's run
        out.mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, out / "recipe.yaml")
    engine = Engine(model, recipe, world)
    loss_fn, temperature = objective_fn(recipe), recipe.distill.temperature
    next_weight = recipe.distill.next_token_weight  # the prefix pass's next-token term (packed batches)

    packed = packing_on(recipe)  # training windows share their rollout's encoder pass; evaluation stays per window

    def batch_of(pairs: torch.Tensor, pack: bool = False, given: torch.Tensor | None = None):
        if dflash:  # every window of a rollout in one pass, for training and evaluation alike
            return make_dflash_batch(rows, pairs, gamma, given).to(engine.device)
        make = make_packed if pack else make_windows
        return make(rows, pairs, gamma, recipe.data.max_prefix_len, d.family, mask_id, vocab, recipe.run.seed,
                    canvas_seed=recipe.distill.canvas_seed).to(engine.device)

    def forward(batch, self_conditioning=None, next_token=False):
        """The drafter's logits over its whole vocabulary (what self-conditioning reads); with ``next_token``, also
        its prefix pass's next-token logits (packed: at every response token; per window: after each prefix)."""
        if dflash:  # one verifier pass gives the features (and the objective's teacher logits: batch.teacher)
            if feature_cache is not None:
                hidden = feature_cache.take(batch.rollouts.tolist(), batch.ids.shape[1]).to(engine.device)
            else:
                hidden, batch.teacher = dflash_verifier_pass(teacher, model.config.target_layer_ids, batch, vocab,
                                                             recipe.distill.objective in NEEDS_TEACHER)
            return dflash_logits(engine.engine, teacher.get_input_embeddings(), teacher.get_output_embeddings(),
                                 batch, hidden, mask_id, vocab)
        if hasattr(batch, "slots"):
            return packed_logits(engine.engine, batch, self_conditioning, next_token)
        return FAMILIES[d.family].canvas_logits(engine.engine, batch.prefix, batch.prefix_mask, batch.canvas,
                                                self_conditioning, next_token=next_token)

    def drafted(batch) -> torch.Tensor:
        """The logits decoding drafts a block of ``batch``'s windows from: the canvas's, the first row the encoder's
        next-token prediction with ``distill.first_token: encoder``; dflash: its T passes, left to right."""
        if dflash:
            return dflash_drafted(forward, batch, recipe.distill.denoise_steps)
        if recipe.distill.first_token == "canvas":
            return forward(batch)
        logits, first = forward(batch, next_token=True)
        return torch.cat([first[:, None], logits[:, 1:]], dim=1)

    # ----------------------------------------------------------------------------------------- resume
    checkpoints = out / "checkpoints"
    if lead and checkpoints.is_dir():  # a save that a crash cut short: never resumed from, removed with a notice
        for partial in sorted(checkpoints.glob(".step-*.partial")):
            discard_partial(partial, f"checkpoint {partial.name[1:-len('.partial')]}")
    barrier()
    state = {"step": 0, "heldout": {}, "data_fingerprint": data_fingerprint}
    found = list_checkpoints(checkpoints)
    if found:
        state = engine.load(found[-1])
        if lead:
            print(f"resuming from {found[-1]} (step {state['step']})", flush=True)
    metrics = MetricsLog(out / "metrics.jsonl", recipe, lead, state["step"])

    # ----------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate() -> dict:
        """Held-out windows, drafted as decoding drafts them: E[streak] under q at the deployment temperature, greedy
        streak, mean q per position."""
        engine.train(False)
        mine = eval_pairs[rank::world]
        sums = torch.zeros(3 + gamma, dtype=torch.float64)
        streaks = torch.zeros(len(eval_pairs), dtype=torch.float64)  # each window's greedy streak, for walk_blocks
        for lo in range(0, len(mine), recipe.train.micro_batch_size):
            batch = batch_of(mine[lo:lo + recipe.train.micro_batch_size])
            logits = drafted(batch)[..., :vocab].float()
            valid = batch.labels >= 0
            logq = (logits / temperature).log_softmax(-1).gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
            q = logq.exp() * valid
            greedy = ((logits.argmax(-1) == batch.labels) & valid).long().cumprod(-1).sum(-1)
            sums[0] += len(batch.labels)
            sums[1] += float(expected_streak(q).sum())
            sums[2] += float(greedy.sum())
            sums[3:] += q.sum(0).double().cpu()
            streaks[rank::world][lo:lo + len(greedy)] = greedy.double().cpu()
        all_reduce(sums)
        all_reduce(streaks)
        engine.train(True)
        n = max(1.0, float(sums[0]))
        result = {"expected_streak": float(sums[1]) / n, "greedy_streak": float(sums[2]) / n,
                  "q_per_position": [round(float(x) / n, 4) for x in sums[3:]]}
        if recipe.distill.stride == 1:  # every offset of each held-out rollout: walk them as greedy decoding does
            first = 1 if dflash else 0  # the dflash drafter's first block follows the verifier's prompt pass
            blocks = [walk_blocks(s, first, recipe.data.max_new_tokens) for s in streaks_by_rollout(eval_pairs, streaks)]
            result["decoded_accepted"] = sum(a for _, a in blocks) / max(1, sum(b for b, _ in blocks))
        return result

    if "before" not in state["heldout"]:
        state["heldout"]["before"] = evaluate()
        metrics.write({"step": 0, "split": "eval", **state["heldout"]["before"]})

    # ----------------------------------------------------------------------------------------- training loop
    t = recipe.train
    accumulation = engine.accumulation
    order = WindowOrder(len(train_pairs), recipe.run.seed, rollout_spans(train_pairs) if packed else None,
                        recipe.data.group_size or offsets_per_call(gamma))
    bar = tqdm(total=t.max_steps, initial=state["step"], desc="train", disable=not lead, dynamic_ncols=True)
    engine.train(True)
    while state["step"] < t.max_steps:
        step = state["step"]
        torch.manual_seed(zlib.crc32(f"{recipe.run.seed}/{step}/{rank}".encode()))  # dropout: the same on resume
        start = time.perf_counter()
        windows = train_pairs[order.take(step * t.global_batch_size, t.global_batch_size)]
        if not packed:  # micro-batches of near prefix lengths pad less; the batch's sums stay the same
            windows = by_prefix_length(rows, windows, recipe.data.max_prefix_len)
        given = None  # dflash, T > 1: per window, the mask rows that hold their labels (the pass it trains)
        if dflash and recipe.distill.denoise_steps > 1:
            valid = torch.tensor([min(gamma, lengths[row] - t) for row, t in windows.tolist()])
            draw = torch.Generator().manual_seed(zlib.crc32(f"given/{recipe.run.seed}/{step}".encode()))
            given = training_given(valid, gamma, recipe.distill.denoise_steps, draw)
        dens = denominators(windows, lengths, gamma, recipe, given)  # known from the labels alone, for the whole batch
        next_den = next_token_denominator(windows, lengths, t.micro_batch_size) if next_weight else 1.0
        share = objective_share(recipe, step)  # of the objective; cross-entropy takes the rest, plus ce_weight
        ce_share = (1.0 - share) + recipe.distill.ce_weight
        total = torch.zeros(1, dtype=torch.float64)
        for micro in range(accumulation):
            lo = (micro * world + rank) * t.micro_batch_size
            batch = batch_of(windows[lo:lo + t.micro_batch_size], pack=packed,
                             given=None if given is None else given[lo:lo + t.micro_batch_size])
            k, self_conditioning = 0 if dflash else denoise_step(recipe.distill.denoise_steps, recipe.run.seed, step,
                                                                 micro), None
            if k:  # T > 1: the canvases decoding has at step k (align/distill/denoise.py)
                noise = torch.Generator(engine.device).manual_seed(zlib.crc32(f"{recipe.run.seed}/{step}/{micro}/"
                                                                              f"{rank}".encode()))
                batch, self_conditioning = advance(forward, batch, k, recipe.distill.denoise_steps,
                                                   FAMILIES[d.family].masked, vocab, noise)
            logits = forward(batch, self_conditioning, next_token=bool(next_weight))
            logits, next_logits = logits if next_weight else (logits, None)
            logits, labels = logits[..., :vocab], batch.labels
            if dflash:  # a later pass of T: the rows it drafts, as a block of their own
                labels, logits, batch.teacher = uncommitted(batch.given, labels, logits, batch.teacher)
            loss = torch.zeros((), device=logits.device)
            if next_weight:  # the prefix pass as a next-token predictor, every response token a label
                term = next_token_loss(next_logits[..., :vocab], next_token_labels(batch)[1], temperature)
                loss = loss + next_weight * term.num / next_den
            if share:
                target = None
                if dflash:
                    target = batch.teacher  # from the pass that gave the features
                elif teacher is not None:
                    target = (packed_teacher_logits if packed else teacher_logits)(teacher, batch, vocab)
                term = loss_fn(logits, labels, temperature, target)
                loss = loss + share * term.num / dens[0]
            if ce_share:
                loss = loss + ce_share * ce_loss(logits, labels, temperature).num / dens[1]
            if not all_finite(loss):
                raise AlignError(stop_on_nonfinite(checkpoints, step, lead))
            engine.backward(loss * accumulation * world)  # DeepSpeed averages over micro-batches and processes
            engine.step()
            total += float(loss.detach())
        all_reduce(total)
        state["step"] = step + 1
        bar.update(1)
        if state["step"] % recipe.log.every == 0 or state["step"] == t.max_steps:
            record = {"step": state["step"], "split": "train", "loss": float(total[0]), "lr": engine.lr,
                      "windows_per_s": t.global_batch_size / (time.perf_counter() - start)}
            metrics.write(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
        if state["step"] % t.eval_every == 0 or state["step"] == t.max_steps:
            state["heldout"]["after"] = evaluate()
            metrics.write({"step": state["step"], "split": "eval", **state["heldout"]["after"]})
        if state["step"] % t.save_every == 0 or state["step"] == t.max_steps:
            saved = engine.save(checkpoints, state["step"], state, t.keep_checkpoints)
            if lead:
                save_recipe(recipe, saved / "recipe.yaml")
    bar.close()

    # ----------------------------------------------------------------------------------------- export
    barrier()
    if lead:
        # LoRA: float32, or updates below bf16's resolution at the base weights would round away in the merge
        final = export_checkpoint(list_checkpoints(checkpoints)[-1], out / "final",
                                  "float32" if recipe.lora.r else weights_dtype)
        before, after = state["heldout"]["before"], state["heldout"].get("after", state["heldout"]["before"])
        print(f"held-out E[streak] {before['expected_streak']:.3f} -> {after['expected_streak']:.3f}, greedy streak "
              f"{before['greedy_streak']:.3f} -> {after['greedy_streak']:.3f}; aligned drafter in {final}", flush=True)
    metrics.close()
    barrier()
    del zero3
    return 0


# --------------------------------------------------------------------------------------------- helpers


def fit_micro_batch(recipe: Recipe, world: int, lead: bool) -> Recipe:
    """The recipe for ``world`` processes: a global batch smaller than micro-batch × processes is split evenly over
    the processes (with a notice), so a recipe written for one process runs unchanged on several; a batch that does
    not divide is refused now, before rollouts or models cost time."""
    t = recipe.train
    if t.micro_batch_size * world > t.global_batch_size and t.global_batch_size % world == 0:
        micro = t.global_batch_size // world
        if lead:
            print(f"train.micro_batch_size {t.micro_batch_size} x {world} processes is more than "
                  f"train.global_batch_size {t.global_batch_size}: {micro} windows per process", flush=True)
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(t, micro_batch_size=micro))
    deepspeed_config(recipe, world)  # raises the one-line error for a batch that does not divide
    return recipe


def freeze_embeddings(model) -> None:
    """No gradient for the token embeddings and the output head (tied or not)."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.weight.requires_grad_(False)


def within_vocab(rows: list[dict], vocab: int) -> tuple[list[dict], int]:
    """Rollouts cut before their first token id >= ``vocab`` (one the drafter's distribution cannot hold); returns
    the rows and how many were cut. Random-weight verifiers emit such ids; trained ones practically never do."""
    cut = 0
    for row in rows:
        stop = next((i for i, t in enumerate(row["response_ids"]) if t >= vocab), None)
        if stop is not None:
            row["response_ids"] = row["response_ids"][:stop]
            cut += 1
    return rows, cut


def heldout_rows(rows: list[dict], fraction: float) -> list[bool]:
    """Which rollout rows are held out: a fixed fraction of prompts, chosen by a hash of the prompt id."""
    return [zlib.crc32(str(r["prompt_id"]).encode()) % 10_000 < int(fraction * 10_000) for r in rows]


class WindowOrder:
    """The data order: epoch e is a seeded permutation of all windows; step s takes the next global batch.

    With ``spans`` (packed training: (start, length) of each rollout's windows) epoch e cuts each rollout's windows,
    shuffled, into groups of ``group`` and permutes the groups: every window once per epoch as before, each group
    sharing one encoder pass, and a micro-batch still drawing on many rollouts.
    """

    def __init__(self, count: int, seed: int, spans: list[tuple[int, int]] | None = None, group: int = 1):
        self.count, self.seed, self.spans, self.group, self.cache = count, seed, spans, group, {}

    def _epoch(self, epoch: int) -> torch.Tensor:
        if epoch not in self.cache:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            if self.spans is None:
                order = torch.randperm(self.count, generator=generator)
            else:
                groups = [chunk for start, length in self.spans
                          for chunk in (start + torch.randperm(length, generator=generator)).split(self.group)]
                order = torch.cat([groups[i] for i in torch.randperm(len(groups), generator=generator)])
            self.cache = {epoch: order}
        return self.cache[epoch]

    def take(self, start: int, size: int) -> torch.Tensor:
        out = []
        while size:
            epoch, offset = divmod(start, self.count)
            chunk = self._epoch(epoch)[offset:offset + size]
            out.append(chunk)
            start, size = start + len(chunk), size - len(chunk)
        return torch.cat(out)


def whole_rollouts(pairs: torch.Tensor, limit: int, seed: int) -> torch.Tensor:
    """The windows of whole rollouts of ``pairs`` (grouped by rollout, as window_index gives), in a seeded order,
    as many rollouts as fit in ``limit`` windows (at least one): every offset of a rollout is there to walk."""
    spans = rollout_spans(pairs)
    taken, total = [], 0
    for i in torch.randperm(len(spans), generator=torch.Generator().manual_seed(seed)).tolist():
        start, length = spans[i]
        if taken and total + length > limit:
            continue
        taken.append(pairs[start:start + length])
        total += length
    return torch.cat(taken) if taken else pairs[:0]


def streaks_by_rollout(pairs: torch.Tensor, streaks: torch.Tensor) -> list[list[int]]:
    """Per rollout of ``pairs`` (rows of (rollout row, offset), any order), its windows' ``streaks`` by offset."""
    by_row: dict[int, dict[int, int]] = {}
    for (row, t), a in zip(pairs.tolist(), streaks.tolist()):
        by_row.setdefault(row, {})[t] = int(a)
    return [[offsets[t] for t in sorted(offsets)] for offsets in by_row.values()]


def rollout_spans(pairs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each rollout's run of windows in ``pairs`` (grouped by rollout, as window_index gives)."""
    rows = pairs[:, 0].tolist()
    starts = [i for i in range(len(rows)) if i == 0 or rows[i] != rows[i - 1]]
    return [(start, end - start) for start, end in zip(starts, starts[1:] + [len(rows)])]


def objective_fn(recipe: Recipe):
    """The recipe's loss with its own keys bound: ``fn(logits, labels, temperature, teacher) -> LossTerm``."""
    d = recipe.distill
    options = {"streak_ce": {"smoothing": d.smoothing}, "margin": {"smoothing": d.smoothing},
               "first_failure": {"after_failure": d.after_failure}, "decayed_ce": {"decay": d.decay}}.get(d.objective, {})
    return functools.partial(LOSSES[d.objective], **options)


def objective_share(recipe: Recipe, step: int) -> float:
    """Weight of the objective at ``step`` (cross-entropy gets one minus it): 1 throughout (constant), 0 before
    schedule_fraction · max_steps then 1 (switch), or rising linearly from 0 to 1 over that span (anneal)."""
    d, span = recipe.distill, recipe.distill.schedule_fraction * recipe.train.max_steps
    if d.schedule == "constant" or span <= 0:
        return 1.0
    if d.schedule == "switch":
        return 0.0 if step < span else 1.0
    return min(1.0, step / span)


def denominators(windows: torch.Tensor, lengths: list[int], gamma: int, recipe: Recipe,
                 given: torch.Tensor | None = None) -> torch.Tensor:
    """(den of the objective, den of cross-entropy) for a whole global batch, from the window lengths alone (less
    the rows that hold their labels, ``given``)."""
    valid = torch.tensor([min(gamma, lengths[row] - t) for row, t in windows.tolist()], dtype=torch.float64)
    if given is not None:
        valid = valid - given.double()
    per_window = recipe.distill.objective in PER_WINDOW
    return torch.stack([torch.tensor(float(len(windows))) if per_window else valid.sum(), valid.sum()]).float()


def next_token_denominator(windows: torch.Tensor, lengths: list[int], micro_batch_size: int) -> float:
    """Response tokens the next-token term reads in a whole global batch: each micro-batch encodes each rollout it
    holds windows of once (a rollout split over two micro-batches counts twice)."""
    return float(sum(lengths[row] for lo in range(0, len(windows), micro_batch_size)
                     for row in set(windows[lo:lo + micro_batch_size, 0].tolist())))


@torch.no_grad()
def teacher_logits(verifier, batch, vocab: int) -> torch.Tensor:
    """The verifier's logits at each block position, teacher-forced on the rollout tokens: (B, γ, V)."""
    labels = batch.labels.clamp(min=0)
    ids = torch.cat([batch.prefix, labels[:, :-1]], dim=1)
    mask = torch.cat([batch.prefix_mask, torch.ones_like(labels[:, :-1])], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = verifier(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return logits[:, batch.prefix.shape[1] - 1:, :vocab]


class MetricsLog:
    """``metrics.jsonl`` always (lines after a resumed step are dropped), wandb when the recipe turns it on."""

    def __init__(self, path: Path, recipe: Recipe, lead: bool, resumed_step: int):
        self.path, self.lead, self.wandb = path, lead, None
        if not lead:
            return
        if path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resumed_step]
            write_text(path, "".join(line + "\n" for line in kept))
        if recipe.log.wandb:
            import wandb

            self.wandb = wandb.init(project=recipe.log.wandb_project, name=recipe.run.name, mode=recipe.log.wandb_mode,
                                    dir=str(path.parent), config=recipe.to_dict(), resume="allow",
                                    id=f"{recipe.run.name}-{recipe.fingerprint(('run', 'drafter', 'distill'))}")

    def write(self, record: dict) -> None:
        if not self.lead:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            prefix = record["split"] + "/"
            self.wandb.log({prefix + k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                           step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def check_run_folder(out: Path, recipe: Recipe) -> None:
    """Refuse to write into a folder that holds a run of a different recipe (nothing there is touched)."""
    saved = out / "recipe.yaml"
    if not saved.is_file():
        if out.is_dir() and any(out.iterdir()):
            raise AlignError(f"run.output_dir {out} is not empty and holds no run of align; choose another folder")
        return
    try:
        old = build_recipe(yaml.safe_load(saved.read_text())).to_dict()
    except (AlignError, yaml.YAMLError):
        raise AlignError(f"{saved} is not a valid recipe; {out} holds something else: choose another run.output_dir")
    new = recipe.to_dict()
    for section, keys in new.items():
        for key, value in keys.items():
            allowed = RESUMABLE.get(section, ())
            if allowed != "*" and key not in allowed and old[section][key] != value:
                raise AlignError(f"{out} holds a run of a different recipe ({section}.{key} was {old[section][key]!r}, "
                                 f"now {value!r}); choose another run.output_dir or delete that folder")


def init_distributed(timeout_minutes: int = 120) -> tuple[int, int]:
    """Start torch.distributed through DeepSpeed (gloo on CPU); a plain ``python`` run is one process of one.
    ``timeout_minutes``: how long a collective waits (torch's default, 10 to 30 minutes, is shorter than a rollout
    shard can take)."""
    import deepspeed

    if "RANK" not in os.environ:  # not started by a launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if not dist.is_initialized():
        if not torch.cuda.is_available() and os.environ["WORLD_SIZE"] == "1":
            # DeepSpeed's shared-memory all-reduce speeds up CPU collectives between processes; one process has
            # none, and loading the op JIT-compiles it on first use (about 43 s) and then waits on a lock every
            # DeepSpeed process on the machine shares: skipped, gloo serves
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


def stop_on_nonfinite(checkpoints: Path, step: int, lead: bool) -> str:
    """The weights after ``step`` steps gave a non-finite loss: set their checkpoint aside (renamed, not deleted)
    and say which checkpoint a rerun will resume from."""
    suspect = checkpoints / f"step-{step}"
    barrier()
    if lead and suspect.is_dir():
        suspect.rename(checkpoints / f"step-{step}.nonfinite")
    barrier()
    good = list_checkpoints(checkpoints)
    where = f"the last good checkpoint is {good[-1]}" if good else "there is no good checkpoint to resume from"
    aside = f" ({suspect.name} was set aside as {suspect.name}.nonfinite)" if suspect.exists() or lead else ""
    return (f"the loss is not finite at step {step + 1}; stopped without saving: {where}{aside}. Lower train.lr or "
            "check the rollouts, then run again")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce(tensor: torch.Tensor) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        device_tensor = tensor.to("cuda") if torch.cuda.is_available() else tensor
        dist.all_reduce(device_tensor)
        tensor.copy_(device_tensor.cpu())


def all_finite(loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every process (all stop together)."""
    flag = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], dtype=torch.float64)
    all_reduce(flag)
    return float(flag) == 0.0


if __name__ == "__main__":
    run_cli(main)
