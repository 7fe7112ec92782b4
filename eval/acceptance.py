"""Acceptance before and after alignment, per category and per position, with speed, in one command.

    python -m eval.acceptance --ckpt runs/tiny/final --suite tinyworld
    python -m eval.acceptance --ckpt runs/tiny/final --suite tinyworld-probe --gamma 8,16,32 --k 1,4,8
    python -m eval.acceptance --ckpt DIR --verifier PATH --prompts my_prompts.jsonl --temperature 0,1 --seed 0,1,2
    python -m eval.acceptance --ckpt runs/tiny/final --drafter ar=runs/tiny/ar --drafter dflash=runs/tiny-dflash/final

``--ckpt`` is an exported drafter (its meta.json names the verifier and the base drafter, the default baseline)
or any drafter with ``--verifier``; ``--drafter LABEL=PATH`` (repeatable) measures more drafters of any kind in the
same loop (the kind is read from the folder: ``align.drafters.load_drafter``). Comma lists sweep. Writes acceptance.json, report.md and PNG plots into
``--out`` (default: ``<ckpt>/eval``), and with ``--save-outputs`` every output's token ids (outputs.jsonl).

Speed: ``speedup`` (and ``ar_tokens_per_s``) is against the verifier alone in a minimal cached loop through the same
verifier path (``align.verifier.verifier_alone``); Hugging Face ``generate``'s tokens/s is reported beside it
(``generate_tokens_per_s``, ``speedup_vs_generate``), and its outputs are what the lossless check compares with.
``--interleave`` decodes each prompt with all of them in turn, so that their speeds share the same minutes of a
machine whose speed drifts (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

import align
from align.config import SelectionConfig, build_recipe
from align.errors import AlignError, run_cli
from align.files import write_text
from align.drafters import load_drafter, ngram
from align.loading import (DRAFTER_DTYPES, check_drafter_dtype, default_device, infer_family, load_verifier_model,
                           resolve_dtype, trained_steps)
from align.lossless import lossless_counts
from align.metrics import now
from align.prompts import encode_prompt, read_prompt_file
from align.selection import make_selection
from align.speculative import SpeculativeDecoder
from align.trees import TreeShape
from align.verifier import Verifier, ar_generate, counted_generate, eos_ids, verifier_alone
from align.zoo import check_drafter, check_model, resolve
from eval.analysis import PromptRecord, combine_seeds, summarize
from eval.quality import nll_per_token, quality
from eval.suites import SUITES, load_suite


def comma_list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__} values, got '{text}'")
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="the (aligned) drafter: an exported folder, any drafter path, or "
                   "prompt lookup: ngram[:[MIN-]MAX][@W[/S]][+PATH] (PATH's drafter where no n-gram of MIN..MAX "
                   "tokens matches; with @W, a match mixed into PATH's rows at weight W; /S: only a match after an "
                   "n-gram under S tokens)")
    p.add_argument("--baseline", default=None, help="drafter to compare with (default: meta.json's base drafter; "
                   "'none' to skip)")
    p.add_argument("--verifier", default=None, help="verifier path (default: meta.json's verifier)")
    p.add_argument("--drafter", action="append", default=[], metavar="LABEL=PATH", type=labelled,
                   help="also measure this drafter, of any kind (its meta.json names its family, or it is detected; "
                        "or ngram[:[MIN-]MAX][@W[/S]][+PATH] as --ckpt takes it), in the same loop, under LABEL "
                        "(repeatable)")
    p.add_argument("--ar-drafter", default=None, help="the same as --drafter ar=PATH (an autoregressive drafter from "
                   "python -m align.baseline train: standard speculative decoding)")
    p.add_argument("--dflash-drafter", default=None, help="the same as --drafter dflash=PATH (a feature-conditioned "
                   "drafter trained against the same verifier)")
    p.add_argument("--family", default=None, help="family of --ckpt and --baseline (default: meta.json's, or detected)")
    p.add_argument("--prompt-lookup", type=comma_list(int), default=[], metavar="N",
                   help="also measure transformers' prompt-lookup decoding, generate(prompt_lookup_num_tokens=N): what "
                        "a user has for free (label 'prompt lookup N', beside generate, in the same loop of prompts; "
                        "comma list)")
    p.add_argument("--assistant", default=None, metavar="PATH",
                   help="also measure transformers' assisted generation with this causal LM as the assistant, "
                        "generate(assistant_model=...) (label 'assisted'); --drafter ar=PATH runs it in align's loop")
    p.add_argument("--assistant-tokens", type=comma_list(int), default=[], metavar="N",
                   help="the assistant's draft tokens per step (its generation config's num_assistant_tokens, label "
                        "'assisted N'; comma list; default: transformers' own, label 'assisted')")
    p.add_argument("--suite", default=None, help=f"prompt suite: {', '.join(SUITES)} (default tinyworld)")
    p.add_argument("--prompts", default=None, help='JSONL of {"id", "prompt", "category"?} instead of a suite')
    p.add_argument("--gamma", type=comma_list(int), default=[16], help="block lengths (comma list)")
    p.add_argument("--steps", type=comma_list(int), default=None,
                   help="denoising steps (drafter passes) per block, T (comma list; default: each drafter's own, the T "
                        "its meta.json says it was trained for, else 1)")
    p.add_argument("--temperature", type=comma_list(float), default=[0.0], help="0: greedy (comma list)")
    p.add_argument("--relaxed", action="append", default=[], metavar="RULE",
                   help="also decode with this relaxed (LOSSY) acceptance rule, greedy only: typical:EPSILON,DELTA, "
                        "topk:K or ratio:R (align/relaxed.py; repeatable). Its results are labelled lossy, measured "
                        "for quality against the verifier alone's outputs, and never pass the lossless check")
    p.add_argument("--stop-below", type=comma_list(float), default=[0.0], metavar="P",
                   help="stop rule: a block ends before the first position whose likeliest token the drafter gives "
                        "less probability than P (comma list; 0: every block drafts γ)")
    p.add_argument("--tree", type=comma_list(str), default=["none"], metavar="NODESxBRANCHING[/P|/auto]",
                   help="verify a token tree grown from the drafter's marginals instead of one draft: at most NODES "
                        "candidates, each position's BRANCHING likeliest tokens, depth γ, none whose path probability "
                        "is below P; /auto: each block as many as pay for their positions on this machine (the "
                        "verifier's cost measured at the warm-up; align/trees.py; comma list, none: one draft)")
    p.add_argument("--k", type=comma_list(int), default=None,
                   help="drafts per block, self-selection (comma list; default: the checkpoint recipe's selection.k, else 1)")
    p.add_argument("--drafter-temperature", type=comma_list(float), default=None,
                   help="temperature of the K drafts (default: recipe's, else 1.0)")
    p.add_argument("--scorer", type=comma_list(str), default=None, help="verifier, drafter, oracle (default: recipe's)")
    p.add_argument("--candidates", type=comma_list(str), default=None, help="iid, swap (default: recipe's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--per-category", type=int, default=None,
                   help="use the first N prompts of each category (before --limit)")
    p.add_argument("--skip-per-category", type=int, default=0, metavar="M",
                   help="leave out the first M prompts of each category (with --per-category N: prompts M+1..M+N, "
                        "e.g. a setting chosen on prompts the reported run does not use)")
    p.add_argument("--seed", type=comma_list(int), default=[0], help="seeds; several give mean ± std")
    p.add_argument("--out", default=None, help="output folder (default: <ckpt>/eval)")
    p.add_argument("--save-outputs", action="store_true", help="write outputs.jsonl with every output's token ids")
    p.add_argument("--save-blocks", action="store_true",
                   help="write blocks.jsonl: every block of every drafter setting (its context length, the lookup "
                        "match it followed, nodes, tokens accepted, drafter and verifier seconds), which "
                        "bench/blocks.py summarises: where a setting's time goes")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16", "auto"),
                   help="weights of both models (default: the exported drafter's recipe's verifier.dtype, "
                        "PATH's for --ckpt ngram...+PATH, else float32; auto: bfloat16 where the device computes in "
                        "it natively, else float32, and the report names the one used; in bfloat16 the lossless check "
                        "tells near-ties from mismatches)")
    p.add_argument("--drafter-dtype", default=None, choices=DRAFTER_DTYPES,
                   help="the drafters' weights, where they should differ from --dtype's (e.g. a bfloat16 verifier, "
                        "whose passes over several positions cost little more than one on a CPU with AMX, beside an "
                        "int8 drafter: its linear layers' weights in int8, the rest float32, CPU only; a drafter's "
                        "small passes cost what its weights weigh; default: --dtype)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the accelerator when present)")
    p.add_argument("--hub-kernels", action="store_true", help="let transformers swap in kernels from the Hugging "
                   "Face Hub (needs the network or a filled kernel cache; off: the models' own code)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the drafter's own modelling code (an exported drafter's recipe may already say so)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--interleave", action="store_true",
                   help="hold every drafter at once and decode each prompt with all of them (and the verifier alone) "
                        "in turn, so that speeds are compared over the same minutes of a machine whose speed drifts "
                        "(default: one drafter in memory at a time, each over all prompts)")
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                   help="hf: align's own decoding loop; vllm: LLM.generate with align.serving's proposer and without "
                        "speculation, vLLM's own counters (run with the Python that has vLLM: .venv-vllm on CPU); "
                        "its results join acceptance.json under 'vllm', beside the hf engine's")
    p.add_argument("--concurrency", type=comma_list(int), default=[1],
                   help="vllm engine: requests running at once (comma list)")
    args = p.parse_args(argv)
    args.drafter += [("ar", args.ar_drafter)] * bool(args.ar_drafter) + \
        [("dflash", args.dflash_drafter)] * bool(args.dflash_drafter)
    return args


def labelled(text: str) -> tuple[str, str]:
    """``LABEL=PATH`` as (label, path)."""
    label, sep, path = text.partition("=")
    if not sep or not label.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH (e.g. ar=runs/tiny/ar), got '{text}'")
    return label.strip(), path.strip()


RESERVED = ("aligned", "baseline", "generate", "alone", "prompt lookup", "assisted")  # the evaluation's own labels
# (and their prefixes: "prompt lookup 4", "assisted 3")


def relaxed_rule(spec: str):
    """A ``--relaxed`` spec as its rule (``align.relaxed``: evaluation only)."""
    from align.relaxed import parse

    return parse(spec)


def model_path(path: str) -> str | None:
    """The model folder a drafter path reads (None for prompt lookup alone: ``ngram``; ``ngram+PATH``: PATH)."""
    return ngram.parse(path)[2] if ngram.is_spec(path) else path


def check_args(args: argparse.Namespace) -> None:
    if args.per_category is not None and args.per_category < 1:
        raise AlignError(f"--per-category must be at least 1, got {args.per_category}")
    if args.skip_per_category < 0:
        raise AlignError(f"--skip-per-category must be 0 or more, got {args.skip_per_category}")
    for name in ("gamma", "steps", "k"):
        bad = [v for v in getattr(args, name) or [] if v < 1]
        if bad:
            raise AlignError(f"--{name.replace('_', '-')} values must be at least 1, got {bad[0]}")
    for spec in args.tree:
        if spec != "none":
            TreeShape.parse(spec)
    if any(not 0 <= p < 1 for p in args.stop_below):
        raise AlignError("--stop-below values must be probabilities from 0 (off) up to, not including, 1")
    if any(t < 0 for t in args.temperature):
        raise AlignError("--temperature values must be >= 0")
    if args.suite and args.prompts:
        raise AlignError("give either --suite or --prompts, not both")
    if args.drafter_dtype:
        check_drafter_dtype(args.drafter_dtype, args.device or default_device())
    args.rules = [relaxed_rule(spec) for spec in args.relaxed]  # each refused now, by name, when malformed
    labels = [label for label, _ in args.drafter]
    for label in labels:
        taken = label.startswith(RESERVED)
        if taken or labels.count(label) > 1:
            raise AlignError(f"--drafter label '{label}' is {'taken' if taken else 'given twice'}: each drafter needs "
                             f"a label of its own, starting with none of {', '.join(RESERVED)}")
    if any(n < 1 for n in args.prompt_lookup + args.assistant_tokens):
        raise AlignError("--prompt-lookup and --assistant-tokens count draft tokens: give values of 1 or more")
    if args.assistant_tokens and not args.assistant:
        raise AlignError("--assistant-tokens sets the assistant's draft length: give the assistant too (--assistant "
                         "PATH)")


def exported_defaults(args: argparse.Namespace, folder: str) -> SelectionConfig:
    """An exported drafter's recipe (``recipe.yaml`` in its folder), where it has one, fills what the flags left
    unset: ``--dtype`` (its ``verifier.dtype``: ``auto`` is bfloat16 where the CPU computes in it natively) and
    ``--trust-remote-code`` (its own modelling code); returned: its self-selection defaults, else the default ones."""
    if not (Path(folder) / "recipe.yaml").is_file():
        return SelectionConfig()
    recipe = build_recipe(yaml.safe_load((Path(folder) / "recipe.yaml").read_text()))
    args.dtype = args.dtype or recipe.verifier.dtype
    args.trust_remote_code = args.trust_remote_code or recipe.drafter.trust_remote_code
    return recipe.selection


def resolve_models(args: argparse.Namespace) -> tuple[str, str | None, str, str]:
    """(aligned drafter, baseline drafter or None, verifier, family) from the flags and the checkpoint's meta.json.
    Every model path is checked (``align.zoo.check_model``) before any is built or loaded; then the zoo models they
    name are built, if they have to be."""
    check_args(args)
    if ngram.is_spec(args.ckpt):  # prompt lookup, or lookup with a drafter to fall back on: as --drafter takes it
        return resolve_lookup(args)
    found = check_model(args.ckpt, "drafter", args.family)
    meta_file = Path(found) / "meta.json" if found else None
    try:
        meta = json.loads(meta_file.read_text()) if meta_file is not None and meta_file.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AlignError(f"{meta_file} is not valid JSON ({error}); export the drafter again, or pass --verifier "
                         "and --family and move the file away") from None
    verifier = args.verifier or meta.get("verifier")
    if verifier is None:
        raise AlignError(f"{args.ckpt} has no meta.json naming its verifier (it is not an exported align drafter); "
                         "pass --verifier PATH")
    baseline = args.baseline if args.baseline is not None else meta.get("base_drafter")
    if baseline is not None and baseline.lower() == "none":
        baseline = None
    family = args.family or meta.get("family")
    if found is not None:  # a local drafter: its config says what it is, before anything else loads or builds
        family = check_drafter(args.ckpt, family, args.trust_remote_code)
    for path, role, kind in ((verifier, "verifier", None), (baseline, "baseline drafter", family),
                             (args.assistant, "assistant", "ar"),
                             *((model_path(path), f"drafter '{label}'", None) for label, path in args.drafter)):
        if path is not None:
            check_model(path, role, kind)
    ckpt = resolve(args.ckpt)  # every input checked: a zoo drafter is built now, if it has to be
    for path in (verifier, baseline, args.assistant, *(model_path(path) for _, path in args.drafter)):
        if path is not None:
            resolve(path)  # and so are the other zoo models named (loading finds them by name)
    selection = exported_defaults(args, ckpt)
    family = family or infer_family(ckpt, args.trust_remote_code)
    args.dtype = args.dtype or "float32"
    args.k = args.k or [selection.k]
    args.drafter_temperature = args.drafter_temperature or [selection.drafter_temperature]
    args.scorer = args.scorer or [selection.scorer]
    args.candidates = args.candidates or [selection.candidates]
    return ckpt, baseline, verifier, family


def resolve_lookup(args: argparse.Namespace) -> tuple[str, None, str, str]:
    """:func:`resolve_models` for ``--ckpt ngram[:[MIN-]MAX][+PATH]``: the verifier is ``--verifier`` (or PATH's export
    names it), the drafter PATH (when given) is checked as any drafter is, and there is no baseline."""
    if args.engine == "vllm":
        raise AlignError(f"--engine vllm serves align's diffusion drafters; --ckpt {args.ckpt} is prompt lookup (vLLM "
                         "has its own: speculative_config method ngram)")
    model = model_path(args.ckpt)
    meta = {}
    if model is not None:
        found = check_model(model, "drafter", args.family)
        meta_file = Path(found) / "meta.json" if found else None
        if meta_file is not None and meta_file.is_file():
            try:
                meta = json.loads(meta_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                meta = {}
    verifier = args.verifier or meta.get("verifier")
    if verifier is None:
        raise AlignError(f"--ckpt {args.ckpt} drafts by prompt lookup, which names no verifier: pass --verifier PATH")
    if args.baseline not in (None, "none"):
        raise AlignError(f"--baseline compares a drafter with its base drafter; --ckpt {args.ckpt} has none: leave "
                         "--baseline out")
    check_model(verifier, "verifier")
    for path, role, kind in ((args.assistant, "assistant", "ar"),
                             *((model_path(path), f"drafter '{label}'", None) for label, path in args.drafter)):
        if path is not None:
            check_model(path, role, kind)
    for path in (verifier, args.assistant, *(model_path(path) for _, path in args.drafter)):
        if path is not None:
            resolve(path)  # zoo models are built now, if they have to be
    if model is not None:  # the drafter PATH falls back on or mixes into: its recipe's verifier dtype
        exported_defaults(args, resolve(model))
    args.dtype = args.dtype or "float32"
    args.k = args.k or [1]
    args.drafter_temperature = args.drafter_temperature or [SelectionConfig().drafter_temperature]
    args.scorer = args.scorer or [SelectionConfig().scorer]
    args.candidates = args.candidates or [SelectionConfig().candidates]
    return args.ckpt, None, verifier, None


def default_out(ckpt: str) -> Path:
    """``<ckpt>/eval`` for a drafter folder; ``runs/eval/<spec>`` for prompt lookup, which has no folder."""
    if ngram.is_spec(ckpt):
        return Path("runs") / "eval" / "".join(c if c.isalnum() or c in "-_." else "-" for c in ckpt)
    return Path(ckpt) / "eval"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt, baseline, verifier_path, family = resolve_models(args)
    args.dtype = resolve_dtype(args.dtype, args.device or default_device())  # auto: the report names the dtype used
    suite = "prompts" if args.prompts else (args.suite or "tinyworld")
    prompts = read_prompt_file(args.prompts) if args.prompts else load_suite(suite)
    prompts = first_per_category(prompts, args.per_category, args.skip_per_category)[: args.limit]
    out = Path(args.out) if args.out else default_out(ckpt)
    if args.engine == "vllm":
        return through_vllm(args, ckpt, baseline, verifier_path, family, prompts, suite, out)

    device = args.device or default_device()
    verifier_model, tokenizer = load_verifier_model(verifier_path, args.dtype, device, hub_kernels=args.hub_kernels)
    eos = eos_ids(verifier_model, tokenizer)
    encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]

    # the verifier alone, once per (temperature, seed). Speed reference: the minimal cached loop through the same
    # Verifier path speculative decoding uses (prompt pass, then one token per step). Hugging Face generate: its
    # outputs for the lossless check, its tokens/s reported beside.
    verifier = Verifier(verifier_model)
    for p, ids in zip(prompts, encoded):  # before any decoding: a prompt the verifier cannot read at all
        if verifier.max_length is not None and len(ids) >= verifier.max_length:
            raise AlignError(f"prompt {p['id']} has {len(ids)} tokens, no fewer than the verifier's context of "
                             f"{verifier.max_length}; shorten it or leave it out of the prompts file")
    ar_generate(verifier_model, encoded[0], args.max_new_tokens, 0.0, eos)  # warm-ups, untimed
    verifier_alone(verifier, encoded[0], args.max_new_tokens, eos)
    references = []
    for temperature, seed in itertools.product(args.temperature, args.seed):
        references.append(Job("generate", {"temperature": temperature}, seed, partial(
            ar_generate, verifier_model, max_new_tokens=args.max_new_tokens, temperature=temperature,
            eos_token_ids=eos, seed=seed)))
        references.append(Job("alone", {"temperature": temperature}, seed, partial(
            verifier_alone, verifier, max_new_tokens=args.max_new_tokens, eos_token_ids=eos, temperature=temperature,
            seed=seed)))
    alternatives = []  # what a user of transformers has besides: generate with prompt lookup, with an assistant
    for label, options in alternative_options(args, device):
        ar_generate(verifier_model, encoded[0], args.max_new_tokens, 0.0, eos, **options)  # warm-up, untimed
        for temperature, seed in itertools.product(args.temperature, args.seed):
            alternatives.append(Job(label, {"temperature": temperature}, seed, partial(
                counted_generate, verifier_model, max_new_tokens=args.max_new_tokens, temperature=temperature,
                eos_token_ids=eos, seed=seed, **options)))
    references += alternatives
    drafters = [("aligned", ckpt, family)] + ([("baseline", baseline, family)] if baseline else []) + \
        [(label, path, None) for label, path in args.drafter]  # None: the folder says its family
    reference: dict[tuple[float, int], tuple[list[list[int]], float]] = {}  # generate's outputs and seconds
    alone: dict[tuple[float, int], tuple[int, float]] = {}  # the cached loop's tokens and seconds
    reference_times: dict[tuple[float, int], list[float]] = {}  # generate's seconds per prompt
    reference_nll: dict[tuple[float, int], float | None] = {}  # the NLL of generate's outputs, once (quality)

    def run_phase(phase_references: list[Job], phase_drafters: list[tuple[str, str, str]]
                  ) -> tuple[list[dict], list[dict], list[dict]]:
        """Load the drafters, decode every prompt through every job in turn, summarise (the drafters are freed on
        return). Returns the results and, with --save-outputs and --save-blocks, the outputs and the blocks."""
        jobs = list(phase_references)
        for label, path, kind in phase_drafters:
            decoder, swept = load_decoder(args, path, kind, verifier_model, verifier, tokenizer, verifier_path, eos,
                                          device)
            decoder.generate(encoded[0], args.max_new_tokens, args.gamma[0], swept[0]["steps"])  # warm-up, untimed
            for tree in sorted({s["tree"] for s in swept if s["tree"]}):
                shape = TreeShape.parse(tree)
                if shape.sized:  # it measures the verifier's cost once and learns its drafter's calibration: untimed
                    decoder.generate(encoded[0], args.max_new_tokens, args.gamma[0], swept[0]["steps"], tree=shape)
            jobs += drafter_jobs(args, label, path, decoder, swept)
        run_jobs(jobs, encoded, device)
        for job in phase_references:
            key = (job.setting["temperature"], job.seed)
            if job.label == "generate":
                reference[key] = (job.outputs, job.seconds)
                reference_times[key] = job.times
            elif job.label == "alone":
                alone[key] = (sum(len(r.tokens) for r in job.outputs), sum(r.total_s for r in job.outputs))
        runs: dict[tuple[str, int], list[dict]] = {}
        saved, blocks = [], []
        for job in jobs[len(phase_references):]:
            records = [PromptRecord(p["id"], p.get("category", "all"), ids, gen.tokens, gen.stats)
                       for p, ids, gen in zip(prompts, encoded, job.outputs)]
            summary = summarize_job(job, records, reference, alone, verifier_model, encoded, suite, verifier_path,
                                    tokenizer, prompts if args.relaxed else None, reference_nll)
            summary["per_category_speedup_vs_generate"] = category_speedups(
                prompts, [len(r.output_ids) for r in records], job.times, reference[(job.setting["temperature"],
                                                                                      job.seed)][0],
                reference_times[(job.setting["temperature"], job.seed)])
            runs.setdefault((job.label, job.index), []).append(summary)
            if args.save_blocks:
                blocks += block_rows(job, records)
            if args.save_outputs:
                s = job.setting
                saved += [{"id": r.id, "label": job.label, "gamma": s["gamma"], "steps": s["steps"],
                           "temperature": s["temperature"], "k": s["k"], "seed": job.seed,
                           "prompt_ids": r.prompt_ids, "output_ids": r.output_ids} for r in records]
        combined = []
        for seeds in runs.values():
            c = combine_seeds(seeds)
            for key in ("generate_tokens_per_s", "speedup_vs_generate"):  # mean over seeds, as the others
                c[key] = sum(r[key] for r in seeds) / len(seeds)
            combined.append(c)
        return combined, saved, blocks

    # one drafter in memory at a time, after the references; --interleave: every drafter at once, each prompt
    # decoded by all of them and the references in turn, so that a machine whose speed drifts slows all alike
    phases = [(references, drafters)] if args.interleave else [(references, [])] + [([], [d]) for d in drafters]
    results, saved, blocks = [], [], []
    for phase_references, phase_drafters in phases:
        phase_results, phase_saved, phase_blocks = run_phase(phase_references, phase_drafters)
        results += phase_results
        saved += phase_saved
        blocks += phase_blocks
    others = [summarize_alternative(job, prompts, encoded, reference, reference_times, alone, verifier_model)
              for job in alternatives]

    out.mkdir(parents=True, exist_ok=True)
    document = {"environment": environment(args.dtype, device, args.drafter_dtype), "suite": suite,
                "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "results": results,
                "alternatives": combine_alternatives(others)}
    write_text(out / "acceptance.json", json.dumps(document, indent=1))  # atomically: a kill leaves the old one
    if args.save_outputs:
        write_text(out / "outputs.jsonl", "".join(json.dumps(row) + "\n" for row in saved))
    if args.save_blocks:
        write_text(out / "blocks.jsonl", "".join(json.dumps(row) + "\n" for row in blocks))
    from eval.report import summary_table, write_report

    write_report(document, out)
    print(summary_table(results))
    print(f"\nreport: {out / 'report.md'}")
    return 0


@dataclass
class Job:
    """One timed pass over the prompts: the verifier alone, generate, or a drafter at one setting and seed.
    ``run(prompt_ids)`` decodes one prompt; its results and the seconds they took accumulate here."""

    label: str
    setting: dict[str, Any]
    seed: int
    run: Callable[[list[int]], Any]
    index: int = 0  # the setting's place in the drafter's sweep
    drafter: str = ""  # the drafter's path
    family: str = ""  # the drafter's family
    outputs: list = field(default_factory=list)
    seconds: float = 0.0
    times: list[float] = field(default_factory=list)  # seconds per prompt


def run_jobs(jobs: list[Job], encoded: list[list[int]], device: str) -> None:
    """Each prompt through every job in turn (timed with the device synchronised)."""
    labels = sorted({j.label for j in jobs})
    for ids in tqdm(encoded, desc=", ".join(labels), leave=False):
        for job in jobs:
            start = now(device)
            job.outputs.append(job.run(ids))
            job.times.append(now(device) - start)
            job.seconds += job.times[-1]


def load_decoder(args, path, family, verifier_model, verifier, tokenizer, verifier_path, eos, device):
    """The speculative decoder of one drafter (any kind, through the one loader) and the settings it is swept over:
    ``--steps``, else the T the drafter was trained for."""
    drafter = load_drafter(path, verifier_path, verifier_model, family=family,
                           dtype=args.drafter_dtype or args.dtype, device=device,
                           trust_remote_code=args.trust_remote_code, verifier_tokenizer=tokenizer,
                           hub_kernels=args.hub_kernels)
    steps = args.steps or [trained_steps(model_path(path) or path)]
    return SpeculativeDecoder(drafter, verifier, eos), settings(args, steps)


def block_rows(job: Job, records: list[PromptRecord]) -> list[dict[str, Any]]:
    """Every block of a drafter job, one row each: its label, setting and seed, the prompt's id and category, the
    block's place in the output and its :class:`align.metrics.Block` fields (``gamma``: the draft length offered)."""
    setting = {key: job.setting[key] for key in ("gamma", "steps", "temperature", "k", "tree")}
    return [{"label": job.label, "setting": setting, "seed": job.seed, "id": r.id, "category": r.category,
             "index": i, **dataclasses.asdict(block)}
            for r in records for i, block in enumerate(r.stats.blocks)]


