"""Synthetic documents: sentences from a small grammar, a long-tailed number of them per document.

Real enough for the pipeline's purposes: documents of very different lengths (most short, a few
long, as in web text), a vocabulary a BPE tokenizer learns in a second, and structure a tiny model
learns in a few hundred steps, so its held-out perplexity tells a trained model from an untrained one.
"""

from __future__ import annotations

import io
import json
import os
from typing import IO, Union

import numpy as np

WORDS = {
    "color": ["red", "green", "blue", "yellow", "black", "white", "orange", "grey"],
    "animal": ["fox", "dog", "cat", "horse", "owl", "rabbit", "bear", "goose"],
    "verb": ["jumps over", "runs past", "sleeps beside", "looks at", "walks around", "hides behind"],
    "adj": ["lazy", "quick", "small", "old", "quiet", "happy"],
    "thing": ["fence", "river", "tree", "house", "bridge", "garden"],
    "name": ["Ada", "Alan", "Grace", "Linus", "Barbara", "Dennis", "Ken", "Margaret"],
    "place": ["station", "market", "harbour", "library", "school", "farm"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "weather": ["sunny", "rainy", "windy", "cold", "warm", "foggy"],
    "city": ["Paris", "Lagos", "Lima", "Oslo", "Osaka", "Cairo", "Quito"],
}
TEMPLATES = [
    "the {color} {animal} {verb} the {adj} {thing}.",
    "{name} saw {count} {animal}s near the {place}.",
    "on {day} it was {weather} in {city}.",
    "{name} and {name} met at the {place} on {day}.",
]
Doc = dict[str, Union[str, None]]


def sentence(rng: np.random.Generator) -> str:
    text = TEMPLATES[rng.integers(len(TEMPLATES))]
    while "{" in text:
        start = text.index("{")
        slot = text[start + 1:text.index("}", start)]
        word = str(rng.integers(2, 10)) if slot == "count" else WORDS[slot][rng.integers(len(WORDS[slot]))]
        text = text[:start] + word + text[text.index("}", start) + 1:]
    return text


def generate_documents(n: int, seed: int) -> list[Doc]:
    """``n`` documents {"id", "text"}; sentences per document are long-tailed (1 + a capped Zipf draw):
    most documents are a sentence or two, a few run to dozens. The same seed gives the same documents."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        sentences = 1 + min(int(rng.zipf(1.8)) - 1, 40)
        docs.append({"id": f"{seed}-{i}", "text": " ".join(sentence(rng) for _ in range(sentences))})
    return docs


def write_jsonl(path_or_fileobj: Union[str, os.PathLike, IO[str]], docs: list[Doc]) -> None:
    """One JSON object per line, to a path or an open text file."""
    if isinstance(path_or_fileobj, (str, os.PathLike)):
        with open(path_or_fileobj, "w", encoding="utf-8") as fh:
            write_jsonl(fh, docs)
        return
    for doc in docs:
        path_or_fileobj.write(json.dumps(doc) + "\n")


def jsonl_bytes(docs: list[Doc]) -> bytes:
    """The file's bytes, e.g. to upload as one S3 object."""
    buffer = io.StringIO()
    write_jsonl(buffer, docs)
    return buffer.getvalue().encode("utf-8")
