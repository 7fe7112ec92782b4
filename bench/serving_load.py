"""Serving under load: align's proposer in vLLM where vLLM's users meet it, each case against vLLM without speculation.

    .venv-vllm/bin/python bench/serving_load.py --ckpt runs/tiny/final --out runs/serving-load

Two engines with the same settings — without speculation, and with ``align.serving.DiffusionProposer`` — each in its
own process (vLLM's metrics are process-wide), run the same cases one after another:

- ``load``: ``--requests`` requests of mixed prompt and output lengths, all submitted at once, at most
  ``--concurrency`` running (``max_num_seqs``), greedy;
- ``near_limit``: prompts that end 1, 2, γ/2, γ and γ + 1 tokens before ``max_model_len``, generating to it, greedy;
- ``aborts``: ``--concurrency`` requests, every other one aborted after a few engine steps, greedy;
- ``parallel``: ``n = --n`` samples per request (parallel sampling) at temperature 1 on one prompt, ``--samples`` in
  all; the tokens at output positions 1, 2 and 3 (position 0 comes from the prefill, speculation starts after it) of
  the two engines are compared by a chi-square test of homogeneity (``align.lossless.homogeneity``; it needs at
  least two cells of 5 expected samples, else it fails as
  saying nothing).

The KV cache holds ``--kv-tokens`` tokens in blocks of 32 (default concurrency × max_model_len / 4): the running
requests' prompts fit, their growth does not, so vLLM must preempt requests and resume them (by recomputation); preemptions are vLLM's own counter ``vllm:num_preemptions``.
After every engine step the proposer's prefix states are counted in its worker (``collective_rpc``): they must never
exceed the requests running; vLLM's ``custom_class`` interface tells a proposer nothing when requests finish, so the
states of the last step's requests live until the engine's next step (vLLM's own persistent batch keeps finished
requests the same way) — the table shows both the most and the count at the end of each case.

Writes ``OUT/serving_load.json``, ``OUT/serving_load.md`` and ``OUT/outputs.json`` (every output of both engines); exits 1 when a check fails (greedy outputs differ, a
sampled position's p-value < ``--alpha``, more states than running requests, or an engine raised).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from align.errors import AlignError, run_cli  # noqa: E402
from eval.vllm_engine import run_child  # noqa: E402

BLOCK = 32  # KV-cache block size in tokens (vLLM-CPU's attention needs a multiple of 32; its default is larger)
CASES = ("load", "near_limit", "aborts", "parallel")
COUNTERS = {"vllm:num_preemptions": "preemptions", "vllm:spec_decode_num_drafts": "drafts",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/serving_load.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="the drafter: an export of align/train.py (its meta.json names the "
                   "verifier)")
    p.add_argument("--verifier", default=None, help="verifier folder (default: meta.json's)")
    p.add_argument("--suite", default=None, help="prompt suite the requests are cut from (default tinyworld)")
    p.add_argument("--prompts", default=None, help='JSONL of {"id", "prompt"} instead of a suite')
    p.add_argument("--gamma", type=int, default=16, help="num_speculative_tokens")
    p.add_argument("--requests", type=int, default=64, help="requests of the load case")
    p.add_argument("--concurrency", type=int, default=16, help="max_num_seqs")
    p.add_argument("--max-model-len", type=int, default=256, help="max_model_len (at most the verifier's context)")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV-cache size in tokens, in blocks of 32 (default "
                   "concurrency × max_model_len / 4: the prompts fit, their growth does not)")
    p.add_argument("--n", type=int, default=8, help="samples per request of the parallel case")
    p.add_argument("--samples", type=int, default=320, help="samples of the parallel case, per engine")
    p.add_argument("--sample-temperature", type=float, default=1.0, help="temperature of the parallel case")
    p.add_argument("--alpha", type=float, default=1e-3, help="the sampled positions' p-value threshold")
    p.add_argument("--proposer", default="align", choices=("align", "constant"),
                   help="align: align.serving.DiffusionProposer with --ckpt; constant: a control that drafts one "
                        "token γ times (ConstantProposer), to tell vLLM's behaviour from the drafter's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/serving-load", help="output folder")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one engine's run, config on stdin
    args = p.parse_args(argv)
    for name in ("gamma", "requests", "concurrency", "max_model_len", "n", "samples"):
        if getattr(args, name) < 1:
            raise AlignError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_model_len <= args.gamma + 2:
        raise AlignError(f"--max-model-len {args.max_model_len} leaves no room for a γ-{args.gamma} draft; raise it")
    if not 0 < args.sample_temperature <= 2:
        raise AlignError(f"--sample-temperature must be in (0, 2] (vLLM's range), got {args.sample_temperature}")
    if args.suite and args.prompts:
        raise AlignError("give either --suite or --prompts, not both")
    return args


def requests(args: argparse.Namespace, pool: list[int], eos: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Every case's requests: {"id", "prompt" (token ids), "max_tokens", "temperature", "n"}, cut from ``pool`` (the
    suite's prompts, encoded and concatenated) with a seeded generator, so both engines get the same."""
    rng = random.Random(args.seed)
    limit, gamma = args.max_model_len, args.gamma

    def cut(length: int) -> list[int]:
        start = rng.randrange(0, max(1, len(pool) - length))
        ids = (pool * (1 + length // len(pool)))[start:start + length]
        return [t if t not in eos else pool[0] for t in ids]  # an EOS inside a prompt would end nothing here

    cases: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    for i in range(args.requests):
        length = rng.randint(1, limit // 2)
        cases["load"].append({"id": f"load-{i}", "prompt": cut(length), "temperature": 0.0, "n": 1,
                              "max_tokens": rng.randint(1, min(limit // 2, limit - length - 1))})
    for i, left in enumerate(sorted({1, 2, max(1, gamma // 2), gamma, gamma + 1})):
        cases["near_limit"].append({"id": f"near-{i}", "prompt": cut(limit - left), "temperature": 0.0, "n": 1,
                                    "max_tokens": left})
    for i in range(args.concurrency):
        cases["aborts"].append({"id": f"abort-{i}", "prompt": cut(rng.randint(4, limit // 4)), "temperature": 0.0,
                                "n": 1, "max_tokens": limit // 4, "abort": i % 2 == 1})
    prompt = cut(8)
    for i in range(-(-args.samples // args.n)):
        cases["parallel"].append({"id": f"parallel-{i}", "prompt": prompt, "temperature": args.sample_temperature,
                                  "n": args.n,
                                  "max_tokens": 4})
    return cases


class ConstantProposer:
    """The control: a ``custom_class`` proposer that drafts token ``CONSTANT`` γ times for every running request and
    keeps no state — whatever it shows under sampling is vLLM's own doing."""

    def __init__(self, vllm_config: Any):
        self.gamma = int(vllm_config.speculative_config.num_speculative_tokens)
        self.states: list = []

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[CONSTANT] * self.gamma if sampled else [] for sampled in sampled_token_ids]


CONSTANT = 5
PROPOSERS = {"align": "align.serving.DiffusionProposer", "constant": "bench.serving_load.ConstantProposer"}


def live_states(worker: Any) -> int:
    """The proposer's kept prefix states, read inside vLLM's worker."""
    worker = getattr(worker, "worker", None) or worker
    return len(worker.model_runner.drafter.states)


def child(config: dict[str, Any]) -> dict[str, Any]:
    """One engine (``config["drafter"]`` or none) through every case; outputs, counters and state counts."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind  # one output per request, all n samples (as LLM.generate)

    spec = None
    if config["drafter"]:
        spec = {"method": "custom_class", "model": PROPOSERS[config["proposer"]],
                "num_speculative_tokens": config["gamma"]}
    llm = LLM(model=config["verifier"], dtype="float32", seed=config["seed"], max_num_seqs=config["concurrency"],
              max_model_len=config["max_model_len"], kv_cache_memory_bytes=config["kv_bytes"], block_size=BLOCK,
              enforce_eager=True,
              disable_log_stats=False, generation_config="vllm", speculative_config=spec)
    engine = llm.llm_engine

    def counters() -> dict[str, float]:
        found = {name: 0.0 for name in COUNTERS.values()}
        for metric in llm.get_metrics():
            if metric.name in COUNTERS:
                found[COUNTERS[metric.name]] += metric.value
        return found

    results = {}
    for case, todo in config["cases"].items():
        before = counters()
        for r in todo:
            params = SamplingParams(temperature=r["temperature"], n=r["n"], max_tokens=r["max_tokens"],
                                    stop_token_ids=config["eos"], output_kind=RequestOutputKind.FINAL_ONLY)
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, params)
        outputs, most, steps = {}, 0, 0
        to_abort = [r["id"] for r in todo if r.get("abort")]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = [list(o.token_ids) for o in out.outputs]
            steps += 1
            if spec:
                most = max(most, llm.collective_rpc(live_states)[0])
            if to_abort and steps == 3:
                engine.abort_request(to_abort)
        after = counters()
        results[case] = {"outputs": {k: v for k, v in outputs.items() if k not in to_abort}, "steps": steps,
                         "most_states": most, "end_states": llm.collective_rpc(live_states)[0] if spec else 0,
                         **{name: after[name] - before[name] for name in COUNTERS.values()}}
    return results


def run_engine(config: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    if config["drafter"]:
        env["ALIGN_DRAFTER"] = config["drafter"]
    return run_child([str(Path(__file__).resolve()), "--ckpt", "-", "--child", "1"], config, env,
                     f"the vLLM engine ({'with' if config['drafter'] else 'without'} speculation) failed")


def compare(cases: dict[str, list[dict]], plain: dict, spec: dict, concurrency: int,
            alpha: float) -> list[dict[str, Any]]:
    """One row per case: what was run, whether it held."""
    from align.lossless import homogeneity

    rows = []
    for case, todo in cases.items():
        p, s = plain[case], spec[case]
        row = {"case": case, "requests": len(todo), "samples": sum(r["n"] for r in todo),
               "concurrency": concurrency, "steps": s["steps"], "preemptions_plain": p["preemptions"],
               "preemptions_spec": s["preemptions"], "drafts": s["drafts"],
               "accepted_mean": s["accepted_tokens"] / s["drafts"] if s["drafts"] else None,
               "most_states": s["most_states"], "end_states": s["end_states"], "aborted": sum(
                   bool(r.get("abort")) for r in todo)}
        greedy = [r["id"] for r in todo if r["temperature"] == 0]
        compared = [i for i in greedy if i in p["outputs"]]  # aborted requests are left out of both
        row["greedy_compared"] = len(compared)
        row["greedy_equal"] = sum(i in s["outputs"] and p["outputs"][i] == s["outputs"][i] for i in compared)
        sampled = [r["id"] for r in todo if r["temperature"] > 0]
        row["p_values"], row["cells"] = [], []
        for position in (1, 2, 3):
            counts = [Counter(o[position] for i in sampled for o in side["outputs"].get(i, []) if len(o) > position)
                      for side in (p, s)]
            if sampled and all(counts):
                value, cells = homogeneity(*counts)
                row["p_values"].append(value)
                row["cells"].append(cells)  # 1: too few samples per outcome to say anything
        row["ok"] = (row["greedy_equal"] == row["greedy_compared"]
                     and row["greedy_compared"] == len(greedy) - row["aborted"]
                     and all(v >= alpha for v in row["p_values"]) and all(c > 1 for c in row["cells"])
                     and row["most_states"] <= concurrency)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | requests (samples) | concurrency | aborted | greedy outputs equal | sampled p (cells), positions 1–3 "
             "| preemptions, without / with speculation | accepted_mean | proposer states: most / at the end | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ps = ", ".join(f"{v:.3f} ({o})" for v, o in zip(r["p_values"], r["cells"])) or "-"
        acc = "-" if r["accepted_mean"] is None else f"{r['accepted_mean']:.2f}"
        greedy = f"{r['greedy_equal']} / {r['greedy_compared']}" if r["greedy_compared"] else "-"
        lines.append(f"| {r['case']} | {r['requests']} ({r['samples']}) | {r['concurrency']} | {r['aborted']} | "
                     f"{greedy} | {ps} | {r['preemptions_plain']:.0f} / {r['preemptions_spec']:.0f} | {acc} | "
                     f"{r['most_states']} / {r['end_states']} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))), flush=True)
        return 0
    from align.files import write_text

    try:
        import vllm  # noqa: F401
    except ImportError:
        raise AlignError("bench/serving_load.py needs vLLM: on CPU run `make vllm-env`, then .venv-vllm/bin/python "
                         "bench/serving_load.py ...") from None
    ckpt, verifier = models(args)
    cases, config = prepare(args, ckpt, verifier)
    plain = run_engine({**config, "drafter": None})
    spec = run_engine({**config, "drafter": ckpt})
    rows = compare(cases, plain, spec, args.concurrency, args.alpha)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "serving_load.json", json.dumps({"settings": {k: v for k, v in config.items() if k != "cases"},
                                                      "rows": rows}, indent=1))
    write_text(out / "serving_load.md", table(rows) + "\n")
    write_text(out / "outputs.json", json.dumps({"without": plain, "with": spec}))  # every output, for a closer look
    print(table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


def models(args: argparse.Namespace) -> tuple[str, str]:
    """(drafter, verifier) folders, checked before any engine starts (the verifier from the export's meta.json)."""
    from align.loading import check_model_folder
    from align.zoo import resolve

    check_model_folder(args.ckpt, "drafter")
    ckpt = resolve(args.ckpt)
    meta = Path(ckpt) / "meta.json"
    verifier = args.verifier or (json.loads(meta.read_text()).get("verifier") if meta.is_file() else None)
    if verifier is None:
        raise AlignError(f"{args.ckpt} has no meta.json naming its verifier (not an align export); pass --verifier")
    check_model_folder(verifier, "verifier")
    if args.prompts and not Path(args.prompts).is_file():
        raise AlignError(f"--prompts {args.prompts}: no such file")
    return ckpt, resolve(verifier)


def prepare(args: argparse.Namespace, ckpt: str, verifier: str) -> tuple[dict, dict[str, Any]]:
    """The cases' requests and the engines' shared settings (the KV-cache budget from the verifier's config)."""
    from transformers import AutoConfig

    from align.loading import load_tokenizer
    from align.prompts import encode_prompt, read_prompt_file
    from align.rollouts import _context, folder_eos
    from eval.suites import load_suite

    if args.max_model_len > _context(verifier):
        raise AlignError(f"--max-model-len {args.max_model_len} exceeds the verifier's context {_context(verifier)}")
    tokenizer = load_tokenizer(verifier, "verifier")
    prompts = read_prompt_file(args.prompts) if args.prompts else load_suite(args.suite or "tinyworld")
    pool = [t for p in prompts for t in encode_prompt(tokenizer, p["prompt"])]
    eos = folder_eos(verifier, tokenizer)
    cfg = AutoConfig.from_pretrained(verifier)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * heads * head_dim * 4  # keys and values, float32
    kv_tokens = args.kv_tokens or args.concurrency * args.max_model_len // 4
    if kv_tokens < args.max_model_len + args.gamma + 1:
        raise AlignError(f"--kv-tokens {kv_tokens} cannot hold one request of max_model_len {args.max_model_len}; "
                         "raise it")
    cases = requests(args, pool, eos)
    return cases, {"verifier": verifier, "proposer": args.proposer, "gamma": args.gamma, "concurrency": args.concurrency, "seed": args.seed,
                   "max_model_len": args.max_model_len, "kv_bytes": kv_tokens * per_token, "kv_tokens": kv_tokens,
                   "eos": eos, "cases": cases}


if __name__ == "__main__":
    run_cli(main)
