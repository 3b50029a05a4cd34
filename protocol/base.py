"""The one msgspec base of every message that crosses a process boundary (rings and client wire).

Array-like (a short msgpack array, fields in declaration order), defaults omitted, no GC tracking.
New fields are only ever added at the end with a default.
"""

from __future__ import annotations

import msgspec


class WireStruct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass
