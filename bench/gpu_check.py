"""One command checks a GPU machine, offline, and writes one report: ``make gpu-check`` (at most 10 minutes on one
H200), or at CPU scale where there is none.

    python bench/gpu_check.py                                    # everything: runs/gpu-check/report.md
    python bench/gpu_check.py --stages pairs --pairs gemma       # a part of it
    python bench/gpu_check.py --scale cpu --budget 600 --suite-args tests/test_structure.py   # CPU rehearsal

Stages, in order, each timed and run only while ``--budget`` has time left for it (a stage that would not fit says
so in the report):

1. ``env``: the machine, the packages, and the accelerator's measured matmul rate in bf16 (what MFU is quoted
   against, beside the data sheet's figure);
2. ``suite``: the test suite with the accelerator visible (``pytest -n WORKERS``): its counts, every failure and
   every skip with its reason;
3. ``demo``: ``make demo``'s pipeline on the accelerator at fewer steps (the tiny zoo, ``align/train.py
   recipes/tiny.yaml``, the same-size autoregressive drafter, ``recipes/tiny-dflash.yaml``, ``eval.acceptance
   --interleave`` with the n-gram drafter beside): tokens/s of each drafter kind against the verifier alone, greedy
   and sampled, and the lossless check;
4. ``pairs``: each replica pair (``--pairs``: the recipes' models, random weights, ~1B at GPU scale): training
   windows/s, model FLOPs utilisation and peak memory under ZeRO-2 and ZeRO-3, LoRA and full, at micro-batch 4 and
   at the recipe's own; a profile of the recipe's step (top kernels, the device's busy share, the step's phases);
   drafter and verifier pass latency per γ and K; speculative decoding against the verifier alone, greedy (lossless,
   bf16 near-ties told apart) and sampled.

MFU: the FLOPs of a training step are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one step's
forward and backward (every matmul and attention as it runs: masked positions included, elementwise work not), and
divided by the step's time and the matmul rate measured here (and the data sheet's, on a known GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STAGES = ("env", "suite", "demo", "pairs")
PAIRS = {"gemma": ("replica-gemma4-verifier", "replica-diffusiongemma", "diffusiongemma"),
         "qwen-diffucoder": ("replica-qwen2.5-verifier", "replica-diffucoder", "dream")}
DATASHEET_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}  # dense bf16 FLOP/s
# the tiny zoo at CPU scale: the sizes the tests build their miniature zoo with
MINI_ZOO = {"docs_per_kind": 40, "test_per_kind": 3, "vocab_size": 400, "batch_size": 8,
            "verifier": {"hidden": 32, "layers": 2, "heads": 2, "steps": 20},
            "drafters": {"tiny-diffusiongemma": {"hidden": 32, "layers": 2, "heads": 2, "steps": 10, "offsets": 2,
                                                 "sliding": 2, "next_token": 1.0},
                         "tiny-mdlm": {"hidden": 32, "layers": 2, "heads": 2, "steps": 10},
                         "tiny-dflash": {"layers": 1, "intermediate": 64, "kv_heads": 1, "target_layers": [0],
                                         "steps": 0}}}


class Clock:
    """The budget: seconds left, and whether a stage expected to take ``need`` seconds still fits."""

    def __init__(self, budget: float):
        self.start, self.budget = time.perf_counter(), budget

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def fits(self, need: float) -> bool:
        return self.left() >= need


# ------------------------------------------------------------------------------------------------ measures


def device_name(device) -> str:
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'x86'})"


def matmul_rate(device, dtype_name: str = "bfloat16") -> float:
    """FLOP/s of a large square matmul in ``dtype_name`` on ``device`` (best of five, after a warm-up)."""
    import torch

    from align.loading import DTYPES
    from align.metrics import now

    n = 8192 if torch.device(device).type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype_name])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype_name])
    a @ b
    best = float("inf")
    for _ in range(5):
        start = now(device)
        a @ b
        best = min(best, now(device) - start)
    return 2 * n ** 3 / best


def matmul_rates(device) -> dict[str, float]:
    """The report's ``matmul_bf16_flops`` and ``matmul_f32_flops`` on ``device``."""
    return {"matmul_bf16_flops": matmul_rate(device, "bfloat16"), "matmul_f32_flops": matmul_rate(device, "float32")}


def peak_memory(device) -> float:
    """GiB: the accelerator's peak allocation since the last reset, else this process's resident memory."""
    import psutil
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return psutil.Process().memory_info().rss / 2 ** 30


