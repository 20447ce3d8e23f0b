"""A GGUF file's header read for what building the model needs: its ``general.architecture`` and
each tensor's ggml type, without the metadata's values (gguf-py's ``GGUFReader`` builds every
value, the tokenizer's ~100k strings included: seconds, where this takes milliseconds).

The layout (GGUF versions 2 and 3, little-endian): ``b"GGUF"``, ``u32`` version, ``u64`` tensor
count, ``u64`` metadata count; each metadata entry a key (``u64`` length + UTF-8), a ``u32`` value
type and its value (an array: ``u32`` element type, ``u64`` count, the elements; a string: ``u64``
length + bytes); then each tensor's name, ``u32`` dimension count, ``u64`` dimensions, ``u32``
ggml type and ``u64`` data offset. A file of another form is read by ``GGUFReader`` instead.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

#: sizes of the fixed-size value types (gguf-py's ``GGUFValueType``): uint8 ... float64; 8 is a
#: string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Little-endian reads from ``buf`` at ``pos``, advancing it."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        n = self.unpack("<Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def skip(self, kind: int) -> None:  # one value of type ``kind``
        if kind == _STRING:
            n = self.unpack("<Q")  # (not ``pos += unpack()``: unpack moves pos first)
            self.pos += n
        elif kind == _ARRAY:
            elem, count = self.unpack("<I"), self.unpack("<Q")
            if elem in _SIZES:
                self.pos += _SIZES[elem] * count
            else:
                for _ in range(count):
                    self.skip(elem)
        else:
            self.pos += _SIZES[kind]


def _read(path: Path) -> tuple[str | None, dict[str, int]] | None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        if buf[:4] != b"GGUF":
            return None
        c.pos = 4
        if c.unpack("<I") not in (2, 3):
            return None
        tensors, entries = c.unpack("<Q"), c.unpack("<Q")
        arch = None
        for _ in range(entries):
            key, kind = c.string(), c.unpack("<I")
            if key == b"general.architecture" and kind == _STRING:
                arch = c.string().decode()
            else:
                c.skip(kind)
        types = {}
        for _ in range(tensors):
            name = c.string().decode()
            dims = c.unpack("<I")
            c.pos += 8 * dims
            types[name] = c.unpack("<I")
            c.pos += 8  # the data offset
        return arch, types


def architecture(reader: Any) -> str:
    """A ``GGUFReader``'s ``general.architecture``.

    Raises:
        ValueError: the file does not state it.
    """
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("the GGUF file has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def read_header(path: Path | str) -> tuple[str, dict[str, int]]:
    """The file's ``general.architecture`` and each tensor's ggml type id by name.

    Raises:
        ValueError: the file does not state its architecture, or gguf-py cannot read it either.
    """
    try:
        header = _read(Path(path))
    except (struct.error, ValueError, IndexError, KeyError):  # not the layout above: gguf-py decides
        header = None
    if header is not None and header[0] is not None:
        return header
    from gguf import GGUFReader  # another version or byte order

    reader = GGUFReader(path)
    return architecture(reader), {t.name: int(t.tensor_type) for t in reader.tensors}
