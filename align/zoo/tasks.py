"""Long-context training prompts of the kinds users send: summarize, extract, answer from a passage.

Spec-Bench's summarization and retrieval questions are a passage of hundreds of tokens and an instruction about it;
the Magpie prompts a small model writes itself (``align/zoo/magpie.py``) are one-line instructions. This module
builds prompts of the first shape from the English text the zoo already reads (``align/zoo/text.py``: Python's
documentation, the GCIDE dictionary, fortunes, a Wikipedia sample): a passage of ``MIN_WORDS`` to ``MAX_WORDS``
words cut at a paragraph or sentence end, and one of the instructions below, in the order they come (seeded).

No prompt may share a run of ``OVERLAP`` words with any evaluation prompt (the probe's and every Spec-Bench turn),
nor equal one: such passages are dropped and counted, as Magpie's are, and the counts go into ``zoo.json``.
"""

from __future__ import annotations

import random
import re

from align.zoo.magpie import evaluation_prompts, ngrams, words

MIN_WORDS, MAX_WORDS = 60, 220  # a passage: about 80 to 300 tokens

#: kind -> instructions; {passage} is the passage, {term} a word it uses (for questions about it)
TEMPLATES: dict[str, tuple[str, ...]] = {
    "summarization": (
        "Summarize: {passage}",
        "Summarize the following text in a few sentences.\n\n{passage}",
        "Write a short summary of this text:\n{passage}",
    ),
    "extraction": (
        "Extract the names, numbers and dates mentioned in the following text, as a list.\n\n{passage}",
        "List the key terms of this text, each with a short definition taken from it:\n{passage}",
        "{passage}\n\nWhich facts does the text above state? Answer with a bulleted list.",
    ),
    "rag": (
        "{passage}\n\nBased on the text above, what does it say about {term}?",
        "Read the passage and answer the question.\n\nPassage: {passage}\n\nQuestion: What is the main point of "
        "the passage?",
        "{passage}\n\nAccording to this text, why does {term} matter?",
    ),
    "rewriting": (
        "Rewrite the following text in simpler words:\n{passage}",
        "Give the following text a short title, then explain it in two sentences.\n\n{passage}",
    ),
}


def passage(text: str, rng: random.Random) -> str | None:
    """A passage of the document ``text``: whole paragraphs (then sentences) from a random start, between MIN_WORDS
    and MAX_WORDS words; None when the document has too few."""
    pieces = [p.strip() for p in text.split("\n") if p.strip()]
    sentences = [s for p in pieces for s in re.split(r"(?<=[.!?])\s+", p) if s]
    if sum(len(s.split()) for s in sentences) < MIN_WORDS:
        return None
    start = rng.randrange(max(1, len(sentences) - 3))
    taken: list[str] = []
    for sentence in sentences[start:] + sentences[:start]:
        if sum(len(s.split()) for s in taken) + len(sentence.split()) > MAX_WORDS:
            break
        taken.append(sentence)
    return " ".join(taken) if sum(len(s.split()) for s in taken) >= MIN_WORDS else None


def term(text: str, rng: random.Random) -> str:
    """A word of the passage to ask about: one of its longer words (capitalised names first)."""
    names = [w for w in re.findall(r"\b[A-Z][a-z]{3,}\b", text) if w.lower() not in {"this", "that", "there", "these"}]
    long = [w for w in re.findall(r"\b[a-z]{7,}\b", text)]
    pool = names[1:] or long or ["it"]  # the first capitalised word usually opens a sentence
    return rng.choice(pool)


def task_prompts(documents: list[dict[str, str]], count: int, seed: int = 0) -> tuple[list[dict], dict[str, int]]:
    """``count`` prompts of the kinds in TEMPLATES, in turn, from ``documents`` ({"source", "text"}), and the counts
    of what was dropped. Raises when the documents cannot give that many."""
    rng = random.Random(seed)
    held = set().union(*(ngrams(p) for p in evaluation_prompts()))
    exact = {" ".join(words(p)) for p in evaluation_prompts()}
    order = list(range(len(documents)))
    rng.shuffle(order)
    kinds = list(TEMPLATES)
    rows: list[dict] = []
    taken: set[str] = set()
    dropped = {"short": 0, "duplicate": 0, "overlaps_evaluation": 0}
    for i in order:
        if len(rows) >= count:
            break
        doc = documents[i]
        text = passage(doc["text"], rng)
        if text is None:
            dropped["short"] += 1
            continue
        kind = kinds[len(rows) % len(kinds)]
        prompt = rng.choice(TEMPLATES[kind]).format(passage=text, term=term(text, rng))
        key = " ".join(words(text))
        if key in taken:
            dropped["duplicate"] += 1
        elif key in exact or ngrams(prompt) & held:
            dropped["overlaps_evaluation"] += 1
        else:
            taken.add(key)
            rows.append({"id": f"task-{len(rows)}", "prompt": prompt, "category": kind, "source": doc["source"]})
    if len(rows) < count:
        raise ValueError(f"the English text gave {len(rows)} task prompts of the {count} asked for ({dropped})")
    return rows, dropped
