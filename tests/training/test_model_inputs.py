"""Issue 14: mr.Model takes inputs as the user gives them, and never guesses a layout.

fit, evaluate, predict and model(x) accept numpy arrays, Python lists and tensors of any float dtype:
floating-point inputs take the module's dtype (float64 numpy data meets a float32 module; a float64
module keeps float64) and integer labels become int64. A module receives exactly what the data
yields, in every entry point: a module that permutes its own NHWC input trains through fit, and
model(x) equals predict(x). Each run is checked against plain PyTorch on one device.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

# Float reassociation only: N replicas add the per-replica partial sums of a gradient in another
# order than one device, a few ulps per step; over the <= 20 steps here that stays far below 1e-5.
RTOL, ATOL = 1e-5, 1e-6


def _compiled(net: nn.Module, replicas: int, **compile_kwargs) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(net)
        model.compile(**compile_kwargs)
    return model


def _assert_weights(model: mr.Model, ref: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    for got, (name, want) in zip(model.get_weights(), ref.state_dict().items()):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=rtol, atol=atol, err_msg=name)
    model.check_in_sync()


def _plain_fit(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, epochs: int, lr: float,
               loss_fn) -> None:
    """One device, the global batches in order, plain SGD: what fit(shuffle=False) must equal."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            opt.zero_grad()
            loss_fn(net(x[i:i + batch]), y[i:i + batch]).backward()
            opt.step()


def test_the_tf_guide_example_runs_as_written():
    """TF's distributed-training guide; it failed with "mat1 and mat2 must have the same dtype"."""
    with strategy_of(2).scope():
        model = mr.Model(nn.Linear(1, 1))
        model.compile(loss="mse", optimizer="sgd")
    model.fit(np.ones((100, 1)), np.ones((100, 1)), epochs=2, batch_size=10, verbose=0)
    loss = model.evaluate(np.ones((100, 1)), np.ones((100, 1)), batch_size=10, verbose=0)
    out = model.predict(np.ones((4, 1)), batch_size=2, verbose=0)
    torch.manual_seed(0)
    with torch.no_grad():
        want = model.module(torch.ones(4, 1)).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_allclose(loss, float(((want - 1.0) ** 2).mean()), rtol=1e-5)
    assert out.dtype == np.float32


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_float64_numpy_inputs_train_a_float32_module_like_plain_torch(replicas):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 3)), rng.normal(size=(50, 2))  # float64, as numpy makes them
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(net)
    model = _compiled(net, replicas, loss="mse", optimizer=mr.optimizers.SGD(learning_rate=0.05))
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)  # batches 12, ..., 2: uneven last
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(y).float()  # Keras casts to floatx
    _plain_fit(ref, xt, yt, 12, 2, 0.05, F.mse_loss)
    _assert_weights(model, ref)
    with torch.no_grad():
        want = ref(xt)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=12, verbose=0), F.mse_loss(want, yt).item(),
                               rtol=RTOL)
    np.testing.assert_allclose(model.predict(x, batch_size=12, verbose=0), want.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(model(x).detach().numpy(), want.numpy(), rtol=RTOL, atol=ATOL)


def test_python_lists_and_int32_labels_are_arrays():
    """A list of rows is an array (Keras's array-like x), and int32 labels become int64 class ids."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 4)).round(3), rng.integers(0, 3, size=16).astype(np.int32)
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    ref = copy.deepcopy(net)
    model = _compiled(net, 2, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      optimizer=mr.optimizers.SGD(learning_rate=0.1))
    model.fit(x.tolist(), y.tolist(), batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _plain_fit(ref, torch.tensor(x, dtype=torch.float32), torch.from_numpy(y).long(), 8, 2, 0.1, F.cross_entropy)
    _assert_weights(model, ref)
    logs = model.evaluate(x.tolist(), y, batch_size=8, verbose=0, return_dict=True)
    with torch.no_grad():
        logits = ref(torch.tensor(x, dtype=torch.float32))
    np.testing.assert_allclose(logs["accuracy"], (logits.argmax(1).numpy() == y).mean(), rtol=1e-6)
    np.testing.assert_allclose(model.predict(x.tolist(), batch_size=8, verbose=0), logits.numpy(), rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(model(x.tolist()).detach().numpy(), logits.numpy(), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="not a rectangular array"):
        model.predict([[1.0, 2.0, 3.0, 4.0], [1.0]], batch_size=2, verbose=0)


def test_a_float64_module_keeps_float64():
    """float32 data meets a float64 module in float64: its weights match a float64 reference to 1e-12."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)
    torch.manual_seed(0)
    net = nn.Linear(3, 1).double()
    ref = copy.deepcopy(net)
    model = _compiled(net, 2, loss="mse", optimizer=mr.optimizers.SGD(learning_rate=0.1))
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    _plain_fit(ref, x.double(), y.double(), 10, 2, 0.1, F.mse_loss)
    _assert_weights(model, ref, rtol=1e-12, atol=1e-14)
    out = model.predict(x.numpy(), batch_size=10, verbose=0)
    assert out.dtype == np.float64 and model(x).dtype == torch.float64
    with torch.no_grad():
        np.testing.assert_allclose(out, ref(x.double()).numpy(), rtol=1e-12)


class _PermutesItsInput(nn.Module):
    """Takes NHWC images and permutes them itself. fit used to permute such a batch first (its last
    axis matched the first convolution's channels), and the module then failed with "expected
    input[8, 8, 1, 8] to have 1 channels"; model(x) and predict(x) disagreed on the same input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        return self.head(F.adaptive_avg_pool2d(F.relu(self.conv(x.permute(0, 3, 1, 2))), 1).flatten(1))


def test_a_module_that_permutes_its_own_nhwc_input_trains_through_fit():
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(16, 8, 8, 1, generator=g), torch.randint(0, 3, (16,), generator=g)
    ref = _PermutesItsInput()
    model = _compiled(_PermutesItsInput(), 2, loss="sparse_categorical_crossentropy",
                      optimizer=mr.optimizers.SGD(learning_rate=0.1))
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
    _plain_fit(ref, x, y, 8, 2, 0.1, F.cross_entropy)
    _assert_weights(model, ref)
    model.evaluate(mr.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
    predicted = model.predict(x, batch_size=8, verbose=0)
    called = model(x).detach().numpy()
    with torch.no_grad():
        want = ref(x).numpy()
    np.testing.assert_allclose(predicted, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(called, predicted, rtol=1e-6, atol=1e-7)  # other batch sizes: other sum orders
    # Every entry point handed the module each replica's part of the batch exactly as the data holds it.
    # (fit, evaluate and predict: batches of 8, 4 per replica; model(x): all 16 on replica 0)
    assert {shape for copy_ in model.replicas for shape in copy_.seen} == {(4, 8, 8, 1), (16, 8, 8, 1)}


def test_model_call_is_inference_like_predict_after_fit():
    """fit leaves the module in training mode; model(x) runs in inference mode (Keras's training=False):
    BatchNorm uses its running statistics and changes nothing, so it equals predict(x)."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(12, 4, generator=g), torch.randint(0, 2, (12,), generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model = _compiled(net, 2, loss="sparse_categorical_crossentropy", optimizer="sgd")
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    assert all(m.training for m in model.replicas)
    before = [b.clone() for b in model.module.buffers()]
    called = model(x).detach().numpy()
    assert all(m.training for m in model.replicas)  # the mode is given back
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.buffers()))
    np.testing.assert_allclose(called, model.predict(x, batch_size=6, verbose=0), rtol=1e-6, atol=1e-7)
    model.check_in_sync()


