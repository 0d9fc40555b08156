"""Keras's names of losses, metrics and optimizers through mr.Model.compile on a torch module: fit on
2 and 3 replicas gives the one-device weights and history (issue 38).

Tolerance: the replicas' gradients and metric sums are the one device's, reassociated (float32
gradients, float64 metric state), over 2 epochs of 3 steps: rtol 1e-5 / atol 1e-6."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mirrored as mr

N, BATCH, EPOCHS = 22, 8, 2  # batches of 8, 8, 6


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(kind: str):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=g)
    if kind == "regression":
        return x, torch.randn(N, 3, generator=g)
    labels = torch.randint(0, 3, (N,), generator=g)
    if kind == "onehot":
        return x, torch.nn.functional.one_hot(labels, 3).float()
    if kind == "binary":
        return x, torch.randint(0, 2, (N, 3), generator=g).float()
    return x, labels


CONFIGS = {
    "regression": ("adagrad", "huber", ["mae", "mse", "root_mean_squared_error", "r2_score", "cosine_similarity",
                                        "logcosh", "mape", "msle"]),
    "onehot": ("nadam", "categorical_focal_crossentropy", ["top_k_categorical_accuracy", "categorical_crossentropy",
                                                           "categorical_hinge"]),
    "binary": ("ftrl", "binary_focal_crossentropy", ["bce", "true_positives", "binary_io_u", "hinge"]),
    "sparse": (None, "sparse_categorical_crossentropy", ["sparse_categorical_crossentropy", "accuracy"]),
}


def _fit(kind: str, replicas: int):
    optimizer, loss, metrics = CONFIGS[kind]
    if optimizer is None:
        optimizer = mr.optimizers.LossScaleOptimizer(mr.optimizers.Lamb(learning_rate=0.05, weight_decay=0.01),
                                                     initial_scale=1024.0, dynamic_growth_steps=2)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    # F1Score's per-class result (average=None, the name's default) is a vector, which history does not hold.
    objects = {"onehot": [mr.metrics.F1Score(average="macro", from_logits=True)],
               "binary": [mr.metrics.FBetaScore(average="micro", beta=2.0, threshold=0.5, from_logits=True)]}
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=optimizer, loss=loss, metrics=metrics + objects.get(kind, []))
    x, y = _data(kind)
    history = model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=EPOCHS, verbose=0).history
    model.check_in_sync()
    return [p.detach().clone() for p in model.module.parameters()], history, model


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_names_train_the_same_on_replicas_as_on_one_device(kind):
    want_weights, want_history, _ = _fit(kind, 1)
    assert set(want_history) >= {"loss", *CONFIGS[kind][2]}
    for replicas in (2, 3):
        weights, history, model = _fit(kind, replicas)
        for got, want in zip(weights, want_weights):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for key, values in want_history.items():
            np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6, err_msg=f"{key} on {replicas}")
        assert all(np.isfinite(v).all() for v in history.values())
        del model


def test_loss_scale_optimizer_in_fit_changes_its_scale_as_on_one_device():
    _, _, one = _fit("sparse", 1)
    _, _, three = _fit("sparse", 3)
    # 6 finite updates with growth every 2: 1024 * 2**3
    assert one.optimizer.loss_scale_factor == three.optimizer.loss_scale_factor == 8192.0
