"""Property-based fuzzing (hypothesis) of what reads user input: the recipe loader, its overrides and the prompt
reader. Whatever they are given, they return a value or raise ``AlignError`` (one line for the user) — never another
exception, which would reach the user as a traceback."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from align.config import SECTIONS, build_recipe, load_recipe
from align.errors import AlignError
from align.prompts import read_prompt_file

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=3), max_leaves=6)
keys = st.sampled_from(["max_steps", "lr", "gamma", "objective", "path", "family", "temperature", "micro_batch_size",
                        "global_batch_size", "zero_stage", "r", "packing", "num_prompts", "name", "bogus"])
sections = st.dictionaries(st.sampled_from([*SECTIONS, "bogus"]), st.one_of(values, st.dictionaries(keys, values,
                                                                                                    max_size=4)),
                           max_size=4)


def _returns_or_refuses(call) -> None:
    try:
        call()
    except AlignError as error:
        assert str(error) and "\n" not in str(error).strip(), str(error)


@FUZZ
@given(sections)
def test_any_mapping_builds_a_recipe_or_is_refused_in_one_line(raw):
    _returns_or_refuses(lambda: build_recipe(raw))


@FUZZ
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_recipe_file_loads_or_is_refused_in_one_line(content):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recipe.yaml"
        path.write_bytes(content)
        _returns_or_refuses(lambda: load_recipe(path))


@FUZZ
@given(st.lists(st.text(max_size=40), max_size=3))
def test_any_override_applies_or_is_refused_in_one_line(items):
    _returns_or_refuses(lambda: load_recipe("recipes/tiny.yaml", items))


@FUZZ
@given(st.binary(max_size=400) | st.lists(st.text(max_size=60), max_size=5).map(lambda ls: "\n".join(ls).encode()))
def test_any_prompt_file_reads_or_is_refused_in_one_line(content):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "prompts.jsonl"
        path.write_bytes(content)
        _returns_or_refuses(lambda: read_prompt_file(path))
