"""A raw safetensors reader/writer that knows the release's dtypes (F8_E4M3, F8_E8M0, I8 packed FP4).

The `safetensors` numpy API cannot hand out F8_E8M0 and copies on read, so this module does the format itself:
8-byte little-endian header length N, N bytes of JSON (`{name: {dtype, shape, data_offsets: [begin, end]}}`,
offsets relative to the data area, plus an optional `__metadata__` of strings), then the raw bytes.
Files written here are valid for the Rust parser too: the data area has no holes, the header is padded with
spaces to 8 bytes and tensors are ordered by falling item size, so every tensor is aligned to its item size.

Two ways to read: `MappedFile.array(name)` is a read-only memory-mapped view (for data read sparsely, like the
Engram tables, or in strided slices); `MappedFile.pread_into` copies a contiguous range into a buffer with one
system call, which is several times faster than page-faulting through a mapping for data read whole.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

# safetensors dtype name -> numpy dtype we hand out. UE8M0 scales and packed FP4 bytes are raw uint8 in our
# tree (quant.Fp8Weight / Fp4Weight), so F8_E8M0 and I8 read as uint8; `write_file` maps them back.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.uint8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
ITEMSIZE = {k: v.itemsize for k, v in NUMPY_DTYPES.items()}

_HEADER_LIMIT = 100 << 20  # the Rust parser refuses larger headers; a bigger length means a corrupt file


class SafetensorsError(ValueError):
    """A safetensors file is unreadable, truncated or inconsistent."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One header entry. begin/end are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass
class Header:
    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int  # absolute offset of the data area
    file_size: int

    @property
    def data_end(self) -> int:
        """Where the last tensor ends (absolute); the file must be at least this long."""
        return max((t.end for t in self.tensors.values()), default=self.data_start)


def read_header(path: str | os.PathLike) -> Header:
    """Parses and checks one file's header without touching the data. Raises SafetensorsError naming the file."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit in the file of {size} bytes "
                                   "(truncated or not a safetensors file)")
        raw = f.read(n)
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e}); the file is corrupt") from None
    metadata = d.pop("__metadata__", None) or {}
    tensors = {}
    for name, e in d.items():
        try:
            dtype, shape, (b, en) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: malformed header entry for tensor {name}: {e!r}") from None
        tensors[name] = TensorInfo(name, dtype, shape, 8 + n + int(b), 8 + n + int(en))
    return Header(path, tensors, metadata, 8 + n, size)


def check_entry(t: TensorInfo, header: Header) -> str | None:
    """What is wrong with one entry on its own (unknown dtype, size not matching shape, past end of file)."""
    if t.dtype not in ITEMSIZE:
        return f"unknown dtype {t.dtype}"
    want = math.prod(t.shape) * ITEMSIZE[t.dtype]
    if t.end < t.begin or t.nbytes != want:
        return f"data_offsets span {t.nbytes} bytes, but {t.dtype}{list(t.shape)} needs {want}"
    if t.end > header.file_size:
        return (f"file is truncated: the tensor ends at byte {t.end} but the file has {header.file_size} bytes")
    return None


class MappedFile:
    """A memory-mapped safetensors file; arrays are read-only views that keep the mapping alive."""

    def __init__(self, header: Header):
        self.header = header
        self._fd = os.open(header.path, os.O_RDONLY)
        self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if header.file_size else None

    def __del__(self):
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def pread_into(self, out: np.ndarray, offset: int) -> None:
        """Fills the C-contiguous `out` with the file's bytes from absolute `offset` (thread-safe, GIL released)."""
        mv = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(mv):
            n = os.preadv(self._fd, [mv[done:]], offset + done)
            if n <= 0:
                raise SafetensorsError(f"{self.header.path}: ends at byte {offset + done}, expected "
                                       f"{offset + len(mv)} (truncated while loading?)")
            done += n

    def advise_huge_pages(self, name: str) -> bool:
        """Asks the kernel to back tensor `name`'s pages with huge pages (fewer TLB misses for random row gathers
        over a large table). File-backed huge pages need a kernel built with them (read-only THP for files);
        elsewhere the advice is refused and nothing changes. -> whether it was taken."""
        if self._mm is None or not hasattr(mmap, "MADV_HUGEPAGE"):
            return False
        t = self.header.tensors[name]
        start = t.begin - t.begin % mmap.PAGESIZE
        try:
            self._mm.madvise(mmap.MADV_HUGEPAGE, start, t.end - start)
        except OSError:
            return False
        return True

    def array(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        dt = NUMPY_DTYPES[t.dtype]
        return np.frombuffer(self._mm, dt, math.prod(t.shape), t.begin).reshape(t.shape)


def open_file(path: str | os.PathLike) -> MappedFile:
    return MappedFile(read_header(path))


@dataclasses.dataclass(frozen=True)
class TensorOut:
    """A tensor to write: `get()` returns its data (any array-like whose bytes are the payload), called once,
    only when the writer reaches it, so a writer never holds more than one leaf on the host."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    get: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def write_file(path: str | os.PathLike, tensors: Iterable[TensorOut], metadata: dict[str, str] | None = None,
               *, fsync: bool = False) -> int:
    """Writes one file; returns its payload bytes. Data is checked against the declared dtype size and shape."""
    order = sorted(tensors, key=lambda t: -ITEMSIZE[t.dtype])  # stable: keeps the caller's order per item size
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for t in order:
        if t.name in header:
            raise SafetensorsError(f"{path}: tensor {t.name} given twice")
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    tmp = os.fspath(path) + ".partial"  # a crash never leaves a plausible-looking short file behind
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in order:
            a = np.ascontiguousarray(np.asarray(t.get()))
            if a.nbytes != t.nbytes or tuple(a.shape) != t.shape:
                raise SafetensorsError(f"{path}: tensor {t.name}: data is {a.dtype}{list(a.shape)} "
                                       f"({a.nbytes} bytes), declared {t.dtype}{list(t.shape)}")
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return off
