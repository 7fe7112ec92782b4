"""The docs agree with the code: every command line README.md and docs/ quote parses with the current CLI (its
flags exist and take the values given), and every make target they name exists. A rename that leaves a doc behind
fails here, naming the file, the line and the command."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAM = re.compile(r"(?:\.venv[\w-]*/bin/)?python3? (-m [\w.]+|(?:align|bench)/\w+\.py)")


class Parsed(Exception):
    """Raised in place of running a command once its arguments parsed."""


def quoted_commands() -> list[tuple[str, int, str]]:
    """(file, line, command) of every command a doc quotes: lines of code blocks (complete commands, ``$ `` marks
    none), and commands in backticks in the prose (fragments: written with ``...`` below, their flags are checked)."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        in_code, i = False, 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                in_code = not in_code
                i += 1
                continue
            texts = [line] if in_code else re.findall(r"`([^`]+)`", line)
            start = i
            if in_code:  # a command continued over lines with a backslash
                while texts[0].rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    texts[0] = texts[0].rstrip()[:-1] + " " + lines[i].strip()
            for text in texts:
                for piece in re.split(r"&&|;", text):
                    match = PROGRAM.search(piece)
                    if match and piece[match.end():match.end() + 1] not in (":", ",", ")"):  # a mention, not a command
                        command = piece[match.start():].split(" #")[0].strip()
                        found.append((path.name, start + 1, command if in_code else command + " ..."))
            i += 1
    return found


def arguments(command: str) -> tuple[str, list[str], bool]:
    """The program, its arguments as a user would type them with the doc's shorthand taken out (``[a | b]``
    optional parts: their first form; ``...``; ``<placeholders>``; output redirection), and whether the doc
    abbreviated the command (``...``: only its flags can be checked, not that it is complete)."""
    abbreviated = "..." in re.sub(r"\[[^\[\]]*\]", "", command)
    command = re.sub(r"\s[>|]\s.*$", "", command)
    command = re.sub(r"<[^>]*>", "placeholder", command)
    command = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1).split(" | ")[0], command)
    words = [w for w in shlex.split(command.replace("...", " ")) if w != "\\"]
    program_at = next(i for i, w in enumerate(words) if w == "-m" or w.startswith(("align/", "bench/")))
    if words[program_at] == "-m":
        return words[program_at + 1], words[program_at + 2:], abbreviated
    return words[program_at], words[program_at + 1:], abbreviated


def parser_of(program: str, argv: list[str], monkeypatch, parse: bool = True) -> argparse.ArgumentParser | None:
    """Run ``program``'s entry point up to its argument parsing and return its parser, having parsed ``argv`` with
    it when ``parse`` (argparse raises SystemExit on a bad flag or value); None for a program that parses no
    arguments."""
    real, seen = argparse.ArgumentParser.parse_args, []

    def parse_args(self, args=None, namespace=None):
        seen.append(self)
        if parse:
            real(self, sys.argv[1:] if args is None else args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [program, *argv])
    main = getattr(load(program), "main", None)
    if main is None:
        return None
    try:
        try:
            main(argv)
        except TypeError:  # a main that reads sys.argv itself
            main()
    except Parsed:
        return seen[0]
    return None


def load(program: str):
    """``program``'s module, imported (a script from its file, under a name of its own; its ``__main__`` guard keeps
    it from running)."""
    if not program.endswith(".py"):
        target = {"align.baseline": "align.baseline.cli", "align.zoo": "align.zoo.__main__"}.get(program, program)
        return importlib.import_module(target)
    return script_module(program)


def flags_of(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The option strings ``parser`` knows, with those of the subcommand ``argv`` names."""
    known = {o for action in parser._actions for o in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in argv:
                if word in action.choices:
                    known |= flags_of(action.choices[word], [])
    return known


COMMANDS = quoted_commands()


def test_the_docs_quote_commands():
    programs = {arguments(c)[0] for _, _, c in COMMANDS}
    assert {"eval.acceptance", "align/train.py", "align.zoo", "align.rollouts", "align.export"} <= programs, programs


@pytest.mark.parametrize("where, line, command", COMMANDS, ids=[f"{f}:{n}" for f, n, _ in COMMANDS])
def test_every_quoted_command_parses(where, line, command, monkeypatch, capsys):
    """A complete command parses as it stands; an abbreviated one (``...``) names flags that exist."""
    program, argv, abbreviated = arguments(command)
    try:
        parser = parser_of(program, argv, monkeypatch, parse=not abbreviated)
    except SystemExit as stop:
        message = capsys.readouterr().err.strip().splitlines()[-1:]
        pytest.fail(f"{where}:{line}: `{command}` does not parse ({stop.code}): {message}")
    if parser is not None:
        unknown = [w.split("=")[0] for w in argv if w.startswith("--") and w.split("=")[0] not in flags_of(parser, argv)]
        assert not unknown, f"{where}:{line}: `{command}` names flags {program} does not have: {unknown}"


def test_a_renamed_flag_is_caught(monkeypatch):
    program, argv, _ = arguments("python -m eval.acceptance --ckpt x --dflash-steps 2")
    with pytest.raises(SystemExit):
        parser_of(program, argv, monkeypatch)
    program, argv, abbreviated = arguments("python -m eval.acceptance ... --dflash-steps 2")
    assert abbreviated and "--dflash-steps" not in flags_of(parser_of(program, argv, monkeypatch, parse=False), argv)


def test_every_make_target_the_docs_name_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {(path.name, t) for path in DOCS for t in re.findall(r"`make ([\w-]+)", path.read_text())}
    missing = sorted((f, t) for f, t in named if t not in targets)
    assert not missing, missing
