"""The model: a small decoder-only (causal) transformer, GPT-style, with tied input and output embeddings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class CausalLM(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, width: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.config = {"vocab_size": vocab_size, "block_size": block_size, "width": width, "heads": heads,
                       "layers": layers}
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tokens.weight
        for embedding in (self.tokens, self.positions):  # GPT-2's: untrained logits near 0, perplexity near vocab
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab] of the next token at every position, from the tokens up to it."""
        time = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(time, device=ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(time, device=ids.device)
        return self.head(self.norm(self.blocks(x, mask=causal, is_causal=True)))


def next_token_loss(model: nn.Module, block: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from tokens 0..t, over a batch of packed blocks."""
    ids = block.long()
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def save(model: CausalLM, path: str) -> None:
    """Weights with the shape they need, atomically: a reader never sees half a model."""
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"config": model.config, "state_dict": model.state_dict()}, tmp)
    os.replace(tmp, path)


def load(path: str, device: Any = "cpu") -> CausalLM:
    saved = torch.load(path, map_location=device, weights_only=True)
    model = CausalLM(**saved["config"])
    model.load_state_dict(saved["state_dict"])
    return model.to(device)
