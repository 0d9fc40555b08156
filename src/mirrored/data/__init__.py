"""mirrored.data: input pipelines with the tf.data API (Dataset) on torch tensors.

`mr.data.images` (decode, resize, convert), `mr.data.tfrecord` (TFRecord files and
tf.train.Example, without TensorFlow) and `mr.data.experimental` (tf.data.experimental's names) are
submodules, importable as attributes of this package; `Options` sets a dataset's options."""
from mirrored.data import experimental as experimental
from mirrored.data import images as images
from mirrored.data import tfrecord as tfrecord
from mirrored.data.dataset import AUTOTUNE as AUTOTUNE
from mirrored.data.dataset import INFINITE_CARDINALITY as INFINITE_CARDINALITY
from mirrored.data.dataset import UNKNOWN_CARDINALITY as UNKNOWN_CARDINALITY
from mirrored.data.dataset import Dataset as Dataset
from mirrored.data.dataset import TensorSpec as TensorSpec
from mirrored.data.options import Options as Options
from mirrored.data.readers import TFRecordDataset as TFRecordDataset

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "Dataset", "Options", "TFRecordDataset",
           "TensorSpec", "experimental", "images", "tfrecord"]
