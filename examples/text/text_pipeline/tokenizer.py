"""The example's tokenizer: byte-level BPE trained here, from this example's own documents.

Nothing is downloaded: ``python -m text_pipeline.tokenizer`` trains it with the ``tokenizers``
library's BPE trainer on documents from :mod:`text_pipeline.data` and writes ``tokenizer.json``
next to this file, which is committed with the code. Preprocessing (the transform), training
(the vocabulary size) and evaluation all load that one file, as a team versions its tokenizer
with its model; its hash is part of the transform's version, so new shards follow a new tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer.json")
SPECIAL = ["<pad>", "<eos>"]  # ids 0 and 1: the trainer adds special tokens first
PAD_ID, EOS_ID = 0, 1
VOCAB_SIZE = 512
CORPUS_SEED, CORPUS_DOCS = 0, 2000


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer (any text encodes, decoding gives it back) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@functools.cache
def load():
    """The committed tokenizer (once per process)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(PATH)


def fingerprint() -> str:
    with open(PATH, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def main() -> None:
    from text_pipeline.data import generate_documents

    texts = [doc["text"] for doc in generate_documents(CORPUS_DOCS, CORPUS_SEED)]
    tokenizer = train_tokenizer(texts)
    tokenizer.save(PATH)
    print(f"wrote {PATH}: {tokenizer.get_vocab_size()} tokens, trained on {len(texts)} documents")


if __name__ == "__main__":
    main()
