"""JSON values to and from `google.protobuf.Value`, the form structured payloads travel in.

Whole numbers come back as `int` (protobuf carries every number as a double), matching what the
gateway gives hooks, so `{"turn": 3}` stays `3`, not `3.0`."""

import math
from typing import Any

from google.protobuf import struct_pb2

# Doubles hold every integer up to 2**53 exactly.
_EXACT = 2**53


def to_value(obj: Any, path: str = "$") -> struct_pb2.Value:
    """A `Value` for a JSON-like object (dict with str keys, list/tuple, str, int, float, bool,
    None). Anything else raises TypeError naming where it is, e.g. `$.messages[2].content`."""
    v = struct_pb2.Value()
    if obj is None:
        v.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        v.bool_value = obj
    elif isinstance(obj, int):
        if abs(obj) > _EXACT:
            raise ValueError(f"{path}: {obj} is too large to travel as a JSON number exactly")
        v.number_value = obj
    elif isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"{path}: {obj} is not a JSON number")
        v.number_value = obj
    elif isinstance(obj, str):
        v.string_value = obj
    elif isinstance(obj, dict):
        fields = v.struct_value.fields
        v.struct_value.SetInParent()
        for key, item in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: object keys must be strings, got {type(key).__name__}")
            fields[key].CopyFrom(to_value(item, f"{path}.{key}"))
    elif isinstance(obj, (list, tuple)):
        v.list_value.SetInParent()
        for i, item in enumerate(obj):
            v.list_value.values.append(to_value(item, f"{path}[{i}]"))
    else:
        raise TypeError(f"{path}: {type(obj).__name__} is not a JSON value")
    return v


def from_value(v: struct_pb2.Value) -> Any:
    """The JSON-like Python object a `Value` holds."""
    kind = v.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "bool_value":
        return v.bool_value
    if kind == "number_value":
        n = v.number_value
        if math.isfinite(n) and n == int(n) and abs(n) < _EXACT:
            return int(n)
        return n
    if kind == "string_value":
        return v.string_value
    if kind == "list_value":
        return [from_value(item) for item in v.list_value.values]
    return {key: from_value(item) for key, item in v.struct_value.fields.items()}
