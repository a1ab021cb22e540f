"""A small causal language model on JSON-lines text, written as a user package on top of dtrain's public API.

Modules: ``data`` (generate the documents), ``tokenizer`` (a BPE tokenizer trained here, from this
example's own text), ``prep`` (the per-document transform dtrain's preprocessing runs: text -> token
ids), ``model`` (the transformer), ``train`` (the DDP script ``dtrain launch`` runs on every rank),
``evaluate`` (held-out perplexity).
"""
