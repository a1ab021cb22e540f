"""The text example package (examples/text): its tokenizer (trained here, from the example's own text),
the transform that tokenizes a document, the documents' long-tailed lengths, held-out perplexity, and
the DAG's packing settings agreeing with the tokenizer."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

EXAMPLE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "text"))
sys.path.insert(0, EXAMPLE)  # as a user's PYTHONPATH would

from text_pipeline import tokenizer  # noqa: E402
from text_pipeline.data import generate_documents, write_jsonl  # noqa: E402
from text_pipeline.prep import TRANSFORM_VERSION, transform  # noqa: E402


def test_the_committed_tokenizer_is_what_training_on_the_examples_text_gives():
    committed = tokenizer.load()
    texts = [d["text"] for d in generate_documents(tokenizer.CORPUS_DOCS, tokenizer.CORPUS_SEED)]
    trained = tokenizer.train_tokenizer(texts)
    # Regenerate with `python -m text_pipeline.tokenizer` when this fails after a change to data.py.
    assert trained.get_vocab() == committed.get_vocab() and committed.get_vocab_size() == tokenizer.VOCAB_SIZE
    assert committed.token_to_id("<eos>") == tokenizer.EOS_ID and committed.token_to_id("<pad>") == tokenizer.PAD_ID
    assert TRANSFORM_VERSION == f"1+tokenizer.{tokenizer.fingerprint()}"  # a new tokenizer makes new shards


def test_transform_tokenizes_a_document_and_decoding_gives_it_back():
    text = "Ada saw 3 owls near the library. on Friday it was foggy in Oslo. Ünïcode too!"
    ids = transform({"id": "a", "text": text})["input_ids"]
    assert ids.dtype == np.uint16 and ids.ndim == 1 and 10 < len(ids) < len(text)
    assert tokenizer.EOS_ID not in ids.tolist()  # the separator is packing's to add
    assert tokenizer.load().decode(ids.tolist()) == text


@pytest.mark.parametrize("record", [{"id": "a"}, {"id": "a", "text": ""}, {"id": "a", "text": "  \n"},
                                    {"id": "a", "text": None}])
def test_transform_drops_a_record_without_text(record):
    assert transform(record) is None


@pytest.mark.parametrize("text", [42, ["a", "b"], {"t": "x"}])
def test_transform_refuses_text_that_is_not_a_string(text):
    with pytest.raises(ValueError, match="text must be a string"):
        transform({"id": "a", "text": text})


def test_documents_are_deterministic_and_long_tailed():
    docs = generate_documents(1000, seed=3)
    assert docs == generate_documents(1000, seed=3) and docs != generate_documents(1000, seed=4)
    lengths = np.array([len(transform(d)["input_ids"]) for d in docs])
    assert np.median(lengths) < 25 and lengths.max() > 8 * np.median(lengths)  # most short, a few long


def test_an_untrained_model_has_about_vocabulary_size_perplexity(tmp_path):
    import torch

    from text_pipeline.evaluate import evaluate
    from text_pipeline.model import CausalLM, save

    torch.manual_seed(0)
    save(CausalLM(tokenizer.VOCAB_SIZE, 64), str(tmp_path / "untrained.pt"))
    write_jsonl(str(tmp_path / "heldout.jsonl"), generate_documents(50, 7) + [{"id": "x", "text": ""}])
    scores = evaluate(str(tmp_path / "untrained.pt"), str(tmp_path / "heldout.jsonl"))
    assert scores["documents"] == 50 and scores["tokens"] % 63 == 0  # 63 predictions per block of 64
    assert 0.7 * tokenizer.VOCAB_SIZE < scores["perplexity"] < 1.4 * tokenizer.VOCAB_SIZE, scores


def test_the_dag_packs_with_the_tokenizers_end_of_text():
    import importlib.util

    spec = importlib.util.spec_from_file_location("text_dag", os.path.join(EXAMPLE, "dags", "text_retraining.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pack = module.dag.get_task("preprocess").partial_kwargs["pack"]
    assert pack == {"field": "input_ids", "block_size": 64, "separator": tokenizer.EOS_ID}
