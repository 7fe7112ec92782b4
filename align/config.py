"""Strict typed recipes: defaults <- YAML <- ``section.key=value`` overrides.

A recipe is one YAML file with one mapping per section below. Every key is declared here, with its type, its
allowed values and one line of documentation (docs/recipes.md is generated from, and checked against, these declarations).
Unknown sections or keys, wrong types and out-of-range values raise :class:`RecipeError` naming the key, the value
and what is allowed. Builders take flat arguments; inner code never sees the whole recipe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from align.distill.losses import OBJECTIVES
from align.errors import AlignError
from align.families import TRAINED, traits

NEEDS_TEACHER = frozenset(name for name, o in OBJECTIVES.items() if o.needs_teacher)  # read the verifier's logits


class RecipeError(AlignError):
    """A recipe that cannot be loaded: the message names the key, the value and what is allowed."""


def option(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
           max: float | None = None) -> Any:
    """Declare a recipe key: its default, one line of documentation and its allowed values."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------------------------------------ sections


@dataclass
class RunConfig:
    name: str = option("tiny", "Run name, used in logs, wandb and the exported meta.json.")
    output_dir: str = option("runs/tiny", "Folder for checkpoints/, metrics.jsonl, final/ and the resolved recipe.")
    seed: int = option(0, "Seed for data order, canvas noise, LoRA init and sampling.", min=0)
    hub_kernels: bool = option(False, "Let transformers replace layers it knows with kernels from the Hugging Face "
                               "Hub (the kernels package; fetched from the Hub, so it needs the network or a filled "
                               "kernel cache). false: every model runs its own PyTorch code, whatever "
                               "USE_HUB_KERNELS says (align.loading.pretrained).")


@dataclass
class VerifierConfig:
    path: str = option("zoo:tiny-verifier", "Verifier: a local folder, a hub name, or zoo:NAME (the zoo: python -m align.zoo list).")
    dtype: str = option("float32", "Verifier weights dtype (rollouts, labels, features, evaluation); auto: bfloat16 "
                        "where the device computes in it natively (a CUDA GPU with bfloat16, a CPU with AVX-512 BF16 "
                        "or AMX), float32 elsewhere (align.machine.native_bf16).",
                        choices=("float32", "bfloat16", "float16", "auto"))


@dataclass
class DrafterConfig:
    path: str = option("zoo:tiny-diffusiongemma", "Drafter to align: a local folder, a hub name, or zoo:NAME.")
    family: str = option("diffusiongemma", "Drafter family: its canvas and logits convention (dflash: the feature-"
                         "conditioned drafter, which drafts from the verifier's hidden states; docs/dflash.md).",
                         choices=TRAINED)
    trust_remote_code: bool = option(False, "Allow the drafter's own modelling code (needed by Dream/DiffuCoder).")
    mask_token_id: int | None = option(None, "Mask token id for masked families; null reads the tokenizer's.", min=0)
    freeze_embeddings: bool = option(False, "Keep the drafter's token embeddings and its (tied) output head as they "
                                     "are: a drafter made from its verifier shares them with it, and at a large "
                                     "vocabulary their gradient is the costliest part of a backward pass.")
    draft_vocab: int | None = option(None, "dflash: the drafter proposes only the N tokens most frequent in the "
                                     "training rollouts' responses, its head those rows of the verifier's (a head a "
                                     "sixth as wide at N 8,192 of 49,152: cheaper drafting and training; tokens "
                                     "outside are never drafted, which costs only acceptance). null: the whole "
                                     "vocabulary.", min=1)


