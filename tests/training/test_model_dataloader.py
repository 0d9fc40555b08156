"""Issue 14: a torch DataLoader of GLOBAL batches is Model.fit's input as it is a PyTorch loop's:
fit (with validation_data a DataLoader too), evaluate and predict, tuple or dict batches, worker
processes. Each run is checked against plain PyTorch on one device over the same DataLoader, on 1,
2 and 3 CPU replicas; a one-shot generator is refused, naming the re-iterable alternatives."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import mirrored as mr
from _replicas import strategy_of  # tests/_replicas.py

# Float reassociation only: each replica sums its part of a batch's gradient and loss, then the parts
# are summed; one device sums the batch at once. A few ulps per step (measured below 6e-8 on these
# weights after 6 steps), and the same for the reported losses, which are means of ~1.
RTOL, ATOL = 1e-6, 2e-7
EPOCHS = 2


def _data(n: int = 22):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _compiled(net: nn.Module, replicas: int) -> mr.Model:
    with strategy_of(replicas).scope():
        model = mr.Model(net)
        model.compile(optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _plain_epoch(net: nn.Module, opt: torch.optim.Optimizer, loader, forward=lambda net, x: net(x)) -> None:
    net.train()
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(forward(net, x), y).backward()
        opt.step()


def _plain_evaluate(net: nn.Module, loader) -> tuple[float, float]:
    """The mean loss and accuracy over every example (Keras weighs each batch by its size)."""
    net.eval()
    with torch.no_grad():
        logits = torch.cat([net(x) for x, _ in loader])
        labels = torch.cat([y for _, y in loader])
    return F.cross_entropy(logits, labels).item(), (logits.argmax(-1) == labels).float().mean().item()


def _assert_weights(model: mr.Model, ref: nn.Module) -> None:
    for got, (name, want) in zip(model.get_weights(), ref.state_dict().items()):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
    model.check_in_sync()


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_fit_validate_evaluate_and_predict_on_dataloaders_match_plain_torch(replicas):
    x, y = _data()
    train = DataLoader(TensorDataset(x, y), batch_size=8)  # 8, 8, 6: on 3 replicas 3/3/2, then 2/2/2
    val = DataLoader(TensorDataset(x[:13], y[:13]), batch_size=5)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    val_logs = []
    for _ in range(EPOCHS):
        _plain_epoch(ref, ref_opt, train)
        val_logs.append(_plain_evaluate(ref, val))
    model = _compiled(_net(), replicas)
    history = model.fit(train, epochs=EPOCHS, validation_data=val, verbose=0)
    _assert_weights(model, ref)
    np.testing.assert_allclose(history.history["val_loss"], [v[0] for v in val_logs], rtol=RTOL)
    assert history.history["val_accuracy"] == pytest.approx([v[1] for v in val_logs], abs=1e-7)
    loss, accuracy = model.evaluate(train, verbose=0)
    want_loss, want_accuracy = _plain_evaluate(ref, train)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert accuracy == pytest.approx(want_accuracy, abs=1e-7)
    with torch.no_grad():
        want = ref(x).numpy()
    np.testing.assert_allclose(model.predict(train, verbose=0), want, rtol=RTOL, atol=ATOL)


class _DictExamples(Dataset):
    """Examples as ({"features": ..., "scale": ...}, label): default_collate stacks each key."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "scale": torch.tensor(2.0)}, self.y[i]


class _DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _net()

    def forward(self, batch):
        return self.body(batch["features"] * batch["scale"][:, None])


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_dict_batches_from_a_dataloader_match_plain_torch(replicas):
    x, y = _data()
    loader = DataLoader(_DictExamples(x, y), batch_size=8)
    ref = _DictNet()
    model = _compiled(copy.deepcopy(ref), replicas)
    model.fit(loader, epochs=EPOCHS, verbose=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(EPOCHS):
        _plain_epoch(ref, ref_opt, loader)
    _assert_weights(model, ref)
    with torch.no_grad():
        want = ref({"features": x, "scale": torch.full((len(x),), 2.0)}).numpy()
    np.testing.assert_allclose(model.predict(loader, verbose=0), want, rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(90)
def test_a_dataloader_with_worker_processes_trains_as_one_without():
    """num_workers=2: the batches come from two worker processes in the same order, so the weights
    are those of the same DataLoader read in this process, bit for bit. (timeout=: a worker that
    dies or hangs fails the test instead of blocking it.)"""
    x, y = _data()
    runs = []
    for workers in (2, 0):
        loader = DataLoader(_DictExamples(x, y), batch_size=8, num_workers=workers,
                            timeout=30 if workers else 0)
        model = _compiled(_DictNet(), 2)
        model.fit(loader, epochs=EPOCHS, verbose=0)
        runs.append(model.get_weights())
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_a_one_shot_generator_is_refused_and_a_list_of_batches_trains():
    x, y = _data()
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]
    model = _compiled(_net(), 2)
    before = model.get_weights()
    for where, call in (("fit", lambda data: model.fit(data, verbose=0)),
                        ("evaluate", lambda data: model.evaluate(data, verbose=0)),
                        ("predict", lambda data: model.predict(data, verbose=0))):
        with pytest.raises(TypeError, match=rf"Model\.{where}: got a generator, which can be read only once.*a "
                                            r"torch DataLoader, a list of batches, "
                                            r"mr\.data\.Dataset\.from_generator\(fn\)"):
            call(b for b in batches)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    model.fit(batches, epochs=EPOCHS, verbose=0)  # a list is read again every epoch
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(EPOCHS):
        _plain_epoch(ref, ref_opt, batches)
    _assert_weights(model, ref)
