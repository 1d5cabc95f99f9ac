"""A model larger than any node: a 7B-class llama GGUF with random Q4_0 weights, built once and cached.

``python -m sim.big_model [--out FILE]`` writes (or finds) the file and prints its path.

Shapes are Llama-2-7B's (32 layers, width 4096, 32 heads, feed-forward 11008)
with the test model's tokenizer and chat template (SmolLM2's 49 152-token
BPE vocabulary, so prompts tokenize and the gateway can serve it); every
matrix is Q4_0, the norms F32 ones, the LM head separate from the token
table: about 3.9 GB. The quantized blocks are random nibbles under one fixed
scale, so activations stay finite through 32 layers; the output is nonsense,
but it is a deterministic function of the weights, which is all a parity test
needs. The weights come from a seeded generator, so every build of the same
version writes the same bytes (same manifest, same fingerprint).

Memory stays bounded while writing: tensor infos first, then one tensor at a
time (the largest is the 200 MB token table). The file is written to
``<name>.partial`` and renamed when complete; an existing file is reused when
its size is right (``--check`` also verifies the stored sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from node.testmodel import test_model_path

BUILD_VERSION = 1
NAME = "swarm-random-7b-q4_0"
Q4_0_BLOCK = 32
Q4_0_BYTES = 18
SCALE = np.float16(0.004)  # std of (q - 8) is about 4.6: weights of about 0.02


@dataclass(frozen=True)
class Shapes:
    n_layers: int = 32
    n_embd: int = 4096
    n_ff: int = 11008
    n_head: int = 32
    n_head_kv: int = 32
    context_length: int = 4096


def default_path() -> Path:
    base = os.environ.get("SWARM_BIG_MODEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "swarm-inference", "models"
    )
    return Path(base) / f"{NAME}-v{BUILD_VERSION}.gguf"


def _tensors(s: Shapes, n_vocab: int) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(name, numpy shape (rows, columns), type) in file order."""
    q, f = GGMLQuantizationType.Q4_0, GGMLQuantizationType.F32
    out: list[tuple[str, tuple[int, ...], GGMLQuantizationType]] = [
        ("token_embd.weight", (n_vocab, s.n_embd), q)
    ]
    kv = s.n_embd // s.n_head * s.n_head_kv
    for i in range(s.n_layers):
        out += [
            (f"blk.{i}.attn_norm.weight", (s.n_embd,), f),
            (f"blk.{i}.attn_q.weight", (s.n_embd, s.n_embd), q),
            (f"blk.{i}.attn_k.weight", (kv, s.n_embd), q),
            (f"blk.{i}.attn_v.weight", (kv, s.n_embd), q),
            (f"blk.{i}.attn_output.weight", (s.n_embd, s.n_embd), q),
            (f"blk.{i}.ffn_norm.weight", (s.n_embd,), f),
            (f"blk.{i}.ffn_gate.weight", (s.n_ff, s.n_embd), q),
            (f"blk.{i}.ffn_up.weight", (s.n_ff, s.n_embd), q),
            (f"blk.{i}.ffn_down.weight", (s.n_embd, s.n_ff), q),
        ]
    out += [("output_norm.weight", (s.n_embd,), f), ("output.weight", (n_vocab, s.n_embd), q)]
    return out


def _q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    blocks = rows * cols // Q4_0_BLOCK
    data = rng.integers(0, 256, size=(blocks, Q4_0_BYTES), dtype=np.uint8)
    data[:, :2] = np.frombuffer(SCALE.tobytes(), dtype=np.uint8)
    return data.reshape(rows, cols // Q4_0_BLOCK * Q4_0_BYTES)


def build(out: Path, shapes: Shapes = Shapes(), *, seed: int = 7, log: bool = True) -> Path:
    """Write the model to ``out`` (atomically); returns ``out``."""
    source = GGUFReader(test_model_path())
    n_vocab = int(next(t for t in source.tensors if t.name == "token_embd.weight").shape[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    writer = GGUFWriter(tmp, "llama")
    writer.add_name(f"{NAME} (random weights, llama-2-7b shapes)")
    writer.add_block_count(shapes.n_layers)
    writer.add_context_length(shapes.context_length)
    writer.add_embedding_length(shapes.n_embd)
    writer.add_feed_forward_length(shapes.n_ff)
    writer.add_head_count(shapes.n_head)
    writer.add_head_count_kv(shapes.n_head_kv)
    writer.add_rope_dimension_count(shapes.n_embd // shapes.n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(2)  # MOSTLY_Q4_0
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    plan = _tensors(shapes, n_vocab)
    for name, shape, qtype in plan:
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            rows, cols = shape
            byte_shape = (rows, cols // Q4_0_BLOCK * Q4_0_BYTES)
            nbytes = rows * byte_shape[1]
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    t0, done = time.monotonic(), 0
    for name, shape, qtype in plan:
        data = np.ones(shape, dtype=np.float32) if qtype == GGMLQuantizationType.F32 else _q4_0(rng, *shape)
        writer.write_tensor_data(data)
        done += data.nbytes
        if log and name.endswith("ffn_down.weight"):
            print(f"  {name}: {done / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    writer.close()
    os.replace(tmp, out)
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def ensure(path: Path | None = None, *, check: bool = False) -> Path:
    """The cached model, built if absent or incomplete (``check``: also re-verify its sha256)."""
    path = path or default_path()
    info = path.with_name(path.name + ".json")
    try:
        meta = json.loads(info.read_text())
        ok = meta.get("version") == BUILD_VERSION and path.stat().st_size == meta.get("size")
        if ok and check:
            ok = sha256_of(path) == meta.get("sha256")
        if ok:
            return path
    except (OSError, ValueError):
        pass
    t0 = time.monotonic()
    print(f"building {path} (about 3.9 GB, once) ...", file=sys.stderr)
    build(path)
    record = {"version": BUILD_VERSION, "size": path.stat().st_size, "sha256": sha256_of(path)}
    info.write_text(json.dumps(record, indent=1))
    print(f"built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the model goes (default: the cache)")
    parser.add_argument("--check", action="store_true", help="re-verify a cached model's sha256")
    args = parser.parse_args(argv)
    print(ensure(args.out, check=args.check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