@dataclass
class DataConfig:
    prompts: str = option("tinyworld:train", "Prompts to roll out: tinyworld:train, zoo:NAME (prompts the zoo "
                          "writes, e.g. zoo:smollm2-prompts), hf:DATASET[:SPLIT[:COLUMN]], or "
                          'a JSONL file of {"id", "prompt", "category"?}.')
    num_prompts: int | None = option(None, "Use at most this many prompts (null: all).", min=1)
    rollouts_dir: str | None = option(None, "Where rollouts are stored; null: a folder under the cache named by "
                                      "a fingerprint of verifier, prompts and sampling settings.")
    backend: str = option("hf", "Rollout backend: hf (transformers' batched generate) or vllm (LLM.generate).",
                          choices=("hf", "vllm"))
    n: int = option(1, "Rollouts per prompt.", min=1)
    temperature: float = option(0.0, "Rollout sampling temperature (0: greedy).", min=0.0)
    top_p: float = option(1.0, "Rollout nucleus sampling mass.", min=0.0, max=1.0)
    max_new_tokens: int = option(160, "Longest rollout, in tokens.", min=1)
    batch_size: int = option(64, "Prompts per generation batch (hf backend).", min=1)
    max_prefix_len: int = option(256, "Windows keep at most this many prefix tokens (cut from the left; packed: "
                                 "the prompt's).", min=1)
    packing: bool | None = option(None, "Train every window of a rollout from one encoder pass "
                                  "(align/distill/packing.py); null: on where that is exact (diffusiongemma, whose "
                                  "encoder is causal), off for the bidirectional families.")
    group_size: int | None = option(None, "Packed training: windows of one rollout that travel together and share "
                                    "its encoder pass; each epoch cuts every rollout's windows into groups of this "
                                    "many. Smaller: more rollouts per micro-batch (more next-token labels, more varied "
                                    "windows) for more encoder work. null: 256 / distill.gamma.", min=1)
    train_rollouts: int | None = option(None, "Train on at most this many of the training rollouts, a fixed subset "
                                        "(by a hash of the prompt id: each smaller subset inside the larger), the "
                                        "held-out ones unchanged; null: all. The data curve (bench/data_curve.py).",
                                        min=1)
    heldout_fraction: float = option(0.05, "Fraction of prompts whose rollouts are held out for evaluation windows.",
                                     min=0.0, max=0.5)
    feature_cache: bool = option(False, "dflash: compute the verifier's features of every rollout once, before "
                                 "training, into the cache ($ALIGN_CACHE/features/, tokens x layers x width in the "
                                 "verifier's dtype; runs over the same rollouts share it; a build copies the rows "
                                 "of sequences another cache of the same verifier, dtype, layers and storage "
                                 "holds; a build cut short resumes; a disk without room for the whole file is refused before the verifier "
                                 "runs) and read them from there: no verifier pass in the training loop; "
                                 "data.text's rows bring theirs from their labelling pass. false: the verifier "
                                 "runs every step (online). Not with objectives that read the verifier's logits "
                                 "(kd, tv, sampled_streak).")
    feature_dtype: str = option("verifier", "dflash with data.feature_cache: the dtype the features are stored in "
                                "(the cache and the labelled text's). verifier: the verifier's own; bfloat16: a "
                                "float32 verifier's features rounded to 8 significant bits in half the bytes "
                                "(SmolLM2's feature cache 7.0 GB, not 14; the drafter trained on it decoded as fast), "
                                "the precision a bfloat16 verifier computes in anyway. Not float16: SmolLM2's later "
                                "layers reach 24,891, within 3x of its largest value.",
                                choices=("verifier", "bfloat16"))
    text: str | None = option(None, "dflash: fixed text labelled by the verifier in one prefill pass, trained on beside "
                              "the rollouts (align/labels.py): english (the zoo's English text, each document after "
                              "a chat instruction) or a JSONL file of {\"id\", \"prompt\", \"response\"}; null: the "
                              "rollouts alone. Held-out windows stay the rollouts'.")
    text_rows: int | None = option(None, "Rows of data.text to label and train on (null: all).", min=1)
    train_text_rows: int | None = option(None, "Train on the first N rows of data.text only; the others stay in the "
                                         "feature cache, so that the data curve's points share one "
                                         "(bench/data_curve.py). null: all.", min=0)
    text_tokens: int = option(256, "Response tokens kept per row of data.text.", min=1)
    text_labels: str = option("greedy", "What a window of data.text learns: greedy (the verifier's own next token at "
                              "every block position while the text agrees with it: exactly its greedy continuation) "
                              "or text (the text's next tokens).", choices=("greedy", "text"))


