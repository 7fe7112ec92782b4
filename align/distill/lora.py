"""LoRA on the drafter's text layers: PEFT adapters on the modules the recipe names, one adapter per shared weight.

Real drafters are more than a stack of text layers. Gemma 4's vision and audio towers have their own ``q_proj`` ...
(``Gemma4ClippableLinear`` wrappers, which PEFT refuses), so the recipe's names are matched only against
``torch.nn.Linear`` modules outside any tower. DiffusionGemma's encoder and decoder text layers share their weight
tensors: two modules, one weight. Separate adapters on each copy would train two updates that a merge then adds
into the one weight, so the export would not be the model that was trained. Here the first module holding a weight
gets the adapter and every other module holding that weight is replaced by the adapted module itself: encoder and
decoder run one adapter, exactly as the merged, still-shared weight will.
"""

from __future__ import annotations

from typing import Any

import torch

from align.errors import AlignError

#: submodules whose linear layers never get adapters (multimodal towers and their projections)
TOWERS = ("vision", "audio")


def lora_targets(model: torch.nn.Module, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """(modules to adapt, {alias: module it shares its weight with}) for the recipe's target ``names``."""
    owners: dict[int, str] = {}
    targets, aliases = [], {}
    for path, module in model.named_modules(remove_duplicate=False):
        parts = path.split(".")
        if parts[-1] not in names or not isinstance(module, torch.nn.Linear):
            continue
        if any(tower in part for part in parts for tower in TOWERS):
            continue
        key = id(module.weight)
        if key in owners:
            aliases[path] = owners[key]
        else:
            owners[key] = path
            targets.append(path)
    if not targets:
        raise AlignError(f"lora.target_modules {names} match no linear layer of the drafter's text layers; "
                         "name its projections (e.g. q_proj, v_proj) or set lora.r: 0")
    return targets, aliases


def add_lora(model: torch.nn.Module, r: int, alpha: int, dropout: float, target_modules: list[str]) -> Any:
    """``model`` wrapped by PEFT with adapters on its text layers; shared weights share one adapter."""
    from peft import LoraConfig, get_peft_model

    targets, aliases = lora_targets(model, target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none")
    peft_model = get_peft_model(model, config)
    for alias, owner in aliases.items():
        parent, _, name = alias.rpartition(".")
        setattr(model.get_submodule(parent), name, model.get_submodule(owner))
    return peft_model


def merge_lora(state: dict[str, torch.Tensor], alpha: int, r: int) -> dict[str, torch.Tensor]:
    """The base model's weights with every adapter merged in, from a PEFT model's state dict.

        W = W₀ + (α / r) · B · A      for each adapted module (A: r × in, B: out × r)

    PEFT's names (``base_model.model.…``, ``….base_layer.weight``) become the base model's own. Merged weights are
    float32 whatever W₀'s dtype: LoRA updates are often below bfloat16's resolution at W₀'s magnitude (a bf16 W₀
    plus a 1e-4 update rounds back to W₀), so rounding after the merge would silently drop the training.
    """
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" not in key:
            merged[key.removeprefix("base_model.model.").replace(".base_layer.", ".")] = value
    for key, a in state.items():
        if ".lora_A." not in key:
            continue
        prefix, _, rest = key.partition(".lora_A.")
        b = state[f"{prefix}.lora_B.{rest}"]
        weight = prefix.removeprefix("base_model.model.") + ".weight"
        delta = (alpha / r) * (b.double() @ a.double())
        merged[weight] = (merged[weight].double() + delta).float()
    return merged


def update_kept(state: dict[str, torch.Tensor], merged: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """How much of the LoRA update survives rounding the merged weights to ``dtype``:
    1 − ‖round(W₀ + ΔW) − (W₀ + ΔW)‖ / ‖ΔW‖ over all adapted weights (1: all of it; ≤ 0: none)."""
    error = update = 0.0
    for key in state:
        if key.endswith(".base_layer.weight"):
            name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
            exact = merged[name].double()
            error += float((exact.to(dtype).double() - exact).square().sum())
            update += float((exact - state[key].double()).square().sum())
    return 1.0 - (error / update) ** 0.5 if update else 1.0
