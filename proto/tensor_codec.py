"""Tensor encodings and checksums of activation frames (pure: numpy, stdlib, messages).

A wire ``Tensor`` declares its logical ``dtype`` (float32), ``shape``
(row-major), ``byte_order`` and ``encoding``; ``data`` (and for int8,
``scales``) hold the values; ``checksum`` covers ``data`` then ``scales``.

Encodings and their error bounds, for a float32 input ``x`` and decoded ``y``:

* ``ENCODING_F32``: exact, bit for bit (NaN payloads included).
* ``ENCODING_F16``: IEEE binary16, round to nearest even. ``|x - y| <=
  2^-11 * |x|`` for ``|x| >= 2^-14`` and ``|x - y| <= 2^-25`` below that.
  Finite values that would overflow binary16 (``|x| >= 65520``) are refused
  with :class:`EncodeError` rather than silently turned into infinities.
* ``ENCODING_INT8_BLOCK``: the last axis is cut into blocks of ``block_size``
  values (the last block of a row may be shorter); each block has one
  binary32 scale ``s >= max|x_block| / 127`` (the float32 value at or just
  above that quotient) and values ``q = round(x / s)`` in ``[-127, 127]``.
  Decoding gives ``y = q * s`` in float32, so ``|x - y| <= s / 2 + 2^-24 *
  |y| + 2^-150``, about ``max|x_block| / 254``. Non-finite inputs and
  ``|x| > 2^100`` are refused. Blocks never cross rows, so a tensor split by
  rows is the same bytes as the rows encoded separately.

Decoding checks, in this order, and raises the matching
:mod:`proto.errors` exception: known dtype/encoding/byte order/checksum
algorithm (``DTypeError``), shape rank and dimensions and the declared size
against the limit (``ShapeError``, ``TooLargeError``), byte lengths against
the shape (``ShapeError``), the checksum (``ChecksumError``), and for int8
finite non-negative scales (``BadFrameError``). No numpy error escapes.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from proto.errors import BadFrameError, ChecksumError, DTypeError, EncodeError, ShapeError, TooLargeError
from proto.swarm.v1 import frame_pb2

DEFAULT_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 4096
MAX_RANK = 4
INT8_MAX_ABS = 2.0**100
_F16_OVERFLOW = 65520.0  # binary16 rounds values at or above this to infinity

ENCODINGS = (frame_pb2.ENCODING_F32, frame_pb2.ENCODING_F16, frame_pb2.ENCODING_INT8_BLOCK)
CHECKSUM_ALGORITHMS = (frame_pb2.CHECKSUM_CRC32, frame_pb2.CHECKSUM_BLAKE2B_128)
_CHECKSUM_LENGTH: dict[int, int] = {frame_pb2.CHECKSUM_CRC32: 4, frame_pb2.CHECKSUM_BLAKE2B_128: 16}
_ITEMSIZE: dict[int, int] = {
    frame_pb2.ENCODING_F32: 4,
    frame_pb2.ENCODING_F16: 2,
    frame_pb2.ENCODING_INT8_BLOCK: 1,
}


@dataclass(frozen=True)
class TensorLayout:
    """Sizes implied by a tensor's declared metadata."""

    shape: tuple[int, ...]
    rows: int  # product of all dimensions but the last
    cols: int  # the last dimension
    data_bytes: int
    scales_bytes: int
    decoded_bytes: int  # size of the float32 result


def checksum(algorithm: frame_pb2.ChecksumAlgorithm, data: bytes, scales: bytes = b"") -> bytes:
    """The checksum of ``data`` followed by ``scales``."""
    if algorithm == frame_pb2.CHECKSUM_CRC32:
        return zlib.crc32(scales, zlib.crc32(data)).to_bytes(4, "big")
    if algorithm == frame_pb2.CHECKSUM_BLAKE2B_128:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(data)
        digest.update(scales)
        return digest.digest()
    raise DTypeError(f"unknown checksum algorithm {algorithm}")


