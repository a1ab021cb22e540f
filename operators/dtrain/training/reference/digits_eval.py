"""The demo pipeline's evaluate function: accuracy of a saved reference model on held-out digits.

    evaluate("/fsx/runs/.../model.pt", None) -> {"accuracy": 0.97, "samples": 360}

``heldout`` is unused: the reference split's held-out 20% ships inside scikit-learn
(dtrain.training.reference.train_digits.load_digits_split), the same on every machine.
"""

from __future__ import annotations

from typing import Any


def evaluate(model_path: str, heldout: str | None = None, hidden: int = 128, seed: int = 0) -> dict[str, Any]:
    import torch

    from dtrain.training.reference.train_digits import build_model, load_digits_split
    from dtrain.training.reference.train_digits import evaluate as accuracy_of

    model = build_model(hidden)
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    _, test = load_digits_split(seed)
    return {"accuracy": round(accuracy_of(model, test, torch.device("cpu")), 4), "samples": int(len(test[1]))}
