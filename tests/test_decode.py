"""The decode CLI and the checks around it: shared vocabulary, padded logit rows, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from align.errors import AlignError
from align.drafters import load_pair
from align.prompts import encode_prompt
from align.speculative import SpeculativeDecoder
from align.verifier import ar_generate

ROOT = Path(__file__).resolve().parents[1]


def decode(args: list[str]) -> int:
    from align.decode import main

    return main(args)


def test_cli_decodes_one_prompt_losslessly(model_dirs):
    result = subprocess.run([sys.executable, "-m", "align.decode", "--drafter", str(model_dirs["diffusiongemma"]),
                             "--verifier", str(model_dirs["verifier"]), "--prompt", "The capital of France is",
                             "--gamma", "4", "--max-new-tokens", "16", "--json"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert stats["lossless"] is True and stats["new_tokens"] == 16
    assert stats["tau"] == pytest.approx(stats["accepted_mean"] + 1) and len(stats["per_position"]) == 4


def test_text_output_marks_accepted_blocks(model_dirs, capsys, monkeypatch):
    """The printed text is the generation piece by piece, each block's accepted draft tokens in [brackets] and the
    verifier's own token after them; with prompt lookup on a verifier that repeats itself, some drafts are
    accepted and marked."""
    from transformers import AutoTokenizer

    from align.speculative import SpeculativeDecoder

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["verifier"])
    made = []
    real = SpeculativeDecoder.generate

    def recording(self, *args, **kwargs):
        made.append(real(self, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(SpeculativeDecoder, "generate", recording)
    for drafter in (str(model_dirs["mdlm"]), "ngram"):
        made.clear()
        assert decode(["--drafter", drafter, "--verifier", str(model_dirs["verifier"]), "--prompt",
                       "Explain why the sky is blue", "--gamma", "4", "--max-new-tokens", "64"]) == 0
        out = capsys.readouterr().out
        assert "accepted_mean" in out and "tau" in out and "speedup" in out and "lossless True" in out
        pieces = made[-1].pieces  # the timed generation's blocks
        expected = "".join((f"[{tokenizer.decode(kept)}]" if tokenizer.decode(kept) else "")
                           + ("" if token is None else tokenizer.decode([token])) for kept, token in pieces)
        assert out.splitlines()[0] == expected.splitlines()[0]
    assert any(kept for kept, _ in pieces) and "[" in out.splitlines()[0]  # lookup's accepted drafts, marked


def test_drafter_with_another_tokenizer_is_refused_naming_both(model_dirs, tmp_path):
    from align.tinyworld.tokenizer import train_tokenizer

    other = tmp_path / "other"
    shutil.copytree(model_dirs["mdlm"], other)
    train_tokenizer(["completely different text " * 50, "zebra quartz"], vocab_size=300).save_pretrained(other)
    with pytest.raises(AlignError) as error:
        load_pair(str(other), str(model_dirs["verifier"]), "mdlm")
    message = str(error.value)
    assert "do not share a tokenizer" in message and str(other) in message and str(model_dirs["verifier"]) in message


def test_padded_logit_rows_are_sliced_and_decoding_stays_exact(model_dirs, tmp_path):
    from transformers import AutoTokenizer

    from conftest import tiny_drafter

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["verifier"])
    padded = tmp_path / "padded"
    tiny_drafter("mdlm", 7, vocab=len(tokenizer) + 24).save_pretrained(padded)  # 24 extra (padding) rows
    tokenizer.save_pretrained(padded)
    drafter, verifier, tok = load_pair(str(padded), str(model_dirs["verifier"]), "mdlm")
    assert drafter.vocab_size == len(tokenizer)
    prompt = encode_prompt(tok, "Give me a haiku about the ocean")
    out = SpeculativeDecoder(drafter, verifier, [1]).generate(prompt, 20, gamma=6)
    assert out.tokens == ar_generate(verifier.model, prompt, 20, eos_token_ids=[1])


@pytest.mark.parametrize("kind", ["diffusiongemma", "mdlm", "dream", "dflash", "ar", "ngram:2+mdlm"])
def test_every_drafter_kind_loads_in_int8_and_decodes_exactly(model_dirs, kind):
    """``--drafter-dtype int8`` for every drafter kind (make real's headline runs its assistant, an AR drafter, in
    int8): the drafter's linear layers become int8 ones, the verifier's stay float, and greedy output is the
    verifier's."""
    from align.loading import is_int8

    verifier_path = str(model_dirs["verifier"])
    lookup, _, folder = kind.rpartition("+")
    path = verifier_path if folder == "ar" else str(model_dirs[folder])
    drafter, verifier, tok = load_pair(f"{lookup}+{path}" if lookup else path, verifier_path,
                                       None if lookup else folder, drafter_dtype="int8",
                                       trust_remote_code=folder == "dream")
    inner = drafter.drafter if lookup else drafter
    assert is_int8(inner.model) and not is_int8(verifier.model)
    prompt = encode_prompt(tok, "Give me a haiku about the ocean")
    out = SpeculativeDecoder(drafter, verifier, [1]).generate(prompt, 20, gamma=6)
    assert out.tokens == ar_generate(verifier.model, prompt, 20, eos_token_ids=[1])


@pytest.mark.parametrize("extra, words", [
    (["--gamma", "0"], "gamma must be a positive"),
    (["--steps", "0"], "steps must be a positive"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", "word " * 400], "context is 256"),
])
def test_bad_decode_input(model_dirs, extra, words):
    args = ["--drafter", str(model_dirs["mdlm"]), "--verifier", str(model_dirs["verifier"]), "--prompt", "hi"]
    with pytest.raises(AlignError, match=words):
        decode(args + extra)