def drafter_jobs(args, label: str, path: str, decoder: SpeculativeDecoder, swept: list[dict]) -> list[Job]:
    """A job per setting and seed; a setting whose selection cannot run is skipped with a line saying why."""
    jobs = []
    for index, setting in enumerate(swept):
        for seed in args.seed:
            try:
                selection = make_selection(setting["k"], setting["drafter_temperature"], setting["scorer"],
                                           setting["candidates"])
                if selection is not None:
                    selection.check(setting["temperature"])
            except AlignError as error:
                print(f"skipped {label} {setting}: {error}")
                break
            jobs.append(Job(label, setting, seed, partial(
                decoder.generate, max_new_tokens=args.max_new_tokens, gamma=setting["gamma"], steps=setting["steps"],
                temperature=setting["temperature"], seed=seed, selection=selection,
                stop_below=setting["stop_below"],
                relaxed=None if setting["relaxed"] is None else relaxed_rule(setting["relaxed"]),
                tree=None if setting["tree"] is None else TreeShape.parse(setting["tree"])), index, path,
                decoder.drafter.family))
    return jobs


def summarize_job(job: Job, records: list[PromptRecord], reference: dict, alone: dict, verifier_model,
                  encoded: list[list[int]], suite: str, verifier_path: str, tokenizer: Any = None,
                  quality_rows: list[dict] | None = None,
                  reference_nll: dict[tuple[float, int], float | None] | None = None) -> dict[str, Any]:
    """One drafter run's summary, its speed against the references and, greedy, its lossless check; with a relaxed
    rule, its label and, against the verifier alone's outputs, its quality (``eval/quality.py``)."""
    setting = job.setting
    ar_outputs, ar_seconds = reference[(setting["temperature"], job.seed)]
    alone_tokens, alone_seconds = alone[(setting["temperature"], job.seed)]
    summary = summarize(records, setting["gamma"])
    summary.update(label=job.label, drafter=job.drafter, family=job.family, verifier=verifier_path, suite=suite,
                   seed=job.seed, **setting)
    summary["ar_tokens_per_s"] = alone_tokens / alone_seconds  # the minimal cached loop
    summary["speedup"] = summary["tokens_per_s"] / summary["ar_tokens_per_s"]
    summary["generate_tokens_per_s"] = sum(map(len, ar_outputs)) / ar_seconds
    summary["speedup_vs_generate"] = summary["tokens_per_s"] / summary["generate_tokens_per_s"]
    summary["lossless"] = summary["lossless_counts"] = None
    if setting["relaxed"] is not None:  # LOSSY: not the verifier's output, by design; what it costs, measured
        rule = relaxed_rule(setting["relaxed"])
        summary.update(lossless="not applicable: lossy rule", lossy=rule.to_dict(), lossy_label=rule.label)
    elif setting["temperature"] == 0:  # token for token, or a near-tie of a low-precision verifier
        counts = lossless_counts(verifier_model, encoded, [r.output_ids for r in records], ar_outputs)
        summary.update(lossless=counts["mismatch"] == 0, lossless_counts=counts)
    if setting["temperature"] == 0 and (setting["relaxed"] is not None or quality_rows):
        key, known = (setting["temperature"], job.seed), {} if reference_nll is None else reference_nll
        if key not in known:  # the verifier's NLL of its own outputs: the same for every setting compared to them
            known[key] = nll_per_token(verifier_model, encoded, ar_outputs)
        summary["quality"] = quality(verifier_model, tokenizer, quality_rows, encoded,
                                     [r.output_ids for r in records], ar_outputs, known[key])
    return summary


