"""Reading GGUF tensors a slice of rows at a time (gguf.py's _to_dtype and _blocks, GGUFFile.row_chunks):
the result is bit-identical to dequantizing the whole tensor with gguf.quants.dequantize and then casting,
for every tensor type the loader reads, and the file pages of a slice leave the resident set once the
next slice is taken. The tensors are random bytes (any scale, NaN and infinity included) in a file
written with GGUFWriter; the slices are small enough that a tensor takes several, the last one ragged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from kvserve.model.gguf import _blocks, _to_dtype
from kvserve.model.gguf_file import GGUFFile, GGUFTensor

# Random scales overflow in gguf's dequantization (numpy warns); both paths must agree there too.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)
Q = GGMLQuantizationType
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
ROWS, K = 37, 512  # K: two blocks of the K-quants' 256 elements
CHUNK_ELEMENTS = 5 * K + 3  # five rows a slice: seven slices of five, then one of two
# The mapping's pages a read may hold besides the slice being read: a fault maps the whole page-cache
# folio it hits (up to 2 MiB where the file system caches files in large folios, as ext4 does on Linux
# 6.18) or 64 KiB of cached pages around it (fault_around_bytes), on either side of the slice.
READ_SLACK = (4 << 20) + (256 << 10)


def write_tensors(path: Path, tensors: dict[str, tuple[GGMLQuantizationType, np.ndarray]]) -> GGUFFile:
    """A GGUF file holding each uint8 [rows, bytes per row] array as a tensor of its type, opened."""
    writer = GGUFWriter(str(path), "llama")
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> GGUFFile:
    gen = np.random.default_rng(0)
    tensors = {}
    for qtype in TYPES:
        elems, size = GGML_QUANT_SIZES[qtype]
        tensors[qtype.name] = (qtype, gen.integers(0, 256, size=(ROWS, K // elems * size), dtype=np.uint8))
    return write_tensors(tmp_path_factory.mktemp("gguf") / "types.gguf", tensors)


def tensor_named(reader: GGUFFile, name: str) -> GGUFTensor:
    return next(t for t in reader.tensors if t.name == name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_sliced_read_equals_whole_dequantize_then_cast(reader, qtype, dtype):
    tensor = tensor_named(reader, qtype.name)
    assert tensor.shape == (ROWS, K)
    whole = torch.from_numpy(np.array(dequantize(tensor.data, qtype), dtype=np.float32)).view(ROWS, K).to(dtype)
    sliced = _to_dtype(reader, tensor, dtype, chunk_elements=CHUNK_ELEMENTS)
    assert sliced.dtype == dtype and sliced.shape == (ROWS, K)
    torch.testing.assert_close(sliced, whole, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_sliced_block_copy_equals_the_file_bytes(reader, qtype):
    tensor = tensor_named(reader, qtype.name)
    copied = _blocks(reader, tensor, chunk_elements=CHUNK_ELEMENTS)
    assert np.array_equal(copied.numpy(), tensor.data)


def mapped_bytes(path: Path) -> int:
    """This process's resident bytes of its mapping of `path` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith(" " + str(path)))
    rss = next(line for line in lines[header + 1 :] if line.startswith("Rss:"))
    return int(rss.split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the resident set from /proc")
def test_a_slice_leaves_the_resident_set_once_the_next_is_taken(tmp_path):
    rows, k = 4096, 2048  # 32 MiB of float32, read 1 MiB at a time
    data = np.random.default_rng(1).standard_normal((rows, k), dtype=np.float32).view(np.uint8)
    path = (tmp_path / "big.gguf").resolve()
    reader = write_tensors(path, {"big": (Q.F32, data)})
    tensor = tensor_named(reader, "big")
    before = mapped_bytes(path)
    most, total = 0, 0.0
    for _, piece in reader.row_chunks(tensor, 128 * k):
        total += float(piece.view(np.float32).sum(dtype=np.float64))  # reads every page of the slice
        most = max(most, mapped_bytes(path) - before)
    assert total == pytest.approx(float(data.view(np.float32).sum(dtype=np.float64)))
    slice_bytes = 128 * k * 4
    assert slice_bytes <= most <= slice_bytes + READ_SLACK
    assert mapped_bytes(path) - before <= READ_SLACK
