"""The tracker's challenge of a newly announced node, as pure functions: the input, the digest, the verdict.

Splits are bit-exact: two honest nodes with the same runtime recipe give the
same bytes for the same input. So before a node is routable the tracker sends
its span one PREFILL of a known input and compares what comes back with what
trusted nodes of the same model, recipe and span gave for the same input:

* the input is deterministic per (model, span, length) but not guessable
  beforehand: a keyed hash (HMAC-SHA256 with the tracker's secret) seeds it.
  A span starting at layer 0 gets token ids, any other span float32 rows of
  ``n_embd`` standard-normal values (and token ids too when it is the last
  stage: they are its penalty history);
* stages before the last answer with their output rows; the digest is
  :func:`proto.codec.output_digest` of the rows *received* (the node's own
  ``output_digest`` must agree with them, or the answer is refused);
* the last stage answers with a greedy sampled token and its top logprobs;
  the digest is blake2b-128 over their canonical JSON (:func:`sampled_digest`).

Verdict (:func:`verdict`): no trusted reference yet -> routable, on probation
like every newcomer (``no_reference``); the digest equals a reference ->
``passed``; it equals none -> ``mismatch``: the node stays out. Pure: numpy,
hashlib and hmac only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

TOP_LOGPROBS = 5  # asked of a last stage: more of its distribution must match


@dataclass(frozen=True)
class ChallengeInput:
    input_id: str  # 32 hex: names the input (references must have answered the same one)
    token_ids: tuple[int, ...] | None  # first stage, and the last stage's penalty history
    hidden: npt.NDArray[np.float32] | None  # stages after the first: [n_tokens, n_embd] float32
    sample: bool  # the span ends at the model's last layer: a token is sampled


def challenge_input(
    secret: bytes,
    *,
    model_fingerprint: str,
    start: int,
    end: int,
    n_layers: int,
    n_embd: int,
    n_vocab: int,
    n_tokens: int,
) -> ChallengeInput:
    """The input for this span: the same for every node of it, unknown without ``secret``."""
    if not (0 <= start < end <= n_layers and n_tokens >= 1 and n_embd >= 1 and n_vocab >= 1):
        raise ValueError("challenge_input: span, width, vocabulary and length must be valid")
    label = f"swarm-challenge/1/{model_fingerprint}/{start}/{end}/{n_layers}/{n_embd}/{n_vocab}/{n_tokens}"
    key = hmac.new(secret, label.encode(), hashlib.sha256).digest()
    rng = np.random.default_rng(int.from_bytes(key[:16], "little"))
    last = end == n_layers
    tokens = tuple(int(t) for t in rng.integers(0, n_vocab, size=n_tokens))
    hidden = None
    if start > 0:
        hidden = rng.standard_normal((n_tokens, n_embd), dtype=np.float32)
    return ChallengeInput(
        input_id=hashlib.blake2b(key, digest_size=16).hexdigest(),
        token_ids=tokens if start == 0 or last else None,
        hidden=hidden,
        sample=last,
    )


def sampled_digest(
    token_id: int, logprob: float, top_logprobs: Sequence[tuple[int, float]], end_of_generation: bool
) -> str:
    """blake2b-128 (hex) of a last stage's answer: the token, its logprob and the top logprobs."""
    body = json.dumps(
        [
            int(token_id),
            float(logprob),
            [[int(t), float(p)] for t, p in top_logprobs],
            bool(end_of_generation),
        ],
        separators=(",", ":"),
        allow_nan=True,
    )
    return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Verdict:
    outcome: str  # "passed", "no_reference" or "mismatch"
    routable: bool
    detail: str


def verdict(digest: str, references: set[str]) -> Verdict:
    """Compare a node's digest with the digests trusted nodes gave for the same input."""
    if not references:
        return Verdict("no_reference", True, "no trusted node of this span and recipe answered it yet")
    if digest in references:
        note = "" if len(references) == 1 else f" (trusted nodes gave {len(references)} different digests)"
        return Verdict("passed", True, "equals a trusted node's answer" + note)
    return Verdict("mismatch", False, f"answer {digest[:16]} differs from every trusted node's")