def step_flops(step) -> int:
    """The FLOPs ``step()`` runs (forward and backward), counted op by op."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def profile_step(step, device, top: int = 8) -> dict:
    """One ``step()`` under torch's profiler: the ops taking the most (device, else CPU) time, the device's busy
    share of the step's wall time, and the step's phases (the ``align.*`` ranges ``train_step`` marks)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from align.metrics import now

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = now(device)
    with profile(activities=activities) as prof:
        step()
        now(device)
    wall = now(device) - start
    events = prof.key_averages()

    def own(e) -> float:  # seconds
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6

    ops = [e for e in events if not e.key.startswith("align.") and not e.key.startswith("ProfilerStep")]
    busy = sum(own(e) for e in ops)
    phases = {e.key: (e.device_time_total if cuda else e.cpu_time_total) / 1e6 for e in events
              if e.key.startswith("align.")}
    ranked = sorted(ops, key=own, reverse=True)[:top]
    return {"wall_s": wall, "busy_s": busy, "busy_share": busy / wall if cuda else None,
            "top": [{"op": e.key[:80], "s": own(e), "share": own(e) / max(busy, 1e-12), "calls": e.count}
                    for e in ranked],
            "phases_s": phases}


def train_setting(pair: str, zero: int, lora: bool, micro_batch: int, args, rate: float,
                  profile: bool = False) -> dict:
    """The trainer's own step (its strategy, Engine, loss and model loading) on random-token rollouts of
    ``args.prefix`` prompt and ``args.response`` response tokens: windows/s over ``args.steps`` timed steps after a
    warm-up step whose FLOPs are counted; MFU against ``rate``; peak memory; with ``profile``, one more step profiled."""
    import torch
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.config import load_recipe
    from align.distill.backend import Engine
    from align.distill.lora import add_lora
    from align.distill.strategy import strategy_for, train_step
    from align.distill.windows import window_index
    from align.loading import load_drafter_model
    from align.metrics import now

    verifier_name, drafter_name, family = PAIRS[pair]
    b = micro_batch
    recipe = load_recipe(ROOT / "recipes" / f"{pair}.yaml", [
        f"drafter.path=zoo:{drafter_name}", f"deepspeed.zero_stage={zero}", "deepspeed.bf16=true",
        f"lora.r={32 if lora else 0}", "lora.dropout=0.0", f"train.micro_batch_size={b}",
        f"train.global_batch_size={b}", f"data.max_prefix_len={args.prefix}",
        f"train.max_steps={args.steps + 2}", "train.warmup_steps=0"])
    zero3 = Engine.prepare(recipe, 1)  # noqa: F841 (while it lives, ZeRO-3 loads the model sharded)
    try:
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
                for _ in range(b * (args.steps + 2))]
        mask = recipe.drafter.mask_token_id if recipe.drafter.mask_token_id is not None else tokenizer.mask_token_id
        strategy = strategy_for(recipe)(recipe, engine.engine, rows, len(tokenizer), mask)
        pairs = window_index([args.response] * len(rows), list(range(len(rows))))

        def step(i: int):
            return lambda: train_step(strategy, engine, pairs[i * b:(i + 1) * b], i, b)

        flops = step_flops(step(0))  # the warm-up, counted
        start = now(device)
        for i in range(1, args.steps + 1):
            step(i)()
        seconds = (now(device) - start) / args.steps
        found = {"pair": pair, "strategy": strategy.name, "zero": zero, "lora": lora, "micro_batch": b,
                 "windows_per_s": b / seconds, "step_s": seconds, "flops_per_step": flops,
                 "mfu": flops / seconds / rate, "peak_gib": peak_memory(device)}
        if profile:
            found["profile"] = profile_step(step(args.steps + 1), device)
    finally:
        unset_hf_deepspeed_config()  # the caller frees the memory
    return found


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


