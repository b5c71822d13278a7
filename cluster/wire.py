"""Parse gRPC requests without letting a malformed one become UNKNOWN, and name the field.

grpc answers a request whose bytes its deserializer rejects with UNKNOWN ("Unexpected
<class DecodeError>"), as if the server had failed. The frontend
registers its service with :func:`safe_parser` instead: a protobuf ``DecodeError`` becomes
a :class:`MalformedRequest` value the servicer turns into INVALID_ARGUMENT, with the path of
the offending field found by :func:`find_bad_field` (a walk over the wire format:
a string that is not UTF-8, a truncated length-delimited field, a bad varint, an
unknown wire type).

Pure Python over ``bytes``; no pickle, no eval: the wire format is read, never executed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import message as pb_message
from google.protobuf.descriptor import Descriptor, FieldDescriptor

__all__ = ["MalformedRequest", "find_bad_field", "safe_parser"]

_MAX_DEPTH = 32


@dataclass(frozen=True)
class MalformedRequest:
    """A request whose bytes did not parse; ``message`` names the field when found."""

    message: str


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at ``pos``. Raises ValueError when malformed."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _check_packed(field: FieldDescriptor, chunk: bytes) -> bool:
    """Whether a packed repeated scalar's payload is well formed."""
    fixed = {
        FieldDescriptor.TYPE_FIXED32: 4,
        FieldDescriptor.TYPE_SFIXED32: 4,
        FieldDescriptor.TYPE_FLOAT: 4,
        FieldDescriptor.TYPE_FIXED64: 8,
        FieldDescriptor.TYPE_SFIXED64: 8,
        FieldDescriptor.TYPE_DOUBLE: 8,
    }.get(field.type)
    if fixed is not None:
        return len(chunk) % fixed == 0
    pos = 0
    try:
        while pos < len(chunk):
            _, pos = _varint(chunk, pos)
    except ValueError:
        return False
    return True


def find_bad_field(descriptor: Descriptor, data: bytes, prefix: str = "", depth: int = 0) -> str:
    """The dotted path of the first field of ``data`` that cannot be parsed as
    ``descriptor`` (unknown field numbers are named ``field <number>``), or ``""`` when the
    wire format looks well formed at every level."""
    pos = 0
    while pos < len(data):
        try:
            key, pos = _varint(data, pos)
        except ValueError:
            return prefix.rstrip(".") or descriptor.name
        number, wire_type = key >> 3, key & 7
        field = descriptor.fields_by_number.get(number)
        name = prefix + (field.name if field is not None else f"field {number}")
        if number == 0:  # no field has number 0
            return name
        try:
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                chunk = data[pos : pos + length]
                pos += length
                if len(chunk) < length:
                    return name
                bad = _bad_in_chunk(field, chunk, name, depth) if field is not None else ""
                if bad:
                    return bad
            else:  # groups (3, 4) are not used by proto3; 6 and 7 do not exist
                return name
        except ValueError:
            return name
        if pos > len(data):
            return name
    return ""


def _bad_in_chunk(field: FieldDescriptor, chunk: bytes, name: str, depth: int) -> str:
    """The bad path inside a length-delimited field's payload, or ``""``."""
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return name
        return ""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if depth >= _MAX_DEPTH:
            return name
        return find_bad_field(field.message_type, chunk, name + ".", depth + 1)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return ""
    return "" if _check_packed(field, chunk) else name


def safe_parser(message_cls: Any) -> Callable[[bytes], Any]:
    """A gRPC request deserializer: the parsed message, or a :class:`MalformedRequest`
    naming the bad field (never an exception, which grpc would report as UNKNOWN)."""

    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except pb_message.DecodeError as exc:
            path = find_bad_field(message_cls.DESCRIPTOR, data)
            where = path or message_cls.DESCRIPTOR.name
            return MalformedRequest(f"{where}: the request could not be parsed ({exc})")

    return parse