def test_resnet_takes_the_layout_its_data_format_declares():
    """mr.models declare the layout (Keras's data_format); a batch of the other layout is refused with
    the fix, never permuted by guess. The default, channels_last, takes HWC images as datasets yield them."""
    g = torch.Generator().manual_seed(5)
    nhwc, y = torch.rand(8, 16, 16, 3, generator=g), torch.randint(0, 4, (8,), generator=g)
    ref = mr.models.resnet_cifar(8, num_classes=4, data_format="channels_first")
    torch.manual_seed(0)
    # One replica: BatchNorm's batch statistics are per replica, and the point here is the layout.
    model = _compiled(mr.models.resnet_cifar(8, num_classes=4), 1, loss="sparse_categorical_crossentropy",
                      optimizer=mr.optimizers.SGD(learning_rate=0.1))
    ref.load_state_dict(model.module.state_dict())
    model.fit(mr.data.Dataset.from_tensor_slices((nhwc, y)).batch(8), epochs=1, verbose=0)
    _plain_fit(ref.train(), nhwc.permute(0, 3, 1, 2).contiguous(), y, 8, 1, 0.1, F.cross_entropy)
    # The reference's convolutions read contiguous NCHW, the model's a channels_last view: other sum
    # orders, measured within 1.3e-8 absolute after one step.
    _assert_weights(model, ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"data_format='channels_last'\) takes NHWC .* got shape \(8, 3, 16, 16\)"
                                         r".*data_format='channels_first'"):
        model.predict(nhwc.permute(0, 3, 1, 2).contiguous(), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="data_format='nhwc'"):
        mr.models.resnet18(data_format="nhwc")


def test_the_modules_dtype_and_device_are_its_first_parameters_as_torch_lists_them():
    """A step reads the module's dtype and device three times, from torch's dicts: the answer is still
    that of module.parameters() (floating-point ones for the dtype), then module.buffers(), in torch's
    order - shared modules and parameters once, None slots skipped - and of the calling replica's copy
    for a mirrored module."""
    from mirrored.training.data_adapter import device_of, module_dtype

    def reference(net, floating):
        found = [t for t in [*net.parameters(), *net.buffers()] if not floating or t.is_floating_point()]
        return found[0] if found else None

    shared = nn.Linear(2, 2).double()
    frozen_ints = nn.Module()
    frozen_ints.register_parameter("ids", nn.Parameter(torch.arange(3), requires_grad=False))
    frozen_ints.register_parameter("gone", None)
    only_buffers = nn.BatchNorm1d(3, affine=False).half()
    nets = [
        nn.Sequential(nn.Sequential(), frozen_ints, nn.Sequential(nn.ReLU(), shared), nn.Linear(2, 2)),
        nn.Sequential(only_buffers, nn.Sequential(shared)),
        nn.Sequential(nn.ReLU(), only_buffers),
        nn.Sequential(frozen_ints),
        nn.Sequential(nn.ReLU()),
    ]
    for net in nets:
        dtype_ref, device_ref = reference(net, True), reference(net, False)
        assert module_dtype(net) == (dtype_ref.dtype if dtype_ref is not None else None)
        assert device_of(net) == (device_ref.device if device_ref is not None else torch.device("cpu"))
    strategy = strategy_of(2)
    with strategy.scope():
        mnet = strategy.mirror(nn.Sequential(nn.ReLU(), nn.Linear(2, 2).double()))
    assert module_dtype(mnet) == torch.float64 and device_of(mnet) == torch.device("cpu")
    assert strategy.run(lambda: module_dtype(mnet)) == torch.float64
