"""Which encoding each stage sends its hidden states in (``activation_encoding``; pure).

Every stage is told in its OPEN (``OpenSession.output_encoding``) how to encode
the hidden states it sends on; the next stage decodes whatever the frame says.
So the choice is per hop, and it is the sender's: stage k's output crosses the
hop into stage k+1, whose ``Hop.bandwidth_mbit_s`` is stage k's announced
uplink (the tracker's route answer, docs/tracker.md). With ``auto``:

==========================================  ==========================================
hop bandwidth                               encoding of stage k's output
==========================================  ==========================================
unknown (nothing announced), or >= f32 min  ``ENCODING_F32`` (exact)
below the f32 min                           ``ENCODING_F16`` (half the bytes)
below the int8 threshold (0: never)         ``ENCODING_INT8_BLOCK`` (about a quarter)
==========================================  ==========================================

An unknown bandwidth keeps f32: the lossy encodings are a trade a slow link
earns, never a default. The last stage sends tokens, not hidden states; its
entry is the exact encoding (unused). f16 and int8 change the next stage's
inputs, so a route with a lossy hop is not bit-exact with the whole model
(docs/protocol.md gives each encoding's error bound).

The encodings are fixed per Route Session (by stage position) when it opens: a
stage replaced mid-session keeps its position's encoding, so the history kept
for its replay matches; every run of a spot check uses the primary's, so honest
nodes report the same digests.
"""

from __future__ import annotations

from collections.abc import Sequence

from proto.swarm.v1 import frame_pb2

Encoding = frame_pb2.Encoding

FIXED: dict[str, Encoding] = {
    "f32": frame_pb2.ENCODING_F32,
    "f16": frame_pb2.ENCODING_F16,
    "int8": frame_pb2.ENCODING_INT8_BLOCK,
}
NAMES: dict[int, str] = {v: k for k, v in FIXED.items()}


def hop_encoding(
    bandwidth_mbit_s: float | None, *, f32_min_mbit_s: float, int8_below_mbit_s: float = 0.0
) -> Encoding:
    """The encoding for hidden states sent over a link of ``bandwidth_mbit_s`` (None: unknown)."""
    if bandwidth_mbit_s is None or bandwidth_mbit_s >= f32_min_mbit_s:
        return frame_pb2.ENCODING_F32
    if bandwidth_mbit_s < int8_below_mbit_s:
        return frame_pb2.ENCODING_INT8_BLOCK
    return frame_pb2.ENCODING_F16


def stage_encodings(
    mode: str,
    bandwidths_mbit_s: Sequence[float | None],
    *,
    f32_min_mbit_s: float,
    int8_below_mbit_s: float = 0.0,
) -> tuple[Encoding, ...]:
    """Per stage of a route, the encoding of what it sends on.

    ``bandwidths_mbit_s[i]`` is the bandwidth of the hop *into* stage i (the
    route's ``Hop.bandwidth_mbit_s``; the first one, the gateway's own, is not
    used). ``mode`` is ``activation_encoding``: a fixed name, or ``auto``.
    """
    n = len(bandwidths_mbit_s)
    if mode != "auto":
        return (FIXED[mode],) * n
    out = [
        hop_encoding(
            bandwidths_mbit_s[k + 1], f32_min_mbit_s=f32_min_mbit_s, int8_below_mbit_s=int8_below_mbit_s
        )
        for k in range(n - 1)
    ]
    return (*out, frame_pb2.ENCODING_F32) if n else ()
