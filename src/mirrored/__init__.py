"""mirrored: synchronous data-parallel training on PyTorch, the tf.distribute.MirroredStrategy way."""
