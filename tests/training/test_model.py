"""Model.fit/evaluate/predict against a hand-written PyTorch loop on one device (the reference)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mirrored as mr

N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 22, 8, 2  # batches of 8, 8, 6: the last one is uneven on 3 replicas


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N_EXAMPLES, 5, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _reference(net, x, y):
    """Plain PyTorch: full global batches on one device; logs as Keras computes them."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    history = {"loss": [], "accuracy": []}
    for _ in range(EPOCHS):
        losses, correct = [], 0
        for i in range(0, N_EXAMPLES, GLOBAL_BATCH):
            xb, yb = x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]
            logits = net(xb)
            per_example = F.cross_entropy(logits, yb, reduction="none")
            losses.append(per_example.detach())
            correct += (logits.argmax(1) == yb).sum().item()
            opt.zero_grad()
            per_example.mean().backward()
            opt.step()
        history["loss"].append(torch.cat(losses).mean().item())
        history["accuracy"].append(correct / N_EXAMPLES)
    return history


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_fit_matches_plain_pytorch_with_uneven_last_batch(replicas):
    x, y = _data()
    ref_net = _net()
    want = _reference(ref_net, x, y)
    strategy = mr.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    got = model.fit(ds, epochs=EPOCHS, verbose=0).history
    # Float reassociation only: per-replica partial sums are added in a different order than one
    # device's sum, which moves results by a few ulps per step.
    for a, b in zip(model.module.parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-7)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)
    model.check_in_sync()
    for other in model.replicas[1:]:
        for a, b in zip(model.module.parameters(), other.parameters()):
            assert torch.equal(a, b)


def test_fit_on_arrays_with_batch_size_and_validation_data():
    x, y = _data()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(x.numpy(), y.numpy(), batch_size=8, epochs=2, validation_data=(x, y), verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    logs = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
    np.testing.assert_allclose(logs["loss"], history.history["val_loss"][-1], rtol=1e-6)
    model.check_in_sync()


def test_evaluate_and_predict_match_the_module_in_input_order():
    x, y = _data()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    ref = copy.deepcopy(model.module)
    with torch.no_grad():
        logits = ref(x)
    ds = mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    np.testing.assert_allclose(model.predict(ds), logits.numpy(), rtol=1e-6, atol=1e-7)
    logs = model.evaluate(ds, return_dict=True, verbose=0)
    np.testing.assert_allclose(logs["loss"], F.cross_entropy(logits, y).item(), rtol=1e-6)
    np.testing.assert_allclose(logs["accuracy"], (logits.argmax(1) == y).float().mean().item(), rtol=1e-6)


def test_batchnorm_model_stays_in_sync_and_saves_and_loads_on_another_replica_count(tmp_path):
    torch.manual_seed(0)
    x = torch.rand(20, 3, 32, 32)
    y = torch.randint(0, 10, (20,))
    two = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with two.scope():
        model = mr.Model(mr.models.resnet_cifar(depth=8, num_classes=10))
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    model.check_in_sync()
    path = tmp_path / "model.safetensors"
    model.save(path)
    three = mr.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with three.scope():
        loaded = mr.Model.load(path)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    loaded.check_in_sync()
    plain = mr.models.resnet_cifar(depth=8, num_classes=10)
    plain.load_state_dict(mr.training.checkpoint.load_state_dict(path))
    for (k, a), b in zip(plain.state_dict().items(), model.get_weights()):
        np.testing.assert_array_equal(a.numpy(), b, err_msg=k)


def test_get_and_set_weights_round_trip_to_every_replica():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(_net())
    weights = [w + 1 for w in model.get_weights()]
    model.set_weights(weights)
    for replica in model.replicas:
        for a, b in zip(replica.state_dict().values(), weights):
            np.testing.assert_array_equal(a.numpy(), b)
    with pytest.raises(ValueError, match="get_weights"):
        model.set_weights(weights[:-1])


def test_fit_without_compile_and_bad_arguments_give_clear_errors():
    model = mr.Model(_net())
    with pytest.raises(RuntimeError, match="compile"):
        model.fit([(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long))])
    with pytest.raises(ValueError, match="loss"):
        model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match="unknown optimizer"):
        model.compile(optimizer="sgdd", loss="mse")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="batch_size"):
        model.fit(mr.data.Dataset.from_tensor_slices((torch.zeros(4, 5),)).batch(2), batch_size=2)
