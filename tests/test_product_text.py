"""The shipped text speaks of the product, not of how it was made.

README.md, docs/, the package's source (docstrings, comments, messages), bench/ (what the benches
print) and examples/ name no issue numbers, no development history ("stop 37", "previous release",
"before this change", "the review's findings") and no machine by where it stands ("this machine", "measured
here", "the development machine", "CI worker"): a figure comes with the command that prints it, the
date and the machine described by what it is. History goes to CHANGELOG.md, which is not scanned,
nor are the tests.
"""
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what is scanned: files and folders relative to the repository root (folders recursively)
SHIPPED = ("README.md", "docs", os.path.join("operators", "dtrain"), "bench", "examples")
TEXT_SUFFIXES = (".md", ".py", ".html", ".js", ".css", ".txt", ".sh", ".cfg", ".toml", ".yaml", ".yml", ".json")
SKIPPED_DIRS = frozenset({"__pycache__", ".ipynb_checkpoints"})

#: each phrase that tells history, or a place only the authors know. The text is searched lower-cased,
#: and a match counts where it starts a word (see starts_a_word); each pattern begins with a literal,
#: which keeps the scan of every shipped file well under a second.
DENIED = tuple(re.compile(pattern) for pattern in (
    r"issues? #?\d+", r"the issue\b", r"issue's\b",           # "issue 27", "the goal is 60 s"
    r"#\d{2,3}\b",                                             # "#30" (not "collective #5", "ompi#4726", "#718096")
    r"stops? \d+\b",                                           # "2299 s at stop 37"
    r"previous release\b", r"this release\b", r"last release\b",
    r"this change\b",                                           # "shards written before this change"
    r"the review(?:'s)? (?:findings?|found|of head)\b", r"a review of head\b",
    r"measured here\b", r"seen here\b", r"tested here\b", r"cost here\b",
    r"this machine\b", r"development machine\b", r"dev machine\b",
    r"ci worker\b", r"whose ci\b", r"a submission whose\b",
    r"commits? [0-9a-f]{7,40}\b", r"against [0-9a-f]{7,40}\b",  # comparisons with older commits
))


def starts_a_word(text: str, start: int) -> bool:
    """Whether a match at ``start`` begins a word: not inside one, nor an HTML entity's ``&#39;`` or a
    URL's ``/#1``."""
    return start == 0 or not (text[start - 1].isalnum() or text[start - 1] in "_&/")


def shipped_files() -> list[str]:
    found = []
    for entry in SHIPPED:
        path = os.path.join(REPO, entry)
        if os.path.isfile(path):
            found.append(path)
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
            found.extend(os.path.join(folder, name) for name in sorted(files) if name.endswith(TEXT_SUFFIXES))
    return found


def denied_phrases(path: str) -> list[str]:
    """``file:line: phrase`` for each denied phrase in the file at ``path``."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        original = fh.read()
    text, lines = original.lower(), original.splitlines()
    hits = []
    for pattern in DENIED:
        for match in pattern.finditer(text):
            if starts_a_word(text, match.start()):
                number = text.count("\n", 0, match.start()) + 1
                hits.append(f"{os.path.relpath(path, REPO)}:{number}: {original[match.start():match.end()]!r} in "
                            f"{lines[number - 1].strip()[:160]}")
    return hits


def test_the_scan_reads_every_shipped_place():
    files = {os.path.relpath(path, REPO).split(os.sep)[0] for path in shipped_files()}
    assert files == {"README.md", "docs", "operators", "bench", "examples"}


@pytest.mark.parametrize("phrase", [
    "the 40-minute goal of issue 24", "see #27", "2299 s at stop 37", "[previous release]", "This release against",
    "shards written before this change", "the review's findings", "Measured here", "seen here at 5 s",
    "no pdsh on this machine", "a 2-core CI worker", "the development machine", "a submission whose CI failed",
    "the issue's goal is 60 s", "against 2a122e2", "A review of HEAD found",
])
def test_each_denied_phrase_is_caught(phrase, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"A line.\nThen {phrase}, said.\n", encoding="utf-8")
    assert len(denied_phrases(str(page))) >= 1


@pytest.mark.parametrize("line", [
    "A handle written by an earlier release has no lease.", "the reviewer approves the model",
    "color: #fff;", "&#39;quoted&#39;", "the local machine", "on a 2-core x86-64 VM, 2026-12-04",
    "never entered collective #5 (gloo:all_reduce)", "races at finalize, e.g. open-mpi/ompi#4726 and #7790",
    'color="#718096"', "the reviewer's decision", "see https://example.org/page/#12", "the issues_url field",
])
def test_product_phrases_pass(line, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(line + "\n", encoding="utf-8")
    assert denied_phrases(str(page)) == []


def test_shipped_text_speaks_of_the_product():
    hits = [hit for path in shipped_files() for hit in denied_phrases(path)]
    assert not hits, (f"{len(hits)} phrase(s) of development history or of a machine only the authors know "
                      "(move history to CHANGELOG.md; give a figure with its command, date and machine):\n"
                      + "\n".join(hits))
