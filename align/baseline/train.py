"""Training the AR drafter from scratch on a diffusion run's rollouts, for that run's wall-clock training time."""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from align.drafters.ar import FAMILY
from align.baseline.model import ar_model, count_parameters, drafter_shape, matched_intermediate
from align.errors import AlignError
from align.files import atomic_folder
from align.metrics import walk_blocks

def read_run(run: Path):
    """The recipe of a training run folder (``align/train.py``'s ``run.output_dir``)."""
    import yaml

    from align.config import build_recipe

    saved = run / "recipe.yaml"
    if not run.is_dir():
        raise AlignError(f"run folder {run} does not exist; pass the run.output_dir of an align/train.py run")
    if not saved.is_file():
        raise AlignError(f"{run} holds no recipe.yaml, so it is not an align/train.py run folder; pass the "
                         "run.output_dir of a training run (e.g. runs/tiny)")
    try:
        return build_recipe(yaml.safe_load(saved.read_text()))
    except yaml.YAMLError as error:
        raise AlignError(f"{saved} is not valid YAML ({str(error).splitlines()[0]})") from None


def diffusion_train_seconds(run: Path, recipe) -> float | None:
    """The diffusion run's training time (optimizer steps only, evaluation and checkpoints excluded), estimated from
    ``metrics.jsonl``: each train record's ``windows_per_s`` times the steps since the previous record."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    seconds, last = 0.0, 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("split") == "train" and record.get("windows_per_s"):
            step = int(record["step"])
            seconds += (step - last) * recipe.train.global_batch_size / float(record["windows_per_s"])
            last = step
    return seconds or None


def load_sequences(recipe, vocab: int) -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]], dict]:
    """(train, held-out) sequences ``(prompt ‖ response, prompt length)`` from the run's rollouts, split exactly as
    ``align/train.py`` splits them, and the rollout metadata."""
    from align.rollouts import generate_rollouts, rollout_meta, rollouts_dir
    from align.distill.data import heldout_rows, within_vocab

    dataset = generate_rollouts(recipe, progress=True)
    rows, cut = within_vocab(dataset.select_columns(["prompt_id", "prompt_ids", "response_ids"]).to_list(), vocab)
    if cut:
        print(f"{cut} rollouts hold tokens past the shared vocabulary of {vocab}: each is cut before the first")
    held = heldout_rows(rows, recipe.data.heldout_fraction)
    docs = [(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in rows]
    train = [d for d, h in zip(docs, held) if not h and len(d[0]) > d[1]]
    heldout = [d for d, h in zip(docs, held) if h and len(d[0]) > d[1]]
    if not train:
        raise AlignError(f"the rollouts in {rollouts_dir(recipe)} leave no training sequences")
    return train, heldout, {**rollout_meta(recipe), "dir": str(rollouts_dir(recipe))}


def collate(docs: list[tuple[list[int], int]], prompt_weight: float, max_len: int, pad: int = 0,
            device: torch.device | str = "cpu"):
    """Right-padded ids (B, L), attention mask, and per-target weights (B, L - 1) on ``device``: 1 for response
    tokens, ``prompt_weight`` for prompt tokens after the first, 0 for padding."""
    docs = [(ids[:max_len], p) for ids, p in docs]
    width = max(len(ids) for ids, _ in docs)
    ids = torch.full((len(docs), width), pad, dtype=torch.long, device="cpu")
    mask = torch.zeros_like(ids)
    weight = torch.zeros((len(docs), width - 1), device="cpu")
    for row, (tokens, prompt_len) in enumerate(docs):
        ids[row, :len(tokens)] = torch.tensor(tokens, device="cpu")
        mask[row, :len(tokens)] = 1
        weight[row, :len(tokens) - 1] = prompt_weight
        weight[row, max(0, prompt_len - 1):len(tokens) - 1] = 1.0  # target t + 1 is a response token
    return ids.to(device), mask.to(device), weight.to(device)


def batches(docs: list, batch_size: int, rng: random.Random):
    """Endless batches; each epoch shuffles, then groups sequences of similar length to limit padding."""
    while True:
        order = list(range(len(docs)))
        rng.shuffle(order)
        groups = []
        for lo in range(0, len(order), 50 * batch_size):
            chunk = sorted(order[lo:lo + 50 * batch_size], key=lambda i: len(docs[i][0]))
            groups += [[docs[i] for i in chunk[j:j + batch_size]] for j in range(0, len(chunk), batch_size)]
        rng.shuffle(groups)
        yield from groups


def sequence_loss(model, ids, mask, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ weighted CE, logits (B, L - 1, V)) of next-token prediction."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="none")
    return (ce.view_as(weight) * weight).sum(), logits


@torch.no_grad()
def evaluate(model, docs: list, gamma: int, max_len: int, batch_size: int = 32,
             limit: int | None = None) -> dict[str, float]:
    """Held-out response tokens: cross-entropy, next-token accuracy, and the greedy streak — for every response
    offset t, how many of the next γ rollout tokens the drafter's argmax matches in a row (teacher-forced, so
    exactly the accepted length of a greedy γ-block there when the rollouts are the verifier's greedy output; the
    same measure as ``greedy_streak`` in the diffusion run's held-out evaluation), and ``decoded_accepted``, those
    streaks walked as greedy decoding walks them (:func:`align.metrics.walk_blocks`; ``limit``: max_new_tokens)."""
    if not docs:
        return {}
    was_training = model.training
    model.eval()
    total = correct = ce_sum = streak_sum = offsets = blocks = accepted = 0.0
    for lo in range(0, len(docs), batch_size):
        part = docs[lo:lo + batch_size]
        ids, mask, weight = collate(part, 0.0, max_len, device=next(model.parameters()).device)
        ce, logits = sequence_loss(model, ids, mask, weight)
        hit = (logits.argmax(-1) == ids[:, 1:]) & (weight > 0)
        ce_sum += float(ce)
        total += float(weight.sum())
        correct += float(hit.sum())
        for row, (tokens, prompt_len) in enumerate(part):
            h = hit[row, prompt_len - 1:min(len(tokens), max_len) - 1].tolist()
            run = 0
            runs = []
            for x in reversed(h):  # run length of correct predictions starting at each offset
                run = run + 1 if x else 0
                runs.append(min(run, gamma))
            streak_sum += sum(runs)
            offsets += len(runs)
            walked = walk_blocks(runs[::-1], limit=limit)
            blocks, accepted = blocks + walked[0], accepted + walked[1]
    model.train(was_training)
    return {"ce": ce_sum / max(total, 1), "accuracy": correct / max(total, 1),
            "greedy_streak": streak_sum / max(offsets, 1), "decoded_accepted": accepted / max(blocks, 1)}




def train(args: argparse.Namespace) -> Path:
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    from align.loading import default_device, load_tokenizer, pretrained, shared_vocab_size
    from align.zoo import resolve

    run, out = Path(args.run), Path(args.out)
    recipe = read_run(run)
    if args.steps is not None and args.steps < 1:
        raise AlignError(f"--steps must be at least 1, got {args.steps}")
    if args.seconds is not None and args.seconds <= 0:
        raise AlignError(f"--seconds must be positive, got {args.seconds}")
    seconds = args.seconds
    if seconds is None and args.steps is None:
        seconds = diffusion_train_seconds(run, recipe)
        if seconds is None:
            raise AlignError(f"{run / 'metrics.jsonl'} has no training records to take the diffusion run's wall time "
                             "from; pass --seconds S or --steps N")
        print(f"budget: {seconds:.0f} s, the diffusion run's training time (from {run / 'metrics.jsonl'})")
    if out.resolve() == run.resolve():
        raise AlignError("--out must be a folder of its own, not the run folder")
    if args.threads:
        torch.set_num_threads(args.threads)

    verifier_path = resolve(recipe.verifier.path)
    tokenizer = load_tokenizer(verifier_path, "verifier")
    vocab = shared_vocab_size(tokenizer, tokenizer, verifier_path, verifier_path)
    from transformers import AutoConfig

    from align.verifier import context_length

    max_len = context_length(AutoConfig.from_pretrained(verifier_path)) or 2048
    target = drafter_shape(recipe.drafter.path, recipe.drafter.family, recipe.drafter.trust_remote_code)
    train_docs, heldout_docs, rollouts = load_sequences(recipe, vocab)

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    if args.init:
        from transformers import AutoModelForCausalLM

        model = pretrained(AutoModelForCausalLM, resolve(args.init), dtype=torch.float32)
        sizes = {"init": args.init}
    else:
        hidden = args.hidden or target["hidden"]
        layers = args.layers or target["layers"]
        heads = args.heads or target["heads"]
        if hidden % heads:
            raise AlignError(f"--hidden {hidden} is not a multiple of --heads {heads}")
        intermediate = args.intermediate or matched_intermediate(target["parameters"], vocab, hidden, layers)
        model = ar_model(vocab, hidden, layers, heads, intermediate, max_len, args.seed, pad, tokenizer.bos_token_id,
                         eos)
        sizes = {"hidden": hidden, "layers": layers, "heads": heads, "intermediate": intermediate}
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=tokenizer.bos_token_id)
    device = torch.device(args.device or default_device())
    model.to(device)
    parameters = count_parameters(model)
    print(f"AR drafter: {parameters:,} parameters ({', '.join(f'{k} {v}' for k, v in sizes.items())}); diffusion "
          f"drafter {recipe.drafter.path}: {target['parameters']:,} parameters")
    print(f"{len(train_docs)} training sequences, {len(heldout_docs)} held-out (the run's held-out prompts); loss on "
          f"response tokens" + (f", prompt tokens weighted {args.prompt_weight}" if args.prompt_weight else ""))

    gamma = recipe.distill.gamma
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    stream = batches(train_docs, args.batch_size, rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))

    def factor(step: int, spent: float) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        done = max(step / args.steps if args.steps else 0.0, spent / seconds if seconds else 0.0)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    log = []
    before = evaluate(model, heldout_docs, gamma, max_len, limit=recipe.data.max_new_tokens)
    log.append({"step": 0, "split": "eval", **before})
    bar = tqdm(total=args.steps if args.steps else round(seconds), unit="step" if args.steps else "s",
               desc="train AR drafter", dynamic_ncols=True)
    model.train()
    step, spent, recent = 0, 0.0, []
    while (args.steps is None or step < args.steps) and (seconds is None or spent < seconds):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = args.lr * factor(step, spent)
        ids, mask, weight = collate(next(stream), args.prompt_weight, max_len, pad, device)
        num, _ = sequence_loss(model, ids, mask, weight)
        loss = num / weight.sum().clamp(min=1)
        if not torch.isfinite(loss):
            raise AlignError(f"the loss is not finite at step {step + 1}; lower --lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        elapsed = time.perf_counter() - start
        spent += elapsed
        recent = (recent + [loss.item()])[-20:]
        bar.update(1 if args.steps else min(round(spent) - bar.n, bar.total - bar.n))
        bar.set_postfix(step=step, loss=f"{sum(recent) / len(recent):.3f}")
        if step % 10 == 0:
            log.append({"step": step, "split": "train", "loss": recent[-1], "lr": optimizer.param_groups[0]["lr"],
                        "seconds": spent, "sequences_per_s": args.batch_size / elapsed})
        if args.eval_every and step % args.eval_every == 0:  # not counted in the budget
            log.append({"step": step, "split": "eval", "seconds": spent,
                        **evaluate(model, heldout_docs, gamma, max_len, limit=recipe.data.max_new_tokens)})
    bar.close()
    after = evaluate(model, heldout_docs, gamma, max_len, limit=recipe.data.max_new_tokens)
    log.append({"step": step, "split": "eval", "seconds": spent, **after})
    model.eval()

    meta = {"family": FAMILY, "verifier": recipe.verifier.path, "diffusion_run": str(run),
            "diffusion_drafter": recipe.drafter.path, "rollouts": rollouts, "seconds": spent,
            "budget_seconds": seconds, "steps": step, "batch_size": args.batch_size, "lr": args.lr,
            "prompt_weight": args.prompt_weight, "seed": args.seed, "parameters": parameters,
            "diffusion_drafter_parameters": target["parameters"], **sizes, "gamma": gamma,
            "heldout": {"before": before, "after": after}, "train_sequences": len(train_docs),
            "heldout_sequences": len(heldout_docs)}
    save(model.cpu(), tokenizer, meta, log, out)
    if after:
        print(f"held-out (teacher-forced, γ {gamma}): greedy streak {before['greedy_streak']:.2f} -> "
              f"{after['greedy_streak']:.2f}, next-token accuracy {after['accuracy']:.3f}, CE {after['ce']:.3f}")
    print(f"{step} steps in {spent:.0f} s of training; AR drafter in {out}")
    return out


def save(model, tokenizer, meta: dict, log: list[dict], out: Path) -> None:
    """Write the drafter into ``out`` atomically: a temporary sibling folder, renamed into place."""
    with atomic_folder(out, f"the AR drafter in {out}") as partial:
        model.save_pretrained(str(partial), safe_serialization=True)
        tokenizer.save_pretrained(str(partial))
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        (partial / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))

