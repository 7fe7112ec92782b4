"""Loading models from paths (local folders, hub names, or ``zoo:NAME`` of a built zoo model), with clear refusals.

A model path is checked once, before anything is built or loaded (:func:`check_model_folder`; the commands reach it
through ``align.zoo.check_model``, which also knows the zoo's names), and loaded by the functions here: the verifier
(any causal LM), a drafter's model as its family says (``align.families``), tokenizers, and what an export's
meta.json records. Drafters themselves are built by ``align.drafters.load_drafter``, on top. Every model weight this
toolkit reads comes through :func:`pretrained`: transformers' Hub kernels stay off unless asked for.

Drafter and verifier must share a tokenizer: the drafter's tokenizer may add tokens after the verifier's (Dream adds
``<|mask|>``), but every verifier token must have the same id in both. Logit rows past the shared vocabulary
(padding rows) are sliced from the drafter's distribution; the verifier's distribution is never changed.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from align.errors import AlignError
from align.families import FAMILIES, Traits, traits
from align.machine import default_device, resolve_dtype, usable_cores  # noqa: F401 (imported from here by callers)
from align.paths import model_path
from align.paths import zoo_built

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
#: what a drafter may run in: a model dtype, or ``int8`` (:func:`int8_linears`: its linear layers' weights in int8,
#: the rest float32; the CPU only)
DRAFTER_DTYPES = ("float32", "bfloat16", "float16", "int8")


def check_drafter_dtype(dtype: str, device: Any) -> None:
    """Refuse a drafter dtype this toolkit cannot run on ``device`` (before anything is loaded)."""
    if dtype not in DRAFTER_DTYPES:
        raise AlignError(f"drafter dtype {dtype!r} is not one of {', '.join(DRAFTER_DTYPES)}")
    if dtype == "int8" and torch.device(device or "cpu").type != "cpu":
        raise AlignError(f"an int8 drafter runs on the CPU only (dynamically quantized linear layers), not on "
                         f"{device}; on a GPU use --drafter-dtype bfloat16")


def int8_linears(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` (float32, on the CPU) with every ``nn.Linear`` replaced by its dynamic int8 quantization: weights
    int8 per output row, each call's activations quantized on the fly (torch.ao's fbgemm kernels). A drafter's
    passes are a handful of rows through weights read from memory each block, so they cost what the weights weigh:
    a quarter of float32's (docs/results.md, "An int8 drafter"). Only the drafter: its numbers change its drafts,
    never which tokens the verifier keeps."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao's notice that this API moves to torchao, and a per-tensor hint
        warnings.simplefilter("ignore")
        if isinstance(module, torch.nn.Linear):  # quantize_dynamic swaps a container's layers, not itself
            return quantize_dynamic(torch.nn.Sequential(module), {torch.nn.Linear}, dtype=torch.qint8)[0]
        # torch's own transformer layers read their linears' weights directly (their fast path): those stay float
        native = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
        kept = {f"{name}.{child}" if name else child for name, layer in module.named_modules()
                if isinstance(layer, native) for child, _ in layer.named_modules() if child}
        names = {name for name, layer in module.named_modules()
                 if isinstance(layer, torch.nn.Linear) and name not in kept}
        return quantize_dynamic(module, names, dtype=torch.qint8, inplace=True)


def logit_rows(head: torch.nn.Module | None, default: int) -> int:
    """How many logit rows an output head ``head`` gives (``default`` when there is none): its ``out_features``, so
    that an int8 head (whose ``weight`` is a method) counts as its float one."""
    if head is None:
        return default
    rows = getattr(head, "out_features", None)
    return rows if isinstance(rows, int) else head.weight.shape[0]


def is_int8(module: torch.nn.Module) -> bool:
    """Whether :func:`int8_linears` quantized ``module``."""
    from torch.ao.nn.quantized.dynamic import Linear

    return any(isinstance(m, Linear) for m in module.modules())


def _config(path: str, role: str, trust_remote_code: bool = False) -> Any:
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        hint = "it is not a model folder or a hub name" if not Path(path).exists() else "it holds no model config"
        raise AlignError(f"cannot load the {role} from '{path}': {hint} ({str(error).splitlines()[0]})") from None


def load_tokenizer(path: str, role: str, trust_remote_code: bool = False) -> Any:
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise AlignError(f"cannot load the {role}'s tokenizer from '{path}' ({str(error).splitlines()[0]})") from None


def load_verifier_model(path: str, dtype: str = "float32", device: str | None = None,
                        role: str = "verifier", hub_kernels: bool = False) -> tuple[Any, Any]:
    """(causal LM, tokenizer) from ``path``, on ``device`` (None: where ``from_pretrained`` puts it); ``role`` names
    it in errors (the verifier, or an autoregressive drafter); ``hub_kernels``: :func:`pretrained`."""
    path = model_path(path)
    config = _config(path, role)
    try:
        model = _weights(AutoModelForCausalLM, path, role, hub_kernels, dtype=DTYPES[resolve_dtype(dtype, device)])
    except ValueError as error:
        raise AlignError(f"the {role} '{path}' ({config.model_type}) is not a causal language model "
                         f"({str(error).splitlines()[0]})") from None
    if device is not None:
        model.to(device)
    return model.eval(), load_tokenizer(path, role)


def load_drafter_model(path: str, family: str, dtype: str = "float32", trust_remote_code: bool = False,
                       device: str | None = None, hub_kernels: bool = False) -> tuple[Any, Any]:
    """(drafter model, tokenizer) from ``path`` on ``device`` in ``dtype`` (one of :data:`DRAFTER_DTYPES`), refusing
    a model that is not of ``family`` (one whose config says it is another family's, or a causal language model
    given as a diffusion drafter);
    ``hub_kernels``: :func:`pretrained`."""
    check_drafter_dtype(dtype, device)
    path = model_path(path)
    config = _config(path, "drafter", trust_remote_code)
    check_family(path, family, config.model_type, getattr(config, "architectures", None),
                 getattr(config, "is_decoder", False))
    try:
        model = _weights(model_class(family, config), path, "drafter", hub_kernels,
                         dtype=DTYPES["float32" if dtype == "int8" else dtype], trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise AlignError(f"the drafter '{path}' ({config.model_type}) cannot be loaded as a {family} model "
                         f"({str(error).splitlines()[0]}); check drafter.path and drafter.family") from None
    if device is not None:
        model.to(device)
    if dtype == "int8":
        int8_linears(model)
    return model.eval(), load_tokenizer(path, "drafter", trust_remote_code)


def model_class(family: str, config: Any) -> Any:
    """The class a model of ``family`` with ``config`` loads into (its traits' ``model_class``)."""
    module, name = traits(family).model_class.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls if isinstance(cls, type) else cls(config)  # else a function of the config that picks the class


def detected(model_type: str | None, architectures: list[str] | None) -> Traits | None:
    """The family whose architecture or model type a config names (None: it names none)."""
    for kind in FAMILIES.values():
        if (kind.architecture and kind.architecture in (architectures or [])) or \
                (kind.model_type and kind.model_type == model_type):
            return kind
    return None


def check_family(path: str, family: str, model_type: str | None, architectures: list[str] | None,
                 is_decoder: bool = False) -> None:
    """Refuse a drafter whose config says it is not of ``family``: another family's model, or a causal language
    model given as a diffusion drafter (read from the config alone, before anything is built or loaded)."""
    kind, found = traits(family), detected(model_type, architectures)
    if found is not None and found is not kind:
        raise AlignError(f"the drafter '{path}' is a {found.name} model ({model_type}), not a {family} one: "
                         f"set drafter.family: {found.name}")
    if (kind.architecture or kind.model_type) and found is None:
        raise AlignError(f"the drafter '{path}' is a {model_type} model, not a {family} drafter; check "
                         "drafter.path and drafter.family")
    if not kind.autoregressive and found is None and (is_decoder or model_type in _causal_types()):
        raise AlignError(f"the drafter '{path}' is a causal language model ({model_type}), not a diffusion "
                         "model; check drafter.path")


def export_meta(path: str) -> dict[str, Any]:
    """An exported drafter's meta.json ({} for a folder that is not an export, or an unreadable file)."""
    meta = Path(model_path(str(path))) / "meta.json"
    try:
        found = json.loads(meta.read_text()) if meta.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        found = {}
    return found if isinstance(found, dict) else {}


def trained_steps(path: str) -> int:
    """The T (drafter passes per block) an exported drafter was trained for: its recipe's distill.denoise_steps, 1
    for a folder that is not an export or an export from before the key was recorded."""
    steps = export_meta(path).get("denoise_steps")
    return steps if isinstance(steps, int) and steps > 0 else 1


def check_model_folder(path: str, role: str, family: str | None = None) -> str | None:
    """The one check of a model path, before anything is built or loaded: a local model folder has a config and
    weights whose headers read (a truncated or half-copied ``*.safetensors`` is named here, not after an hour of
    other work), and its config says it is what ``role`` needs — a drafter of ``family`` (when given), or, for the
    verifier, no drafter; a zoo model not built yet is left to the zoo, which knows its names and builds it after
    every other check (``align.zoo.check_model``); hub names pass through. Returns the local folder, or None (a zoo
    model still to build, a hub name)."""
    if path.startswith("zoo:") and not zoo_built(path[len("zoo:"):]):
        return None  # a zoo model that is not built yet: built once every input has been checked
    folder = Path(model_path(path))  # a built zoo model's folder: nothing is built here
    if not folder.exists():
        if path.startswith(("/", ".", "~")) or Path(path).suffix:
            raise AlignError(f"the {role} folder '{path}' does not exist; check the path")
        return None  # a hub name: from_pretrained resolves it
    if not (folder / "config.json").is_file():
        raise AlignError(f"the {role} folder '{path}' has no config.json; it is not a saved model (export or copy "
                         "it again)")
    from safetensors import SafetensorError, safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as error:
            raise AlignError(f"the {role}'s weights {file} cannot be read ({str(error).strip().splitlines()[0][:160]});"
                             " the file is truncated or corrupt: export or copy it again") from None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AlignError(f"the {role}'s config {folder / 'config.json'} is not valid JSON ({error}); export or copy "
                         "it again") from None
    model_type, architectures = config.get("model_type"), config.get("architectures")
    if role == "verifier":
        found = detected(model_type, architectures)
        if found is not None and not found.autoregressive:
            raise AlignError(f"the verifier '{path}' is a {found.name} drafter, not a causal language model; pass "
                             "the verifier (the model whose output must not change) as the verifier")
    elif family is not None:
        check_family(path, family, model_type, architectures, bool(config.get("is_decoder")))
    return str(folder)


def check_drafter_folder(path: str, family: str | None = None, trust_remote_code: bool = False,
                         role: str = "drafter") -> str | None:
    """:func:`check_model_folder` for a drafter whose family may not be given: a local folder's family is read from
    it (its meta.json, else its config) and checked against its config, before anything is built or loaded.
    Returns the family (None for a zoo model still to build or a hub name, whose family is read when it loads)."""
    folder = check_model_folder(path, role, family)
    if folder is None or family is not None:
        return family
    family = infer_family(folder, trust_remote_code)
    check_model_folder(path, role, family)
    return family


def pretrained(cls: Any, path: str, hub_kernels: bool = False, **kwargs) -> Any:
    """``cls.from_pretrained(path, **kwargs)``, the one call that reads model weights (the loaders below, the zoo's
    builds, the autoregressive baseline). transformers (5.2x) would otherwise kernelize every model with kernels
    fetched from the Hugging Face Hub (the ``kernels`` package, ``kernels-community/*``) unless ``USE_HUB_KERNELS``
    says no: on a GPU machine without network that raises, and without the package it raises too. Off here whatever
    the environment says; ``hub_kernels`` (the recipe's ``run.hub_kernels``, the commands' ``--hub-kernels``) asks
    for them, where the Hub or a filled kernel cache is at hand."""
    return cls.from_pretrained(path, use_kernels=hub_kernels, **kwargs)


def _weights(cls: Any, path: str, role: str, hub_kernels: bool = False, **kwargs) -> Any:
    """:func:`pretrained`, refusing weights that are unreadable, of other shapes, or missing (which
    ``from_pretrained`` would fill with random values and a warning)."""
    from safetensors import SafetensorError

    try:
        model, info = pretrained(cls, path, hub_kernels, output_loading_info=True, **kwargs)
    except (OSError, RuntimeError, SafetensorError) as error:
        raise AlignError(f"cannot read the {role}'s weights in '{path}' ({str(error).strip().splitlines()[0][:200]}); "
                         "the checkpoint is incomplete, corrupt or of another architecture: export or copy it again") from None
    missing = info.get("missing_keys") or []
    if missing:
        raise AlignError(f"the {role}'s weights in '{path}' lack {len(missing)} of the model's tensors (e.g. "
                         f"{sorted(missing)[0]}); the checkpoint is incomplete: export or copy it again")
    return model


def _causal_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def shared_vocab_size(drafter_tokenizer: Any, verifier_tokenizer: Any, drafter_name: str, verifier_name: str) -> int:
    """The verifier's vocabulary size, after checking that the drafter's tokenizer agrees on every token."""
    drafter_vocab, verifier_vocab = drafter_tokenizer.get_vocab(), verifier_tokenizer.get_vocab()
    for token, index in verifier_vocab.items():
        if drafter_vocab.get(token) != index:
            raise AlignError(
                f"drafter and verifier do not share a tokenizer: drafter '{drafter_name}' has {len(drafter_vocab)} "
                f"tokens, verifier '{verifier_name}' has {len(verifier_vocab)}, and token {token!r} is "
                f"{drafter_vocab.get(token)} in the drafter but {index} in the verifier; use a drafter trained with "
                "the verifier's tokenizer")
    return max(verifier_vocab.values()) + 1


def infer_family(path: str, trust_remote_code: bool = False) -> str:
    """The drafter family a model folder belongs to: an export's meta.json names it; otherwise its config (a family's
    architecture or model type; remote code with an ``AutoModel`` entry: ``dream``; else ``mdlm``, any masked LM)."""
    family = export_meta(path).get("family")
    if isinstance(family, str) and family:
        return family
    config = _config(path, "drafter", trust_remote_code)
    found = detected(config.model_type, getattr(config, "architectures", None))
    if found is not None:
        return found.name
    if getattr(config, "auto_map", None) and "AutoModel" in config.auto_map:
        return next(name for name, kind in FAMILIES.items() if kind.remote_code)
    return "mdlm"
