"""Tensor encodings: round trips within the documented bounds, corrupted input rejected."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from proto import errors
from proto.swarm.v1 import frame_pb2
from proto.tensor_codec import decode_tensor, encode_tensor

MAX_BYTES = 1 << 24
F32, F16, INT8 = frame_pb2.ENCODING_F32, frame_pb2.ENCODING_F16, frame_pb2.ENCODING_INT8_BLOCK
ORDERS = st.sampled_from([frame_pb2.BYTE_ORDER_LITTLE, frame_pb2.BYTE_ORDER_BIG])
CHECKSUMS = st.sampled_from([frame_pb2.CHECKSUM_CRC32, frame_pb2.CHECKSUM_BLAKE2B_128])
SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=24)


def arrays(max_abs: float, *, allow_nan: bool = False) -> st.SearchStrategy[npt.NDArray[np.float32]]:
    elements = st.floats(
        min_value=None if allow_nan else -max_abs,
        max_value=None if allow_nan else max_abs,
        allow_nan=allow_nan,
        allow_infinity=allow_nan,
        width=32,
    )
    return hnp.arrays(np.float32, SHAPES, elements=elements)


@settings(max_examples=60, deadline=None)
@given(x=arrays(0, allow_nan=True), order=ORDERS, algorithm=CHECKSUMS)
def test_f32_round_trip_is_bit_exact(x: npt.NDArray[np.float32], order: int, algorithm: int) -> None:
    tensor = encode_tensor("hidden", x, F32, byte_order=order, checksum_algorithm=algorithm)
    y = decode_tensor(frame_pb2.Tensor.FromString(tensor.SerializeToString()), MAX_BYTES)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert y.tobytes() == x.tobytes()


@settings(max_examples=60, deadline=None)
@given(x=arrays(60000.0), order=ORDERS)
def test_f16_round_trip_within_half_precision(x: npt.NDArray[np.float32], order: int) -> None:
    y = decode_tensor(encode_tensor("hidden", x, F16, byte_order=order), MAX_BYTES)
    bound = np.maximum(np.abs(x).astype(np.float64) * 2.0**-11, 2.0**-25)
    assert y.shape == x.shape
    assert np.all(np.abs(x.astype(np.float64) - y) <= bound)


@settings(max_examples=60, deadline=None)
@given(x=arrays(2.0**100), block=st.sampled_from([1, 7, 32, 64]), order=ORDERS)
def test_int8_round_trip_within_block_bound(x: npt.NDArray[np.float32], block: int, order: int) -> None:
    tensor = encode_tensor("hidden", x, INT8, block_size=block, byte_order=order)
    y = decode_tensor(tensor, MAX_BYTES)
    assert y.shape == x.shape
    cols = x.shape[-1]
    rows = x.reshape(-1, cols).astype(np.float64)
    n_blocks = -(-cols // block)
    padded = np.zeros((rows.shape[0], n_blocks * block))
    padded[:, :cols] = np.abs(rows)
    block_max = padded.reshape(rows.shape[0], n_blocks, block).max(axis=2)
    per_value = np.repeat(block_max / 127.0, block, axis=1)[:, :cols]
    # Documented: |x - y| <= s/2 + 2^-24 |y| + 2^-150, s the float32 scale >= max|block| / 127.
    scale = per_value * (1 + 2.0**-23)
    bound = scale / 2 + 2.0**-24 * np.abs(y.reshape(rows.shape)) + 2.0**-150
    assert np.all(np.abs(rows - y.reshape(rows.shape)) <= bound)


def test_int8_row_split_equals_separate_encoding() -> None:
    x = np.random.default_rng(7).standard_normal((6, 50)).astype(np.float32)
    whole = encode_tensor("hidden", x, INT8, block_size=16)
    top, bottom = (
        encode_tensor("hidden", x[:2], INT8, block_size=16),
        encode_tensor("hidden", x[2:], INT8, block_size=16),
    )
    assert whole.data == top.data + bottom.data and whole.scales == top.scales + bottom.scales


@pytest.mark.parametrize(
    ("values", "encoding"),
    [
        (np.array([[np.nan, 1.0]], np.float32), INT8),
        (np.array([[np.inf, 1.0]], np.float32), INT8),
        (np.array([[7e4, 1.0]], np.float32), F16),
        (np.array([[1, 2]], np.int32), F32),
        (np.zeros((0, 4), np.float32), F32),
    ],
)
def test_unencodable_values_raise_encode_error(values: npt.NDArray[np.generic], encoding: int) -> None:
    with pytest.raises(errors.EncodeError):
        encode_tensor("hidden", values, encoding)


@settings(max_examples=40, deadline=None)
@given(
    x=arrays(100.0),
    encoding=st.sampled_from([F32, F16, INT8]),
    data=st.data(),
)
def test_flipped_payload_byte_is_a_checksum_error(
    x: npt.NDArray[np.float32], encoding: int, data: st.DataObject
) -> None:
    tensor = encode_tensor("hidden", x, encoding)
    field = data.draw(st.sampled_from(["data", "scales"] if tensor.scales else ["data"]))
    payload = bytearray(getattr(tensor, field))
    index = data.draw(st.integers(0, len(payload) - 1))
    payload[index] ^= data.draw(st.integers(1, 255))
    setattr(tensor, field, bytes(payload))
    with pytest.raises(errors.ChecksumError):
        decode_tensor(tensor, MAX_BYTES)


@settings(max_examples=40, deadline=None)
@given(x=arrays(100.0), encoding=st.sampled_from([F32, F16, INT8]), cut=st.integers(1, 64))
def test_truncated_payload_is_a_shape_error(x: npt.NDArray[np.float32], encoding: int, cut: int) -> None:
    tensor = encode_tensor("hidden", x, encoding)
    tensor.data = tensor.data[: max(0, len(tensor.data) - cut)]
    with pytest.raises(errors.ShapeError):
        decode_tensor(tensor, MAX_BYTES)


def _tensor(encoding: int = F32) -> frame_pb2.Tensor:
    return encode_tensor("hidden", np.ones((4, 8), np.float32), encoding)


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda t: t.shape.__setitem__(0, 5), errors.ShapeError),
        (lambda t: t.shape.append(2), errors.ShapeError),
        (lambda t: t.shape.__setitem__(1, 0), errors.ShapeError),
        (lambda t: t.ClearField("shape"), errors.ShapeError),
        (lambda t: t.shape.extend([1, 1, 1, 1]), errors.ShapeError),
        (lambda t: t.shape.__setitem__(0, 1 << 40), errors.TooLargeError),
        (lambda t: setattr(t, "dtype", frame_pb2.DTYPE_UNSPECIFIED), errors.DTypeError),
        (lambda t: setattr(t, "dtype", 77), errors.DTypeError),
        (lambda t: setattr(t, "encoding", 99), errors.DTypeError),
        (lambda t: setattr(t, "byte_order", frame_pb2.BYTE_ORDER_UNSPECIFIED), errors.DTypeError),
        (lambda t: setattr(t, "checksum_algorithm", frame_pb2.CHECKSUM_UNSPECIFIED), errors.DTypeError),
        (lambda t: setattr(t, "checksum", b"\x00"), errors.BadFrameError),
        (lambda t: setattr(t, "encoding", frame_pb2.ENCODING_F16), errors.ShapeError),
        (lambda t: setattr(t, "scales", b"\x00" * 4), errors.BadFrameError),
    ],
)
def test_declared_metadata_must_match_the_bytes(mutate: object, error: type[errors.ProtocolError]) -> None:
    tensor = _tensor()
    mutate(tensor)  # type: ignore[operator]
    with pytest.raises(error):
        decode_tensor(tensor, MAX_BYTES)


def test_int8_metadata_checks() -> None:
    tensor = _tensor(INT8)
    tensor.block_size = 0
    with pytest.raises(errors.BadFrameError):
        decode_tensor(tensor, MAX_BYTES)
    tensor = _tensor(INT8)
    tensor.scales = tensor.scales[:-4]
    with pytest.raises(errors.ShapeError):
        decode_tensor(tensor, MAX_BYTES)


def test_negative_or_nan_scales_are_rejected_after_a_valid_checksum() -> None:
    from proto.tensor_codec import checksum

    tensor = _tensor(INT8)
    tensor.scales = np.full(len(tensor.scales) // 4, -1.0, "<f4").tobytes()
    tensor.checksum = checksum(tensor.checksum_algorithm, tensor.data, tensor.scales)
    with pytest.raises(errors.BadFrameError):
        decode_tensor(tensor, MAX_BYTES)


def test_decoded_size_limit_is_checked_before_allocation() -> None:
    with pytest.raises(errors.TooLargeError):
        decode_tensor(_tensor(), 4 * 8 * 4 - 1)
