"""_protobuf.py: message classes built from a descriptor written in code, against protobuf's wire
format encoded by hand (a tag byte is field_number << 3 | wire_type)."""
from __future__ import annotations

import struct

from google.protobuf import descriptor_pb2

from mirrored import _protobuf
from mirrored.data import tfrecord

F = descriptor_pb2.FieldDescriptorProto


def test_built_messages_write_the_wire_format_and_leave_other_pools_alone():
    file_proto = descriptor_pb2.FileDescriptorProto(name="test/event.proto", package="probe", syntax="proto3")
    event = file_proto.message_type.add(name="Event")
    event.field.append(_protobuf.message_field("wall_time", 1, F.TYPE_DOUBLE))
    event.field.append(_protobuf.message_field("tags", 2, F.TYPE_STRING, repeated=True))
    classes = _protobuf.build_messages(file_proto)
    message = classes["Event"](wall_time=1.5, tags=["a"])
    # field 1, wire type 1 (64-bit): 0x09 and the double; field 2, wire type 2 (length-delimited): 0x12, 1, "a"
    assert message.SerializeToString() == b"\x09" + struct.pack("<d", 1.5) + b"\x12\x01a"
    assert classes["Event"].FromString(message.SerializeToString()) == message
    assert tfrecord.Example.DESCRIPTOR.full_name == "tensorflow.Example"  # built in its own pool, untouched


def test_packed_and_nested_fields():
    file_proto = descriptor_pb2.FileDescriptorProto(name="test/outer.proto", package="probe", syntax="proto3")
    outer = file_proto.message_type.add(name="Outer")
    inner = outer.nested_type.add(name="Inner")
    inner.field.append(_protobuf.message_field("ids", 1, F.TYPE_INT64, repeated=True, packed=True))
    outer.field.append(_protobuf.message_field("inner", 1, F.TYPE_MESSAGE, type_name=".probe.Outer.Inner"))
    classes = _protobuf.build_messages(file_proto)
    assert sorted(classes) == ["Outer", "Outer.Inner"]
    message = classes["Outer"](inner=classes["Outer.Inner"](ids=[1, 300]))
    packed = b"\x0a\x03\x01\xac\x02"  # ids: field 1, length 3, varints 1 and 300 (0xac 0x02)
    assert message.SerializeToString() == b"\x0a" + bytes([len(packed)]) + packed
