"""Bad input is refused before anything trains (issue 17), better than Keras 3 on TF 2.21, which
trains forever on an infinite dataset without steps_per_epoch and only warns on an empty one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mirrored as mr


def _model() -> mr.Model:
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"], timeout_s=20)
    with strategy.scope():
        torch.manual_seed(0)
        model = mr.Model(torch.nn.Linear(3, 2))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def _data(n: int = 16) -> mr.data.Dataset:
    g = torch.Generator().manual_seed(0)
    return mr.data.Dataset.from_tensor_slices((torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)))


class _Count(mr.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.per_epoch: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


def test_an_infinite_dataset_without_steps_per_epoch_is_refused():
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"repeats forever .* steps_per_epoch is not set"):
        model.fit(_data().batch(4).repeat(), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="validation_steps"):
        model.fit(_data().batch(4), validation_data=_data().batch(4).repeat(), verbose=0)
    with pytest.raises(ValueError, match=r"repeats forever .* steps is not set"):
        model.evaluate(_data().batch(4).repeat(), verbose=0)
    with pytest.raises(ValueError, match=r"repeats forever .* steps is not set"):
        model.predict(_data().batch(4).repeat(), verbose=0)
    assert all((a == b).all() for a, b in zip(model.get_weights(), before))
    # With steps_per_epoch (or steps) it is fine.
    counter = _Count()
    model.fit(_data().batch(4).repeat(), epochs=2, steps_per_epoch=3, verbose=0, callbacks=[counter])
    assert counter.per_epoch == [3, 3]
    model.evaluate(_data().batch(4).repeat(), steps=2, verbose=0)


def test_an_empty_dataset_is_refused_naming_it():
    model = _model()
    empty = _data().filter(lambda x, y: torch.tensor(False)).batch(4)  # cardinality unknown: found empty
    with pytest.raises(ValueError, match=r"yielded no batches in epoch 1 \(.*Dataset"):
        model.fit(empty, epochs=2, verbose=0)
    with pytest.raises(ValueError, match=r"yields no batches \(.*Dataset"):
        model.fit(_data().take(0).batch(4), epochs=2, verbose=0)  # cardinality 0: refused before training
    with pytest.raises(ValueError, match="yielded no batches"):
        model.evaluate(empty, verbose=0)
    with pytest.raises(ValueError, match="no batches"):
        model.predict(empty, verbose=0)
    with pytest.raises(ValueError, match="yields no batches"):
        model.fit(_data().batch(4), validation_data=_data().take(0).batch(4), verbose=0)
    for shuffle in (True, False):  # arrays with no rows (shuffle=True used to fail in Dataset.shuffle(0))
        with pytest.raises(ValueError, match=r"Model.fit: x has no rows \(shape \(0, 4\)\)"):
            model.fit(np.zeros((0, 4), np.float32), np.zeros(0, np.int64), batch_size=4, shuffle=shuffle, verbose=0)


def test_steps_per_epoch_that_divides_the_pass_starts_the_next_pass_without_an_empty_epoch():
    """8 batches, 4 per epoch: every epoch trains 4 (the third starts the second pass; before, it
    found the first pass exhausted and trained nothing)."""
    model = _model()
    counter = _Count()
    model.fit(_data(32).batch(4), epochs=3, steps_per_epoch=4, verbose=0, callbacks=[counter])
    assert counter.per_epoch == [4, 4, 4]
