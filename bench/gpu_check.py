"""GPU check: the real recipe's models as ~1B-parameter random-weight replicas on one GPU, timed part by part.

    python bench/gpu_check.py                          # one GPU, gemma pair, gpu-scale replicas (at most ~8 min)
    python bench/gpu_check.py --pair qwen-diffucoder
    python bench/gpu_check.py --scale cpu --steps 1 --zero 3 --gammas 8 --ks 1,2 --prompts 1 --max-new-tokens 8   # CPU smoke

Prints three tables: training windows/s and peak memory under ZeRO-2 and ZeRO-3 in bf16, with LoRA and full
fine-tuning (one process, the trainer's own step: its strategy, Engine, loss and model loading, on random-token
rollouts); drafter-pass and verifier-pass latency
per block at each γ and K (after a warm-up, device synchronised); speculative decoding against the verifier alone
in tokens/s (greedy, same prompts, both warmed up). Replicas are built into ``--out``/cache (align/zoo/replicas.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAIRS = {"gemma": ("replica-gemma4-verifier", "replica-diffusiongemma", "diffusiongemma"),
         "qwen-diffucoder": ("replica-qwen2.5-verifier", "replica-diffucoder", "dream")}


def peak_memory(device) -> float:
    """GiB: the accelerator's peak allocation since the last reset, else this process's resident memory."""
    import psutil
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return psutil.Process().memory_info().rss / 2 ** 30


def train_throughput(pair: str, zero: int, lora: bool, args) -> tuple[float, float]:
    """(training windows/s, peak GiB) of ``args.steps`` timed steps after one warm-up step: the trainer's own step
    (``align.distill.strategy.train_step``, with the recipe's strategy, loss and Engine) on random-token rollouts of
    ``args.prefix`` prompt tokens and ``args.response`` response tokens, every window of each."""
    import torch
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.config import load_recipe
    from align.distill.backend import Engine
    from align.distill.lora import add_lora
    from align.distill.strategy import strategy_for, train_step
    from align.distill.windows import window_index
    from align.loading import load_drafter_model
    from align.metrics import now

    verifier, drafter, family = PAIRS[pair]
    b = args.micro_batch
    recipe = load_recipe(ROOT / "recipes" / f"{pair}.yaml", [
        f"drafter.path=zoo:{drafter}", f"deepspeed.zero_stage={zero}", "deepspeed.bf16=true",
        f"lora.r={32 if lora else 0}", f"train.micro_batch_size={b}", f"train.global_batch_size={b}",
        f"data.max_prefix_len={args.prefix}", f"train.max_steps={args.steps + 1}", "train.warmup_steps=0"])
    zero3 = Engine.prepare(recipe, 1)
    model, tokenizer = load_drafter_model(recipe.drafter.path, family, "bfloat16", recipe.drafter.trust_remote_code)
    if lora:
        model = add_lora(model, recipe.lora.r, recipe.lora.alpha, 0.0, recipe.lora.target_modules)
    engine = Engine(model, recipe, 1)
    device = engine.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = [{"prompt_ids": torch.randint(300, 20_000, (args.prefix,), generator=g, device="cpu").tolist(),
             "response_ids": torch.randint(300, 20_000, (args.response,), generator=g, device="cpu").tolist()}
            for _ in range(b * (args.steps + 1))]
    mask = recipe.drafter.mask_token_id if recipe.drafter.mask_token_id is not None else tokenizer.mask_token_id
    strategy = strategy_for(recipe)(recipe, engine.engine, rows, len(tokenizer), mask, device=device)
    pairs = window_index([args.response] * len(rows), list(range(len(rows))))
    for step in range(args.steps + 1):
        if step == 1:
            start = now(device)
        train_step(strategy, engine, pairs[step * b:(step + 1) * b], step, b)
    seconds = now(device) - start
    peak = peak_memory(device)
    del engine, model, zero3, strategy
    unset_hf_deepspeed_config()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return args.steps * b / seconds, peak


def pass_latency(drafter, verifier, prompt: list[int], gamma: int, k: int, repeats: int) -> tuple[float, float]:
    """(drafter pass ms, verifier pass ms) for one block of γ draft tokens and K candidates after a cached prompt,
    mean of ``repeats`` after a warm-up round."""
    import torch

    from align.metrics import now

    device = verifier.device
    prefix = torch.tensor([prompt], device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    drafter.reset()  # the first round encodes the prompt; later rounds find it cached, as decoding does
    for i in range(repeats + 1):
        t0 = now(device)
        logq = drafter.marginals(prefix, gamma, 1, 0.0, generator)[0]
        drafts = torch.multinomial(logq.exp(), k, replacement=True, generator=generator).T  # (K, γ)
        t1 = now(device)
        verifier.start(prompt[:-1])
        verifier.score(drafts[:, :0])  # the prompt enters the cache; the block below is what is timed
        verifier.commit(0, 0, prompt[-1])
        t2 = now(device)
        verifier.score(drafts)
        t3 = now(device)
        if i:  # the first round is the warm-up
            times.append((t1 - t0, t3 - t2))
    return tuple(1000 * sum(t[j] for t in times) / len(times) for j in (0, 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="gemma", choices=tuple(PAIRS))
    p.add_argument("--scale", default="gpu", choices=("cpu", "gpu"), help="replica size (align/zoo/replicas.py)")
    p.add_argument("--out", default="runs/gpu-check")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per setting")
    p.add_argument("--zero", default="2,3", help="ZeRO stages timed (comma list), each with LoRA and full fine-tuning")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--prefix", type=int, default=512, help="prompt tokens of each training rollout")
    p.add_argument("--response", type=int, default=64, help="response tokens of each training rollout (a window "
                   "per token)")
    p.add_argument("--gammas", default="8,16,32")
    p.add_argument("--ks", default="1,8")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    os.environ["ALIGN_CACHE"] = str((ROOT / args.out / "cache").resolve())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from align.distill.distributed import init_distributed
    from align.zoo.build import ZooSpec, build

    verifier_name, drafter_name, family = PAIRS[args.pair]
    start = time.perf_counter()
    build([verifier_name, drafter_name], ZooSpec(replica_scale=args.scale))
    print(f"replicas ready in {time.perf_counter() - start:.0f} s", flush=True)
    init_distributed()

    print("\n| training (bf16, 1 process, the trainer's step) | windows/s | peak memory (GiB) |\n|---|---|---|",
          flush=True)
    for zero in map(int, args.zero.split(",")):
        for lora in (True, False):
            speed, peak = train_throughput(args.pair, zero, lora, args)
            print(f"| ZeRO-{zero}, {'LoRA r=32' if lora else 'full'} | {speed:,.1f} | {peak:.1f} |", flush=True)

    from align.drafters import load_pair
    from align.families import traits
    from align.prompts import encode_prompt
    from align.speculative import SpeculativeDecoder
    from align.tinyworld.corpus import read_jsonl
    from align.metrics import now
    from align.verifier import ar_generate, eos_ids
    from align.zoo import model_dir, world_dir

    drafter, verifier, tokenizer = load_pair(str(model_dir(drafter_name)), str(model_dir(verifier_name)), family,
                                             "bfloat16", trust_remote_code=traits(family).remote_code)
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in read_jsonl(world_dir() / "test_prompts.jsonl")]
    prompts = prompts[:args.prompts]
    print("\n| γ | K | drafter pass (ms) | verifier pass (ms) |\n|---|---|---|---|", flush=True)
    gammas = [int(g) for g in args.gammas.split(",")]
    for gamma in gammas:
        for k in map(int, args.ks.split(",")):
            d_ms, v_ms = pass_latency(drafter, verifier, prompts[0], gamma, k, repeats=5)
            print(f"| {gamma} | {k} | {d_ms:.2f} | {v_ms:.2f} |", flush=True)

    eos = eos_ids(verifier.model, tokenizer)
    decoder = SpeculativeDecoder(drafter, verifier, eos)
    gamma = gammas[len(gammas) // 2]
    decoder.generate(prompts[0], args.max_new_tokens, gamma)  # warm-up of both
    ar_generate(verifier.model, prompts[0], args.max_new_tokens, 0.0, eos)
    tokens, spec_s, accepted, blocks = 0, 0.0, 0, 0
    for prompt in prompts:
        out = decoder.generate(prompt, args.max_new_tokens, gamma)
        tokens, spec_s = tokens + len(out.tokens), spec_s + out.stats.total_s
        accepted += sum(b.accepted for b in out.stats.blocks if b.gamma)
        blocks += sum(1 for b in out.stats.blocks if b.gamma)
    t0 = now(verifier.device)
    ar_tokens = sum(len(ar_generate(verifier.model, p, args.max_new_tokens, 0.0, eos)) for p in prompts)
    ar_s = now(verifier.device) - t0
    device = torch.cuda.get_device_name(verifier.device) if verifier.device.type == "cuda" else "cpu"
    print(f"\n| decoding ({device}, bf16, greedy, γ={gamma}) | tokens/s | accepted_mean |\n|---|---|---|\n"
          f"| speculative (random-weight drafter) | {tokens / spec_s:.1f} | {accepted / max(1, blocks):.2f} |\n"
          f"| verifier alone | {ar_tokens / ar_s:.1f} | – |")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
