"""Acceptance through vLLM: ``LLM.generate`` with align's proposer and without speculation, vLLM's own counters.

``python -m eval.acceptance --engine vllm ...`` calls :func:`measure` (run it with the Python of the environment
that has vLLM: ``.venv-vllm/bin/python`` on CPU). Each configuration (drafter or none, concurrency) runs in its own
process: vLLM's metrics are process-wide and its engine is easiest to release by exiting.

Per configuration, after a warm-up request: every prompt through one ``LLM.generate`` call with at most
``concurrency`` requests running at once (``max_num_seqs``); tokens/s over that call; from vLLM's counters
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos``: accepted_mean = accepted / drafts, τ = 1 + accepted / drafts (vLLM's mean
acceptance length), α_j = accepted at position j / reached position j. Greedy outputs with the proposer are compared
token for token with the outputs without it (``lossless``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from align.errors import AlignError

PROPOSER = "align.serving.DiffusionProposer"
COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def engine_name() -> str:
    import torch

    return "vllm" if torch.cuda.is_available() else "vllm-cpu"


def measure(verifier: str, drafters: list[tuple[str, str]], prompts: list[list[int]], gamma: int, steps: int,
            temperature: float, max_new_tokens: int, concurrency: list[int], seed: int, dtype: str,
            family: str | None = None) -> list[dict[str, Any]]:
    """One result per (drafter label, concurrency), each beside vLLM without speculation at that concurrency."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise AlignError("--engine vllm needs vLLM in this environment: on CPU run `make vllm-env`, then "
                         ".venv-vllm/bin/python -m eval.acceptance --engine vllm ...; on GPU pip install vllm"
                         ) from None
    results = []
    for c in concurrency:
        common = dict(verifier=verifier, prompts=prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                      concurrency=c, seed=seed, dtype=dtype)
        plain = _run({**common, "drafter": None})
        for label, path in drafters:
            spec = _run({**common, "drafter": path, "family": family, "gamma": gamma, "steps": steps})
            drafts = max(1, spec["drafts"])
            per_pos = spec["accepted_per_pos"]
            reached = [spec["drafts"]] + per_pos[:-1]
            result = {"engine": engine_name(), "label": label, "drafter": path, "verifier": verifier,
                      "concurrency": c, "gamma": gamma, "steps": steps, "temperature": temperature, "seed": seed,
                      "n_prompts": len(prompts), "drafts": spec["drafts"], "draft_tokens": spec["draft_tokens"],
                      "accepted_tokens": spec["accepted_tokens"], "accepted_per_pos": per_pos,
                      "accepted_mean": spec["accepted_tokens"] / drafts,
                      "acceptance_length": 1.0 + spec["accepted_tokens"] / drafts,  # vLLM's mean acceptance length
                      "per_position": [a / r if r else None for a, r in zip(per_pos, reached)],
                      "new_tokens": spec["new_tokens"], "tokens_per_s": spec["tokens_per_s"],
                      "plain_tokens_per_s": plain["tokens_per_s"],
                      "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                      "lossless": spec["outputs"] == plain["outputs"] if temperature == 0 else None,
                      "outputs_equal": sum(a == b for a, b in zip(spec["outputs"], plain["outputs"]))}
            results.append(result)
            print(f"{engine_name()} {label} concurrency {c}: accepted_mean {result['accepted_mean']:.2f}, "
                  f"tokens/s {result['tokens_per_s']:.1f} (without speculation {plain['tokens_per_s']:.1f}), "
                  f"lossless {result['lossless']}", flush=True)
    return results


def _run(config: dict[str, Any]) -> dict[str, Any]:
    """One configuration in a child process of this Python (see the module docstring)."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if config["drafter"]:
        env["ALIGN_DRAFTER"] = config["drafter"]
        env["ALIGN_DRAFTER_STEPS"] = str(config["steps"])
        if config.get("family"):
            env["ALIGN_DRAFTER_FAMILY"] = config["family"]
    return run_child(["-m", "eval.vllm_engine"], config, env,
                     f"vLLM run failed (drafter {config['drafter']}, concurrency {config['concurrency']})")


def run_child(argv: list[str], config: dict[str, Any], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run ``python argv`` (this Python, from the repository root, which joins PYTHONPATH: vLLM imports the proposer
    in its own processes) with ``config`` as JSON on stdin; the last JSON line it prints, or one error naming
    ``what`` with the tail of its output."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**env, "PYTHONPATH": root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")}
    done = subprocess.run([sys.executable, *argv], input=json.dumps(config), env=env, cwd=root,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        raise AlignError(f"{what}: " + " | ".join(tail))
    return json.loads(lines[-1])


def _child(config: dict[str, Any]) -> dict[str, Any]:
    from align.machine import vllm_on_every_core

    vllm_on_every_core()
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.reader import Vector

    from align.families import FAMILIES

    spec = None
    kind = FAMILIES.get(config.get("family") or "")
    if config["drafter"] and kind is not None and kind.reads_features:  # vLLM's own dflash method loads the export
        spec = {"method": "dflash", "model": config["drafter"], "num_speculative_tokens": config["gamma"]}
    elif config["drafter"]:
        spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": config["gamma"]}
    import torch
    from transformers import AutoTokenizer

    from align.rollouts import _context, folder_eos

    path = config["verifier"]
    extra = {} if torch.cuda.is_available() else {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 28}
    llm = LLM(model=path, dtype=config["dtype"], seed=config["seed"], max_num_seqs=config["concurrency"],
              max_model_len=min(4096, _context(path)), disable_log_stats=False, generation_config="vllm",
              speculative_config=spec, **extra)
    params = SamplingParams(temperature=config["temperature"], max_tokens=config["max_new_tokens"],
                            seed=config["seed"] if config["temperature"] > 0 else None,
                            stop_token_ids=folder_eos(path, AutoTokenizer.from_pretrained(path)))  # where align stops
    prompts = [{"prompt_token_ids": ids} for ids in config["prompts"]]

    def counters() -> dict[str, Any]:
        found = {name: 0 for name in COUNTERS.values()}
        found["accepted_per_pos"] = [0] * config.get("gamma", 0)
        for metric in llm.get_metrics():
            if metric.name in COUNTERS:
                found[COUNTERS[metric.name]] += metric.value
            elif metric.name == PER_POSITION and isinstance(metric, Vector):
                found["accepted_per_pos"] = [a + b for a, b in zip(found["accepted_per_pos"], metric.values)]
        return found

    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up, untimed
    before = counters()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = counters()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {name: after[name] - before[name] for name in COUNTERS.values()}
    result["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"])]
    result.update(outputs=tokens, new_tokens=sum(map(len, tokens)), seconds=seconds,
                  tokens_per_s=sum(map(len, tokens)) / seconds)
    return result


if __name__ == "__main__":  # vLLM starts its engine in child processes: this module must be importable by them
    print(json.dumps(_child(json.loads(sys.stdin.read()))), flush=True)
