"""Relaxed (lossy) acceptance (align/relaxed.py): the rules, their labels everywhere a result is reported, and that
nothing in training, rollouts or serving can reach them."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import VOCAB, tiny_drafter, tiny_verifier
from align.drafters.diffusion import Drafter
from align.errors import AlignError
from align.relaxed import Relaxed, parse, relaxed_accept
from align.speculative import SpeculativeDecoder
from align.verifier import Verifier, ar_generate
from test_structure import ROOT, module_graph


def test_the_rules_accept_what_they_say():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02], [0.25, 0.25, 0.25, 0.25]]))
    draft = torch.tensor([1, 1, 3])
    assert parse("topk:2").accepts(logits, draft).tolist() == [True, True, True]  # second, second, a 4-way tie
    assert parse("topk:1").accepts(logits, draft).tolist() == [False, False, True]
    assert parse("ratio:0.5").accepts(logits, draft).tolist() == [True, False, True]  # 0.6, 0.056, 1
    # typical: p(x) > min(ε, δ exp(-H)); H of the flat row is log 4, so its threshold is δ / 4
    assert parse("typical:0.2,0.5").accepts(logits, draft).tolist() == [True, False, True]
    assert parse("typical:0.2,2.0").accepts(logits, draft).tolist() == [True, False, True]
    assert parse("typical:0.99,0.0001").accepts(logits, draft).tolist() == [True, True, True]
    full = torch.cat([logits, logits[:1]])
    assert relaxed_accept(draft, full, parse("ratio:0.5")) == (1, 0)  # kept one, then the verifier's own argmax


def test_a_bad_rule_is_one_clear_error():
    for spec, words in (("mode:3", "unknown relaxed rule"), ("topk", "takes 1 number"), ("topk:0", "at least 1"),
                        ("ratio:1.5", r"\(0, 1\]"), ("typical:0.3", "takes 2 number"), ("topk:x", "takes 1 number")):
        with pytest.raises(AlignError, match=words):
            parse(spec)
    assert parse("typical:0.3,0.09").label == "LOSSY typical(epsilon=0.3, delta=0.09)"


def test_a_rule_that_accepts_only_the_argmax_is_greedy_and_one_that_accepts_all_keeps_every_draft():
    verifier = tiny_verifier(1)
    drafter = Drafter(tiny_drafter("mdlm", 2), "mdlm", VOCAB, mask_token_id=3)
    decoder = SpeculativeDecoder(drafter, Verifier(verifier), None)
    prompt = [5, 9, 14, 22]
    greedy = ar_generate(verifier, prompt, 30, eos_token_ids=[])
    for spec in ("topk:1", "ratio:1"):
        assert decoder.generate(prompt, 30, 4, relaxed=parse(spec)).tokens == greedy
    everything = decoder.generate(prompt, 30, 4, relaxed=Relaxed("topk", {"k": VOCAB}))
    assert all(b.accepted == b.gamma for b in everything.stats.blocks)
    assert everything.tokens != greedy  # the drafter's own text: nothing like the verifier's
    with pytest.raises(AlignError, match="temperature 0"):
        decoder.generate(prompt, 8, 4, temperature=1.0, relaxed=parse("topk:2"))


def reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def test_no_relaxed_rule_can_be_reached_from_training_rollouts_or_serving():
    """What training (the entry script and everything it imports, lazily too), rollouts and the vLLM proposer can
    reach holds no relaxed rule; the loop takes one only when a caller hands it over, and none does by default."""
    import ast
    import inspect

    graph = module_graph()
    script = ast.parse((ROOT / "align" / "train.py").read_text())
    entry = {node.module for node in ast.walk(script) if isinstance(node, ast.ImportFrom) and node.module}
    entry |= {a.name for node in ast.walk(script) if isinstance(node, ast.Import) for a in node.names}
    starts = {m for m in entry if m in graph} | {"align.rollouts", "align.serving", "align.export"}
    assert "align.distill.strategy" in starts and "align.relaxed" in graph
    assert "align.relaxed" not in reachable(graph, starts)
    assert inspect.signature(SpeculativeDecoder.generate).parameters["relaxed"].default is None
    callers = [p for p in (ROOT / "align").rglob("*.py") if "relaxed" in p.read_text() and p.name != "relaxed.py"]
    assert sorted(p.relative_to(ROOT).as_posix() for p in callers) == ["align/speculative.py",  # the loop takes one
                                                                       "align/tinyworld/check.py"], callers  # a doc
    assert "import" not in "".join(line for line in (ROOT / "align" / "speculative.py").read_text().splitlines()
                                   if "relaxed" in line and line.lstrip().startswith(("import", "from")))


def test_every_relaxed_result_is_labelled_lossy_in_the_json_and_the_report(exported, world_prompts, tmp_path,
                                                                            monkeypatch):
    import eval.acceptance as module

    counted, original = [], module.nll_per_token
    monkeypatch.setattr(module, "nll_per_token", lambda *a: counted.append(1) or original(*a))
    out = tmp_path / "eval"
    assert module.main(["--ckpt", str(exported), "--prompts", str(world_prompts), "--limit", "4", "--gamma", "4",
                        "--max-new-tokens", "12", "--relaxed", "topk:3", "--relaxed", "typical:0.3,0.09",
                        "--temperature", "0,1", "--baseline", "none", "--out", str(out)]) == 0
    document = json.loads((out / "acceptance.json").read_text())
    greedy = [r["quality"] for r in document["results"] if r["temperature"] == 0]
    assert len(greedy) == 3 and len({q["reference_nll_per_token"] for q in greedy}) == 1
    assert len(counted) == 1  # the verifier's NLL of its own outputs, once for the three settings compared to them
    lossy = [r for r in document["results"] if r.get("relaxed")]
    assert {r["relaxed"] for r in lossy} == {"topk:3", "typical:0.3,0.09"}  # greedy only: none at temperature 1
    assert all(r["temperature"] == 0 and r["lossless"] == "not applicable: lossy rule" and r["lossy"]["lossy"]
               and r["lossy_label"].startswith("LOSSY") and "identical" in r["quality"] for r in lossy)
    exact = [r for r in document["results"] if not r.get("relaxed")]
    assert all(r["lossless"] is not None or r["temperature"] > 0 for r in exact)
    assert all("lossy" not in r and r["lossless"] != "not applicable: lossy rule" for r in exact)
    report = (out / "report.md").read_text()
    assert "## Relaxed (LOSSY) acceptance" in report
    lines = [line for line in report.splitlines() if "topk" in line or "typical" in line]
    assert lines and all("LOSSY" in line for line in lines)


def test_the_probe_table_puts_each_way_in_its_column_and_labels_the_relaxed_one_lossy():
    from conftest import script_module

    probe = script_module("bench/probe_three_ways.py")
    prompts = [{"id": f"probe-{i}", "prompt": f"prompt {i}", "category": "open", "reported_accepted": i,
                "reported_block": 16} for i in range(1, 4)]  # the probe's rows, as ../shared/data/probe8.jsonl has them
    ids = [p["id"] for p in prompts]

    def result(label, temperature, relaxed, k):  # every prompt: the first block the prompt's pass, then k of 16
        quality = {"identical": 0.5, "nll_per_token": 1.25, "reference_nll_per_token": 1.0} if relaxed else None
        return {"label": label, "temperature": temperature, "k": 1, "relaxed": relaxed, "stop_below": 0.0,
                "accepted_mean": float(k), "tau": 1.0 + k, "quality": quality,
                "per_prompt": [{"id": i, "first_block": [0, 0], "first_drafted": [k, 16], "accepted_mean": float(k)}
                               for i in ids]}

    document = {"results": [result("aligned", 0.0, None, 3), result("aligned", 1.0, None, 4),
                            result("aligned", 0.0, "ratio:0.3", 5), result("baseline", 0.0, None, 0),
                            result("baseline", 1.0, None, 1), result("baseline", 0.0, "ratio:0.3", 2)]}
    text = probe.table(document, "ratio:0.3", prompts=prompts)
    header, *rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert header.count("LOSSY ratio:0.3") == 2 and "unaligned: exact greedy" in header
    assert len(rows) == len(ids)
    # unaligned exact, sampling, relaxed, then aligned's: the first drafted block, not the prompt's pass
    cells = ["0/16 (0.00)", "1/16 (1.00)", "2/16 (2.00)", "3/16 (3.00)", "4/16 (4.00)", "5/16 (5.00)"]
    assert all([c.strip() for c in row.strip("| ").split(" | ")[3:]] == cells for row in rows)
    assert "identical to the verifier's 50%" in text and "NLL per token 1.250" in text
