"""The AR drafter's model: a causal Llama with tied embeddings, its parameter count matched to a diffusion drafter's."""

from __future__ import annotations

from typing import Any

import torch

from align.errors import AlignError

def ar_model(vocab_size: int, hidden: int, layers: int, heads: int, intermediate: int, max_len: int,
             seed: int = 0, pad: int = 0, bos: int | None = None, eos: int | list[int] | None = None):
    """A causal Llama with tied input and output embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
        pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=True, rope_theta=10000.0,
    )
    return LlamaForCausalLM(config)


def count_parameters(model: Any) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def llama_parameters(vocab: int, hidden: int, layers: int, intermediate: int) -> int:
    """Parameters of :func:`ar_model` (heads do not change the count)."""
    return vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + hidden


def matched_intermediate(target: int, vocab: int, hidden: int, layers: int, multiple: int = 8) -> int:
    """The MLP width (a multiple of ``multiple``) that brings :func:`ar_model` closest to ``target`` parameters."""
    free = target - llama_parameters(vocab, hidden, layers, 0)
    if free <= 0:
        raise AlignError(f"a {layers}-layer, {hidden}-wide Llama over {vocab} tokens already has "
                         f"{llama_parameters(vocab, hidden, layers, 0):,} parameters without its MLP, more than the "
                         f"{target:,} to match; pass smaller --hidden/--layers")
    width = free / (3 * hidden * layers)
    return max(multiple, int(round(width / multiple)) * multiple)


def drafter_shape(path: str, family: str, trust_remote_code: bool = False) -> dict[str, int]:
    """Parameter count and text sizes of a (diffusion) drafter, built on the meta device: no weights are read."""
    from transformers import AutoConfig

    from align.loading import model_class
    from align.zoo import is_built, resolve

    name = path[len("zoo:"):] if path.startswith("zoo:") else None
    if name is not None and not is_built(name):  # count it from the zoo's spec rather than start a build
        from transformers import AutoTokenizer

        from align.zoo.build import ZooSpec, drafter_model, tokenizer_dir

        spec = ZooSpec()
        sizes = spec.drafters.get(name)
        if sizes is None or not (tokenizer_dir() / "tokenizer.json").is_file():
            raise AlignError(f"the drafter {path} is not built yet; build it first (python -m align.zoo build {name})")
        with torch.device("meta"):
            model = drafter_model(name, spec, len(AutoTokenizer.from_pretrained(str(tokenizer_dir()))))
        return {"parameters": count_parameters(model), "hidden": sizes["hidden"], "layers": sizes["layers"],
                "heads": sizes["heads"]}
    path = resolve(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise AlignError(f"cannot read the drafter's config from '{path}' ({str(error).splitlines()[0]})") from None
    with torch.device("meta"):
        cls = model_class(family, config)
        own_config = getattr(cls, "config_class", None)  # a project model reads its own (a dflash drafter's layers)
        if own_config is not None and not isinstance(config, own_config):
            config = own_config.from_pretrained(path)
        model = cls.from_config(config, trust_remote_code=trust_remote_code) if hasattr(cls, "from_config") \
            else cls(config)
    text = config.get_text_config()
    return {"parameters": count_parameters(model), "hidden": text.hidden_size, "layers": text.num_hidden_layers,
            "heads": text.num_attention_heads}