def encoded_row_bytes(cols: int, encoding: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of ``data`` plus ``scales`` for one row of ``cols`` values."""
    if encoding not in _ITEMSIZE:
        raise DTypeError(f"unknown encoding {encoding}")
    size = cols * _ITEMSIZE[encoding]
    if encoding == frame_pb2.ENCODING_INT8_BLOCK:
        size += 4 * math.ceil(cols / block_size)
    return size


def _float_order(byte_order: int, itemsize: int) -> np.dtype[np.floating]:
    if byte_order == frame_pb2.BYTE_ORDER_LITTLE:
        return np.dtype(f"<f{itemsize}")
    if byte_order == frame_pb2.BYTE_ORDER_BIG:
        return np.dtype(f">f{itemsize}")
    raise DTypeError(f"unknown byte order {byte_order}")


def tensor_layout(tensor: frame_pb2.Tensor, max_decoded_bytes: int) -> TensorLayout:
    """Check a tensor's metadata and byte lengths (not its checksum)."""
    if tensor.dtype != frame_pb2.DTYPE_FLOAT32:
        raise DTypeError(f"tensor {tensor.name!r}: unsupported dtype {tensor.dtype}")
    if tensor.encoding not in ENCODINGS:
        raise DTypeError(f"tensor {tensor.name!r}: unsupported encoding {tensor.encoding}")
    _float_order(tensor.byte_order, 4)
    if tensor.checksum_algorithm not in CHECKSUM_ALGORITHMS:
        raise DTypeError(
            f"tensor {tensor.name!r}: unsupported checksum algorithm {tensor.checksum_algorithm}"
        )
    if len(tensor.checksum) != _CHECKSUM_LENGTH[tensor.checksum_algorithm]:
        raise BadFrameError(f"tensor {tensor.name!r}: checksum has {len(tensor.checksum)} bytes")
    shape = tuple(int(d) for d in tensor.shape)
    if not 1 <= len(shape) <= MAX_RANK:
        raise ShapeError(f"tensor {tensor.name!r}: rank {len(shape)} not in 1..{MAX_RANK}")
    if any(d < 1 for d in shape):
        raise ShapeError(f"tensor {tensor.name!r}: empty dimension in shape {list(shape)}")
    count = math.prod(shape)  # Python ints: no overflow for absurd declared shapes
    if count * 4 > max_decoded_bytes:
        raise TooLargeError(f"tensor {tensor.name!r}: {count * 4} bytes decoded exceed {max_decoded_bytes}")
    cols = shape[-1]
    rows = count // cols
    data_bytes = count * _ITEMSIZE[tensor.encoding]
    scales_bytes = 0
    if tensor.encoding == frame_pb2.ENCODING_INT8_BLOCK:
        if not 1 <= tensor.block_size <= MAX_BLOCK_SIZE:
            raise BadFrameError(
                f"tensor {tensor.name!r}: block_size {tensor.block_size} not in 1..{MAX_BLOCK_SIZE}"
            )
        scales_bytes = rows * math.ceil(cols / tensor.block_size) * 4
    elif tensor.scales or tensor.block_size:
        raise BadFrameError(f"tensor {tensor.name!r}: scales/block_size set for a non-int8 encoding")
    if len(tensor.data) != data_bytes:
        raise ShapeError(
            f"tensor {tensor.name!r}: shape {list(shape)} needs {data_bytes} data bytes, "
            f"got {len(tensor.data)}"
        )
    if len(tensor.scales) != scales_bytes:
        raise ShapeError(
            f"tensor {tensor.name!r}: needs {scales_bytes} scale bytes, got {len(tensor.scales)}"
        )
    return TensorLayout(shape, rows, cols, data_bytes, scales_bytes, count * 4)


def verify_checksum(tensor: frame_pb2.Tensor) -> None:
    """Raise :class:`ChecksumError` unless the checksum matches ``data`` + ``scales``."""
    actual = checksum(tensor.checksum_algorithm, tensor.data, tensor.scales)
    if actual != tensor.checksum:
        raise ChecksumError(
            f"tensor {tensor.name!r}: checksum {tensor.checksum.hex()} != computed {actual.hex()}"
        )


def decode_tensor(tensor: frame_pb2.Tensor, max_decoded_bytes: int) -> npt.NDArray[np.float32]:
    """The float32 array (native byte order, C-contiguous, writable) a wire tensor holds."""
    layout = tensor_layout(tensor, max_decoded_bytes)
    verify_checksum(tensor)
    if tensor.encoding == frame_pb2.ENCODING_INT8_BLOCK:
        q = np.frombuffer(tensor.data, dtype=np.int8).reshape(layout.rows, layout.cols)
        n_blocks = math.ceil(layout.cols / tensor.block_size)
        scales = np.frombuffer(tensor.scales, dtype=_float_order(tensor.byte_order, 4)).astype(np.float32)
        if not (np.all(np.isfinite(scales)) and np.all(scales >= 0)):
            raise BadFrameError(f"tensor {tensor.name!r}: int8 scales must be finite and non-negative")
        full = np.repeat(scales.reshape(layout.rows, n_blocks), tensor.block_size, axis=1)[:, : layout.cols]
        values = q.astype(np.float32) * full
    else:
        wire = _float_order(tensor.byte_order, _ITEMSIZE[tensor.encoding])
        values = np.frombuffer(tensor.data, dtype=wire).astype(np.float32)
    return np.ascontiguousarray(values.reshape(layout.shape), dtype=np.float32)


def _as_float32(name: str, array: npt.ArrayLike) -> npt.NDArray[np.float32]:
    values = np.asarray(array)
    if not np.issubdtype(values.dtype, np.floating):
        raise EncodeError(f"tensor {name!r}: dtype {values.dtype} is not floating point")
    if not 1 <= values.ndim <= MAX_RANK or 0 in values.shape:
        raise EncodeError(f"tensor {name!r}: shape {values.shape} is empty or of rank > {MAX_RANK}")
    return np.ascontiguousarray(values, dtype=np.float32)


def _quantize_int8(name: str, x: npt.NDArray[np.float32], block_size: int) -> tuple[bytes, bytes]:
    if not np.all(np.isfinite(x)):
        raise EncodeError(f"tensor {name!r}: int8 encoding needs finite values")
    if np.max(np.abs(x)) > INT8_MAX_ABS:
        raise EncodeError(f"tensor {name!r}: values beyond {INT8_MAX_ABS:g} do not fit int8 blocks")
    cols = x.shape[-1]
    rows = x.size // cols
    n_blocks = math.ceil(cols / block_size)
    padded = np.zeros((rows, n_blocks * block_size), dtype=np.float64)
    padded[:, :cols] = x.reshape(rows, cols)
    blocks = padded.reshape(rows, n_blocks, block_size)
    exact = np.max(np.abs(blocks), axis=2) / 127.0
    scales = exact.astype(np.float32)
    # Round the scale up so that |x| / scale <= 127 holds exactly.
    low = scales.astype(np.float64) < exact
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float64)
    q = np.clip(np.rint(blocks / safe[:, :, None]), -127, 127).astype(np.int8)
    data = q.reshape(rows, n_blocks * block_size)[:, :cols].tobytes()
    return data, scales.astype("<f4").tobytes()