def alternative_options(args: argparse.Namespace, device: str) -> list[tuple[str, dict[str, Any]]]:
    """(label, ``generate`` options) of the alternatives asked for: prompt lookup, an assistant model."""
    import copy

    found = [(f"prompt lookup {n}", {"prompt_lookup_num_tokens": n}) for n in args.prompt_lookup]
    if args.assistant:
        assistant, _ = load_verifier_model(args.assistant, args.dtype, device, role="assistant",
                                           hub_kernels=args.hub_kernels)
        for n in args.assistant_tokens or [None]:
            model = assistant
            if n is not None:  # the same weights, a generation config of its own
                model = copy.copy(assistant)
                model.generation_config = copy.deepcopy(assistant.generation_config)
                model.generation_config.num_assistant_tokens = n
            found.append(("assisted" if n is None else f"assisted {n}", {"assistant_model": model}))
    return found


def category_speedups(prompts: list[dict], tokens: list[int], times: list[float], reference: list[list[int]],
                      reference_times: list[float]) -> dict[str, float]:
    """Per category: tokens/s of a job over generate's tokens/s on the same prompts."""
    out: dict[str, float] = {}
    for category in dict.fromkeys(p.get("category", "all") for p in prompts):
        rows = [i for i, p in enumerate(prompts) if p.get("category", "all") == category]
        mine = sum(tokens[i] for i in rows) / max(1e-9, sum(times[i] for i in rows))
        theirs = sum(len(reference[i]) for i in rows) / max(1e-9, sum(reference_times[i] for i in rows))
        out[category] = mine / theirs
    return out


