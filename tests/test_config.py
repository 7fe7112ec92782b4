"""Recipes: every shipped recipe loads; every kind of bad input is one clear error naming the key and value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from align.config import RecipeError, load_recipe, recipe_keys, save_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_there_are_the_four_recipes():
    assert {p.stem for p in RECIPES} >= {"tiny", "tiny-mdlm", "gemma", "qwen-diffucoder"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_round_trips(path, tmp_path):
    recipe = load_recipe(path)
    assert recipe.run.name and recipe.distill.gamma > 0
    save_recipe(recipe, tmp_path / "recipe.yaml")
    assert load_recipe(tmp_path / "recipe.yaml") == recipe


def test_defaults_yaml_overrides_precedence(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  lr: 0.001\n  max_steps: 7\n")
    recipe = load_recipe(path, ["train.max_steps=9", "distill.objective=ce", "lora.target_modules=[q_proj]"])
    assert recipe.train.lr == 0.001  # YAML over default
    assert recipe.train.max_steps == 9  # override over YAML
    assert recipe.distill.objective == "ce" and recipe.lora.target_modules == ["q_proj"]
    assert recipe.train.warmup_steps == 30  # default kept
    assert load_recipe(path, ["train.lr=1e-4"]).train.lr == 1e-4  # YAML reads 1e-4 as text; a float key takes it


@pytest.mark.parametrize("override, words", [
    ("foo.bar=1", ["unknown recipe section 'foo'", "run, verifier"]),
    ("train.foo=1", ["unknown recipe key 'train.foo'", "max_steps"]),
    ("train.lr=fast", ["train.lr", "'fast'", "a number"]),
    ("train.max_steps=0", ["train.max_steps", "got 0", ">= 1"]),
    ("distill.objective=magic", ["distill.objective", "'magic'", "'streak'"]),
    ("deepspeed.zero_stage=4", ["deepspeed.zero_stage", "<= 3"]),
    ("deepspeed.bf16=1", ["deepspeed.bf16", "true or false"]),
    ("data.top_p=1.5", ["data.top_p", "<= 1.0"]),
    ("train.global_batch_size=33", ["train.global_batch_size", "multiple of"]),
    ("drafter.family=dream", ["trust_remote_code"]),
    ("data.feature_cache=true", ["data.feature_cache", "reads none", "set data.feature_cache: false"]),
    ("nodot=3", ["bad override", "section.key=value"]),
])
def test_bad_values_name_key_value_and_what_is_allowed(override, words):
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [override])
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_a_feature_cache_is_refused_with_an_objective_that_reads_the_verifiers_logits():
    base = ["drafter.family=dflash", "distill.canvas_seed=null", "data.feature_cache=true"]
    assert load_recipe("recipes/tiny-dflash.yaml", base[2:]).data.feature_cache
    for objective in ("tv", "kd", "sampled_streak"):
        with pytest.raises(RecipeError, match=f"distill.objective {objective} reads its logits"):
            load_recipe("recipes/tiny-dflash.yaml", [*base, f"distill.objective={objective}"])


def test_missing_and_malformed_recipe_files(tmp_path):
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(RecipeError, match="not valid YAML at line"):
        load_recipe(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must be a mapping"):
        load_recipe(listy)


def test_cli_prints_one_line_and_exits_nonzero(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "align" / "train.py"), str(tmp_path / "missing.yaml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: recipe not found: {tmp_path / 'missing.yaml'} "
                                                  "(pass the path of a YAML file such as recipes/tiny.yaml)"]


def test_docs_recipes_documents_every_recipe_key():
    from align.config import recipe_markdown

    undocumented = [f"{s}.{k}" for s, k, _, help in recipe_keys() if len(help.split()) < 3]
    assert not undocumented, f"recipe keys without documentation: {undocumented}"
    assert (ROOT / "docs" / "recipes.md").read_text() == recipe_markdown(), \
        "docs/recipes.md is out of date: python -m align.config > docs/recipes.md"
