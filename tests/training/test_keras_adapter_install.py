"""keras_adapter.install() is the one explicit call that changes Keras and registers with
mirrored.distribute, and uninstall() undoes it (issue 37: the patches were a side effect of
importing the adapter). Checked in a fresh interpreter: the patches are process-wide."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported (it reads it once)
pytest.importorskip("keras")

PROBE = """
import os; os.environ["KERAS_BACKEND"] = "torch"
import keras
from keras.src.random import seed_generator
from keras.src.layers.normalization.batch_normalization import BatchNormalization as BN
from keras.src.backend.torch.trainer import TorchTrainer
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.trainers import data_adapters
def now():
    return (seed_generator.SeedGenerator.next, seed_generator.global_seed_generator, BN._moments,
            keras.Model.compile, keras.Model.train, TorchTrainer.make_train_function, BaseOptimizer.apply,
            data_adapters.get_data_adapter)
own = now()
owned = ("next" in vars(seed_generator.SeedGenerator), "compile" in vars(keras.Model), "train" in vars(keras.Model))
import mirrored as mr
from mirrored.distribute import modules
from mirrored.training import keras_adapter
assert now() == own, "importing the adapter changed Keras"
assert not keras_adapter.installed()
copiers = len(modules._COPIERS)
keras_adapter.install()
keras_adapter.install()  # a second call changes nothing more
replaced = [a is not b for a, b in zip(now(), own)]
assert all(replaced), replaced
assert len(modules._COPIERS) == copiers + 1
keras_adapter.uninstall()
assert now() == own, "uninstall left a replacement"
assert owned == ("next" in vars(seed_generator.SeedGenerator), "compile" in vars(keras.Model),
                 "train" in vars(keras.Model)), "uninstall left an attribute where Keras inherits one"
assert len(modules._COPIERS) == copiers and not keras_adapter.installed()
# A Keras model taken in installs it again: its replicas are Keras copies, its dropout per replica.
net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
with strategy.scope():
    model = mr.Model(net)
assert keras_adapter.installed() and all(a is not b for a, b in zip(now(), own))
assert model.replicas[1] is not net and type(model.replicas[1]) is type(net)
print("ok")
"""


@pytest.mark.timeout(120)
def test_install_is_explicit_idempotent_and_undone_by_uninstall():
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok"], done.stdout