def decoding(drafter, verifier, tokenizer, prompts: list[list[int]], gamma: int, max_new_tokens: int) -> list[dict]:
    """Speculative decoding against the verifier alone (the same cached loop), greedy and sampled (temperature 1),
    on the same prompts, both warmed up; greedy outputs checked against ``generate``'s (exact, near-tie, mismatch)."""
    from align.lossless import classify
    from align.metrics import now
    from align.speculative import SpeculativeDecoder
    from align.verifier import ar_generate, eos_ids, verifier_alone

    eos = eos_ids(verifier.model, tokenizer)
    decoder = SpeculativeDecoder(drafter, verifier, eos)
    decoder.generate(prompts[0], max_new_tokens, gamma)  # warm-ups
    verifier_alone(verifier, prompts[0], max_new_tokens, eos)
    rows = []
    for temperature in (0.0, 1.0):
        spec_tokens = spec_s = alone_tokens = alone_s = accepted = blocks = 0
        verdicts = {"exact": 0, "near-tie": 0, "mismatch": 0}
        for seed, prompt in enumerate(prompts):
            out = decoder.generate(prompt, max_new_tokens, gamma, temperature=temperature, seed=seed)
            spec_tokens, spec_s = spec_tokens + len(out.tokens), spec_s + out.stats.total_s
            accepted += sum(b.accepted for b in out.stats.blocks if b.gamma)
            blocks += sum(1 for b in out.stats.blocks if b.gamma)
            start = now(verifier.device)
            alone = verifier_alone(verifier, prompt, max_new_tokens, eos, temperature, seed)
            alone_s += now(verifier.device) - start
            alone_tokens += len(alone.tokens)
            if temperature == 0:
                reference = ar_generate(verifier.model, prompt, max_new_tokens, 0.0, eos)
                verdicts[classify(verifier.model, prompt, out.tokens, reference)[0]] += 1
        rows.append({"temperature": temperature, "gamma": gamma, "tokens_per_s": spec_tokens / spec_s,
                     "alone_tokens_per_s": alone_tokens / alone_s,
                     "speedup": (spec_tokens / spec_s) / (alone_tokens / alone_s),
                     "accepted_mean": accepted / max(1, blocks), "lossless": verdicts if temperature == 0 else None})
    return rows


# ------------------------------------------------------------------------------------------------ stages


def stage_env(args, report: dict) -> None:
    import torch

    from align.machine import default_device

    device = default_device()
    versions = {}
    for name in ("torch", "transformers", "deepspeed", "datasets", "peft", "vllm"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    sheet = next((v for k, v in DATASHEET_BF16.items() if k in device_name(device)), None)
    report["env"] = {"device": device_name(device), "devices": torch.cuda.device_count(), "cpu_cores": os.cpu_count(),
                     "python": platform.python_version(), "versions": versions, **matmul_rates(device),
                     "datasheet_bf16_flops": sheet, "hub_offline": os.environ.get("HF_HUB_OFFLINE")}


def stage_suite(args, report: dict, clock: Clock) -> None:
    """The test suite with the accelerator visible: counts, failures and every skip with its reason."""
    workers = args.workers or max(1, min(16, (os.cpu_count() or 2) - 2))
    timeout = max(30, int(min(args.suite_seconds, clock.left() - 60)))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=line",
               *(["-n", str(workers)] if workers > 1 else []), *args.suite_args.split()]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        out, code = (expired.stdout or b"").decode(errors="replace"), "timeout"
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", summary)}
    report["suite"] = {"command": " ".join(command[1:]), "exit": code, "seconds": time.perf_counter() - start,
                       "counts": counts, "summary": summary.strip("= "),
                       "failed": [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))][:40],
                       "skipped": [line for line in out.splitlines() if line.startswith("SKIPPED")][:40]}


def run(command: list[str], log: Path, env: dict, timeout: float) -> float:
    """Run ``command`` with its output into ``log``; its seconds (raises with the log's tail when it fails)."""
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[1:4])} failed ({done.returncode}): "
                           + " | ".join(log.read_text().strip().splitlines()[-3:]))
    return time.perf_counter() - start


