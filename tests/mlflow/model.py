"""A model as a team's package would define it, for the registry tests: 4 features -> 1."""

from __future__ import annotations


def build():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def load(path: str):
    """What MlflowRegistry(load_model=...) calls: the trained state dict into the module."""
    import torch

    model = build()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


def save(path: str, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    torch.save(build().state_dict(), path)