def summarize_alternative(job: Job, prompts: list[dict], encoded: list[list[int]], reference: dict,
                          reference_times: dict, alone: dict, verifier_model) -> dict[str, Any]:
    """An alternative's speed against generate and the cached loop, its τ (tokens per verifier call) and, greedy,
    its outputs against generate's."""
    key = (job.setting["temperature"], job.seed)
    outputs = [tokens for tokens, _ in job.outputs]
    calls = sum(c for _, c in job.outputs)
    tokens = sum(map(len, outputs))
    generate_outputs, generate_seconds = reference[key]
    alone_tokens, alone_seconds = alone[key]
    summary = {"label": job.label, "temperature": job.setting["temperature"], "seed": job.seed,
               "tokens_per_s": tokens / job.seconds, "tau": tokens / max(1, calls), "verifier_calls": calls,
               "generate_tokens_per_s": sum(map(len, generate_outputs)) / generate_seconds,
               "ar_tokens_per_s": alone_tokens / alone_seconds,
               "per_category_speedup_vs_generate": category_speedups(prompts, [len(o) for o in outputs], job.times,
                                                                      generate_outputs, reference_times[key]),
               "lossless": None, "lossless_counts": None}
    summary["speedup_vs_generate"] = summary["tokens_per_s"] / summary["generate_tokens_per_s"]
    summary["speedup"] = summary["tokens_per_s"] / summary["ar_tokens_per_s"]
    if key[0] == 0:
        counts = lossless_counts(verifier_model, encoded, outputs, generate_outputs)
        summary.update(lossless=counts["mismatch"] == 0, lossless_counts=counts)
    return summary