def stage_demo(args, report: dict, clock: Clock) -> None:
    """``make demo``'s pipeline on the accelerator, with ``--demo-steps`` training steps per drafter."""
    from align.zoo.build import ZooSpec, build

    out = (ROOT / args.out / "demo").resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec = ZooSpec(**MINI_ZOO) if args.scale == "cpu" else ZooSpec()
    times, py = {}, sys.executable
    start = time.perf_counter()
    build(["tiny-verifier", "tiny-diffusiongemma", "tiny-dflash"], spec)
    times["zoo"] = time.perf_counter() - start
    env = {**os.environ, "ALIGN_CACHE": os.environ["ALIGN_CACHE"]}
    steps = [f"train.max_steps={args.demo_steps}", f"train.save_every={args.demo_steps}",
             f"train.eval_every={args.demo_steps}"]
    small = ["data.num_prompts=48", "data.max_new_tokens=32", "train.eval_windows=64"] if args.scale == "cpu" else []
    commands = [
        ("align", [py, "align/train.py", "recipes/tiny.yaml", *steps, *small, f"run.output_dir={out}/tiny"]),
        ("ar", [py, "-m", "align.baseline", "train", "--run", f"{out}/tiny", "--out", f"{out}/tiny/ar",
                "--eval-every", "0", *(["--steps", "5", "--batch-size", "8"] if args.scale == "cpu" else [])]),
        ("dflash", [py, "align/train.py", "recipes/tiny-dflash.yaml", *steps, *small,
                    f"run.output_dir={out}/tiny-dflash"]),
        ("eval", [py, "-m", "eval.acceptance", "--ckpt", f"{out}/tiny/final", "--suite", "tinyworld", "--gamma",
                  "16", "--temperature", "0,1", "--drafter", f"ar={out}/tiny/ar", "--drafter",
                  f"dflash={out}/tiny-dflash/final", "--drafter", "lookup=ngram", "--interleave", "--limit",
                  str(args.demo_prompts), "--max-new-tokens", str(args.demo_tokens), "--out", f"{out}/eval"]),
    ]
    for name, command in commands:
        if (out / "tiny" / "final" / "meta.json").is_file() and name == "align" or \
                (out / "tiny" / "ar" / "meta.json").is_file() and name == "ar":
            continue  # done by an earlier run of this check
        times[name] = run(command, out / f"{name}.log", env, max(60, clock.left()))
    results = json.loads((out / "eval" / "acceptance.json").read_text())["results"]
    report["demo"] = {"seconds": times, "steps": args.demo_steps, "prompts": args.demo_prompts,
                      "rows": [{k: r.get(k) for k in ("label", "temperature", "accepted_mean", "tau", "tokens_per_s",
                                                      "ar_tokens_per_s", "speedup", "lossless", "lossless_counts")}
                               for r in results]}


