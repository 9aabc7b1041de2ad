"""The training command in miniature: reproducible from its seed, and it changes the weights."""

from __future__ import annotations

import torch

from model_making.make_tiny_model import build_pipeline
from model_making.train_default_model import TrainingPlan, train

TINY_PLAN = TrainingPlan(images=64, vae_steps=3, vae_batch_size=4, unet_steps=3, unet_batch_size=4)


def weights(pipeline) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value
        for name in ("vae", "unet", "text_encoder")
        for key, value in getattr(pipeline, name).state_dict().items()
    }


def test_same_seed_same_weights_and_training_moves_them():
    first, second = weights(train(TINY_PLAN)), weights(train(TINY_PLAN))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first), "training is not reproducible"
    untrained = weights(build_pipeline(TINY_PLAN.seed))
    assert any(not torch.equal(first[key], untrained[key]) for key in first if key.startswith("unet."))
    assert any(not torch.equal(first[key], untrained[key]) for key in first if key.startswith("vae."))
    other = weights(train(TrainingPlan(**{**TINY_PLAN.__dict__, "seed": 1})))
    assert any(not torch.equal(first[key], other[key]) for key in first)
