"""The TensorBoard callback and the event files of scalars it writes, without TensorFlow.

EventFileWriter appends Event protos (first one with file_version "brain.Event:2", then one per
step with summary{value{tag, simple_value}}) framed as TFRecords: uint64 length, masked CRC32C of
the length, the data, masked CRC32C of the data. Unlike mirrored.data.tfrecord.TFRecordWriter
(atomic: the file appears at close), it appends and flushes in place, because TensorBoard reads
event files while training writes them. The message classes come from a descriptor written here
with TensorFlow's field numbers, built by mirrored/_protobuf.py.
A full disk stops fit with one FileWriteError naming the event file, the file cut back to its
last whole event. Uses crc32c, numpy, protobuf, _protobuf.py, _callback.py and mirrored._files.
"""
from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Mapping

import crc32c
import numpy as np
from google.protobuf import descriptor_pb2

from mirrored._files import append_whole, reporting_write_errors
from mirrored._protobuf import build_messages, message_field
from mirrored.training._callback import NOT_METRICS, Callback, Logs, writes_summaries

__all__ = ["Event", "EventFileWriter", "Summary", "TensorBoard"]

_F = descriptor_pb2.FieldDescriptorProto
_MASK_DELTA = 0xA282EAD8  # TFRecord masks CRCs so a CRC stored inside CRC'd data does not cancel
_FILE_VERSION = "brain.Event:2"
_file_counter = itertools.count()  # two writers in one second in one process get distinct names


def _event_file_proto() -> descriptor_pb2.FileDescriptorProto:
    """The parts of tensorflow/core/util/event.proto and framework/summary.proto scalars need."""
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="mirrored/tensorflow_event.proto", package="tensorflow", syntax="proto3")
    summary = file_proto.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    value.field.append(message_field("tag", 1, _F.TYPE_STRING))
    value.field.append(message_field("simple_value", 2, _F.TYPE_FLOAT, oneof_index=0))
    summary.field.append(message_field("value", 1, _F.TYPE_MESSAGE, repeated=True,
                                       type_name=".tensorflow.Summary.Value"))
    event = file_proto.message_type.add(name="Event")
    event.oneof_decl.add(name="what")
    event.field.append(message_field("wall_time", 1, _F.TYPE_DOUBLE))
    event.field.append(message_field("step", 2, _F.TYPE_INT64))
    event.field.append(message_field("file_version", 3, _F.TYPE_STRING, oneof_index=0))
    event.field.append(message_field("summary", 5, _F.TYPE_MESSAGE, type_name=".tensorflow.Summary",
                                     oneof_index=0))
    return file_proto


_CLASSES = build_messages(_event_file_proto())
Event = _CLASSES["Event"]
Summary = _CLASSES["Summary"]


def _masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", _masked_crc(length)) + data
            + struct.pack("<I", _masked_crc(data)))