def encode_tensor(
    name: str,
    array: npt.ArrayLike,
    encoding: frame_pb2.Encoding = frame_pb2.ENCODING_F32,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    checksum_algorithm: frame_pb2.ChecksumAlgorithm = frame_pb2.CHECKSUM_CRC32,
    byte_order: frame_pb2.ByteOrder = frame_pb2.BYTE_ORDER_LITTLE,
) -> frame_pb2.Tensor:
    """A wire tensor holding ``array`` (any floating dtype, cast to float32)."""
    x = _as_float32(name, array)
    if checksum_algorithm not in CHECKSUM_ALGORITHMS:
        raise EncodeError(f"unknown checksum algorithm {checksum_algorithm}")
    if byte_order not in (frame_pb2.BYTE_ORDER_LITTLE, frame_pb2.BYTE_ORDER_BIG):
        raise EncodeError(f"unknown byte order {byte_order}")
    scales = b""
    wire_block = 0
    if encoding == frame_pb2.ENCODING_F32:
        data = x.astype(_float_order(byte_order, 4)).tobytes()
    elif encoding == frame_pb2.ENCODING_F16:
        if np.any(np.isfinite(x) & (np.abs(x) >= _F16_OVERFLOW)):
            raise EncodeError(f"tensor {name!r}: values with |x| >= {_F16_OVERFLOW:g} overflow f16")
        data = x.astype(_float_order(byte_order, 2)).tobytes()
    elif encoding == frame_pb2.ENCODING_INT8_BLOCK:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise EncodeError(f"block_size {block_size} not in 1..{MAX_BLOCK_SIZE}")
        data, scales = _quantize_int8(name, x, block_size)
        if byte_order == frame_pb2.BYTE_ORDER_BIG:
            scales = np.frombuffer(scales, dtype="<f4").astype(">f4").tobytes()
        wire_block = block_size
    else:
        raise EncodeError(f"unknown encoding {encoding}")
    return frame_pb2.Tensor(
        name=name,
        shape=list(x.shape),
        dtype=frame_pb2.DTYPE_FLOAT32,
        encoding=encoding,
        byte_order=byte_order,
        data=data,
        scales=scales,
        block_size=wire_block,
        checksum_algorithm=checksum_algorithm,
        checksum=checksum(checksum_algorithm, data, scales),
    )
