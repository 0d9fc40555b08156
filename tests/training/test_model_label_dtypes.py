"""Issue 14: labels and sample weights take the module's float dtype, as Keras 3's data adapters
cast every float array (x, y and sample_weight alike) to floatx: float64 numpy labels reach a
float32 module's loss and metrics as float32 (they reached a custom loss as float64, so the loss
and its gradient ran in float64 next to a float32 x), and a float64 module keeps float64. Checked
against plain PyTorch with the labels cast by hand, on 1, 2 and 3 CPU replicas."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

# Float reassociation of the gradient sum only (see test_model_inputs.py): a few ulps per step.
RTOL, ATOL = 1e-6, 2e-7


class _Seen:
    """A loss or metric function that records the dtypes it was given."""

    def __init__(self):
        self.dtypes: set[tuple[torch.dtype, torch.dtype]] = set()

    def loss(self, y_true, y_pred):
        self.dtypes.add((y_true.dtype, y_pred.dtype))
        return ((y_pred - y_true) ** 2).mean(dim=-1)

    def metric(self, y_true, y_pred):
        self.dtypes.add((y_true.dtype, y_pred.dtype))
        return (y_pred - y_true).abs().mean(dim=-1)


def _data(dtype=np.float64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(22, 4)).astype(dtype), rng.normal(size=(22, 2)).astype(dtype)


def _plain(net: nn.Module, x: torch.Tensor, y: torch.Tensor, sw: torch.Tensor | None = None) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for i in range(0, len(x), 8):
        opt.zero_grad()
        per_example = ((net(x[i:i + 8]) - y[i:i + 8]) ** 2).mean(dim=-1)
        w = sw[i:i + 8] if sw is not None else torch.ones(len(per_example))
        ((per_example * w).sum() / len(per_example)).backward()
        opt.step()


def _fit(net: nn.Module, replicas: int, x, y, seen: _Seen, **fit_kwargs) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(net)
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1), loss=seen.loss, metrics=[seen.metric])
    model.fit(x, y, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    return model


def _assert_weights(model: mr.Model, ref: nn.Module) -> None:
    for got, (name, want) in zip(model.get_weights(), ref.state_dict().items()):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
    model.check_in_sync()


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_float64_labels_reach_a_float32_module_as_float32(replicas):
    x, y = _data()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    ref = copy.deepcopy(net)
    seen = _Seen()
    model = _fit(net, replicas, x, y, seen, batch_size=8)
    assert seen.dtypes == {(torch.float32, torch.float32)}
    _plain(ref, torch.from_numpy(x).float(), torch.from_numpy(y).float())
    _assert_weights(model, ref)
    # evaluate takes the same path
    seen.dtypes.clear()
    model.evaluate(x, y, batch_size=8, verbose=0)
    assert seen.dtypes == {(torch.float32, torch.float32)}


def test_a_float64_module_keeps_float64_labels():
    x, y = _data(np.float32)  # float32 data meets a float64 module: everything becomes float64
    torch.manual_seed(0)
    net = nn.Linear(4, 2).double()
    ref = copy.deepcopy(net)
    seen = _Seen()
    model = _fit(net, 2, x, y, seen, batch_size=8)
    assert seen.dtypes == {(torch.float64, torch.float64)}
    _plain(ref, torch.from_numpy(x).double(), torch.from_numpy(y).double())
    for got, want in zip(model.get_weights(), ref.state_dict().values()):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-12, atol=1e-14)  # float64 reassociation


def test_float64_labels_and_weights_from_a_dataloader_train_as_float32():
    """A DataLoader of float64 tensors (torch.from_numpy of numpy data) and float64 sample weights:
    the same weights, bit for bit, as the same data in float32."""
    x, y = _data()
    sw = np.random.default_rng(1).uniform(0.5, 2.0, size=22)
    runs = []
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(0)
        seen = _Seen()
        loader = DataLoader(TensorDataset(*(torch.from_numpy(a).to(dtype) for a in (x, y, sw))), batch_size=8)
        runs.append(_fit(nn.Linear(4, 2), 2, loader, None, seen))
        assert seen.dtypes == {(torch.float32, torch.float32)}
    for a, b in zip(runs[0].get_weights(), runs[1].get_weights()):
        np.testing.assert_array_equal(a, b)
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    _plain(ref, *(torch.from_numpy(a).float() for a in (x, y, sw)))
    _assert_weights(runs[0], ref)