class EventFileWriter:
    """Appends scalar summaries to a new event file in `directory`, readable while written. Each event is
    written whole or not at all: a write that fails (a full disk) cuts the file back to its last whole
    event and raises FileWriteError naming the file and `writer`."""

    def __init__(self, directory: str | os.PathLike, writer: str = "EventFileWriter"):
        self.directory = os.fspath(directory)
        self.writer = writer
        # TensorBoard finds files by "tfevents" in the name and orders them by the timestamp.
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_file_counter)}.v2")
        self.path = os.path.join(self.directory, name)
        with reporting_write_errors(self.path, writer, "No event file was made."):
            os.makedirs(self.directory, exist_ok=True)
            self._file = open(self.path, "ab", buffering=0)  # unbuffered: each event is one whole write
        self._events = 0
        self._write(Event(wall_time=time.time(), file_version=_FILE_VERSION))

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One event at `step` with a simple_value per tag of `scalars` (NaN and inf included)."""
        event = Event(wall_time=time.time(), step=int(step))
        for tag, value in scalars.items():
            event.summary.value.add(tag=tag, simple_value=float(value))
        if event.summary.value:
            self._write(event)

    def flush(self) -> None:
        """Nothing to do: every event reaches the file as it is added (kept for the writer API)."""

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _write(self, event) -> None:
        if self._file is None:
            raise ValueError(f"EventFileWriter({self.directory!r}): the writer is closed.")
        kept = ("The events written before are intact (TensorBoard reads them), and no part of this one was left."
                if self._events else "Nothing was written to it.")
        append_whole(self.path, frame_record(event.SerializeToString()), self.writer, kept, fd=self._file.fileno())
        self._events += 1

    def __repr__(self) -> str:
        return f"EventFileWriter({self.path!r}{', closed' if self._file is None else ''})"


def scalar_logs(logs: Mapping[str, object]) -> dict[str, float]:
    """The entries of `logs` that are real numbers (bools and non-numbers left out); a metric with one value
    per class (an array, F1Score(average=None)) as one scalar per class, tagged "<key>/<class>"."""
    out = {}
    for key, value in logs.items():
        if isinstance(value, bool):
            continue
        try:
            out[key] = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            try:
                values = np.asarray(value, dtype=np.float64).reshape(-1)
            except (TypeError, ValueError):
                continue
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(values)})
    return out


class TensorBoard(Callback):
    """Writes the logs as TensorBoard scalars: `tensorboard --logdir {log_dir}`.

    Epoch logs go to log_dir/train as "epoch_loss", ... and the val_ keys, prefix removed, to
    log_dir/validation, so both runs share one chart per metric, at step = epoch. With
    update_freq="batch" or N, batch logs also go to log_dir/train as "batch_loss", ... every N
    steps, at step = training steps so far in this fit().
    """

    def __init__(self, log_dir: str | os.PathLike = "logs", update_freq: str | int = "epoch"):
        super().__init__()
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (isinstance(update_freq, bool)
                                       or not isinstance(update_freq, int) or update_freq <= 0):
            raise ValueError(f"TensorBoard(update_freq={update_freq!r}): give 'epoch', 'batch' "
                             f"or a positive number of steps.")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writers: dict[str, EventFileWriter] = {}
        self._train_step = 0
        self._chief = True

    def _writer(self, run: str) -> EventFileWriter:
        if run not in self._writers:
            self._writers[run] = EventFileWriter(os.path.join(self.log_dir, run), writer=repr(self))
        return self._writers[run]

    def on_train_begin(self, logs: Logs | None = None) -> None:
        """Starts this fit()'s step count at 0 and opens log_dir/train (on the chief of a multi-worker run
        only: the other workers write no events, see writes_summaries)."""
        self._train_step = 0
        self._chief = writes_summaries(self.model)
        if self._chief:
            self._writer("train")

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """With update_freq="batch" or N, writes the batch's logs as "batch_<key>" to log_dir/train
        every N steps, at step = training steps so far in this fit()."""
        self._train_step += 1
        if self.update_freq == "epoch" or self._train_step % self.update_freq or not self._chief:
            return
        scalars = scalar_logs(
            {f"batch_{k}": v for k, v in (logs or {}).items() if k not in NOT_METRICS})
        writer = self._writer("train")
        writer.add_scalars(self._train_step, scalars)
        writer.flush()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Writes the epoch's logs as "epoch_<key>" at step = epoch: training keys (and the optimizer's
        learning rate) to log_dir/train, the val_ keys, prefix removed, to log_dir/validation."""
        if not self._chief:
            return
        logs = {k: v for k, v in (logs or {}).items() if k not in NOT_METRICS}
        train = {f"epoch_{k}": v for k, v in logs.items() if not k.startswith("val_")}
        if "epoch_learning_rate" not in train:
            lr = getattr(getattr(self.model, "optimizer", None), "learning_rate", None)
            if isinstance(lr, (int, float)) and not isinstance(lr, bool):
                train["epoch_learning_rate"] = lr
        val = {f"epoch_{k[len('val_'):]}": v for k, v in logs.items() if k.startswith("val_")}
        for run, values in (("train", train), ("validation", val)):
            scalars = scalar_logs(values)
            if scalars:
                writer = self._writer(run)
                writer.add_scalars(epoch, scalars)
                writer.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        """Closes the event files, so TensorBoard reads them whole."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    def __repr__(self) -> str:
        return f"TensorBoard({self.log_dir!r}, update_freq={self.update_freq!r})"
