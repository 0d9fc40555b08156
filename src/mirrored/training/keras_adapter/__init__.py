"""Keras 3 models (torch backend) under a strategy, by section:

- _adapter.py: KerasAdapter, what mr.Model asks of a Keras model (the forward call with `training=`,
  Keras's losses, metrics and optimizers, regularization, summary), and the ".keras" archive;
- _objects.py, _optimizer.py: keras.losses / keras.metrics / keras.optimizers objects computed by
  Keras on every replica, with tf.distribute's aggregation;
- _mirroring.py: a copy per replica, and the variables layers assign in call, combined after a step;
- _replicas.py: a Keras model's own steps on every replica's copy (the gradient all-reduce in its
  optimizer's apply, the metrics combined after each step), which _keras_fit.py (Keras's own fit,
  evaluate and predict in a strategy's scope) and _own_steps.py (mr.Model of a class that defines its
  own steps or compile) use;
- _seeds.py, _batchnorm.py, _keras_fit.py: what replica threads need of Keras's own code (a random
  stream per replica, global-batch BatchNormalization, Keras's own fit on every replica);
- _install.py: install() / uninstall(), the one explicit, undoable call that puts the last three in place.

Keras is never imported by `import mirrored`: an object is a Keras one only if the program imported
keras already. Uses mirrored.distribute's public surface, losses.py, metrics.py, optimizers.py and keras.
"""
from mirrored.training.keras_adapter._adapter import KerasAdapter, load_archive
from mirrored.training.keras_adapter._batchnorm import convert_sync_batchnorm, has_global_batchnorm
from mirrored.training.keras_adapter._common import check_model, is_keras, is_keras_model
from mirrored.training.keras_adapter._install import install, installed, uninstall
from mirrored.training.keras_adapter._objects import KerasLoss, KerasMetric
from mirrored.training.keras_adapter._optimizer import KerasOptimizer

__all__ = ["KerasAdapter", "KerasLoss", "KerasMetric", "KerasOptimizer", "check_model", "convert_sync_batchnorm",
           "has_global_batchnorm", "install", "installed", "is_keras", "is_keras_model", "load_archive", "uninstall"]
