"""The tiny zoo: a miniature build from nothing, saved and loaded like real models; zoo names resolve or fail."""

from __future__ import annotations

import json

import pytest
import torch

from align.errors import AlignError

MINI = dict(docs_per_kind=20, test_per_kind=2, vocab_size=300, batch_size=4,
            verifier={"hidden": 32, "layers": 1, "heads": 2, "steps": 3},
            drafters={"tiny-diffusiongemma": {"hidden": 32, "layers": 1, "heads": 2, "steps": 3, "offsets": 4},
                       "tiny-mdlm": {"hidden": 32, "layers": 1, "heads": 2, "steps": 3}})


@pytest.fixture()
def mini_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_miniature_zoo_builds_saves_and_loads(mini_cache, capsys):
    from align.drafters import load_pair
    from align.prompts import encode_prompt
    from align.speculative import SpeculativeDecoder
    from align.verifier import ar_generate
    from align.zoo import DEFAULT_BUILD, is_built, model_dir
    from align.zoo.build import ZooSpec, build

    assert build(spec=ZooSpec(**MINI)) == list(DEFAULT_BUILD)  # the replicas only when named
    assert build(spec=ZooSpec(**MINI)) == []  # nothing missing: nothing rebuilt
    for name in DEFAULT_BUILD:
        assert is_built(name)
        for file in ("config.json", "model.safetensors", "tokenizer.json", "zoo.json"):
            assert (model_dir(name) / file).is_file(), (name, file)
        meta = json.loads((model_dir(name) / "zoo.json").read_text())
        assert meta["parameters"] > 0 and meta["spec"]["seed"] == 0
    for name, family in (("tiny-diffusiongemma", "diffusiongemma"), ("tiny-mdlm", "mdlm")):
        drafter, verifier, tokenizer = load_pair(f"zoo:{name}", "zoo:tiny-verifier", family)
        prompt = encode_prompt(tokenizer, "The capital of France is")
        out = SpeculativeDecoder(drafter, verifier, [tokenizer.eos_token_id]).generate(prompt, 12, gamma=4)
        assert out.tokens == ar_generate(verifier.model, prompt, 12, eos_token_ids=[tokenizer.eos_token_id])
    world = mini_cache / "tinyworld"
    assert {p.name for p in world.iterdir()} >= {"train_docs.jsonl", "train_prompts.jsonl", "test_prompts.jsonl",
                                                 "probe.jsonl", "world.json"}
    # a model built with other settings than the build's is rebuilt (and only that one)
    changed = dict(MINI, drafters={**MINI["drafters"], "tiny-mdlm": {**MINI["drafters"]["tiny-mdlm"], "steps": 4}})
    assert build(spec=ZooSpec(**changed)) == ["tiny-mdlm"]
    assert "zoo:tiny-mdlm was built with other settings (" in capsys.readouterr().out
    assert json.loads((model_dir("tiny-mdlm") / "zoo.json").read_text())["spec"]["drafters"]["tiny-mdlm"]["steps"] == 4


