"""A GGUF file's metadata and tensor index, read in one pass; tensor bytes stay in the memory-mapped file.

The gguf package's GGUFReader builds a numpy view per element of every metadata array, which made
opening a 262k-token vocabulary (Gemma 3's) cost more than loading its weights; this reader decodes
each array in one go. The format (llama.cpp's gguf.md): magic, version, tensor and key counts, the
key-value pairs, the tensor infos (name, dims innermost first, type, offset), then the tensor data from
the next aligned offset.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.intmath import div_ceil

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Value types with a fixed size: (struct code, numpy dtype).
_SCALARS = {
    0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16), 4: ("I", np.uint32),
    5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_), 10: ("Q", np.uint64), 11: ("q", np.int64),
    12: ("d", np.float64),
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major (numpy) order: GGUF's dims reversed
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8 bytes in the file's mmap, [rows, bytes per row]
    file_offset: int  # where `data` starts in the file


@dataclass(frozen=True)
class _ArrayField:
    """A metadata array of strings or scalars left in the file until read: the parse is kept for the
    process's life (open_gguf_file), and Gemma 3's 262k tokens and scores held as Python objects were
    over 40 MB of it (benchmarks/RESULTS.md, "Loading Gemma 3 within the RSS budget")."""

    item: int  # the elements' value type
    count: int
    offset: int  # of the first element in the file


class GGUFFile:
    def __init__(self, path: Path) -> None:
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, tensor_count, kv_count = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        self._fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self._fields[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        alignment = int(self.field("general.alignment") or 32)
        start = div_ceil(self._pos, alignment) * alignment
        raw = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = []
        for name, dims, kind, offset in infos:
            block, type_size = GGML_QUANT_SIZES[kind]
            row_bytes = dims[0] // block * type_size
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            data = raw[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors.append(GGUFTensor(name, shape, kind, data, start + offset))

    def field(self, key: str) -> Any:
        """The metadata value under `key` (arrays as lists), or None."""
        value = self._fields.get(key)
        if not isinstance(value, _ArrayField):
            return value
        if value.item in _SCALARS:  # one copy of the whole array
            dtype = _SCALARS[value.item][1]
            return np.frombuffer(self._map, dtype=dtype, count=value.count, offset=value.offset).tolist()
        strings, pos = [], value.offset
        for _ in range(value.count):
            (n,) = struct.unpack_from("<Q", self._map, pos)
            strings.append(self._map[pos + 8 : pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        return strings

    def row_chunks(self, tensor: GGUFTensor, max_elements: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, rows) of `tensor` in turn, each as many whole rows as hold at most `max_elements`
        elements (at least one row), as views of the mapped file. When the caller takes the next chunk (or
        stops), the previous one's pages leave this process's resident set: reading a file through its
        mapping would otherwise keep every page read counted in the RSS of the loading process, on top of
        the copy being made (the pages stay in the OS page cache; reading them again maps them again)."""
        rows, row_bytes = tensor.data.shape
        step = max(1, max_elements // tensor.shape[-1])
        for start in range(0, rows, step):
            chunk = tensor.data[start : start + step]
            try:
                yield start, chunk
            finally:
                self._release(tensor.file_offset + start * row_bytes, chunk.nbytes)

    def _release(self, offset: int, nbytes: int) -> None:
        """Drop the whole pages of file bytes [offset, offset + nbytes) and the page holding `offset`
        from the resident set; the page holding the end may hold bytes still to be read. Never affects
        what a read returns: a dropped page is mapped again from the page cache (or the file) when read."""
        first = offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    def _read(self, n: int) -> bytes:
        out = self._map[self._pos : self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return self._read(n).decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            array = _ArrayField(item, count, self._pos)
            if item == _STRING:  # skipped: each string's length, then its bytes
                for _ in range(count):
                    (n,) = self._unpack("<Q")
                    self._pos += n
                return array
            if item in _SCALARS:
                self._pos += count * struct.calcsize(_SCALARS[item][0])
                return array
            return [self._value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack("<" + _SCALARS[kind][0])[0]


@functools.cache
def open_gguf_file(path: Path) -> GGUFFile:
    """One parse per file and process (config, weights and tokenizer are read at different times)."""
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    return GGUFFile(path)
