"""The package's structure: imports inside ``align/`` run one way (no module reaches, directly or through others,
back to a module that imports it), counting every import — module-level, inside functions and type-only — since a
lazy import is a dependency too, and counting what Python runs for it: importing ``align.drafters.diffusion`` runs
``align/drafters/__init__.py`` first, so a module that imports it depends on that package too. Only a module's own
packages are left out (Python has imported them before the module runs)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_graph(package: str = "align") -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports."""
    files = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # from PACKAGE import NAME: the submodule PACKAGE.NAME where there is one, else PACKAGE itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                found = owner(target)
                while found and found != name and not name.startswith(found + "."):  # not its own packages
                    graph[name].add(found)  # the module, and the packages Python runs before it
                    found = found.rpartition(".")[0]
                    found = found if found in files else None
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_inside_align():
    assert circles(module_graph()) == []


def test_importing_a_submodule_depends_on_its_packages(tmp_path, monkeypatch):
    """``from align.drafters.diffusion import X`` runs align/drafters/__init__.py too: an edge to both."""
    graph = module_graph()
    assert {"align.drafters.diffusion", "align.drafters"} <= graph["align.distill.windows"]
    assert "align.drafters" not in graph["align.drafters.diffusion"]  # its own package: imported before it


def below(graph: dict[str, set[str]], top: str) -> set[str]:
    """The modules ``top`` (a package: with its submodules) reaches, outside it."""
    seen, stack = set(), [m for m in graph if m == top or m.startswith(top + ".")]
    while stack:
        for w in graph[stack.pop()]:
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return {m for m in seen if not (m == top or m.startswith(top + "."))}


def test_nothing_below_the_zoo_imports_it():
    """The zoo builds models with the loader, the drafters and the trainer's pieces; none of those reaches back into
    the zoo: a ``zoo:NAME`` path becomes a folder in align.paths (below everything), and the commands build the zoo
    models they name before loading them."""
    graph = module_graph()
    under = below(graph, "align.zoo")
    assert {"align.loading", "align.drafters", "align.distill.packing"} <= under
    assert sorted(m for m in under if any(t == "align.zoo" or t.startswith("align.zoo.") for t in graph[m])) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def importers_of(module: str) -> list[str]:
    """Files under align/, eval/, bench/ and tests/ that import ``module`` (any form, lazily too)."""
    found = []
    for folder in ("align", "eval", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
                    if isinstance(node, ast.ImportFrom) and not node.level else []
                if any(n == module or n.startswith(module + ".") for n in names):
                    found.append(str(path.relative_to(ROOT)))
    return sorted(set(found))


def test_nothing_imports_the_training_script():
    """``align/train.py`` is an entry script: the library it uses lives in the package (align/distill/), so that
    nothing has to import the script, and the benchmarks time the trainer's own step, not a copy."""
    assert importers_of("align.train") == []


def test_the_importer_check_sees_an_import():
    assert "tests/test_structure.py" in importers_of("ast")


def test_every_kind_of_drafter_follows_the_one_protocol(tmp_path):
    """Every family has a builder and a record; every kind's drafter satisfies the loop's protocol, and the loop
    reads nothing of a drafter that the protocol does not name."""
    import inspect
    import re

    from conftest import VOCAB, tiny_drafter, tiny_verifier
    from align import speculative
    from align.drafters import BUILDERS
    from align.drafters.ar import ARDrafter
    from align.drafters.base import DrafterKind
    from align.drafters.dflash import DFlashDrafter
    from align.drafters.diffusion import Drafter
    from align.families import FAMILIES
    from align.zoo.models import dflash_model

    assert set(BUILDERS) == set(FAMILIES)
    verifier = tiny_verifier()
    kinds = [Drafter(tiny_drafter(f), f, VOCAB, mask_token_id=VOCAB - 1) for f in ("diffusiongemma", "mdlm", "dream")]
    kinds += [ARDrafter(tiny_verifier(1), VOCAB),
              DFlashDrafter(dflash_model(verifier.config, [0], VOCAB - 1, layers=1, intermediate=32), verifier, VOCAB)]
    for drafter in kinds:
        assert isinstance(drafter, DrafterKind), type(drafter).__name__
        assert drafter.family in FAMILIES
    assert not isinstance(object(), DrafterKind)
    members = {name for name in dir(DrafterKind) if not name.startswith("_")}
    used = set(re.findall(r"self\.drafter\.(\w+)", inspect.getsource(speculative)))
    assert used <= members, used - members
    assert "getattr(self.drafter" not in inspect.getsource(speculative)


def test_the_recipe_choices_come_from_the_tables():
    """A recipe's drafter.family and distill.objective choices are the families' and objectives' tables."""
    import dataclasses

    from align.config import NEEDS_TEACHER, DistillConfig, DrafterConfig
    from align.distill.losses import OBJECTIVES
    from align.families import FAMILIES

    choices = {f.name: f.metadata["choices"] for c in (DrafterConfig, DistillConfig) for f in dataclasses.fields(c)}
    assert set(choices["family"]) == {name for name, t in FAMILIES.items() if t.trained_here}
    assert tuple(choices["objective"]) == tuple(OBJECTIVES)
    assert NEEDS_TEACHER == {name for name, o in OBJECTIVES.items() if o.needs_teacher} == {"kd", "tv", "sampled_streak"}
    for name, objective in OBJECTIVES.items():  # every option an objective binds is a distill key
        assert set(objective.options) <= {f.name for f in dataclasses.fields(DistillConfig)}, name