def combine_alternatives(rows: list[dict]) -> list[dict]:
    """One row per alternative and temperature, its seeds combined (mean ± std)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["temperature"]), []).append(row)
    combined = []
    for group in groups.values():
        row = combine_seeds(group)
        for key in ("generate_tokens_per_s", "speedup_vs_generate"):  # mean over seeds, as the others
            row[key] = sum(r[key] for r in group) / len(group)
        combined.append(row)
    return combined


def through_vllm(args: argparse.Namespace, ckpt: str, baseline: str | None, verifier_path: str, family: str,
                 prompts: list[dict], suite: str, out: Path) -> int:
    """``--engine vllm``: the same prompts through vLLM (eval/vllm_engine.py); results go under ``vllm`` in
    acceptance.json, beside whatever the hf engine wrote there."""
    from align.loading import load_tokenizer
    from eval.report import engine_table, write_report
    from eval.vllm_engine import engine_name, measure

    steps = args.steps or [trained_steps(ckpt)]
    if len(args.gamma) > 1 or len(steps) > 1 or len(args.temperature) > 1 or len(args.seed) > 1:
        raise AlignError("--engine vllm measures one --gamma, --steps, --temperature and --seed at a time")
    tokenizer = load_tokenizer(resolve(verifier_path), "verifier")
    encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]
    drafters = [("aligned", ckpt)] + ([("baseline", baseline)] if baseline else [])
    results = measure(resolve(verifier_path), drafters, encoded, args.gamma[0], steps[0], args.temperature[0],
                      args.max_new_tokens, args.concurrency, args.seed[0], args.dtype, family)
    document = {"suite": suite, "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "results": []}
    if (out / "acceptance.json").is_file():
        try:
            document = json.loads((out / "acceptance.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise AlignError(f"{out / 'acceptance.json'} is not valid JSON; move it away or choose another --out") from None
    document["vllm"] = {"engine": engine_name(), "suite": suite, "n_prompts": len(prompts),
                        "max_new_tokens": args.max_new_tokens, "results": results}
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "acceptance.json", json.dumps(document, indent=1))
    if document["results"]:
        write_report(document, out)
    else:
        write_text(out / "report.md", "# Acceptance report\n\n## Engines\n\n" + engine_table(document) + "\n")
    print(engine_table(document))
    print(f"\nreport: {out / 'report.md'}")
    return 0


def first_per_category(prompts: list[dict], n: int | None, skip: int = 0) -> list[dict]:
    """The first ``n`` prompts of each category after its first ``skip``, in file order (None: all the rest)."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        category = p.get("category", "all")
        seen[category] = seen.get(category, 0) + 1
        if skip < seen[category] and (n is None or seen[category] <= skip + n):
            out.append(p)
    return out


