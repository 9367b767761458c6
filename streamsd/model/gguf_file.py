"""Reading a GGUF file in one pass over a memory map: its metadata, its tensor table, its tensors.

gguf's own GGUFReader turns every element of every metadata array into numpy views (SmolLM2's 49k
tokens and 49k merges: ~150k of them), which took 5-10 s per read on a 2-core machine, and the
transformers GGUF path read the file four times over. Here the header is walked with ``struct``,
string arrays are skipped unless asked for, and a tensor is a view of the mapped file until it is
dequantised (by gguf's own dequantisers), one at a time.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

# Fixed-size metadata value types (GGUF spec): u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists the fastest-moving dimension first)
    ggml_type: int
    offset: int  # into the data section


@dataclass(slots=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]  # string arrays not asked for hold their length
    tensors: dict[str, TensorInfo]
    data_start: int
    _map: mmap.mmap

    @classmethod
    def open(cls, path: Path, string_arrays: Container[str] = ()) -> GgufFile:
        """Parse the header; ``string_arrays``: metadata keys whose string arrays to keep (not just count)."""
        with open(path, "rb") as fh:
            try:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise GgufError(str(exc)) from exc
        try:
            metadata, tensors, end = _parse(mapped, string_arrays)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            mapped.close()
            raise GgufError(f"truncated or malformed header ({exc})") from exc
        except GgufError:
            mapped.close()
            raise
        alignment = int(metadata.get("general.alignment", 32))
        return cls(Path(path), metadata, tensors, -(-end // alignment) * alignment, mapped)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, shaped [*outer, bytes per row] (a view of the mapped file)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self.tensors[name]
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        row_bytes = info.shape[-1] // block * block_bytes
        rows = prod(info.shape[:-1])
        start = self.data_start + info.offset
        if start + rows * row_bytes > len(self._map):
            raise GgufError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=start)
        return data.reshape(*info.shape[:-1], row_bytes)

    def float32(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, in its numpy shape."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        return dequantize(self.raw(name), GGMLQuantizationType(info.ggml_type)).reshape(info.shape)

    def close(self) -> None:
        self._map.close()


def _parse(buf: mmap.mmap, string_arrays: Container[str]) -> tuple[dict[str, Any], dict[str, TensorInfo], int]:
    if buf[:4] != b"GGUF":
        raise GgufError("it does not start with the GGUF magic bytes")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GgufError(f"GGUF version {version} is not supported (2 and 3 are)")
    if n_kv > len(buf) or n_tensors > len(buf):  # each takes a dozen bytes at least
        raise GgufError(f"it claims {n_kv} metadata entries and {n_tensors} tensors in {len(buf)} bytes")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _value(buf, pos + 4, kind, key in string_arrays)
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, offset)
    return metadata, tensors, pos


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n


def _value(buf: mmap.mmap, pos: int, kind: int, keep: bool) -> tuple[Any, int]:
    if kind in _SCALAR:
        fmt = _SCALAR[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(buf, pos)
    if kind != _ARRAY:
        raise GgufError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALAR:
        width = struct.calcsize(_SCALAR[item])
        if not keep:  # token types and scores: big, and nothing here reads them
            return count, pos + count * width
        return list(struct.unpack_from(f"<{count}{_SCALAR[item][1]}", buf, pos)), pos + count * width
    if item == _STRING:
        if keep:
            values = []
            for _ in range(count):
                s, pos = _string(buf, pos)
                values.append(s)
            return values, pos
        for _ in range(count):  # only walked: a vocabulary or merge list nobody asked for
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
        return count, pos
    raise GgufError(f"arrays of metadata type {item} are not supported")

