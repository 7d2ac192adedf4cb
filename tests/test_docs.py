"""The README and the pages under docs/: every relative link resolves to a file and, where it
names one, to a heading of that file (GitHub's anchors); the README's generated headline says
what the generated results page and docs/results.json say."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchor(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor of a heading: lower case, inline code marks and punctuation other than
    '-' and '_' dropped, spaces to '-'; the n-th repeat of an anchor gets '-n'."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    return slug if n == 0 else f"{slug}-{n}"


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    return {anchor(m[1], seen) for line in _prose(path.read_text())
            if (m := re.match(r"#{1,6} (.+)", line))}


def test_anchor_follows_github():
    seen: dict[str, int] = {}
    assert anchor("What the TPU compiler says: `bench.py memory`", seen) == (
        "what-the-tpu-compiler-says-benchpy-memory")
    assert anchor("Real text: SmolLM2 writes reviews", seen) == "real-text-smollm2-writes-reviews"
    assert anchor("The sampler and the trainer: bfloat16, top-k and the rollout correction",
                  seen) == "the-sampler-and-the-trainer-bfloat16-top-k-and-the-rollout-correction"
    assert [anchor("Results", seen) for _ in range(3)] == ["results", "results-1", "results-2"]


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCUMENTS:
        for line in _prose(doc.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, fragment = target.partition("#")
                path = (doc.parent / file).resolve() if file else doc
                name = f"{doc.relative_to(ROOT)} -> {target}"
                if not path.exists():
                    broken.append(f"{name}: no such file")
                elif fragment and fragment not in anchors(path):
                    broken.append(f"{name}: no such heading")
    assert broken == []


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    assert [p.name for p in DOCUMENTS[1:] if p not in linked] == []


def _readme_results():
    spec = importlib.util.spec_from_file_location(
        "readme_results", ROOT / "experiments" / "readme_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _between(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1 and text.count(end) == 1
    return text.split(start)[1].split(end)[0]


def test_readme_headline_is_the_results_page():
    rr = _readme_results()
    page = _between((ROOT / "docs" / "synthetic_results.md").read_text(), rr.START, rr.END)
    headline = _between((ROOT / "README.md").read_text(), rr.HEADLINE_START, rr.HEADLINE_END)
    # Both sections come from the same command.
    assert page.splitlines()[1] == headline.splitlines()[1]
    table = [line for line in page.splitlines() if line.startswith("|")]
    shown = [line for line in headline.splitlines() if line.startswith("|")]
    page_rows = {row[0]: row for row in (_cells(line) for line in table[2:])}
    header = _cells(shown[0])
    assert header[0] == "arm" and set(header) <= set(_cells(table[0]))
    assert len(shown) == len(table)
    for line in shown[2:]:
        row = _cells(line)
        full = page_rows[row[0]]
        assert row == [full[_cells(table[0]).index(name)] for name in header]
    sft = re.search(r"SFT gold = (\d+\.\d+)", page)[1]
    assert f"SFT gold = {sft}" in headline
    assert re.search(r"!\[[^\]]*\]\(docs/synthetic_curves\.png\)", headline)

    # Every kept claim of docs/results.json, and no other, in words.
    claims = json.loads((ROOT / "docs" / "results.json").read_text())["claims"]
    stated = set()
    for line in headline.splitlines():
        m = re.match(r"- `(\w+)` has (higher|lower) (.+) than `(\w+)`", line)
        if m:
            for metric in re.split(r", | and ", m[3]):
                stated.add((m[1], m[4], metric, 1 if m[2] == "higher" else -1))
    words = rr.report_lib.METRIC_WORDS
    assert stated == {(c["arm"], c["versus"], words[c["metric"]], c["direction"])
                      for c in claims}

    # The comparisons no run could tell apart: the page's, and no other.
    apart = set()
    for line in headline.split("Not distinguishable on any run:")[1].splitlines():
        m = re.match(r"- `(\w+)` vs `(\w+)`[^:]*: (.+)\.$", line)
        if m:
            apart |= {(m[1], m[2], metric) for metric in re.split(r", | and ", m[3])}
    assert apart == set(re.findall(r"^- `(\w+)` vs `(\w+)`[^,]*, ([^:]+): not distinguishable: ",
                                   page, re.M))

def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]