def settings(args: argparse.Namespace, steps: list[int]) -> list[dict[str, Any]]:
    """Every combination of the swept flags at these ``steps`` (T); selection flags only vary where K > 1."""
    out = []
    for gamma, steps, temperature, k, stop, relaxed, tree in itertools.product(
            args.gamma, steps, args.temperature, args.k, args.stop_below, [None, *args.relaxed],
            [None if t == "none" else t for t in args.tree]):
        if relaxed is not None and (temperature > 0 or k > 1):  # a relaxed rule replaces greedy verification
            continue
        if tree is not None and (k > 1 or relaxed is not None):  # a tree verifies its own candidates
            continue
        combos = [(None, None, None)]
        if k > 1:  # the swap generator does not sample: the drafter temperature does not apply to it
            combos = [(s, c, t) for s in args.scorer for c in args.candidates
                      for t in (args.drafter_temperature if c != "swap" else args.drafter_temperature[:1])]
        for scorer, candidates, drafter_temperature in combos:
            out.append({"gamma": gamma, "steps": steps, "temperature": temperature, "k": k, "scorer": scorer,
                        "candidates": candidates, "drafter_temperature": drafter_temperature, "stop_below": stop,
                        "relaxed": relaxed, "tree": tree})
    return out


def environment(dtype: str, device: str, drafter_dtype: str | None = None) -> dict[str, Any]:
    import transformers

    if torch.device(device).type == "cuda":
        device = torch.cuda.get_device_name(torch.device(device))
    else:
        device = f"cpu ({platform.processor() or 'x86_64'})"
    return {"device": device, "dtype": dtype, "drafter_dtype": drafter_dtype or dtype,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "align": align.__version__, "python": platform.python_version()}


if __name__ == "__main__":
    run_cli(main)
