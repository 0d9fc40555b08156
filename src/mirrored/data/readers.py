"""TFRecordDataset: a Dataset of the records of TFRecord files, as tf.data.TFRecordDataset reads them.

    files = mr.data.Dataset.list_files("data/train-*.tfrecord")      # shuffled each pass
    ds = mr.data.TFRecordDataset(files, num_parallel_reads=4).map(parse)

The file names form a Files source node (or are the elements of a dataset of names), which is what a
multi-worker strategy's FILE auto-sharding divides between workers. Records are bytes; the reader is
tfrecord.read_records (both CRCs checked, GZIP/ZLIB as TF's compression_type). Uses dataset.py,
_sources.py and tfrecord.py.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from mirrored.data import _sources
from mirrored.data._structure import TensorSpec
from mirrored.data._threads import AUTOTUNE
from mirrored.data.dataset import Dataset
from mirrored.data.tfrecord import _compression_type, read_records

__all__ = ["TFRecordDataset"]


def TFRecordDataset(filenames: str | os.PathLike | list[str | os.PathLike] | Dataset,  # noqa: N802 - tf.data's name
                    compression_type: str | None = None, buffer_size: int | None = None,
                    num_parallel_reads: int | None = None) -> Dataset:
    """The records (bytes) of `filenames` - a path, a list of paths, or a Dataset of path strings -
    file after file, or `num_parallel_reads` files interleaved record by record (tf.data's order).

    Args:
      compression_type: None or "" (uncompressed), "GZIP" or "ZLIB", for every file.
      buffer_size: accepted for tf.data's signature; reads are buffered by the OS here.
      num_parallel_reads: None reads files one after another; N (or AUTOTUNE) keeps N open, read ahead on
        threads, taking one record from each in turn.
    """
    where = "TFRecordDataset"
    del buffer_size  # tf.data's read buffer: Python's file objects buffer already
    compression = _compression_type(compression_type, where)
    if isinstance(filenames, Dataset):
        names = filenames
    else:
        listed = list(filenames) if isinstance(filenames, (list, tuple)) else [filenames]
        if not listed or not all(isinstance(f, (str, os.PathLike)) for f in listed):
            raise TypeError(f"{where}: filenames must be a path, a list of paths or a Dataset of path strings; "
                            f"got {filenames!r:.200}.")
        names = Dataset(_sources.Files([os.fspath(f) for f in listed], "file"))

    def records(name: Any) -> Dataset:
        path = os.fspath(name if isinstance(name, (str, os.PathLike)) else str(name))

        def read() -> Iterator[bytes]:
            return read_records(path, compression_type=compression)
        return Dataset.from_generator(read, output_signature=TensorSpec((), bytes))

    if num_parallel_reads is None:
        return names.flat_map(records)
    cycle = None if num_parallel_reads == AUTOTUNE else num_parallel_reads
    return names.interleave(records, cycle_length=cycle, num_parallel_calls=num_parallel_reads)
