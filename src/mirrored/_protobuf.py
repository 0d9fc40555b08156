"""Protobuf message classes built from a descriptor written in code, so that mirrored writes
TensorFlow's messages (tf.train.Example in data/, TensorBoard's Event in training/) with TF's field
numbers and bytes, without TensorFlow or generated _pb2 files. Uses protobuf only."""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto


def message_field(name: str, number: int, type_: int, *, repeated: bool = False, type_name: str | None = None,
                  packed: bool = False, oneof_index: int | None = None) -> descriptor_pb2.FieldDescriptorProto:
    """One field of a message in a FileDescriptorProto; type_ is e.g. FieldDescriptorProto.TYPE_BYTES."""
    proto = _F(name=name, number=number, type=type_,
               label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if type_name is not None:
        proto.type_name = type_name
    if packed:
        proto.options.packed = True
    if oneof_index is not None:
        proto.oneof_index = oneof_index
    return proto


def build_messages(file_proto: descriptor_pb2.FileDescriptorProto,
                   pool: descriptor_pool.DescriptorPool | None = None) -> dict[str, type]:
    """Message classes for every message in `file_proto`, keyed by name ("Outer.Inner" if nested).

    Adds the file to `pool`, by default a new private pool, so nothing clashes with other users of
    the same proto names (e.g. TensorFlow itself, if imported). Give one pool to several calls when
    one file depends on another.
    """
    pool = descriptor_pool.DescriptorPool() if pool is None else pool
    file_descriptor = pool.AddSerializedFile(file_proto.SerializeToString())
    classes: dict[str, type] = {}

    def add(descriptor, prefix: str) -> None:
        if descriptor.GetOptions().map_entry:
            return
        classes[prefix + descriptor.name] = message_factory.GetMessageClass(descriptor)
        for nested in descriptor.nested_types:
            add(nested, f"{prefix}{descriptor.name}.")

    for descriptor in file_descriptor.message_types_by_name.values():
        add(descriptor, "")
    return classes