def stage_pairs(args, report: dict, clock: Clock) -> None:
    import torch

    from align.distill.distributed import init_distributed
    from align.drafters import load_pair
    from align.families import traits
    from align.prompts import encode_prompt
    from align.tinyworld.corpus import read_jsonl
    from align.zoo import model_dir, world_dir
    from align.zoo.build import ZooSpec, build

    init_distributed()
    # MFU's peak: the faster of the two dtypes a step's matmuls run in (the drafter's bf16, LoRA's float32); where
    # the device converts bfloat16 in software (an AVX2-only CPU: a tenth of float32's rate) float32 is its peak
    env = report.get("env") or matmul_rates(torch.device("cpu"))
    rate = max(env["matmul_bf16_flops"], env["matmul_f32_flops"])
    report["pairs"] = {}
    for pair in args.pairs.split(","):
        verifier_name, drafter_name, family = PAIRS[pair]
        found = report["pairs"][pair] = {"train": [], "latency": [], "decoding": []}
        start = time.perf_counter()
        # the replicas, and the tiny world whose tokenizer they extend and whose prompts are decoded below
        build([verifier_name, drafter_name], ZooSpec(**MINI_ZOO, replica_scale="cpu") if args.scale == "cpu" else
              ZooSpec(replica_scale="gpu"))
        found["build_s"] = time.perf_counter() - start
        recipe_batch = int(re.search(r"micro_batch_size: (\d+)", (ROOT / "recipes" / f"{pair}.yaml").read_text())[1])
        batches = sorted({args.micro_batch, recipe_batch if args.scale == "gpu" else args.micro_batch})
        for zero in map(int, args.zero.split(",")):
            for lora in {"lora": (True,), "full": (False,), "both": (True, False)}[args.modes]:
                for b in batches:
                    if not clock.fits(args.pair_reserve):
                        found["train"].append({"zero": zero, "lora": lora, "micro_batch": b, "skipped": "budget"})
                        continue
                    profile = zero == 2 and not lora and b == batches[-1]  # the recipe's batch, full fine-tuning
                    try:
                        found["train"].append(train_setting(pair, zero, lora, b, args, rate, profile))
                    except torch.OutOfMemoryError as error:
                        found["train"].append({"zero": zero, "lora": lora, "micro_batch": b,
                                               "error": str(error).splitlines()[0][:160]})
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
        drafter, verifier, tokenizer = load_pair(str(model_dir(drafter_name)), str(model_dir(verifier_name)), family,
                                                 "bfloat16", trust_remote_code=traits(family).remote_code)
        prompts = [encode_prompt(tokenizer, r["prompt"]) for r in read_jsonl(world_dir() / "test_prompts.jsonl")]
        prompts = prompts[:args.prompts]
        gammas = [int(g) for g in args.gammas.split(",")]
        for gamma in gammas:
            for k in map(int, args.ks.split(",")):
                d_ms, v_ms = pass_latency(drafter, verifier, prompts[0], gamma, k, repeats=args.repeats)
                found["latency"].append({"gamma": gamma, "k": k, "drafter_ms": d_ms, "verifier_ms": v_ms})
        found["decoding"] = decoding(drafter, verifier, tokenizer, prompts, gammas[len(gammas) // 2],
                                     args.max_new_tokens)
        found["seconds"] = time.perf_counter() - start
        del drafter, verifier
        gc.collect()


# ------------------------------------------------------------------------------------------------ the report


def markdown(report: dict) -> str:
    """The report as markdown: one table per measure."""
    lines = [f"# GPU check ({report['date']}, {report['scale']} scale, {report['seconds']:.0f} s)", ""]
    env = report.get("env")
    if env:
        sheet = env["datasheet_bf16_flops"]
        lines += [f"Machine: {env['device']} ({env['devices']} GPU, {env['cpu_cores']} cores), Python {env['python']}; "
                  + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ". Measured bf16 matmul: "
                  f"{env['matmul_bf16_flops'] / 1e12:.1f} TFLOP/s" + (f" (data sheet {sheet / 1e12:.0f})" if sheet
                                                                        else "") +
                  f", float32 {env['matmul_f32_flops'] / 1e12:.1f} TFLOP/s (MFU's peak: the faster).", ""]
    for stage, reason in report.get("skipped", {}).items():
        lines += [f"Stage {stage}: not run ({reason}).", ""]
    suite = report.get("suite")
    if suite:
        lines += ["## The suite", "", f"`{suite['command']}`: exit {suite['exit']}, {suite['summary']} "
                  f"({suite['seconds']:.0f} s)", ""] + [f"- {line}" for line in suite["failed"] + suite["skipped"]]
        lines.append("")
    demo = report.get("demo")
    if demo:
        lines += ["## make demo's pipeline", "", f"{demo['steps']} training steps per drafter, {demo['prompts']} "
                  "held-out prompts, γ 16, interleaved; stage seconds: " + ", ".join(
                      f"{k} {v:.0f}" for k, v in demo["seconds"].items()), "",
                  "| drafter | temperature | accepted_mean | τ | tokens/s | verifier alone tokens/s | speedup | "
                  "lossless |", "|---|---|---|---|---|---|---|---|"]
        for r in demo["rows"]:
            counts = r["lossless_counts"]
            verdict = "– (sampled)" if counts is None else ", ".join(f"{counts.get(k.replace('-', '_'), 0)} {k}"
                                                                     for k in ("exact", "near-tie", "mismatch"))
            lines.append(f"| {r['label']} | {r['temperature']:g} | {r['accepted_mean'] or 0:.2f} | "
                         f"{r['tau'] or 0:.2f} | {r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f} | {verdict} |")
        lines.append("")
    for pair, found in report.get("pairs", {}).items():
        lines += [f"## The {pair} pair (replicas, {report['scale']} scale; built in {found['build_s']:.0f} s)", "",
                  "| training (bf16, 1 process) | micro-batch | windows/s | FLOPs per step | MFU | peak GiB |",
                  "|---|---|---|---|---|---|"]
        for t in found["train"]:
            name = f"ZeRO-{t['zero']}, {'LoRA r=32' if t['lora'] else 'full'}"
            if "windows_per_s" not in t:
                lines.append(f"| {name} | {t['micro_batch']} | {t.get('skipped') or t.get('error')} | | | |")
                continue
            lines.append(f"| {name} ({t['strategy']}) | {t['micro_batch']} | {t['windows_per_s']:,.1f} | "
                         f"{t['flops_per_step']:.3g} | {100 * t['mfu']:.1f}% | {t['peak_gib']:.1f} |")
        profiled = next((t for t in found["train"] if "profile" in t), None)
        if profiled:
            p = profiled["profile"]
            busy = "" if p["busy_share"] is None else f", the device busy {100 * p['busy_share']:.0f}% of it"
            lines += ["", f"Profile of one step (ZeRO-{profiled['zero']}, full, micro-batch {profiled['micro_batch']}):"
                      f" {1000 * p['wall_s']:.0f} ms{busy}; phases: " + ", ".join(
                          f"{k[len('align.'):]} {1000 * v:.0f} ms" for k, v in p["phases_s"].items()), "",
                      "| op | ms | share | calls |", "|---|---|---|---|"]
            lines += [f"| `{o['op']}` | {1000 * o['s']:.1f} | {100 * o['share']:.0f}% | {o['calls']} |"
                      for o in p["top"]]
        lines += ["", "| γ | K | drafter pass (ms) | verifier pass (ms) |", "|---|---|---|---|"]
        lines += [f"| {x['gamma']} | {x['k']} | {x['drafter_ms']:.2f} | {x['verifier_ms']:.2f} |"
                  for x in found["latency"]]
        lines += ["", "| decoding (bf16, random-weight drafter) | γ | tokens/s | verifier alone tokens/s | speedup | "
                  "accepted_mean | lossless (greedy) |", "|---|---|---|---|---|---|---|"]
        for d in found["decoding"]:
            verdict = "–" if d["lossless"] is None else ", ".join(f"{n} {k}" for k, n in d["lossless"].items())
            lines.append(f"| {'greedy' if d['temperature'] == 0 else 'sampled, T 1'} | {d['gamma']} | "
                         f"{d['tokens_per_s']:.1f} | {d['alone_tokens_per_s']:.1f} | {d['speedup']:.2f} | "
                         f"{d['accepted_mean']:.2f} | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    p.add_argument("--scale", default="gpu", choices=("cpu", "gpu"), help="replica and demo size")
    p.add_argument("--out", default="runs/gpu-check")
    p.add_argument("--budget", type=float, default=570, help="seconds for everything (stages that would not fit "
                   "are left out, with a line saying so)")
    p.add_argument("--workers", type=int, default=None, help="pytest workers (default: the cores less two)")
    p.add_argument("--suite-args", default="tests", help="what pytest runs (the suite stage)")
    p.add_argument("--suite-seconds", type=float, default=200, help="the suite stage's limit")
    p.add_argument("--demo-steps", type=int, default=100, help="training steps of each demo drafter")
    p.add_argument("--demo-prompts", type=int, default=32, help="held-out prompts the demo evaluates")
    p.add_argument("--demo-tokens", type=int, default=64, help="new tokens per prompt in the demo's evaluation")
    p.add_argument("--pairs", default="gemma,qwen-diffucoder", help=f"comma list of {', '.join(PAIRS)}")
    p.add_argument("--pair-reserve", type=float, default=60, help="seconds a training setting needs, at least")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per setting")
    p.add_argument("--zero", default="2,3", help="ZeRO stages timed (comma list)")
    p.add_argument("--modes", default="both", choices=("lora", "full", "both"), help="LoRA, full fine-tuning or both")
    p.add_argument("--micro-batch", type=int, default=4, help="the micro-batch timed besides the recipe's own")
    p.add_argument("--prefix", type=int, default=512, help="prompt tokens of each training rollout")
    p.add_argument("--response", type=int, default=64, help="response tokens of each training rollout (a window "
                   "per token)")
    p.add_argument("--gammas", default="8,16,32")
    p.add_argument("--ks", default="1,8")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per γ and K")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    stages = args.stages.split(",")
    if unknown := [s for s in stages if s not in STAGES]:
        raise SystemExit(f"error: unknown stage {unknown[0]}; choose from {', '.join(STAGES)}")
    if unknown := [s for s in args.pairs.split(",") if s not in PAIRS]:
        raise SystemExit(f"error: unknown pair {unknown[0]}; choose from {', '.join(PAIRS)}")
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    os.environ["ALIGN_CACHE"] = str((out / "cache").resolve())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    clock = Clock(args.budget)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "scale": args.scale, "args": vars(args), "skipped": {}}
    need = {"env": 5, "suite": 60, "demo": 90, "pairs": args.pair_reserve}
    for stage in stages:
        if not clock.fits(need[stage]):
            report["skipped"][stage] = f"{max(0.0, clock.left()):.0f} s of the budget left"
            continue
        print(f"== {stage} ({clock.left():.0f} s left)", flush=True)
        try:
            if stage == "env":
                stage_env(args, report)
            else:
                globals()[f"stage_{stage}"](args, report, clock)
        except Exception as error:  # one stage failing is a finding of the check, not the end of it
            report["skipped"][stage] = f"failed: {type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    report["seconds"] = time.perf_counter() - clock.start
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    failed = [s for s, why in report["skipped"].items() if why.startswith("failed")]
    suite_bad = report.get("suite", {}).get("exit") not in (None, 0)
    return 1 if failed or suite_bad else 0


if __name__ == "__main__":
    sys.exit(main())
