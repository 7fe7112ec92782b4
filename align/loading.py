"""Loading verifiers and drafters from paths (local folders, hub names or ``zoo:NAME``), with clear refusals.

A drafter must be the diffusion model its family says, and drafter and verifier must share a tokenizer: the
drafter's tokenizer may add tokens after the verifier's (Dream adds ``<|mask|>``), but every verifier token must
have the same id in both. Logit rows past the shared vocabulary (padding rows) are sliced from the drafter's
distribution; the verifier's distribution is never changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from align.dflash.drafter import FAMILY as DFLASH
from align.drafter import FAMILIES, FIRST_TOKEN, Drafter
from align.models.dflash import ARCHITECTURE
from align.errors import AlignError
from align.verifier import Verifier
from align.machine import default_device, usable_cores  # noqa: F401 (imported from here by callers)
from align.zoo import check_name, is_built, resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


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
                        role: str = "verifier") -> tuple[Any, Any]:
    """(causal LM, tokenizer) from ``path``, on ``device`` (None: where ``from_pretrained`` puts it); ``role`` names
    it in errors (the verifier, or an autoregressive drafter)."""
    path = resolve(path)
    config = _config(path, role)
    try:
        model = _weights(AutoModelForCausalLM, path, role, dtype=DTYPES[dtype])
    except ValueError as error:
        raise AlignError(f"the {role} '{path}' ({config.model_type}) is not a causal language model "
                         f"({str(error).splitlines()[0]})") from None
    if device is not None:
        model.to(device)
    return model.eval(), load_tokenizer(path, role)


def load_drafter_model(path: str, family: str, dtype: str = "float32", trust_remote_code: bool = False,
                       device: str | None = None) -> tuple[Any, Any]:
    """(diffusion model, tokenizer) from ``path`` on ``device``, refusing a model that is not of ``family``."""
    if family not in FAMILIES and family != DFLASH:
        raise AlignError(f"unknown drafter family '{family}'; choose one of {', '.join([*FAMILIES, DFLASH])}")
    path = resolve(path)
    config = _config(path, "drafter", trust_remote_code)
    kind = config.model_type
    dflash = ARCHITECTURE in (getattr(config, "architectures", None) or [])
    if dflash != (family == DFLASH):
        raise AlignError(f"the drafter '{path}' is {'a' if dflash else 'not a'} feature-conditioned (dflash) drafter: "
                         f"set drafter.family: {'dflash' if dflash else infer_family(path, trust_remote_code)}")
    if dflash:
        from align.models.dflash import DFlashDraftModel

        model = _weights(DFlashDraftModel, path, "drafter", dtype=DTYPES[dtype])
        return (model.to(device) if device is not None else model).eval(), load_tokenizer(path, "drafter")
    if family == "diffusiongemma" and kind != "diffusion_gemma":
        raise AlignError(f"the drafter '{path}' is a {kind} model, not a DiffusionGemma block-diffusion model; "
                         "check drafter.path and drafter.family")
    if family != "diffusiongemma" and kind == "diffusion_gemma":
        raise AlignError(f"the drafter '{path}' is a DiffusionGemma model: set drafter.family: diffusiongemma")
    if getattr(config, "is_decoder", False) or kind in _causal_types():
        raise AlignError(f"the drafter '{path}' is a causal language model ({kind}), not a diffusion model; "
                         "check drafter.path")
    try:
        if family == "diffusiongemma":
            from align.models.diffusiongemma import drafter_class

            cls = drafter_class(config)  # DiffusionGemma, or with Gemma 3's value path
        elif family == "mdlm":
            cls = AutoModelForMaskedLM
        else:
            cls = AutoModel
        model = _weights(cls, path, "drafter", dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise AlignError(f"the drafter '{path}' ({kind}) cannot be loaded as a {family} diffusion model "
                         f"({str(error).splitlines()[0]}); check drafter.path and drafter.family") from None
    if device is not None:
        model.to(device)
    return model.eval(), load_tokenizer(path, "drafter", trust_remote_code)


def export_meta(path: str) -> dict[str, Any]:
    """An exported drafter's meta.json ({} for a folder that is not an export, or an unreadable file)."""
    meta = Path(resolve(str(path))) / "meta.json"
    try:
        found = json.loads(meta.read_text()) if meta.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        found = {}
    return found if isinstance(found, dict) else {}


def drafting_of(path: str) -> dict[str, Any]:
    """How an exported drafter drafts, as its training set it (its meta.json; defaults for a folder that is not an
    export): ``canvas_seed``, the fixed canvas it was trained on (None: a fresh draw per block), ``first_token``, what
    drafts a block's first token, and ``context``, the prefix tokens a bidirectional drafter reads (its training's
    ``data.max_prefix_len``; None: all). Keyword arguments of :class:`align.drafter.Drafter`."""
    found = export_meta(path)
    seed, first, context = found.get("canvas_seed"), found.get("first_token"), found.get("context")
    return {"canvas_seed": seed if isinstance(seed, int) else None,
            "first_token": first if first in FIRST_TOKEN else "canvas",
            "context": context if isinstance(context, int) and context > 0 else None}


