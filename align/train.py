"""Streak distillation: fine-tune a diffusion drafter on verifier rollouts so the verifier accepts more of each block.

    python align/train.py recipes/tiny.yaml [section.key=value ...]                # one process (still DeepSpeed)
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 align/train.py recipes/tiny.yaml    # two CPU processes
    deepspeed --num_gpus 8 align/train.py recipes/gemma.yaml                      # eight GPUs

Running the same command again resumes from the newest checkpoint (weights, optimizer, schedule, data position).
Writes into ``run.output_dir``: ``recipe.yaml``, ``metrics.jsonl``, ``checkpoints/step-N/`` and ``final/`` (the
aligned drafter, exported for ``from_pretrained``, with ``meta.json``). How each kind of drafter trains (its
batches, its forward, its teacher) is its strategy's business (``align/distill/strategy.py``); this script reads
top to bottom: recipe, processes, rollouts and windows, models, resume, the loop, export.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the package, not this folder's modules by their bare names
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import hashlib
import time
import zlib

import torch
from tqdm.auto import tqdm

from align.config import load_recipe, packing_on, save_recipe
from align.distill.backend import Engine, list_checkpoints
from align.distill.data import (WindowOrder, heldout_rows, rollout_spans, subset, whole_rollouts,
                               within_vocab)
from align.distill.distributed import barrier, init_distributed
from align.distill.lora import add_lora
from align.distill.packing import offsets_per_call
from align.distill.run import MetricsLog, check_run_folder, fit_micro_batch, freeze_embeddings, stop_on_nonfinite
from align.distill.strategy import NonFiniteLoss, heldout_metrics, strategy_for, train_step
from align.distill.windows import window_index
from align.errors import AlignError, run_cli
from align.export import export_checkpoint
from align.files import discard_partial
from align.loading import (default_device, load_drafter_model, load_tokenizer, load_verifier_model, shared_vocab_size,
                           usable_cores)
from align.locks import hold_folder
from align.machine import bf16_training
from align.labels import check_text, generate_labels, label_meta
from align.rollouts import generate_rollouts, rollout_meta
from align.zoo import check_model, check_prompts, resolve

HELDOUT_KEYS = ("heldout_windows", "heldout_digest")  # the held-out windows in a run's data fingerprint


def main(argv: list[str]) -> int:
    # ----------------------------------------------------------------------------------------- recipe
    parser = argparse.ArgumentParser(prog="align/train.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    out = Path(recipe.run.output_dir)
    d = recipe.drafter
    # every input before anything is started, built or loaded: the configs of both models say what they are
    check_model(d.path, "drafter", d.family)
    check_model(recipe.verifier.path, "verifier")
    check_prompts(recipe.data.prompts)
    check_text(recipe.data.text)

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
    drafter_path, verifier_path = resolve(d.path), resolve(recipe.verifier.path)  # zoo models: built now if need be
    drafter_tokenizer = load_tokenizer(drafter_path, "drafter", d.trust_remote_code)
    verifier_tokenizer = load_tokenizer(verifier_path, "verifier")
    vocab = shared_vocab_size(drafter_tokenizer, verifier_tokenizer, d.path, recipe.verifier.path)  # what decoding drafts
    rollouts = generate_rollouts(recipe, rank, world, barrier=barrier, progress=lead)
    rows = rollouts.select_columns(["prompt_id", "prompt_ids", "response_ids"]).to_list()
    text = []  # labelled text (data.text): trained on beside the rollouts, never held out
    if recipe.data.text is not None:
        labelled = generate_labels(recipe, rank, world, barrier=barrier, progress=lead)
        text = labelled.select_columns(["prompt_id", "prompt_ids", "response_ids", "label_ids"]).to_list()
    rows, cut = within_vocab(rows + text, vocab)
    lengths = [len(r["response_ids"]) for r in rows]
    if cut and lead:
        print(f"{cut} rollouts hold tokens past the shared vocabulary of {vocab} (verifier logit rows no tokenizer "
              "names, which the drafter cannot propose): each is cut before its first such token", flush=True)
    rollout_count = len(rows) - len(text)
    held = heldout_rows(rows[:rollout_count], recipe.data.heldout_fraction) + [False] * len(text)
    heldout = [i for i in range(len(rows)) if held[i]]
    text_trained = len(text) if recipe.data.train_text_rows is None else min(len(text), recipe.data.train_text_rows)
    train_rows = subset(rows, [i for i in range(rollout_count) if not held[i]], recipe.data.train_rollouts) + \
        list(range(rollout_count, rollout_count + text_trained))
    gamma = recipe.distill.gamma
    if max(lengths, default=0) < gamma:
        raise AlignError(f"distill.gamma ({gamma}) is longer than every rollout (the longest has {max(lengths, default=0)} "
                         "tokens); lower distill.gamma or raise data.max_new_tokens")
    train_pairs = window_index(lengths, train_rows, recipe.distill.stride)
    eval_pairs = whole_rollouts(window_index(lengths, heldout or train_rows[:1], recipe.distill.stride),
                                recipe.train.eval_windows)
    data_fingerprint = {"rollouts": rollout_meta(recipe), "windows": len(train_pairs), "heldout_windows": len(eval_pairs),
                        "heldout_digest": hashlib.sha256(eval_pairs.numpy().tobytes()).hexdigest()[:16]}
    if text:
        data_fingerprint["text"] = {**label_meta(recipe), "rows": len(text), "trained_rows": text_trained}
    if lead:
        how = "packed: each rollout's windows from one encoder pass" if packing_on(recipe) else "one pass per window"
        more = f" and {len(text)} rows of labelled text" if text else ""
        print(f"{rollout_count} rollouts{more}, {len(train_rows)} rows trained on: {len(train_pairs)} training windows "
              f"({how}), {len(eval_pairs)} held-out windows (gamma {gamma})", flush=True)

    # ----------------------------------------------------------------------------------------- models
    Strategy = strategy_for(recipe)  # how this kind of drafter trains (align/distill/strategy.py)
    teacher = None  # the verifier, frozen: for objectives that read its logits, and drafters that read its features
    if Strategy.needs_verifier(recipe):  # whole on every process, before ZeRO-3 could shard it
        teacher, _ = load_verifier_model(verifier_path, recipe.verifier.dtype, default_device(),
                                         hub_kernels=recipe.run.hub_kernels)
        teacher.requires_grad_(False)
    zero3 = Engine.prepare(recipe, world)  # ZeRO-3: parameters are sharded while the model loads
    weights_dtype = "bfloat16" if bf16_training(recipe.deepspeed.bf16) else "float32"
    model, _ = load_drafter_model(drafter_path, d.family, weights_dtype, d.trust_remote_code,
                                  hub_kernels=recipe.run.hub_kernels)
    prepared = Strategy.prepare(recipe, model, teacher, drafter_tokenizer, rows, lead)  # its mask, its features
    data_fingerprint.update(prepared["fingerprint"])
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
    strategy = Strategy(recipe, engine.engine, rows, vocab, prepared["mask_id"], teacher, prepared["feature_cache"],
                        engine.device)
    eval_pairs = strategy.eval_order(eval_pairs)

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

    def evaluate() -> dict:
        """Held-out windows, drafted as decoding drafts them (``heldout_metrics``), and how many they were."""
        engine.train(False)
        result = heldout_metrics(strategy, eval_pairs, recipe.train.micro_batch_size, rank, world)
        engine.train(True)
        return {**result, "windows": len(eval_pairs)}

    if state["step"] == 0:
        state["heldout"]["before"] = evaluate()
        metrics.write({"step": 0, "split": "eval", **state["heldout"]["before"]})
    elif any(state["data_fingerprint"].get(key, data_fingerprint[key]) != data_fingerprint[key] for key in HELDOUT_KEYS):
        # resumed with other held-out windows (train.eval_windows): the figures so far measured others, so they are
        # set aside (metrics.jsonl keeps them) and the drafter as resumed is measured on these, no step taken; its
        # checkpoint is written again with them, which is how a finished run is measured on more windows
        if lead:
            print(f"train.eval_windows changed: the held-out figures so far are of other windows; measuring the "
                  f"drafter at step {state['step']} on these {len(eval_pairs)}", flush=True)
        state["data_fingerprint"].update({key: data_fingerprint[key] for key in HELDOUT_KEYS})
        state["heldout"] = {"after": evaluate()}
        metrics.write({"step": state["step"], "split": "eval", **state["heldout"]["after"]})
        saved = engine.save(checkpoints, state["step"], state, recipe.train.keep_checkpoints)
        if lead:
            save_recipe(recipe, saved / "recipe.yaml")

    # ----------------------------------------------------------------------------------------- training loop
    t = recipe.train
    order = WindowOrder(len(train_pairs), recipe.run.seed, rollout_spans(train_pairs) if strategy.packs else None,
                        recipe.data.group_size or offsets_per_call(gamma))
    bar = tqdm(total=t.max_steps, initial=state["step"], desc="train", disable=not lead, dynamic_ncols=True)
    engine.train(True)
    while state["step"] < t.max_steps:
        step = state["step"]
        torch.manual_seed(zlib.crc32(f"{recipe.run.seed}/{step}/{rank}".encode()))  # dropout: the same on resume
        start = time.perf_counter()
        windows = train_pairs[order.take(step * t.global_batch_size, t.global_batch_size)]
        try:
            loss = train_step(strategy, engine, windows, step, t.micro_batch_size, rank, world)
        except NonFiniteLoss:
            raise AlignError(stop_on_nonfinite(checkpoints, step, lead)) from None
        state["step"] = step + 1
        bar.update(1)
        if state["step"] % recipe.log.every == 0 or state["step"] == t.max_steps:
            record = {"step": state["step"], "split": "train", "loss": loss, "lr": engine.lr,
                      "windows_per_s": t.global_batch_size / (time.perf_counter() - start)}
            metrics.write(record)
            bar.set_postfix(loss=f"{loss:.4f}")
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
        before = state["heldout"].get("before")  # none where the run was measured again on other windows
        after = state["heldout"].get("after", before)
        change = {key: (f"{before[key]:.3f} -> " if before else "") + f"{after[key]:.3f}"
                  for key in ("expected_streak", "greedy_streak")}
        print(f"held-out E[streak] {change['expected_streak']}, greedy streak {change['greedy_streak']} "
              f"({after.get('windows', data_fingerprint['heldout_windows'])} windows); aligned drafter in {final}",
              flush=True)
    metrics.close()
    barrier()
    del zero3
    return 0


if __name__ == "__main__":
    run_cli(main)
