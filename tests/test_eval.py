"""The evaluation suite: JSON schema, suites, sweeps, the report, losslessness of saved outputs, bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from align.errors import AlignError
from conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"label", "drafter", "verifier", "suite", "gamma", "steps", "temperature", "k", "n_prompts", "n_blocks",
          "accepted_mean", "tau", "acceptance_rate", "per_position", "per_category", "tokens_per_s",
          "ar_tokens_per_s", "speedup", "lossless", "expected_tau", "rejected_in_top5", "verifier_entropy",
          "entropy_acceptance_spearman", "per_prompt"}


def evaluate(args: list[str]) -> int:
    from eval.acceptance import main

    return main(args)


def test_schema_sweep_report_and_lossless_outputs(exported, world_prompts, model_dirs, tmp_path):
    out = tmp_path / "eval"
    assert evaluate(["--ckpt", str(exported), "--prompts", str(world_prompts), "--limit", "4", "--gamma", "2,4",
                     "--k", "1,2", "--max-new-tokens", "12", "--seed", "0,1", "--out", str(out), "--save-outputs"]) == 0
    doc = json.loads((out / "acceptance.json").read_text())
    assert {"device", "dtype", "torch", "transformers"} <= set(doc["environment"])
    results = doc["results"]
    assert len(results) == 2 * 2 * 2  # label x gamma x k
    for r in results:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert 1 <= r["tau"] <= r["accepted_mean"] + 1 + 1e-9  # less where EOS ended a block (no bonus token)
        assert r["lossless_counts"]["mismatch"] == 0
        assert len(r["per_position"]) == r["gamma"] and r["lossless"] is True
        assert r["seeds"] == [0, 1] and "accepted_mean_std" in r
    assert {r["label"] for r in results} == {"aligned", "baseline"}
    for name in ("report.md", "per_position.png", "per_category.png", "gamma_sweep.png", "k_sweep.png"):
        assert (out / name).stat().st_size > 1000 or name == "report.md" and (out / name).stat().st_size > 200
    report = (out / "report.md").read_text()
    assert "| setting | drafter | accepted_mean | τ (tokens per verifier call) |" in report
    assert "accepted + 1" not in report, "τ is not accepted + 1 (EOS blocks, calls with no room to draft)"

    from align.loading import load_verifier_model

    verifier, _ = load_verifier_model(str(model_dirs["verifier"]))
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 8 * 2
    for row in rows[:8]:
        ids = torch.tensor([row["prompt_ids"]])
        expected = verifier.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                     eos_token_id=1, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert row["output_ids"] == expected


def test_interleaved_timing_decodes_exactly_what_one_drafter_at_a_time_does(exported, world_prompts, tmp_path):
    """--interleave changes only the order the prompts meet the drafters (for speeds under drift), not a token."""
    common = ["--ckpt", str(exported), "--prompts", str(world_prompts), "--limit", "3", "--gamma", "2,4",
              "--temperature", "0,1", "--seed", "0,1", "--max-new-tokens", "10", "--save-outputs"]
    docs, outputs = {}, {}
    for mode in ("apart", "interleaved"):
        out = tmp_path / mode
        assert evaluate(common + ["--out", str(out)] + (["--interleave"] if mode == "interleaved" else [])) == 0
        docs[mode] = json.loads((out / "acceptance.json").read_text())["results"]
        outputs[mode] = sorted((r["label"], r["gamma"], r["temperature"], r["seed"], r["id"], r["output_ids"])
                               for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines()))
    assert outputs["interleaved"] == outputs["apart"] and len(outputs["apart"]) == 2 * 2 * 2 * 2 * 3
    assert len({tuple(o[-1]) for o in outputs["apart"]}) > 1  # the prompts and temperatures differ
    keys = ("label", "gamma", "temperature", "accepted_mean", "n_blocks", "lossless", "per_prompt")
    assert [{k: r[k] for k in keys} for r in docs["interleaved"]] == [{k: r[k] for k in keys} for r in docs["apart"]]
    assert all(r["tokens_per_s"] > 0 and r["ar_tokens_per_s"] > 0 for r in docs["interleaved"])


def test_sampling_sweep_marks_lossless_as_not_applicable(exported, world_prompts, tmp_path):
    out = tmp_path / "eval"
    assert evaluate(["--ckpt", str(exported), "--prompts", str(world_prompts), "--limit", "2", "--temperature", "1",
                     "--k", "1,2", "--scorer", "verifier,drafter", "--baseline", "none", "--max-new-tokens", "8",
                     "--out", str(out)]) == 0
    results = json.loads((out / "acceptance.json").read_text())["results"]
    assert [r["label"] for r in results] == ["aligned", "aligned"]  # the drafter scorer is refused when sampling
    assert all(r["lossless"] is None for r in results)


def test_suites_load():
    from eval.suites import load_suite

    probe = load_suite("tinyworld-probe")
    assert len(probe) == 8 and probe[2]["prompt"] == "The capital of France is"
    assert len({p["category"] for p in load_suite("tinyworld")}) == 7


def test_a_broken_specbench_file_is_refused_naming_its_line(tmp_path):
    from eval.suites import read_specbench

    broken = tmp_path / "q.jsonl"
    broken.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n{"question_id": 2}\n')
    with pytest.raises(AlignError, match="q.jsonl:2"):
        read_specbench(broken)


def test_the_shared_suites_load():
    """Spec-Bench's 480 questions and the probe's eight prompts, read from ../shared/data."""
    from eval.suites import load_suite

    shared = ROOT.parent / "shared" / "data"
    if not (shared / "spec_bench" / "question.jsonl").is_file():
        pytest.skip("../shared/data is not here")
    spec = load_suite("specbench")
    assert len(spec) == 480 and {"translation", "summarization", "qa", "math_reasoning", "rag"} <= {
        s["category"] for s in spec}
    assert spec[0]["prompt"].startswith("Compose an engaging travel blog post")
    assert [p["prompt"] for p in load_suite("probe8")][0] == "Translate 'good morning' into Spanish"


def test_bad_input_is_one_line_and_nonzero(exported, model_dirs, world_prompts, tmp_path):
    no_meta = tmp_path / "plain"
    shutil.copytree(model_dirs["mdlm"], no_meta)
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('{"id": 1, "prompt": "hello"}\n{"id": 2, "prompt": \n')
    cases = [
        (["--ckpt", str(no_meta), "--prompts", str(world_prompts)], "no meta.json naming its verifier"),
        (["--ckpt", str(exported), "--prompts", str(bad_prompts)], "bad.jsonl:2: not valid JSON"),
        (["--ckpt", str(exported), "--suite", "nosuch"], "unknown suite 'nosuch'"),
        (["--ckpt", str(exported), "--prompts", str(world_prompts), "--gamma", "0"], "--gamma values must be at least 1"),
    ]
    for args, words in cases:
        with pytest.raises(AlignError, match=words):
            evaluate(args)
    result = subprocess.run([sys.executable, "-m", "eval.acceptance", "--ckpt", str(no_meta)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: ") and "--verifier" in result.stderr


def test_cost_table_puts_a_block_in_verifier_alone_steps():
    from eval.report import cost_table

    r = {"gamma": 16, "steps": 1, "temperature": 0.0, "k": 1, "label": "aligned", "n_blocks": 10, "tau": 3.0,
         "total_s": 0.12, "drafter_s": 0.04, "verifier_s": 0.07, "ar_tokens_per_s": 250.0, "speedup": 0.98}
    row = cost_table([r]).splitlines()[-1]
    # a step of the verifier alone is 4 ms: a 12 ms block costs 3 steps; τ / cost = 1.00; bound 3 × 4 / 7 = 1.71
    assert row.endswith("| aligned | 12.00 | 4.00 | 7.00 | 3.00 | 1.00 | 0.98 | 1.71 |"), row
    assert len(cost_table([{**r, "n_blocks": 0}]).splitlines()) == 2  # nothing decoded: no row


def test_category_and_prompt_means_pool_the_blocks_that_offered_a_draft():
    """A block with room for one token only (γ 0, at the length limit) drafted nothing: like the pooled
    accepted_mean, the per-category and per-prompt means leave it out (they once averaged it in as a 0)."""
    from align.metrics import Block, DecodeStats
    from eval.analysis import PromptRecord, summarize

    stats = DecodeStats(blocks=[Block(4, 3), Block(4, 1), Block(0, 0)], new_tokens=7)
    summary = summarize([PromptRecord("p", "open", [1], [2] * 7, stats)], gamma=4)
    assert summary["accepted_mean"] == 2.0
    assert summary["per_category"]["open"] == 2.0
    assert summary["per_prompt"][0]["accepted_mean"] == 2.0


def test_tau_and_the_vllm_acceptance_length_are_reported_apart():
    """τ counts tokens per verifier call (an EOS block gets no bonus token, γ-0 steps count); vLLM's mean acceptance
    length is 1 + accepted/drafts. Both are in the results, each under its own name, and the tables label them."""
    from align.metrics import Block, DecodeStats
    from eval.analysis import PromptRecord, summarize
    from eval.report import summary_table

    stats = DecodeStats(blocks=[Block(4, 4, produced=4), Block(4, 2), Block(0, 0)], new_tokens=8, total_s=1.0)
    r = summarize([PromptRecord("p", "open", [1], [2] * 8, stats)], gamma=4)
    assert r["tau"] == 8 / 3 and r["acceptance_length"] == 1 + 3.0
    r.update(label="aligned", gamma=4, steps=1, temperature=0.0, k=1, ar_tokens_per_s=1.0, speedup=1.0,
             lossless=True, lossless_counts=None)
    table = summary_table([r])
    assert "τ (tokens per verifier call)" in table and "1 + accepted_mean (vLLM's mean acceptance length)" in table
    assert "| 2.67 | 4.00 |" in table


def test_per_category_takes_each_categorys_prompts_after_the_skipped_ones():
    from eval.acceptance import first_per_category

    prompts = [{"id": f"{c}{i}", "category": c} for i in range(4) for c in "ab"]  # a0 b0 a1 b1 ...
    ids = lambda chosen: [p["id"] for p in chosen]  # noqa: E731
    assert ids(first_per_category(prompts, 2)) == ["a0", "b0", "a1", "b1"]
    assert ids(first_per_category(prompts, 1, skip=2)) == ["a2", "b2"]
    assert ids(first_per_category(prompts, None, skip=3)) == ["a3", "b3"]
    assert first_per_category(prompts, None) == prompts


def test_alternatives_run_in_the_same_loop_with_their_calls_counted(exported, world_prompts, model_dirs, tmp_path):
    """Prompt lookup and assisted generation (transformers' own) beside the drafters: outputs equal to generate's,
    τ from the verifier's forward calls counted. The verifier as its own assistant accepts every drafted token, so its
    τ is well above 1; prompt lookup on a random model that rarely repeats itself stays near 1. make real's report
    (bench/real_report.py) reads the document as a pair's headline."""
    out = tmp_path / "eval"
    assert evaluate(["--ckpt", str(exported), "--baseline", "none", "--prompts", str(world_prompts), "--limit", "3",
                     "--gamma", "2,3", "--max-new-tokens", "12", "--interleave", "--prompt-lookup", "2,3",
                     "--assistant", str(model_dirs["verifier"]), "--assistant-tokens", "3", "--out", str(out)]) == 0
    doc = json.loads((out / "acceptance.json").read_text())
    rows = {r["label"]: r for r in doc["alternatives"]}
    assert set(rows) == {"prompt lookup 2", "prompt lookup 3", "assisted 3"}
    for row in rows.values():
        assert row["lossless"] is True and row["tokens_per_s"] > 0 and row["verifier_calls"] > 0
        assert set(row["per_category_speedup_vs_generate"]) <= {p.get("category", "all") for p in map(
            json.loads, world_prompts.read_text().splitlines())}
    assert rows["assisted 3"]["tau"] > 1.5
    assert all(1 <= rows[f"prompt lookup {n}"]["tau"] <= n + 1 for n in (2, 3))
    assert "prompt lookup 2" in (out / "report.md").read_text()

    # make real's report reads the same document as a pair's headline: the stage table, the alternatives, and a
    # lossless line that counts every greedy output of the loop's drafters (prompts x settings), no Dream section
    real_report = script_module("bench/real_report.py")
    (tmp_path / "real" / "eval").mkdir(parents=True)
    shutil.copytree(out, tmp_path / "real" / "eval" / "smollm2-headline")
    (tmp_path / "real" / "stages.json").write_text(json.dumps({"zoo": 1.2, "eval": [2.0, 30.4]}))
    times = script_module("bench/real.py").read_stages(tmp_path / "real" / "stages.json")  # what make real passes
    report = real_report.write_real_report(tmp_path / "real", ["smollm2"], times).read_text()
    assert "| zoo | 1 |" in report and "| eval | 2 + 30 |" in report and "| **all** | **34** |" in report
    assert "## smollm2: the shipped drafter against what a user already has" in report and "assisted 3" in report
    counts = re.search(r"(\d+) exact, (\d+) near-tie, (\d+) mismatch", report.split("### smollm2: lossless")[1])
    exact, near_tie, mismatch = map(int, counts.groups())
    assert (exact + near_tie, mismatch) == (doc["n_prompts"] * len(doc["results"]), 0)
    assert real_report.PAIRS["smollm2"].title not in report and "probe's eight prompts" not in report


def test_make_real_resumes_past_an_assistant_trained_as_asked(tmp_path):
    """A rerun of make real (after a failed evaluation) does not train the headline's assistant again when it is
    trained with the record's settings after the drafter's last checkpoint; other settings or a newer drafter do."""
    import os

    from align.zoo.pairs import Headline

    real = script_module("bench/real.py")
    args = ("--lr", "1e-3", "--batch-size", "8", "--warmup", "10", "--seconds", "900")
    h = Headline("recipes/x.yaml", "zoo:start", str(tmp_path / "ar"), args, ())
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-10").mkdir(parents=True)
    assert not real.assistant_done(h, str(run_dir))  # nothing trained yet
    (tmp_path / "ar").mkdir()
    meta = {"init": "zoo:start", "lr": 1e-3, "batch_size": 8, "budget_seconds": 900.0}
    (tmp_path / "ar" / "meta.json").write_text(json.dumps(meta))
    assert real.assistant_done(h, str(run_dir))
    assert not real.assistant_done(Headline("recipes/x.yaml", "zoo:start", str(tmp_path / "ar"),
                                            ("--lr", "2e-3", *args[2:]), ()), str(run_dir))  # another learning rate
    later = run_dir / "checkpoints" / "step-20"
    later.mkdir()
    os.utime(later, (os.path.getmtime(tmp_path / "ar" / "meta.json") + 5,) * 2)
    assert not real.assistant_done(h, str(run_dir))  # the drafter trained again after it


def test_make_real_keeps_every_invocations_stage_times(tmp_path, monkeypatch):
    """A resumed make real adds its stage times beside the first run's (a cache hit's seconds never replace the
    from-nothing time); a stages.json of single numbers, as earlier versions wrote, reads as one invocation each."""
    import sys

    real = script_module("bench/real.py")
    monkeypatch.setattr(real, "OUT", tmp_path)
    (tmp_path / "stages.json").write_text(json.dumps({"zoo x": 176.0}))
    times = real.read_stages(tmp_path / "stages.json")
    for _ in range(2):
        real.run("zoo x", [sys.executable, "-c", "pass"], times)
    stored = json.loads((tmp_path / "stages.json").read_text())
    assert stored["zoo x"][0] == 176.0 and len(stored["zoo x"]) == 3
    assert real.read_stages(tmp_path / "stages.json") == stored


@pytest.mark.parametrize("flags, message", [
    (["--drafter", "assisted 2=x"], "taken"),
    (["--prompt-lookup", "0"], "1 or more"),
    (["--assistant-tokens", "3"], "give the assistant too"),
    (["--drafter-dtype", "int8", "--device", "cuda"], "CPU only")])
def test_alternatives_refuse_bad_flags_before_any_model_loads(exported, flags, message, capsys):
    with pytest.raises(AlignError, match=message):
        evaluate(["--ckpt", str(exported), "--suite", "tinyworld", *flags])


def test_ckpt_takes_every_drafter_the_drafter_flag_takes(exported, world_prompts, model_dirs, tmp_path):
    """``--ckpt ngram:3`` (prompt lookup) and ``--ckpt ngram:2+PATH`` are measured as ``--drafter`` measures them
    (issue "The trained drafter pays", item 5: it was refused as "not a model folder or a hub name"); without a
    verifier, or with a malformed spec, one line."""
    verifier = str(model_dirs["verifier"])
    out = tmp_path / "lookup"
    assert evaluate(["--ckpt", "ngram:3", "--verifier", verifier, "--prompts", str(world_prompts), "--limit", "3",
                     "--gamma", "4", "--max-new-tokens", "12", "--out", str(out)]) == 0
    rows = json.loads((out / "acceptance.json").read_text())["results"]
    assert [r["label"] for r in rows] == ["aligned"] and rows[0]["drafter"] == "ngram:3"
    assert rows[0]["lossless"] is True and rows[0]["lossless_counts"]["mismatch"] == 0
    out = tmp_path / "fallback"
    assert evaluate(["--ckpt", f"ngram:2+{exported}", "--prompts", str(world_prompts), "--limit", "2", "--gamma",
                     "4", "--max-new-tokens", "12", "--out", str(out)]) == 0  # the verifier: the export's meta.json
    assert json.loads((out / "acceptance.json").read_text())["results"][0]["lossless"] is True
    with pytest.raises(AlignError, match="pass --verifier PATH"):
        evaluate(["--ckpt", "ngram:3", "--prompts", str(world_prompts)])
    with pytest.raises(AlignError, match="whole number"):
        evaluate(["--ckpt", "ngram:x", "--verifier", verifier, "--prompts", str(world_prompts)])


def test_an_exported_drafters_recipe_sets_the_verifier_dtype_through_a_lookup_spec(exported, world_prompts,
                                                                                     tmp_path):
    """The export's ``recipe.yaml`` names the verifier's dtype (``verifier.dtype``); ``--ckpt ngram:3@0.7+PATH`` takes
    PATH's as ``--ckpt PATH`` does (the headline's command ran its verifier in float32 where the recipe said
    bfloat16), and ``--dtype`` still wins."""
    from eval.acceptance import parse_args, resolve_models

    folder = tmp_path / "final"
    shutil.copytree(exported, folder)
    (folder / "recipe.yaml").write_text(f"verifier:\n  path: {exported}\n  dtype: bfloat16\n")
    for ckpt in (str(folder), f"ngram:3@0.7+{folder}", f"ngram:2+{folder}"):
        args = parse_args(["--ckpt", ckpt, "--prompts", str(world_prompts), "--baseline", "none"])
        resolve_models(args)
        assert args.dtype == "bfloat16", ckpt
        args = parse_args(["--ckpt", ckpt, "--prompts", str(world_prompts), "--baseline", "none", "--dtype",
                           "float32"])
        resolve_models(args)
        assert args.dtype == "float32", ckpt
    args = parse_args(["--ckpt", f"ngram:3+{exported}", "--prompts", str(world_prompts)])  # no recipe: float32
    resolve_models(args)
    assert args.dtype == "float32"


def test_token_trees_run_in_the_same_loop_and_sweep_with_the_rest(exported, world_prompts, tmp_path):
    """``--tree none,4x2,12x4,12x4/auto``: each shape is a setting of its own beside one draft per block, lossless,
    with its candidates per block reported (a sized tree at most its NODES); a malformed shape is one line before
    anything loads."""
    out = tmp_path / "eval"
    assert evaluate(["--ckpt", str(exported), "--baseline", "none", "--prompts", str(world_prompts), "--limit", "3",
                     "--gamma", "4", "--max-new-tokens", "12", "--tree", "none,4x2,12x4,12x4/auto",
                     "--out", str(out)]) == 0
    rows = json.loads((out / "acceptance.json").read_text())["results"]
    assert [r["tree"] for r in rows] == [None, "4x2", "12x4", "12x4/auto"]
    assert 1 <= rows[3]["tree_nodes_mean"] <= 12
    assert all(r["lossless"] is True for r in rows)
    assert rows[0]["tree_nodes_mean"] is None and 1 <= rows[1]["tree_nodes_mean"] <= 4 < rows[2]["tree_nodes_mean"]
    assert "tree 12x4" in (out / "report.md").read_text()
    with pytest.raises(AlignError, match="NODESxBRANCHING"):
        evaluate(["--ckpt", str(exported), "--suite", "tinyworld", "--tree", "lots"])


def test_saved_blocks_say_where_each_block_stood_and_what_it_followed(exported, world_prompts, tmp_path):
    """``--save-blocks``: one row per block of every drafter setting, in order, each at the context its block read
    (the prompt, then every token produced before it), a lookup drafter's rows naming the match they followed (a
    block without one a plain step), a drafter that looks nothing up None; the rows add up to the outputs and to
    acceptance.json's counts."""
    out = tmp_path / "blocks"
    assert evaluate(["--ckpt", f"ngram:2@0.7+{exported}", "--drafter", "lookup=ngram:2", "--prompts",
                     str(world_prompts), "--limit", "3", "--gamma", "4", "--tree", "none,6x2", "--max-new-tokens",
                     "16", "--interleave", "--out", str(out), "--save-blocks", "--save-outputs"]) == 0
    rows = [json.loads(line) for line in (out / "blocks.jsonl").read_text().splitlines()]
    outputs = {(r["label"], r["id"]): r for r in
               map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    results = json.loads((out / "acceptance.json").read_text())["results"]
    assert {(r["label"], r["setting"]["tree"]) for r in rows} == {(lab, tree) for lab in ("aligned", "lookup")
                                                                  for tree in (None, "6x2")}
    for result in results:
        mine = [r for r in rows if r["label"] == result["label"] and r["setting"]["tree"] == result["tree"]]
        assert len(mine) == result["n_blocks"]
        for prompt in dict.fromkeys(r["id"] for r in mine):
            blocks = [r for r in mine if r["id"] == prompt]
            saved = outputs[(result["label"], prompt)]
            assert [b["index"] for b in blocks] == list(range(len(blocks)))
            assert blocks[0]["context"] == len(saved["prompt_ids"])
            for before, after in zip(blocks, blocks[1:]):
                assert after["context"] == before["context"] + before["produced"]
            assert sum(b["produced"] for b in blocks) == len(saved["output_ids"])
            room = [16 - 1 - (b["context"] - blocks[0]["context"]) for b in blocks]  # draft tokens it could offer
            assert all((b["matched"] is None) == (left == 0) for b, left in zip(blocks, room))  # both look up
    lookup = [r for r in rows if r["label"] == "lookup" and r["matched"] is not None]
    assert all(r["gamma"] == 0 for r in lookup if not r["matched"])  # no match: nothing drafted, a plain step
    assert any(r["matched"] for r in lookup) and any(not r["matched"] for r in lookup)


def test_the_block_summary_fits_the_verifier_cost_and_parts_blocks_by_match():
    """bench/blocks.py: the cost fit recovers a known line (the prompt's pass, a prefill, left out), blocks with and
    without a match (and by the match's n-gram length) are counted apart with their accepted tokens, those without one
    grouped by the block before them, and a drafter that looks nothing up has none of these."""
    blocks = script_module("bench/blocks.py")

    def row(index, nodes, matched, accepted, label="mixed", context=100):
        return {"label": label, "setting": {"gamma": 8, "steps": 1, "temperature": 0.0, "k": 1, "tree": "16x4/auto"},
                "index": index, "gamma": 8, "nodes": nodes, "matched": matched, "accepted": accepted,
                "produced": accepted + 1, "context": context + index, "drafter_s": 0.004, "entropy": 0.5 + index % 3,
                "verifier_s": (40 + 1.5 * nodes) / 1000, "total_s": (45 + 1.5 * nodes) / 1000}

    rows = [row(0, 0, None, 0) | {"verifier_s": 9.0}] + [row(i, i % 7, i % 3, i % 2) for i in range(1, 40)]
    rows += [row(i, 2, None, 1, label="plain", context=700) for i in range(5)]
    summary = blocks.summarise(rows, [0, 300, 600])
    mixed = summary["mixed γ=8 tree 16x4/auto"]
    a, b = mixed["by_context"][0]["fit"]
    assert mixed["by_context"][0]["blocks"] == 39 and abs(a - 40) < 1e-9 and abs(b - 1.5) < 1e-9
    assert mixed["match"]["blocks"] == sum(1 for i in range(1, 40) if i % 3)
    assert mixed["no match"]["accepted_counts"] == {0: 6, 1: 7}  # i = 3, 6, ..., 39
    assert [mixed[f"match after {n}"]["blocks"] for n in (1, 2)] == [13, 13] and "match after 3" not in mixed
    # before each block without a match (i = 3, 6, ..., 39) stands block i - 1: accepted (i - 1) % 2, entropy 2.5
    assert mixed["after"] == {"accepted before": {"0": [7, 1.0], "1": [6, 0.0]},
                              "entropy before": {"≥ 2": [13, 7 / 13]}}
    plain = summary["plain γ=8 tree 16x4/auto"]
    assert "match" not in plain and "after" not in plain and plain["by_context"][0]["context"] == [600, None]
    assert plain["by_context"][0]["fit"] is None  # one size of tree: no slope to fit
    assert "| mixed γ=8 tree 16x4/auto, no match | 13 |" in blocks.tables(summary)
