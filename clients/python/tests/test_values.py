"""Payload values to and from google.protobuf.Value, without a gateway: what cannot travel as JSON
is refused with the place it is at, and what comes back keeps its Python types."""

import math
import unittest

from sluice_client import Client
from sluice_client._values import from_value, to_value


class ValuesTest(unittest.TestCase):
    def test_round_trip_keeps_types(self):
        v = {"model": "m", "turn": 3, "ratio": 0.5, "tools": [{"name": "w"}], "none": None, "ok": True,
             "big": 2**53, "neg": -7, "tuple": (1, "a")}
        back = from_value(to_value(v))
        self.assertEqual(back, {**v, "tuple": [1, "a"]})
        self.assertIsInstance(back["turn"], int)
        self.assertIsInstance(back["ok"], bool)
        self.assertIsInstance(back["ratio"], float)

    def test_what_json_cannot_carry_is_refused_with_its_path(self):
        cases = [
            ({"a": [1, {"b": {1, 2}}]}, TypeError, "$.a[1].b: set is not a JSON value"),
            ({"a": math.nan}, ValueError, "$.a: nan is not a JSON number"),
            ({"a": math.inf}, ValueError, "$.a: inf"),
            ({"a": 2**60}, ValueError, "too large"),
            ({1: "x"}, TypeError, "keys must be strings"),
            ({"a": b"bytes"}, TypeError, "bytes is not a JSON value"),
        ]
        for value, exc, needle in cases:
            with self.subTest(value=value), self.assertRaises(exc) as cm:
                to_value(value)
            self.assertIn(needle, str(cm.exception))

    def test_a_single_string_is_not_a_chunk_source(self):
        with Client("127.0.0.1:1") as c, self.assertRaises(TypeError) as cm:
            c.stream("bot", "one whole reply")
        self.assertIn("pass [text]", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