@dataclass
class DistillConfig:
    objective: str = option("ce", "Training loss (align/distill/losses.py; the measured rankings: docs/results.md, "
                            "Which objective).",
                            choices=tuple(OBJECTIVES))
    gamma: int = option(16, "Block length: canvas positions per window.", min=1, max=256)
    temperature: float = option(1.0, "Deployment temperature applied to the drafter's logits inside q.", min=1e-3)
    ce_weight: float = option(0.0, "Weight of an added plain cross-entropy term (0: the objective alone).", min=0.0)
    smoothing: float = option(0.5, "λ of streak_ce and margin: weights from s = λ q + (1 - λ) (1: the streak's own).",
                              min=0.0, max=1.0)
    after_failure: float = option(0.1, "first_failure: weight of positions after the drafter's first greedy failure.",
                                  min=0.0, max=1.0)
    decay: float = option(7.0, "decayed_ce: γ' of the position weights exp(-(k - 1) / γ') (7 for blocks of 16).",
                          min=1e-3)
    schedule: str = option("constant", "constant: the objective throughout; switch: ce, then the objective; anneal: "
                           "ce blending linearly into the objective.", choices=("constant", "switch", "anneal"))
    schedule_fraction: float = option(0.5, "Fraction of train.max_steps before the switch, or over which to anneal.",
                                      min=0.0, max=1.0)
    stride: int = option(1, "Distance between window offsets within a rollout.", min=1)
    canvas_seed: int | None = option(None, "Train from one fixed fully noised canvas, drawn from this seed, instead "
                                     "of a fresh draw per window (uniform-noise families): in one-step drafting its "
                                     "positions become markers the drafter learns; the export's meta.json carries it "
                                     "and decoding drafts from the same canvas. null: a fresh draw.", min=0)
    next_token_weight: float = option(0.0, "Weight of a next-token cross-entropy on the drafter's own prefix pass, "
                                      "every response token a label (packed training only: the encoder reads each "
                                      "rollout once anyway; its weights are the decoder's).", min=0.0)
    first_token: str = option("canvas", "What drafts a block's first token: canvas (the decoder's first canvas "
                              "position) or encoder (diffusiongemma: the prefix pass's own next-token prediction at "
                              "the last prefix token, read from the same drafting pass; next_token_weight trains "
                              "it). The export's meta.json carries it and decoding drafts so.",
                              choices=("canvas", "encoder"))
    denoise_steps: int = option(1, "T that decoding will use: each micro-batch trains at a step k drawn from "
                                "0..T-1 of its confidence schedule (k passes without gradient commit the drafter's most "
                                "confident tokens, self-conditioning on the last; align/distill/denoise.py). 1: every "
                                "window fully noised. dflash: T passes fill the block left to right, each its share "
                                "of the positions with the rows before holding the tokens drafted so far; a window "
                                "trains one pass drawn uniformly, those rows holding its labels (docs/dflash.md).",
                                min=1, max=64)


@dataclass
class TrainConfig:
    max_steps: int = option(300, "Optimizer steps of the whole run (a rerun with more resumes).", min=1)
    micro_batch_size: int = option(16, "Windows per process per forward pass (per window: cut from the global "
                                   "batch ordered by prefix length, so that each pads little).", min=1)
    global_batch_size: int = option(32, "Windows per optimizer step over all processes (sets accumulation).", min=1)
    lr: float = option(3e-4, "Peak learning rate.", min=0.0)
    weight_decay: float = option(0.005, "AdamW weight decay.", min=0.0)
    warmup_steps: int = option(30, "Linear warm-up steps.", min=0)
    schedule: str = option("linear", "Decay after warm-up.", choices=("linear", "cosine", "constant"))
    min_lr_ratio: float = option(0.0, "Final learning rate as a fraction of lr.", min=0.0, max=1.0)
    grad_clip: float = option(1.0, "Gradient-norm clipping (0: off).", min=0.0)
    save_every: int = option(100, "Checkpoint every N steps (the last step is always saved).", min=1)
    eval_every: int = option(50, "Evaluate held-out windows every N steps.", min=1)
    eval_windows: int = option(512, "Held-out windows per evaluation: every window of as many held-out rollouts as fit "
                               "(at least one), so that they can be walked as greedy decoding (decoded_accepted); the same "
                               "rollouts for every run.seed: seeds vary the training, not what it is measured on. Changed on a "
                               "resume, the drafter as resumed is measured on the new windows first (a finished run: "
                               "measured and exported again, no step taken; 100000 takes every held-out window).", min=1)
    keep_checkpoints: int = option(2, "Most recent checkpoints kept on disk.", min=1)


