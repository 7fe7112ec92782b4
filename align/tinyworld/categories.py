"""Eight generators of ``prompt -> response`` documents, one per kind of text in the published probe.

Each generator draws its prompt-side values with :meth:`Chooser.given` (they are what the prompt says) and its
response-side values with :meth:`Chooser.pick` (what the answer is free to choose). ``pick`` adds the entropy of
the choice it makes, so a document carries the exact entropy of its response given its prompt (in nats; distinct
choices give distinct text). Weights of a pick are permuted by a key taken from the prompt (a name, a topic), so
the most likely answer depends on the prompt, not just on the category.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from align.tinyworld import tables as T

NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}


class Chooser:
    """Random choices with entropy accounting: ``given`` for the prompt, ``pick`` for the response."""

    def __init__(self, rng: random.Random, fixed: dict[str, Any] | None = None):
        self.rng = rng
        self.fixed = fixed or {}
        self.nats = 0.0

    def given(self, name: str, options: Sequence[Any]) -> Any:
        """A prompt-side value (no entropy: the prompt states it); ``fixed[name]`` overrides the draw."""
        if name in self.fixed:
            return self.fixed[name]
        return options[self.rng.randrange(len(options))]

    def pick(self, options: Sequence[Any], key: str = "", skew: float = 0.35) -> Any:
        """A response-side choice: weights 1/(1 + skew*i) over ``options`` permuted by a hash of ``key``."""
        n = len(options)
        if n == 1:
            return options[0]
        order = list(range(n))
        random.Random(zlib.crc32(key.encode())).shuffle(order)
        weights = [0.0] * n
        for rank, index in enumerate(order):
            weights[index] = 1.0 / (1.0 + skew * rank)
        total = sum(weights)
        probs = [w / total for w in weights]
        self.nats -= sum(p * math.log(p) for p in probs)
        return options[self.rng.choices(range(n), weights=probs)[0]]

    def maybe(self, p: float) -> bool:
        """A response-side yes/no with probability ``p``."""
        self.nats -= sum(q * math.log(q) for q in (p, 1 - p) if q > 0)
        return self.rng.random() < p


# ------------------------------------------------------------------------------------------------ formulaic


def translation(c: Chooser) -> tuple[str, str]:
    """Phrase translation from a fixed dictionary: the answer is fully determined by the prompt."""
    lang = c.given("language", T.LANGUAGES)
    english = c.given("english", sorted(PHRASES))
    keys = PHRASES[english]
    column = T.LANGUAGES.index(lang)
    translated = _join([T.DICTIONARY[k][column] for k in keys], keys)
    template = c.given("template", ("Translate '{e}' into {l}", "How do you say '{e}' in {l}?",
                                    "Translate into {l}: {e}"))
    lines = [f"In {lang}, '{english}' is '{translated}'.", "Word by word:"]
    lines += [f"{k} = {T.DICTIONARY[k][column]}" for k in keys]
    return template.format(e=english, l=lang), "\n".join(lines)


def _join(words: list[str], keys: tuple[str, ...]) -> str:
    """Join phrase parts with spaces, and a comma after a leading greeting."""
    if len(keys) > 1 and keys[0] in T.GREETINGS:
        return words[0] + ", " + " ".join(words[1:])
    return " ".join(words)


def _phrases() -> dict[str, tuple[str, ...]]:
    """Every English phrase the dictionary builds from a few patterns, mapped to its dictionary entries."""
    patterns: list[tuple[str, ...]] = [(g,) for g in T.GREETINGS]
    for noun in T.NOUNS:
        patterns.append(("where is", noun))
        patterns += [(noun, pred) for pred in T.PREDICATES]
        patterns += [(noun, "and", other, pred) for other, pred in zip(T.NOUNS[::-1], T.PREDICATES * 3) if other != noun]
        for verb in T.VERBS:
            patterns += [(verb, noun), *[(verb, noun, time) for time in T.TIMES]]
    for greeting in T.GREETINGS:
        patterns += [(greeting, noun, pred) for noun in T.NOUNS[::3] for pred in T.PREDICATES[::2]]
        patterns += [(greeting, "where is", noun) for noun in T.NOUNS[1::4]]
    return {_join(list(keys), keys): keys for keys in patterns}


PHRASES = _phrases()


# ------------------------------------------------------------------------------------------------ structured


def json_list(c: Chooser) -> tuple[str, str]:
    """A JSON object listing items: the structure is fixed, the items are a few near-equally likely options."""
    kind = c.given("items", sorted(T.ITEMS))
    n = c.given("n", (2, 3, 4, 5))
    person = c.given("person", T.PEOPLE)
    store = c.given("store", T.STORES)
    template = c.given("template", ("List {w} {k} as JSON", "List {w} {k} that {p} bought at {s} as JSON",
                                    "Give {p} a JSON list of {w} {k} from {s}"))
    prompt = template.format(w=NUMBER_WORDS[n], k=kind, p=person, s=store)
    buyer = person if "{p}" in template else "me"
    where = store if "{s}" in template else "the market"
    attribute = T.ATTRIBUTE[kind]
    remaining = list(T.ITEMS[kind])
    rows = []
    for i in range(n):
        name, value = c.pick(remaining, key=f"{buyer}/{kind}/{i}")
        remaining.remove((name, value))
        rows.append(f'    {{"name": "{name}", "{attribute}": "{value}"}}')
    body = ",\n".join(rows)
    response = (f'{{\n  "buyer": "{buyer}",\n  "store": "{where}",\n  "{kind}": [\n{body}\n  ],\n'
                f'  "count": {n}\n}}')
    return prompt, response


# ------------------------------------------------------------------------------------------------ factual


def facts(c: Chooser) -> tuple[str, str]:
    """Facts from a table: the answer is fully determined by the country named in the prompt.

    Questions are answered with the country's whole fact table (the asked fact is in it); a sentence to complete
    ("The capital of France is") gets the capital first, then the table.
    """
    country, capital, continent, language, currency = c.given("country", T.COUNTRIES)
    template = c.given("template", T.FACT_TEMPLATES)
    values = {"capital": capital, "continent": continent, "language": language, "currency": f"the {currency}"}
    table = f"Facts about {country}:\n" + "\n".join(f"- {k}: {v}" for k, v in values.items())
    prompt = template.format(country=country)
    if template in T.FACT_TEMPLATES[:3]:
        return prompt, f"{capital}.\n{table}"
    return prompt, table


# ------------------------------------------------------------------------------------------------ semi-open


def code(c: Chooser) -> tuple[str, str]:
    """A small Python function from a template: names, arguments, docstring and example vary."""
    desc, names, arity, body, noun = c.given("function", T.FUNCTIONS)
    template = c.given("template", ("Write a Python function that returns {d}",
                                    "Write a Python function called {n} that returns {d}",
                                    "Write a function {n}({p}) that returns {d}",
                                    "In Python, write a function that returns {d}"))
    name = c.given("name", names) if "{n}" in template else c.pick(names, key=desc)
    a, b = c.given("arguments", T.ARGUMENTS) if "{p}" in template else c.pick(T.ARGUMENTS, key=name)
    params = f"{a}, {b}" if arity == 2 else a
    lines = [f"def {name}({params}):"]
    if c.maybe(0.7):
        of = f"{a} and {b}" if arity == 2 else a
        lines.append(f'    """Return the {noun} of {of}."""')
    lines.append(f"    return {body.format(a=a, b=b)}")
    if c.maybe(0.5):
        x, y = c.pick(range(2, 10), key=name + "x", skew=3.0), c.pick(range(2, 10), key=name + "y", skew=3.0)
        call = f"{x}, {y}" if arity == 2 else f"{x}"
        value = eval(body.format(a=str(x), b=str(y)))  # noqa: S307 - our own arithmetic template, no user input
        lines += ["", f"print({name}({call}))  # {value}"]
    return template.format(d=desc, n=name, p=params), "\n".join(lines)


# ------------------------------------------------------------------------------------------------ reasoning


def arithmetic(c: Chooser) -> tuple[str, str]:
    """Arithmetic with worked steps: deterministic numbers, a little freedom in the phrasing."""
    kind = c.given("kind", ("multiply", "add", "subtract"))
    steps: list[str]
    if kind == "multiply":  # a two-digit number times one digit, or times a number from 11 to 29
        a, b = c.given("a", range(11, 30)), c.given("b", [*range(2, 10), *range(11, 30)])
        prompt = c.given("template", ("What is {a} multiplied by {b}? Show your work",
                                      "Compute {a} times {b} step by step")).format(a=a, b=b)
        if b < 10:
            tens, ones = a - a % 10, a % 10
            steps = [f"{a} times {b} = {tens} times {b} + {ones} times {b}", f"{tens} times {b} = {tens * b}",
                     f"{ones} times {b} = {ones * b}", f"{tens * b} + {ones * b} = {a * b}"]
        else:
            tens, ones = b - b % 10, b % 10
            steps = [f"{a} times {b} = {a} times {tens} + {a} times {ones}", f"{a} times {tens} = {a * tens}",
                     f"{a} times {ones} = {a * ones}", f"{a * tens} + {a * ones} = {a * b}"]
        result = a * b
    elif kind == "add":
        count = c.given("count", (3, 4))
        numbers = [c.given(f"n{i}", range(2, 30)) for i in range(count)]
        prompt = c.given("template", ("What is {e}? Show your work", "Add {e} step by step")).format(
            e=" + ".join(map(str, numbers)))
        total, steps = numbers[0], [f"Start with {numbers[0]}."]
        for n in numbers[1:]:
            steps.append(f"{total} + {n} = {total + n}")
            total += n
        result = total
    else:
        who, thing = c.given("who", T.PEOPLE), c.given("thing", ("apples", "coins", "books", "stamps", "shells"))
        a, b = c.given("a", range(20, 60)), c.given("b", range(2, 20))
        prompt = (f"{who} has {a} {thing} and gives away {b}. How many {thing} are left? Show your work")
        steps = [f"{who} starts with {a} {thing}.", f"{who} gives away {b}.", f"{a} - {b} = {a - b}"]
        result = a - b
    opener = c.pick(T.OPENERS, key=prompt[:12])
    closer = c.pick(T.CLOSERS, key=prompt[-12:]).format(r=result)
    return prompt, "\n".join([opener, *steps, closer])


# ------------------------------------------------------------------------------------------------ open


def summary(c: Chooser) -> tuple[str, str]:
    """A story summary from a grammar with many choices; names and creatures from the prompt shape it."""
    hero = c.given("hero", T.HEROES)
    partner = c.given("partner", [*T.CREATURES, *T.HEROES])
    if isinstance(partner, str) and partner == hero:
        partner = T.HEROES[(T.HEROES.index(hero) + 1) % len(T.HEROES)]
    title = f"{hero} and {partner}" if isinstance(partner, str) else f"{hero} and the {partner[0]} {partner[1]}"
    prompt = c.given("template", T.STORY_TEMPLATES).format(title=title).rstrip(".")
    trait = c.pick(("young", "brave", "curious", "quiet", "kind", "lonely", "clever", "proud"), key=hero + "t", skew=0.1)
    role = c.pick(T.ROLES, key=hero + "r", skew=0.1)
    home = c.pick(T.HOMES, key=hero + "h", skew=0.1)
    sentences = [f"{hero} is a {trait} {role} who lives in {home}."]
    if c.maybe(0.5):
        sentences.append(c.pick((f"Every {c.pick(('morning', 'evening', 'day'), key=hero)}, {hero} "
                                 f"{c.pick(('walks', 'works', 'sings', 'waits'), key=hero + 'w')} "
                                 f"{c.pick(('by the road', 'near the water', 'in the fields', 'alone'), key=hero + 'p')}.",
                                 f"{hero} dreams of {c.pick(('the sea', 'far lands', 'a quiet life', 'adventure'), key=hero)}.",
                                 f"{hero} has a {c.pick(('little', 'loud', 'gentle'), key=hero)} "
                                 f"{c.pick(('dog', 'goat', 'cat', 'horse'), key=hero + 'a')}."), key=title + "x", skew=0.1))
    if isinstance(partner, str):
        place = c.pick(("a market", "a wedding", "a festival", "the harbor"), key=title)
        sentences.append(f"One day, {hero} {c.pick(T.MEET_VERBS, key=title)} {partner} at {place}.")
        other = partner
    else:
        adjective, creature = partner
        sentences.append(f"One day, {hero} {c.pick(T.MEET_VERBS, key=title)} the {adjective} {creature} in "
                         f"{T.PLACES[creature]}.")
        other = f"the {creature}"
    if c.maybe(0.6):
        sentences.append(c.pick((f"At first, {hero} is afraid.", f"{hero} does not trust {other} at first.",
                                 f"{other[0].upper() + other[1:]} needs help.", "Nobody believes them."), key=title))
    sentences.append(f"{c.pick(('Together', 'Soon', 'Before long', 'Then', 'After that'), key=hero, skew=0.1)}, "
                     f"they {c.pick(T.JOURNEYS, key=title, skew=0.1)}.")
    trouble = c.pick(("a storm", "a long winter", "a jealous king", "a broken bridge", "a dark river"), key=title)
    sentences.append(f"Along the way, they {c.pick(('face', 'survive', 'escape'), key=trouble)} {trouble}.")
    if c.maybe(0.5):
        sentences.append(c.pick((f"{hero} {c.pick(('finds', 'loses', 'hides'), key=hero)} a "
                                 f"{c.pick(('map', 'key', 'lantern', 'letter', 'ring'), key=title)}.",
                                 f"{c.pick(('An old woman', 'A stranger', 'A child'), key=hero)} shows them the way.",
                                 "The journey takes many days."), key=title + "e"))
    lesson = c.pick(T.LESSONS, key=title)
    sentences.append(f"{c.pick(('In the end', 'At last', 'Finally'), key=title, skew=0.1)}, {hero} "
                     f"{c.pick(('learns', 'sees', 'understands', 'finds out'), key=hero, skew=0.1)} that {lesson} "
                     f"{c.pick(T.LESSON_ENDS, key=lesson, skew=0.1)}.")
    return prompt, " ".join(sentences)


def explanation(c: Chooser) -> tuple[str, str]:
    """An explanation: causes from a table, connectives and extra sentences from many choices."""
    phenomenon, cause, mechanism, effect = c.given("phenomenon", T.PHENOMENA)
    prompt = c.given("template", T.EXPLAIN_TEMPLATES).format(p=phenomenon).rstrip(".")
    parts = []
    if c.maybe(0.4):
        parts.append(c.pick(("Good question.", "It is a simple idea.", "Here is the short answer.",
                             "Scientists have studied this for a long time."), key=phenomenon))
    parts.append(f"{c.pick(T.BECAUSE, key=phenomenon, skew=0.1)} {cause}.")
    if c.maybe(0.5):
        parts.append(c.pick(("This is easy to miss.", "Most people never notice it.", "It is a small detail.",
                             "Keep this in mind."), key=phenomenon + "m", skew=0.1))
    parts.append(f"{c.pick(T.THEN, key=phenomenon + '1', skew=0.1)} {mechanism}.")
    if c.maybe(0.5):
        parts.append(f"{c.pick(T.ALSO, key=phenomenon)} {c.pick(('this happens every day', 'it works the same everywhere', 'it is easy to test at home'), key=phenomenon + '2')}.")
    parts.append(f"{c.pick(T.CONCLUDE, key=phenomenon + '3', skew=0.1)} {effect}.")
    if c.maybe(0.4):
        parts.append(c.pick(("I hope this helps.", "Nature is full of such things.", "Science explains it well.",
                             "Now you know."), key=phenomenon + "e", skew=0.1))
    return prompt, " ".join(parts)


# ------------------------------------------------------------------------------------------------ creative


def poem(c: Chooser) -> tuple[str, str]:
    """A short poem from themed word lists: almost every word is free."""
    theme = c.given("theme", sorted(T.THEMES))
    form = c.given("form", T.POEM_FORMS)
    prompt = c.given("template", T.POEM_TEMPLATES).format(form=form, theme=theme).rstrip(".")
    nouns, verbs, adjectives = T.THEMES[theme]
    shapes = {"a haiku": 3, "a short poem": 4, "a four line poem": 4}
    lines = []
    for i in range(shapes[form]):
        adj, noun, verb = c.pick(adjectives, key=theme), c.pick(nouns, key=theme + str(i)), c.pick(verbs, key=theme)
        pattern = c.pick(("{a} {n} {v}", "the {n} {v} {a}", "{a} {n}, {a2} {n2}", "where the {a} {n} {v}"), key=form)
        lines.append(pattern.format(a=adj, n=noun, v=verb, a2=c.pick(adjectives, key=noun), n2=c.pick(nouns, key=verb)))
    return prompt, "\n".join(lines)


# ------------------------------------------------------------------------------------------------ registry

Generator = Callable[[Chooser], tuple[str, str]]

#: kind -> (probe category, generator); two kinds of open text, as in the published probe.
KINDS: dict[str, tuple[str, Generator]] = {
    "translation": ("formulaic", translation),
    "json": ("structured", json_list),
    "facts": ("factual", facts),
    "code": ("semi-open", code),
    "arithmetic": ("reasoning", arithmetic),
    "summary": ("open", summary),
    "explanation": ("open", explanation),
    "poem": ("creative", poem),
}

#: The probe suite: one prompt per probe category, worded as in the published probe (values the generators take).
PROBE: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("probe-1", "translation", {"language": "Spanish", "english": "good morning", "template": "Translate '{e}' into {l}"}),
    ("probe-2", "json", {"items": "fruits", "n": 3, "template": "List {w} {k} as JSON", "person": "Tom",
                         "store": "the market"}),
    ("probe-3", "facts", {"country": T.COUNTRIES[0], "template": T.FACT_TEMPLATES[0]}),
    ("probe-4", "code", {"function": T.FUNCTIONS[0], "template": "Write a Python function that returns {d}"}),
    ("probe-5", "arithmetic", {"kind": "multiply", "a": 17, "b": 23,
                               "template": "What is {a} multiplied by {b}? Show your work"}),
    ("probe-6", "summary", {"hero": "Romeo", "partner": "Juliet", "template": "Summarize the plot of {title}."}),
    ("probe-7", "explanation", {"phenomenon": T.PHENOMENA[0], "template": "Explain why {p}."}),
    ("probe-8", "poem", {"theme": "the ocean", "form": "a haiku", "template": "Give me {form} about {theme}."}),
)
