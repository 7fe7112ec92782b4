"""Shared fixtures: tiny random models of every family (hidden 16-32, vocabulary 64), built in seconds."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# transformers' own default, whatever this machine's environment says: only the loader may keep Hub kernels off
os.environ["USE_HUB_KERNELS"] = "YES"
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

VOCAB = 64
EOS, MASK = 1, 3


def train_main(argv: list[str]) -> int:
    """``align/train.py``'s main, run in this process from the script's file: the entry script is no module anything
    imports (tests/test_structure.py)."""
    import runpy

    return runpy.run_path(str(ROOT / "align" / "train.py"), run_name="align_train_script")["main"](argv)


def script_module(path: str):
    """The script at ``path`` (``bench/real_report.py``) as a module, imported from its file once under a name of its
    own; its ``__main__`` guard keeps it from running."""
    import importlib.util

    name = "script_" + path.replace("/", "_").removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def tiny_verifier(seed: int = 0, vocab: int = VOCAB, dtype=torch.float64):
    from align.zoo.models import verifier_model

    return verifier_model(vocab, hidden=32, layers=2, heads=2, max_len=256, seed=seed).to(dtype).eval()


def tiny_drafter(family: str, seed: int = 0, vocab: int = VOCAB, dtype=torch.float32):
    from align.zoo.models import diffusiongemma_model, mdlm_model

    if family == "diffusiongemma":
        model = diffusiongemma_model(vocab, hidden=32, layers=2, heads=2, experts=4, max_len=256, seed=seed)
    elif family == "mdlm":
        model = mdlm_model(vocab, hidden=32, layers=2, heads=2, max_len=256, seed=seed)
    else:
        from tinydream import TinyDreamConfig, TinyDreamModel

        torch.manual_seed(seed)
        model = TinyDreamModel(TinyDreamConfig(vocab_size=vocab, hidden_size=32, mask_token_id=MASK))
    return model.to(dtype).eval()


def save_tinydream(model, path: Path) -> None:
    """Save a TinyDream model as remote code: weights, config with auto_map, and the modelling file."""
    model.config.auto_map = {"AutoConfig": "tinydream.TinyDreamConfig", "AutoModel": "tinydream.TinyDreamModel"}
    model.save_pretrained(path)
    shutil.copy(ROOT / "tests" / "tinydream.py", path / "tinydream.py")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A tokenizer trained on a miniature tiny world (a few hundred entries)."""
    from align.tinyworld.corpus import build_world
    from align.tinyworld.tokenizer import train_tokenizer

    world = build_world(docs_per_kind=40, test_per_kind=3, seed=0)
    tok = train_tokenizer([d["prompt"] for d in world["train_docs"]] + [d["response"] for d in world["train_docs"]],
                          vocab_size=400)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir):
    """Saved tiny verifier and drafters of every family, each with the shared tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    verifier = tiny_verifier(vocab=vocab, dtype=torch.float32)
    verifier.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=0, bos_token_id=2)
    for name, model in [("verifier", verifier), ("diffusiongemma", tiny_drafter("diffusiongemma", vocab=vocab)),
                        ("mdlm", tiny_drafter("mdlm", vocab=vocab)), ("dream", tiny_drafter("dream", vocab=vocab))]:
        path = root / name
        model = model.float()
        if name == "dream":
            save_tinydream(model, path)
        else:
            model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[name] = path
    from align.zoo.models import dflash_model  # reads the verifier's layer 0 (of 2)

    dflash = dflash_model(verifier.config, [0], MASK, layers=1, intermediate=64, kv_heads=1, seed=1)
    dflash.save_pretrained(root / "dflash")
    tokenizer.save_pretrained(root / "dflash")
    dirs["dflash"] = root / "dflash"
    return dirs


@pytest.fixture(scope="session")
def world_prompts(tmp_path_factory):
    """A JSONL of tiny-world training prompts (one per line)."""
    import json

    from align.tinyworld.corpus import build_world

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = build_world(docs_per_kind=40, test_per_kind=3, seed=0)["train_prompts"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session", autouse=True)
def no_hub_kernels():
    """Every model load in every test keeps transformers' Hub kernels off: a load that would turn them on (on a GPU it
    fetches ``kernels-community/*`` from the Hub, which fails offline) fails the test, on this CPU machine too."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.set_use_kernels

    def guarded(self, use_kernels, *args, **kwargs):
        if use_kernels:
            raise AssertionError(f"loading {type(self).__name__} asked transformers for the Hub's kernels "
                                 "(use_kernels): load models through align.loading.pretrained")
        return original(self, use_kernels, *args, **kwargs)

    PreTrainedModel.set_use_kernels = guarded
    yield
    PreTrainedModel.set_use_kernels = original


@pytest.fixture(scope="session", autouse=True)
def align_cache(tmp_path_factory):
    """Every test shares one throw-away cache (rollouts land there), never the user's."""
    path = tmp_path_factory.mktemp("cache")
    os.environ["ALIGN_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def exported(model_dirs, tmp_path_factory):
    """A drafter folder laid out like an export: weights, tokenizer and a meta.json naming verifier and base."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("exported") / "final"
    shutil.copytree(model_dirs["mdlm"], path)
    (path / "meta.json").write_text(json.dumps({"verifier": str(model_dirs["verifier"]), "family": "mdlm",
                                                "base_drafter": str(model_dirs["mdlm"])}))
    return path


@pytest.fixture(scope="session")
def vllm_verifier(tokenizer_dir, tmp_path_factory):
    """A tiny Llama vLLM's CPU kernels accept (head size 32), with well separated logits (no greedy near-ties)."""
    from transformers import AutoTokenizer, GenerationConfig

    from align.zoo.models import verifier_model

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = verifier_model(len(tokenizer), hidden=64, layers=2, heads=2, max_len=256, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0, bos_token_id=2)
    path = tmp_path_factory.mktemp("vllm-verifier")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