@dataclass
class LoraConfig:
    r: int = option(0, "LoRA rank (0: train all weights).", min=0)
    alpha: int = option(32, "LoRA alpha: adapters scale their update by alpha / r.", min=1)
    dropout: float = option(0.0, "Dropout on the LoRA adapters' input while training.", min=0.0, max=1.0)
    target_modules: list[str] = option(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                       "Module names that get LoRA adapters.")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = option(0, "ZeRO stage: 0 none, 1 optimizer state, 2 and gradients, 3 and parameters sharded.",
                            min=0, max=3)
    bf16: bool | None = option(False, "Train in bf16 (fp32 master weights); null: where the device computes in "
                               "bfloat16 natively, as verifier.dtype auto decides.")
    offload_optimizer: bool = option(False, "Keep optimizer state on the CPU (ZeRO >= 1).")
    offload_params: bool = option(False, "Keep parameters on the CPU (ZeRO 3).")
    torch_adam: bool = option(True, "Use torch's AdamW (false: DeepSpeed's fused kernel, compiled on first use).")
    timeout_minutes: int = option(120, "How long a process waits at a collective before giving up (rollout shards "
                                  "of unequal length end at one).", min=1)


@dataclass
class LogConfig:
    every: int = option(10, "Write a metrics.jsonl line every N steps.", min=1)
    wandb: bool = option(False, "Also log to Weights & Biases.")
    wandb_project: str = option("align", "The wandb project runs are logged to.")
    wandb_mode: str = option("offline", "wandb mode: offline writes ./wandb/ for a later sync; online needs a login.",
                            choices=("offline", "online", "disabled"))


@dataclass
class SelectionConfig:
    """Self-selection defaults for evaluating this run's drafter (the eval.acceptance flags override them)."""

    k: int = option(1, "Drafts sampled from one drafter pass (1: no self-selection).", min=1, max=256)
    drafter_temperature: float = option(1.0, "Temperature of the K candidate drafts (1.0 measured best: docs/results.md, "
                                                "Self-selection).", min=1e-3)
    scorer: str = option("verifier", "How candidates are scored (greedy only).",
                         choices=("verifier", "drafter", "oracle"))
    candidates: str = option("iid", "Candidate generator: iid (samples from the marginals) or swap (the argmax draft "
                            "with its least confident positions swapped; greedy only).", choices=("iid", "swap"))


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    log: LogConfig = field(default_factory=LogConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def fingerprint(self, sections: tuple[str, ...]) -> str:
        """A short hash of the named sections: what makes two runs the same run."""
        blob = json.dumps({s: dataclasses.asdict(getattr(self, s)) for s in sections}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Recipe)}  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------ loading