def test_saved_models_reload_to_the_same_outputs(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, DiffusionGemmaForBlockDiffusion

    from align.zoo.models import diffusiongemma_model, mdlm_model, verifier_model

    ids = torch.randint(4, 60, (1, 9))
    canvas = torch.randint(4, 60, (1, 4))
    for make, load in ((verifier_model, AutoModelForCausalLM), (mdlm_model, AutoModelForMaskedLM),
                       (diffusiongemma_model, DiffusionGemmaForBlockDiffusion)):
        model = make(64, hidden=32, layers=1, heads=2).eval()
        model.save_pretrained(tmp_path / make.__name__)
        again = load.from_pretrained(tmp_path / make.__name__, use_kernels=False).eval()
        with torch.no_grad():
            if make is diffusiongemma_model:
                from transformers import DynamicCache

                a = model(input_ids=ids, decoder_input_ids=canvas, cache=DynamicCache(config=model.config)).logits
                b = again(input_ids=ids, decoder_input_ids=canvas, cache=DynamicCache(config=again.config)).logits
            else:
                a, b = model(input_ids=ids).logits, again(input_ids=ids).logits
        assert torch.allclose(a, b, atol=1e-6), make.__name__


def test_zoo_names_resolve_build_on_demand_or_fail(mini_cache, monkeypatch, capsys):
    import align.zoo.build as build_module
    from align.zoo import resolve
    from align.zoo.build import ZooSpec

    with pytest.raises(AlignError, match="unknown zoo model 'tiny-gpt'; the zoo has: tiny-verifier"):
        resolve("zoo:tiny-gpt")
    assert resolve("/some/local/folder") == "/some/local/folder"
    real = build_module.build
    monkeypatch.setattr(build_module, "build", lambda names: real(names, spec=ZooSpec(**MINI)))
    path = resolve("zoo:tiny-mdlm")
    assert "zoo:tiny-mdlm is not built yet: building it" in capsys.readouterr().out
    assert path.endswith("tiny-mdlm") and (mini_cache / "zoo" / "tiny-mdlm" / "zoo.json").is_file()
    assert not (mini_cache / "zoo" / "tiny-verifier").exists()  # only what was asked for


def test_zoo_cli_lists_and_refuses_unknown_names(mini_cache):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "align.zoo", "build", "tiny-nope"], capture_output=True, text=True,
                            timeout=120)
    from align.zoo import MODELS

    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: unknown zoo model 'tiny-nope'; the zoo has: {', '.join(MODELS)}")
    assert list(MODELS)[:4] == ["tiny-verifier", "tiny-diffusiongemma", "tiny-mdlm", "tiny-dflash"] and \
        {"smollm2-135m-instruct", "gemma3-270m", "smollm2-dream", "replica-diffucoder"} <= set(MODELS)
    listing = subprocess.run([sys.executable, "-m", "align.zoo", "list"], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and listing.stdout.count("not built") == len(MODELS)


def test_a_model_transformers_would_not_write_is_an_error_not_an_empty_folder(tmp_path, monkeypatch, tokenizer_dir):
    """Under a launcher, transformers' save_pretrained writes nothing on a rank other than 0 (found by a two-process
    run on a fresh cache: the drafter folder held a tokenizer and no model). The build refuses, keeping the old
    folder; the trainer builds zoo models on the lead before the others look."""
    from transformers import AutoTokenizer

    from align.zoo import build as zoo_build
    from align.zoo.models import verifier_model

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = verifier_model(len(tokenizer), hidden=16, layers=1, heads=2, max_len=64, seed=0)
    meta = {"parameters": 1, "seconds": 0}
    zoo_build._save("tiny-verifier", model, tokenizer, meta)
    folder = zoo_build.model_dir("tiny-verifier")
    assert (folder / "config.json").is_file()
    monkeypatch.setattr(type(model), "should_save_on_this_rank", lambda self, is_main_process: False)
    with pytest.raises(AlignError, match="transformers wrote no model"):
        zoo_build._save("tiny-verifier", model, tokenizer, meta)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def test_other_ranks_wait_for_rank_0_to_build(tmp_path, monkeypatch, capsys):
    """Under a launcher only rank 0 builds a missing zoo model; the others wait for it, with no collective (a build
    can outlast any process-group timeout: a gloo barrier gave up after 10 minutes)."""
    import align.zoo as zoo
    import align.zoo.build as zoo_build

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    checks = iter([False, False, False, True, True])
    monkeypatch.setattr(zoo, "is_built", lambda name: next(checks))
    monkeypatch.setattr(zoo.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(zoo_build, "build", lambda *a, **k: pytest.fail("rank 1 must not build"))
    assert zoo.resolve("zoo:tiny-verifier") == str(zoo.model_dir("tiny-verifier"))
    assert "waiting for rank 0" in capsys.readouterr().out
