"""Keras-style training on top of `mirrored.distribute`: Model, losses, metrics, optimizers,
callbacks, checkpoints and SyncBatchNorm. Uses only the public names of distribute/ and data/."""
from mirrored.training.model import Model

__all__ = ["Model"]