def load_recipe(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Merge defaults <- YAML file ``path`` <- ``section.key=value`` overrides, and validate everything."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides:
        section, key, value = _parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise RecipeError(f"recipe section '{section}' must be a mapping of keys, got {raw[section]!r}")
        raw[section][key] = value
    return build_recipe(raw)


def build_recipe(raw: dict[str, Any]) -> Recipe:
    """Build and validate a :class:`Recipe` from a nested dict (unknown keys are errors)."""
    sections = {}
    for name, body in raw.items():
        if name not in SECTIONS:
            raise RecipeError(f"unknown recipe section '{name}'; allowed sections: {', '.join(SECTIONS)}")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise RecipeError(f"recipe section '{name}' must be a mapping of keys, got {body!r}")
        sections[name] = _build_section(name, SECTIONS[name], body)
    recipe = Recipe(**sections)
    _check_recipe(recipe)
    return recipe


def save_recipe(recipe: Recipe, path: str | Path) -> None:
    """Write the resolved recipe as YAML (what produced an output, next to it)."""
    Path(path).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def recipe_keys() -> list[tuple[str, str, Any, str]]:
    """(section, key, default, help) for every recipe key: docs/recipes.md is checked against this."""
    rows = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            rows.append((section, f.name, default, f.metadata["help"]))
    return rows


def recipe_markdown() -> str:
    """docs/recipes.md: every recipe key with its type, default, allowed values and meaning, from the declarations
    above (``python -m align.config > docs/recipes.md``; a test fails when the file is out of date)."""
    lines = ["# Recipe keys", "", "Generated from the recipe dataclasses' own declarations (`align/config.py`) by "
             "`python -m align.config > docs/recipes.md`; `tests/test_config.py` fails when this file and the "
             "declarations disagree. A recipe is a YAML file with these sections; `load_recipe(path, overrides)` "
             "merges defaults ← YAML ← `section.key=value` overrides, and unknown keys, wrong types and out-of-range "
             "values are one clear error naming the key, the value and what is allowed.", ""]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        doc = (cls.__doc__ or "").strip()
        lines += [f"## `{section}`", ""] + ([doc, ""] if doc and not doc.startswith(cls.__name__ + "(") else [])
        lines += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            meta = f.metadata
            allowed = ", ".join(f"`{c}`" for c in meta["choices"]) if meta.get("choices") else " ".join(
                part for part in (f"≥ {meta['min']:g}" if meta.get("min") is not None else "",
                                  f"≤ {meta['max']:g}" if meta.get("max") is not None else "") if part)
            kind = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            kind = kind.replace(" | None", " or null")
            shown = ", ".join(default) if isinstance(default, list) else yaml.safe_dump(default).strip().removesuffix(
                "\n...").removesuffix("...").strip()
            lines.append(f"| `{section}.{f.name}` | {kind} | `{shown}` | {allowed or '-'} | {meta['help']} |")
        lines.append("")
    return "\n".join(lines)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RecipeError(f"recipe not found: {path} (pass the path of a YAML file such as recipes/tiny.yaml)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise RecipeError(f"recipe {path} is not UTF-8 text (byte {error.start + 1}); save it as UTF-8 YAML") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise RecipeError(f"recipe {path} is not valid YAML{line}: {problem}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(raw).__name__}")
    return raw


def _parse_override(item: str) -> tuple[str, str, Any]:
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise RecipeError(f"bad override '{item}': write section.key=value, e.g. train.max_steps=100")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return section, key, value


def _build_section(name: str, cls: type, body: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in body.items():
        if key not in fields:
            raise RecipeError(f"unknown recipe key '{name}.{key}'; allowed keys in '{name}': {', '.join(fields)}")
        values[key] = _check_value(f"{name}.{key}", value, hints[key], fields[key].metadata)
    return cls(**values)


def _check_value(key: str, value: Any, hint: Any, meta: Any) -> Any:
    """Coerce ``value`` to the declared type and range, or raise a RecipeError that names the key."""
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
    if value is None:
        if optional:
            return None
        raise RecipeError(f"recipe key {key} must be set: expected {_describe(base, meta)}")
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base is str:
        ok = isinstance(value, str)
    elif typing.get_origin(base) is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:  # pragma: no cover - a declaration error, not user input
        raise TypeError(f"unsupported recipe type {base} for {key}")
    if not ok:
        raise RecipeError(f"recipe key {key}: got {value!r} ({type(value).__name__}); expected {_describe(base, meta)}")
    choices, low, high = meta.get("choices"), meta.get("min"), meta.get("max")
    if (choices and value not in choices) or (low is not None and value < low) or (high is not None and value > high):
        raise RecipeError(f"recipe key {key}: got {value!r}; expected {_describe(base, meta)}")
    return value


def _describe(base: Any, meta: Any) -> str:
    if meta.get("choices"):
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(base, "a list of strings")
    bounds = []
    if meta.get("min") is not None:
        bounds.append(f">= {meta['min']}")
    if meta.get("max") is not None:
        bounds.append(f"<= {meta['max']}")
    return name + (" " + " and ".join(bounds) if bounds else "")


def packing_on(recipe: Recipe) -> bool:
    """Whether training packs windows (``data.packing``; null: where it is exact, a family whose prefix pass is
    causal). A drafter that reads the verifier's features always runs a rollout's windows in one pass."""
    kind = traits(recipe.drafter.family)
    if kind.reads_features:
        return True
    return recipe.data.packing if recipe.data.packing is not None else kind.causal_prefix


def _check_recipe(recipe: Recipe) -> None:
    """Rules that involve more than one key."""
    t = recipe.train
    if t.global_batch_size % t.micro_batch_size:
        raise RecipeError(f"recipe key train.global_batch_size: got {t.global_batch_size}; expected a multiple of "
                          f"train.micro_batch_size ({t.micro_batch_size})")
    if recipe.deepspeed.offload_params and recipe.deepspeed.zero_stage != 3:
        raise RecipeError("recipe key deepspeed.offload_params: true needs deepspeed.zero_stage: 3")
    if recipe.deepspeed.offload_optimizer and recipe.deepspeed.zero_stage == 0:
        raise RecipeError("recipe key deepspeed.offload_optimizer: true needs deepspeed.zero_stage >= 1")
    family, kind = recipe.drafter.family, traits(recipe.drafter.family)
    if kind.remote_code and not recipe.drafter.trust_remote_code:
        raise RecipeError(f"recipe key drafter.trust_remote_code: {family} drafters (Dream-style) ship their own "
                          "modelling code; set drafter.trust_remote_code: true")
    if recipe.data.packing and not (kind.causal_prefix or kind.reads_features):
        raise RecipeError(f"recipe key data.packing: true needs a causal prefix encoder (diffusiongemma); the "
                          f"{family} family re-reads its prefix bidirectionally, so windows cannot "
                          "share it: set data.packing: null (or false; distill.stride subsamples offsets)")
    if recipe.distill.next_token_weight and not packing_on(recipe) and not kind.reads_features:
        raise RecipeError(f"recipe key distill.next_token_weight: got {recipe.distill.next_token_weight}; it reads the "
                          "packed prefix pass, and this recipe trains one window at a time (data.packing off or a "
                          f"{family} drafter): set distill.next_token_weight: 0 or data.packing: null")
    if recipe.distill.first_token == "encoder" and not kind.causal_prefix:
        raise RecipeError(f"recipe key distill.first_token: encoder needs a causal prefix encoder (diffusiongemma); "
                          f"the {family} family has no next-token prediction: set distill.first_token: "
                          "canvas")
    if recipe.distill.first_token == "encoder" and not recipe.distill.next_token_weight:
        raise RecipeError("recipe key distill.first_token: encoder drafts each block's first token from the prefix "
                          "pass's next-token prediction, and distill.next_token_weight is 0, so nothing would train "
                          "that prediction; set distill.next_token_weight > 0 (1.0 in recipes/tiny.yaml) or "
                          "distill.first_token: canvas")
    if kind.reads_features:
        _check_features(recipe)
    if recipe.drafter.draft_vocab is not None and not kind.reads_features:
        raise RecipeError(f"recipe key drafter.draft_vocab: a {family} drafter's head is its own (a draft "
                          "vocabulary takes rows of the verifier's head, which only a dflash drafter shares): set "
                          "drafter.draft_vocab: null")
    if recipe.data.feature_cache and not kind.reads_features:
        raise RecipeError(f"recipe key data.feature_cache: true caches the verifier's features a dflash drafter reads; "
                          f"a {family} drafter reads none: set data.feature_cache: false")
    if recipe.data.text is not None and not kind.reads_features:
        raise RecipeError(f"recipe key data.text: labelled text trains a dflash drafter (its windows read the verifier's "
                          f"features of the text); a {family} drafter reads none: set data.text: null")
    if recipe.data.text is not None and recipe.distill.objective in NEEDS_TEACHER:
        raise RecipeError(f"recipe key data.text: the labelled text keeps the verifier's tokens, not its logits, which "
                          f"the {recipe.distill.objective} objective reads: use streak_ce or ce, or set data.text: null")
    if recipe.data.feature_cache and recipe.distill.objective in NEEDS_TEACHER:
        raise RecipeError(f"recipe key data.feature_cache: true leaves the verifier out of the training loop, and "
                          f"distill.objective {recipe.distill.objective} reads its logits at every step: set "
                          "data.feature_cache: false, or an objective that reads the labels only (streak_ce, ce)")
    if recipe.distill.gamma > recipe.data.max_new_tokens:
        raise RecipeError(f"recipe key distill.gamma: got {recipe.distill.gamma}, longer than any rollout can be "
                          f"(data.max_new_tokens is {recipe.data.max_new_tokens}); lower distill.gamma or raise "
                          "data.max_new_tokens")
    if recipe.distill.schedule != "constant" and recipe.distill.objective == "ce":
        raise RecipeError(f"recipe key distill.schedule: {recipe.distill.schedule} moves from ce to the objective, "
                          "and distill.objective is ce; name another objective or set distill.schedule: constant")
    if recipe.data.top_p <= 0:
        raise RecipeError("recipe key data.top_p: got 0; expected a number > 0")


def _check_features(recipe: Recipe) -> None:
    """What a feature-conditioned drafter (dflash) cannot do: it drafts a block from the verifier's features (in T
    passes left to right, not by confidence), and has no embeddings, prefix encoder or canvas of its own."""
    d = recipe.distill
    for key, value, fix in (("distill.next_token_weight", d.next_token_weight != 0, "0"),
                            ("distill.first_token", d.first_token != "canvas", "canvas"),
                            ("distill.canvas_seed", d.canvas_seed is not None, "null"),
                            ("lora.r", recipe.lora.r != 0, "0"),
                            ("drafter.freeze_embeddings", recipe.drafter.freeze_embeddings, "false"),
                            ("data.packing", recipe.data.packing is False, "null")):
        if value:
            raise RecipeError(f"recipe key {key} does not apply to the dflash drafter (it drafts from the verifier's "
                              f"features; the verifier's embeddings and head, always frozen): set {key}: {fix}")


if __name__ == "__main__":
    print(recipe_markdown(), end="")
