"""Typed msgspec messages, one module per boundary.

- ``sampling``: ``SamplingParams`` (travels client → engine core → worker).
- ``engine``:   engine client ↔ engine core (add, abort, per-step outputs, stats).
- ``worker``:   engine core ↔ worker (``ExecuteStep`` diff, ``StepResult``).
- ``control``:  heartbeats and actor status for the supervisor and recovery controller.

Schema evolution rules (every boundary):

1. New fields are appended at the end of a struct, always with a default.
2. Fields are never reordered, renamed or removed; a field no longer used keeps its slot.
3. Hot-path structs (``array_like=True``) are encoded positionally, so rules 1 and 2 are what
   keeps an old peer able to decode a new message; ``tests/unit/test_bus_codec.py`` pins
   their field order.
4. Tags are strings and never reused for another struct.
"""
