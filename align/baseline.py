"""The standard alternative: a same-size autoregressive drafter, trained on the same rollouts for the same time.

    python -m align.baseline train --run runs/tiny --out runs/tiny/ar [--seconds S | --steps N] [--seed 0] [--lr LR]
    python -m align.baseline eval --drafter runs/tiny/ar [--diffusion runs/tiny/final] [--limit 48] [--gamma 16]

``train`` reads the run's ``recipe.yaml``, loads the very rollouts that run was trained on (and holds out the same
prompts as ``align/train.py``), builds a causal Llama with the verifier's tokenizer, tied embeddings and a
parameter count matched to the run's diffusion drafter, and trains it from scratch by next-token cross-entropy on
``prompt ‖ response`` (every response token supervised in one teacher-forced pass; prompt tokens are context only,
unless ``--prompt-weight`` > 0: the drafter only ever drafts response tokens, and the prompts are not the
verifier's output). The budget is wall-clock training time (``--seconds``; default: the diffusion run's training
time, estimated from its ``metrics.jsonl``) and/or steps. Saved with ``save_pretrained`` plus ``meta.json``
(``family: ar``), atomically.

:class:`ARDrafter` drafts γ tokens one at a time on a KV cache kept across blocks and plugs into
``align.speculative.SpeculativeDecoder`` in place of :class:`align.drafter.Drafter`: that is standard speculative
decoding, through the same loop. ``eval`` measures it (and optionally a diffusion drafter) on held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from align.drafter import PrefixState
from align.errors import AlignError, run_cli

FAMILY = "ar"


# ------------------------------------------------------------------------------------------------ the drafter


class ARDrafter:
    """An autoregressive drafter behind the :class:`align.drafter.Drafter` interface.

    ``marginals(prefix, γ, steps, temperature, generator)`` drafts γ tokens one at a time (argmax at temperature 0,
    else a sample from ``softmax(logq_j / temperature)`` with ``generator``) and returns the rows they were drawn
    from, as temperature-1 log-probabilities (B, γ, V): row j is the drafter's distribution after the prefix and
    draft tokens 0..j-1. The draft itself is kept in ``self.draft`` (B, γ): at temperature 0 it is the rows'
    argmax, which is what the loop takes; at temperature > 0 the loop must verify this draft rather than redraw one
    from the rows (see the report's speculative.py change; :func:`own_draft` does it for one decoder). Redrawing
    from the rows (``expose_draft=False``, or the unchanged loop) is still lossless — the rows are fixed before the
    draw — but accepts less. ``steps`` is accepted and ignored (no denoising).

    Batch 1 (decoding) keeps the prefix's KV cache in ``self.state`` (:class:`PrefixState`) across blocks: a new
    prefix that extends the cached ids reuses the cache; otherwise the cache is cropped to the longest common
    prefix (the rejected draft tokens go) and only the rest is run.
    """

    family = FAMILY

    def __init__(self, model: Any, vocab_size: int, expose_draft: bool = True):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        rows = head.weight.shape[0] if head is not None else model.config.vocab_size
        if rows < vocab_size:
            raise AlignError(f"the AR drafter has {rows} logit rows, fewer than the {vocab_size} tokens of the shared "
                             "vocabulary")
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.state = PrefixState()
        self.expose_draft = expose_draft  # False: leave self.draft None, so the loop redraws from the rows
        self.draft: torch.Tensor | None = None
        self.forward_calls = 0  # model calls made, for tests and profiling

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        """Forget the cached prefix (start of a new sequence)."""
        self.state = PrefixState()
        self.draft = None

    def _step(self, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Run ``ids`` (B, n) on ``cache``; the log-probabilities (B, V) after the last one."""
        self.forward_calls += 1
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits[..., :self.vocab_size].float().log_softmax(-1)

    def _start(self, prefix: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
        """A cache holding all of ``prefix`` but what still has to run, and that rest (at least one token)."""
        if prefix.shape[0] != 1:  # batches: no state, the whole prefix
            return DynamicCache(config=self.model.config), prefix
        ids = prefix[0].tolist()
        state = self.state
        common = 0
        if state.cache is not None:
            limit = min(len(ids), len(state.ids))
            while common < limit and ids[common] == state.ids[common]:
                common += 1
        common = min(common, len(ids) - 1)  # the last prefix token must run: its logits give draft token 0
        if common == 0:
            state.cache, state.ids = DynamicCache(config=self.model.config), []
        elif common < state.cache.get_seq_length():
            state.cache.crop(common - state.cache.get_seq_length())  # a negative count: the tokens to remove
        state.ids = ids[:common]
        return state.cache, prefix[:, common:]

    @torch.no_grad()
    def marginals(self, prefix: torch.Tensor, gamma: int, steps: int = 1, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Log-probabilities (B, γ, V) of the γ draft positions, each conditioned on the draft before it."""
        if gamma <= 0 or steps <= 0:
            raise AlignError(f"gamma and steps must be positive, got gamma={gamma}, steps={steps}")
        if prefix.shape[1] == 0:
            raise AlignError("the AR drafter needs a non-empty prefix")
        cache, new = self._start(prefix)
        rows, draft = [], []
        for j in range(gamma):
            logq = self._step(new, cache)
            rows.append(logq)
            if temperature > 0:
                token = torch.multinomial((logq / temperature).softmax(-1), 1, generator=generator)[:, 0]
            else:
                token = logq.argmax(-1)
            draft.append(token)
            if j < gamma - 1:
                new = token[:, None]
        if prefix.shape[0] == 1:  # the cache now holds prefix ‖ draft[:γ-1]
            self.state.ids = prefix[0].tolist() + [int(t) for t in draft[:-1]]
        self.draft = torch.stack(draft, 1) if self.expose_draft else None
        return torch.stack(rows, 1)


def load_ar_drafter(path: str | Path, device: str | torch.device | None = None, vocab_size: int | None = None,
                    dtype: str = "float32") -> ARDrafter:
    """An :class:`ARDrafter` from a folder written by ``python -m align.baseline train`` (or any causal LM).

    ``vocab_size`` is the vocabulary shared with the verifier (default: the model's own vocabulary)."""
    from align.loading import load_verifier_model

    model, _ = load_verifier_model(str(path), dtype, device, role="AR drafter")
    return ARDrafter(model, vocab_size or model.config.vocab_size)


# ------------------------------------------------------------------------------------------------ the model


def ar_model(vocab_size: int, hidden: int, layers: int, heads: int, intermediate: int, max_len: int,
             seed: int = 0, pad: int = 0, bos: int | None = None, eos: int | list[int] | None = None):
    """A causal Llama with tied input and output embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
        pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=True, rope_theta=10000.0,
    )
    return LlamaForCausalLM(config)


def count_parameters(model: Any) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def llama_parameters(vocab: int, hidden: int, layers: int, intermediate: int) -> int:
    """Parameters of :func:`ar_model` (heads do not change the count)."""
    return vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + hidden


def matched_intermediate(target: int, vocab: int, hidden: int, layers: int, multiple: int = 8) -> int:
    """The MLP width (a multiple of ``multiple``) that brings :func:`ar_model` closest to ``target`` parameters."""
    free = target - llama_parameters(vocab, hidden, layers, 0)
    if free <= 0:
        raise AlignError(f"a {layers}-layer, {hidden}-wide Llama over {vocab} tokens already has "
                         f"{llama_parameters(vocab, hidden, layers, 0):,} parameters without its MLP, more than the "
                         f"{target:,} to match; pass smaller --hidden/--layers")
    width = free / (3 * hidden * layers)
    return max(multiple, int(round(width / multiple)) * multiple)


def drafter_shape(path: str, family: str, trust_remote_code: bool = False) -> dict[str, int]:
    """Parameter count and text sizes of a (diffusion) drafter, built on the meta device: no weights are read."""
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

    from align.zoo import is_built, resolve

    name = path[len("zoo:"):] if path.startswith("zoo:") else None
    if name is not None and not is_built(name):  # count it from the zoo's spec rather than start a build
        from transformers import AutoTokenizer

        from align.zoo.build import ZooSpec, tokenizer_dir
        from align.zoo.models import diffusiongemma_model, mdlm_model

        sizes = ZooSpec().drafters.get(name)
        if sizes is None or not (tokenizer_dir() / "tokenizer.json").is_file():
            raise AlignError(f"the drafter {path} is not built yet; build it first (python -m align.zoo build {name})")
        maker = diffusiongemma_model if name == "tiny-diffusiongemma" else mdlm_model
        with torch.device("meta"):
            model = maker(len(AutoTokenizer.from_pretrained(str(tokenizer_dir()))), sizes["hidden"], sizes["layers"],
                          sizes["heads"])
        return {"parameters": count_parameters(model), "hidden": sizes["hidden"], "layers": sizes["layers"],
                "heads": sizes["heads"]}
    path = resolve(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise AlignError(f"cannot read the drafter's config from '{path}' ({str(error).splitlines()[0]})") from None
    with torch.device("meta"):
        if config.model_type == "diffusion_gemma":
            from transformers import DiffusionGemmaForBlockDiffusion

            model = DiffusionGemmaForBlockDiffusion(config)
        elif family == "mdlm":
            model = AutoModelForMaskedLM.from_config(config)
        else:
            model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    return {"parameters": count_parameters(model), "hidden": text.hidden_size, "layers": text.num_hidden_layers,
            "heads": text.num_attention_heads}


# ------------------------------------------------------------------------------------------------ data


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
    from align.train import heldout_rows, within_vocab

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


def collate(docs: list[tuple[list[int], int]], prompt_weight: float, max_len: int, pad: int = 0):
    """Right-padded ids (B, L), attention mask, and per-target weights (B, L - 1): 1 for response tokens,
    ``prompt_weight`` for prompt tokens after the first, 0 for padding."""
    docs = [(ids[:max_len], p) for ids, p in docs]
    width = max(len(ids) for ids, _ in docs)
    ids = torch.full((len(docs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    weight = torch.zeros((len(docs), width - 1))
    for row, (tokens, prompt_len) in enumerate(docs):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
        weight[row, :len(tokens) - 1] = prompt_weight
        weight[row, max(0, prompt_len - 1):len(tokens) - 1] = 1.0  # target t + 1 is a response token
    return ids, mask, weight


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
def evaluate(model, docs: list, gamma: int, max_len: int, batch_size: int = 32) -> dict[str, float]:
    """Held-out response tokens: cross-entropy, next-token accuracy, and the greedy streak — for every response
    offset t, how many of the next γ rollout tokens the drafter's argmax matches in a row (teacher-forced, so
    exactly the accepted length of a greedy γ-block there when the rollouts are the verifier's greedy output; the
    same measure as ``greedy_streak`` in the diffusion run's held-out evaluation)."""
    if not docs:
        return {}
    was_training = model.training
    model.eval()
    total = correct = ce_sum = streak_sum = offsets = 0.0
    for lo in range(0, len(docs), batch_size):
        part = docs[lo:lo + batch_size]
        ids, mask, weight = collate(part, 0.0, max_len)
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
    model.train(was_training)
    return {"ce": ce_sum / max(total, 1), "accuracy": correct / max(total, 1),
            "greedy_streak": streak_sum / max(offsets, 1)}


# ------------------------------------------------------------------------------------------------ training


def train(args: argparse.Namespace) -> Path:
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    from align.loading import load_tokenizer, shared_vocab_size
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

        model = AutoModelForCausalLM.from_pretrained(resolve(args.init), dtype=torch.float32)
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
    before = evaluate(model, heldout_docs, gamma, max_len)
    log.append({"step": 0, "split": "eval", **before})
    bar = tqdm(total=args.steps if args.steps else round(seconds), unit="step" if args.steps else "s",
               desc="train AR drafter", dynamic_ncols=True)
    model.train()
    step, spent, recent = 0, 0.0, []
    while (args.steps is None or step < args.steps) and (seconds is None or spent < seconds):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = args.lr * factor(step, spent)
        ids, mask, weight = collate(next(stream), args.prompt_weight, max_len, pad)
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
                        **evaluate(model, heldout_docs, gamma, max_len)})
    bar.close()
    after = evaluate(model, heldout_docs, gamma, max_len)
    log.append({"step": step, "split": "eval", "seconds": spent, **after})
    model.eval()

    meta = {"family": FAMILY, "verifier": recipe.verifier.path, "diffusion_run": str(run),
            "diffusion_drafter": recipe.drafter.path, "rollouts": rollouts, "seconds": spent,
            "budget_seconds": seconds, "steps": step, "batch_size": args.batch_size, "lr": args.lr,
            "prompt_weight": args.prompt_weight, "seed": args.seed, "parameters": parameters,
            "diffusion_drafter_parameters": target["parameters"], **sizes, "gamma": gamma,
            "heldout": {"before": before, "after": after}, "train_sequences": len(train_docs),
            "heldout_sequences": len(heldout_docs)}
    save(model, tokenizer, meta, log, out)
    if after:
        print(f"held-out (teacher-forced, γ {gamma}): greedy streak {before['greedy_streak']:.2f} -> "
              f"{after['greedy_streak']:.2f}, next-token accuracy {after['accuracy']:.3f}, CE {after['ce']:.3f}")
    print(f"{step} steps in {spent:.0f} s of training; AR drafter in {out}")
    return out


def save(model, tokenizer, meta: dict, log: list[dict], out: Path) -> None:
    """Write the drafter into ``out`` atomically: a temporary sibling folder, renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial), safe_serialization=True)
    tokenizer.save_pretrained(str(partial))
    (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    (partial / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ measuring


def spread(items: list, limit: int | None) -> list:
    """``limit`` items evenly spaced over ``items`` (all when ``limit`` is None or larger)."""
    if limit is None or limit >= len(items):
        return items
    return [items[int(i * len(items) / limit)] for i in range(limit)]


def measure(args: argparse.Namespace) -> list[dict]:
    """Greedy or sampled speculative decoding with the AR drafter (and a diffusion drafter) on held-out prompts,
    against the verifier alone: accepted per block, τ, tokens/s, and (greedy) token-for-token equality."""
    from tqdm.auto import tqdm

    from align.loading import (default_device, infer_family, load_drafter_model, load_verifier_model,
                               shared_vocab_size)
    from align.drafter import Drafter
    from align.metrics import DecodeStats, now
    from align.prompts import encode_prompt, load_prompts
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate, eos_ids
    from align.zoo import resolve

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(resolve(args.drafter))
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    verifier_path = args.verifier or meta.get("verifier")
    if verifier_path is None:
        raise AlignError(f"{path} has no meta.json naming its verifier; pass --verifier PATH")
    device = args.device or default_device()
    verifier_model, tokenizer = load_verifier_model(verifier_path, "float32", device)
    eos = eos_ids(verifier_model, tokenizer)
    vocab = shared_vocab_size(tokenizer, tokenizer, verifier_path, verifier_path)
    prompts = spread(load_prompts(args.prompts), args.limit)
    encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]

    verifier = Verifier(verifier_model)
    ar_generate(verifier_model, encoded[0], args.max_new_tokens, 0.0, eos)  # warm-up, untimed
    start = now(device)
    reference = [ar_generate(verifier_model, ids, args.max_new_tokens, args.temperature, eos, args.seed)
                 for ids in tqdm(encoded, desc="verifier alone (generate)", leave=False)]
    generate_tps = sum(map(len, reference)) / (now(device) - start)
    try:  # the speed reference: a minimal cached loop through the same Verifier path, where the project has it
        from align.verifier import verifier_alone
    except ImportError:
        ar_tps = generate_tps
    else:
        verifier_alone(verifier, encoded[0], args.max_new_tokens, eos)  # warm-up, untimed
        runs = [verifier_alone(verifier, ids, args.max_new_tokens, eos, args.temperature, args.seed)
                for ids in tqdm(encoded, desc="verifier alone (cached loop)", leave=False)]
        ar_tps = sum(len(r.tokens) for r in runs) / sum(r.total_s for r in runs)
    def ar() -> ARDrafter:
        drafter = load_ar_drafter(path, device, vocab)
        drafter.expose_draft = not args.resample
        return drafter

    drafters = [("ar", ar)]
    if args.diffusion:
        def diffusion() -> Drafter:
            dpath = resolve(args.diffusion)
            family = infer_family(dpath)
            model, _ = load_drafter_model(dpath, family, "float32", device=device)
            return Drafter(model, family, vocab, tokenizer.mask_token_id)
        drafters.append(("diffusion", diffusion))
    results = []
    for label, build in drafters:
        drafter = build()
        decoder = SpeculativeDecoder(drafter, verifier, eos)
        if isinstance(drafter, ARDrafter):
            own_draft(decoder)
        decoder.generate(encoded[0], args.max_new_tokens, args.gamma)  # warm-up, untimed
        stats, same = DecodeStats(), 0
        for ids, ref in zip(tqdm(encoded, desc=label, leave=False), reference):
            gen = decoder.generate(ids, args.max_new_tokens, args.gamma, 1, args.temperature, args.seed)
            stats = stats + gen.stats
            same += gen.tokens == ref
        s = stats.summary(args.gamma)
        row = {"drafter": label, "path": str(path) if label == "ar" else args.diffusion, "prompts": len(encoded),
               "gamma": args.gamma, "temperature": args.temperature, "accepted_mean": s["accepted_mean"],
               "tau": s["tau"], "acceptance_rate": s["acceptance_rate"], "tokens_per_s": s["tokens_per_s"],
               "verifier_alone_tokens_per_s": ar_tps, "speedup": s["tokens_per_s"] / ar_tps,
               "generate_tokens_per_s": generate_tps,
               "drafter_s": s["drafter_s"], "verifier_s": s["verifier_s"],
               "identical_outputs": f"{same}/{len(encoded)}" if args.temperature == 0 else None}
        results.append(row)
    print(f"{len(encoded)} prompts ({args.prompts}), γ={args.gamma}, temperature {args.temperature}")
    print("| drafter | accepted_mean | τ | acceptance rate | tokens/s | verifier alone tokens/s | speedup | "
          "HF generate tokens/s | drafter s | verifier s | identical to verifier |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['drafter']} | {r['accepted_mean']:.2f} | {r['tau']:.2f} | {r['acceptance_rate']:.3f} | "
              f"{r['tokens_per_s']:.1f} | {r['verifier_alone_tokens_per_s']:.1f} | {r['speedup']:.2f} | "
              f"{r['generate_tokens_per_s']:.1f} | {r['drafter_s']:.1f} | {r['verifier_s']:.1f} | "
              f"{r['identical_outputs'] or '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def own_draft(decoder) -> None:
    """Make ``decoder`` verify the draft an :class:`ARDrafter` drew (what the report's speculative.py change does
    for every drafter that keeps one), not one redrawn independently from its rows."""
    drafter, plain = decoder.drafter, decoder._drafts

    def drafts(logq, temperature, generator, selection):
        if selection is None and getattr(drafter, "draft", None) is not None:
            return drafter.draft[:1]
        return plain(logq, temperature, generator, selection)

    decoder._drafts = drafts


# ------------------------------------------------------------------------------------------------ command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m align.baseline", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a same-size AR drafter on a run's rollouts")
    t.add_argument("--run", required=True, help="an align/train.py run folder (holds recipe.yaml), e.g. runs/tiny")
    t.add_argument("--out", required=True, help="where the AR drafter is written, e.g. runs/tiny/ar")
    t.add_argument("--seconds", type=float, default=None,
                   help="training wall-clock budget (default: the diffusion run's training time from metrics.jsonl)")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (with --seconds: whichever ends first)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW, warm-up, cosine decay)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate as a fraction of --lr")
    t.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--batch-size", type=int, default=64, help="sequences (prompt ‖ response) per step")
    t.add_argument("--prompt-weight", type=float, default=0.0,
                   help="loss weight of prompt tokens (0: prompts are context only; response tokens weigh 1)")
    t.add_argument("--hidden", type=int, default=None, help="width (default: the diffusion drafter's)")
    t.add_argument("--layers", type=int, default=None, help="layers (default: the diffusion drafter's)")
    t.add_argument("--heads", type=int, default=None, help="attention heads (default: the diffusion drafter's)")
    t.add_argument("--intermediate", type=int, default=None,
                   help="MLP width (default: what matches the diffusion drafter's parameter count)")
    t.add_argument("--init", default=None, help="start from this causal LM instead of random weights")
    t.add_argument("--eval-every", type=int, default=200, help="held-out evaluation every N steps (0: at the end)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    e = sub.add_parser("eval", help="speculative decoding with the AR drafter vs the verifier alone")
    e.add_argument("--drafter", required=True, help="an AR drafter folder (from train)")
    e.add_argument("--diffusion", default=None, help="also measure this diffusion drafter, e.g. runs/tiny/final")
    e.add_argument("--verifier", default=None, help="verifier path (default: the AR drafter's meta.json)")
    e.add_argument("--prompts", default="tinyworld:test", help="tinyworld:test (held out everywhere) or a JSONL file")
    e.add_argument("--limit", type=int, default=None, help="N prompts evenly spaced over the file")
    e.add_argument("--gamma", type=int, default=16)
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--resample", action="store_true",
                   help="temperature > 0: redraw the draft from the AR drafter's rows instead of verifying its own")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", default=None)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command == "train":
        train(args)
    else:
        if args.gamma < 1:
            raise AlignError(f"--gamma must be at least 1, got {args.gamma}")
        measure(args)
    return 0


if __name__ == "__main__":
    run_cli(main)
