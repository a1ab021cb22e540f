"""Comparisons the DCP tests share: two state dicts, tensor by tensor."""

from __future__ import annotations


def flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}/"))
        return out
    if isinstance(value, (list, tuple)):
        return flatten(dict(enumerate(value)), prefix)
    return {prefix.rstrip("/"): value}


def assert_same_state(expected, actual) -> None:
    """Every entry of the two states (dicts, or files torch.save wrote) equal: tensors exactly (values,
    shape, dtype), the rest by ==."""
    import torch

    expected = flatten(expected if isinstance(expected, dict) else torch.load(expected, weights_only=False))
    actual = flatten(actual if isinstance(actual, dict) else torch.load(actual, weights_only=False))
    assert sorted(expected) == sorted(actual)
    assert any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in expected.values())
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(actual[key], torch.Tensor), key
            assert value.shape == actual[key].shape and value.dtype == actual[key].dtype, key
            assert torch.equal(value, actual[key]), f"{key} differs after the resume"
        else:
            assert value == actual[key], key