def trained_steps(path: str) -> int:
    """The T (drafter passes per block) an exported drafter was trained for: its recipe's distill.denoise_steps, 1
    for a folder that is not an export or an export from before the key was recorded."""
    steps = export_meta(path).get("denoise_steps")
    return steps if isinstance(steps, int) and steps > 0 else 1


def check_model_folder(path: str, role: str) -> None:
    """Before anything loads: a local model folder has a config and weights whose headers read (a truncated or
    half-copied ``*.safetensors`` is named here, not after an hour of other work); a zoo name is in the zoo, and one
    not built yet is left to build after every other check (``align.zoo.check_name``). Hub names pass through."""
    name = check_name(path)
    if name is not None and not is_built(name):
        return  # a zoo model that is not built yet: built once every input has been checked
    folder = Path(resolve(path))
    if not folder.exists():
        if path.startswith(("/", ".", "~")) or Path(path).suffix:
            raise AlignError(f"the {role} folder '{path}' does not exist; check the path")
        return  # a hub name: from_pretrained resolves it
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


def _weights(cls: Any, path: str, role: str, **kwargs) -> Any:
    """``cls.from_pretrained(path)``, refusing weights that are unreadable, of other shapes, or missing (which
    ``from_pretrained`` would fill with random values and a warning)."""
    from safetensors import SafetensorError

    try:
        model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
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


def load_pair(drafter_path: str, verifier_path: str, family: str, dtype: str = "float32",
              trust_remote_code: bool = False, mask_token_id: int | None = None,
              drafter_dtype: str | None = None, device: str | None = None) -> tuple[Drafter, Verifier, Any]:
    """(Drafter, Verifier, tokenizer) on ``device`` (default: the accelerator when present), vocabulary checked; a
    dflash drafter is a :class:`DFlashDrafter` reading this verifier (refused unless trained on it)."""
    device = device or default_device()
    verifier_model, tokenizer = load_verifier_model(verifier_path, dtype, device)
    if family == DFLASH:
        vocab = shared_vocab_size(load_tokenizer(resolve(drafter_path), "dflash drafter"), tokenizer, drafter_path,
                                  verifier_path)
        drafter = load_dflash_drafter(resolve(drafter_path), verifier_model, vocab, drafter_dtype or dtype, device,
                                      verifier_path)
        return drafter, Verifier(verifier_model), tokenizer
    drafter_model, drafter_tokenizer = load_drafter_model(drafter_path, family, drafter_dtype or dtype,
                                                          trust_remote_code, device)
    vocab = shared_vocab_size(drafter_tokenizer, tokenizer, drafter_path, verifier_path)
    rows = drafter_model.get_output_embeddings().weight.shape[0] if drafter_model.get_output_embeddings() is not None else vocab
    if rows < vocab:
        raise AlignError(f"the drafter '{drafter_path}' has {rows} logit rows, fewer than the {vocab} tokens of the "
                         "shared vocabulary")
    if mask_token_id is None:
        mask_token_id = drafter_tokenizer.mask_token_id
    drafter = Drafter(drafter_model, family, vocab, mask_token_id, **drafting_of(drafter_path))
    return drafter, Verifier(verifier_model), tokenizer


def infer_family(path: str, trust_remote_code: bool = False) -> str:
    """The drafter family a model folder belongs to (its config says; exported drafters also name it)."""
    meta = Path(path) / "meta.json"
    if meta.is_file():
        import json

        family = json.loads(meta.read_text()).get("family")
        if family:
            return family
    config = _config(path, "drafter", trust_remote_code)
    if ARCHITECTURE in (getattr(config, "architectures", None) or []):
        return DFLASH
    if config.model_type == "diffusion_gemma":
        return "diffusiongemma"
    if getattr(config, "auto_map", None) and "AutoModel" in config.auto_map:
        return "dream"
    return "mdlm"


def load_dflash_drafter(path: str | Path, verifier_model: Any, vocab_size: int, dtype: str = "float32",
                        device: str | torch.device | None = None, verifier_name: str = "the verifier") -> DFlashDrafter:
    """A :class:`DFlashDrafter` from a saved folder, for ``verifier_model`` (checked against the drafter's meta)."""
    from align.dflash.drafter import DFlashDrafter, check_verifier
    from align.features import check_layers

    check_verifier(path, verifier_model, verifier_name)
    model, _ = load_drafter_model(str(path), DFLASH, dtype, device=device)
    check_layers(verifier_model, model.config.target_layer_ids)
    width = verifier_model.config.get_text_config().hidden_size
    if (model.config.target_hidden_size or model.config.hidden_size) != width or model.config.hidden_size != width:
        raise AlignError(f"the dflash drafter {path} is {model.config.hidden_size} wide and reads features "
                         f"{model.config.target_hidden_size} wide, but the verifier is {width} wide: it shares the "
                         "verifier's embeddings and head, so both must be the verifier's width")
    return DFlashDrafter(model, verifier_model, vocab_size)
