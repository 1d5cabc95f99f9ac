"""Shard extraction: partial GGUFs, metadata, caching and every refusal."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader

from node import shard as shard_mod
from node.errors import LayerRangeError, NotGGUFError, ShardError, UnsupportedArchitecture
from node.fingerprint import model_fingerprint, sha256_file, store_manifest
from node.manifest import Manifest, build_manifest
from node.shard import extract_shard, extract_vocab, parse_layers, read_model_meta

pytestmark = pytest.mark.slow  # cuts shards out of the real model file (about 100 MB of copies)


def _fields(path: Path) -> dict:
    r = GGUFReader(path)
    return {
        k: f.contents()
        for k, f in r.fields.items()
        if not k.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"))
    }


def test_middle_shard_has_only_its_blocks_and_metadata(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 10, 20, node_cache)
    reader = GGUFReader(files.path)
    names = {t.name for t in reader.tensors}
    blocks = {int(n.split(".")[1]) for n in names if n.startswith("blk.")}
    assert blocks == set(range(10))
    assert "output.weight" not in names
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert list(embd.shape) == [576, 1]  # dummy one-token vocabulary
    meta = _fields(files.path)
    assert meta["llama.block_count"] == 10
    assert meta["llama.vocab_size"] == 1
    assert meta["tokenizer.ggml.model"] == "none"
    assert meta["swarm.shard.start"] == 10 and meta["swarm.shard.end"] == 20
    assert meta["swarm.source.fingerprint"] == model_fingerprint(model_path, None)
    assert meta["swarm.source.block_count"] == 30
    assert files.embeddings_path is None and not files.is_first and not files.is_last


def test_block_tensors_are_copied_byte_for_byte(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 7, 23, node_cache)
    src = {t.name: t for t in GGUFReader(model_path).tensors}
    dst = {t.name: t for t in GGUFReader(files.path).tensors}
    for i in (0, 8, 15):
        for part in ("attn_q.weight", "ffn_down.weight", "attn_norm.weight"):
            a = src[f"blk.{i + 7}.{part}"]
            b = dst[f"blk.{i}.{part}"]
            assert a.tensor_type == b.tensor_type
            assert bytes(a.data) == bytes(b.data)


def test_last_shard_keeps_vocabulary_and_head(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 15, 30, node_cache)
    reader = GGUFReader(files.path)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert list(embd.shape) == [576, 49152]
    assert "output_norm.weight" in {t.name for t in reader.tensors}
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert files.is_last and not files.is_first


def test_first_shard_writes_embeddings_companion(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 0, 15, node_cache)
    assert files.is_first and files.embeddings_path is not None
    reader = GGUFReader(files.embeddings_path)
    assert [t.name for t in reader.tensors] == ["token_embd.weight"]
    assert reader.fields["swarm.shard.role"].contents() == "embeddings"


def test_second_extraction_reuses_the_file(model_path: Path, node_cache: Path) -> None:
    first = extract_shard(model_path, 0, 10, node_cache)
    mtime = first.path.stat().st_mtime_ns
    again = extract_shard(model_path, 0, 10, node_cache)
    assert again == first
    assert first.path.stat().st_mtime_ns == mtime


def test_fingerprint_is_cached_and_invalidated_by_change(tmp_path: Path, model_path: Path) -> None:
    copy = tmp_path / "m.gguf"
    shutil.copy(model_path, copy)
    cache = tmp_path / "cache"
    digest = model_fingerprint(copy, cache)
    assert digest == build_manifest(model_path).fingerprint()
    assert digest != sha256_file(model_path)  # the manifest's digest, not the whole file's
    index = cache / "manifests" / "local.json"
    stored = cache / "manifests" / f"{digest}.json"
    assert index.is_file() and stored.is_file()
    # A cached fingerprint is trusted while the file's identity holds (not hashed again) ...
    import json

    other = Manifest(1, 0, "0" * 64, ())
    store_manifest(cache, other)
    data = json.loads(index.read_text())
    data[str(copy.resolve())]["fingerprint"] = other.fingerprint()
    data[str(copy.resolve())]["size"] = copy.stat().st_size
    index.write_text(json.dumps(data))
    assert model_fingerprint(copy, cache) == digest  # ... but a stored manifest of another size is not
    data[str(copy.resolve())]["fingerprint"] = digest
    index.write_text(json.dumps(data))
    stored.write_bytes(stored.read_bytes().replace(b'"format":1', b'"format":1 '))  # no longer its digest
    assert model_fingerprint(copy, cache) == digest  # rebuilt, not trusted
    # ... and recomputed once the file changes.
    with open(copy, "ab") as fh:
        fh.write(b"\0")
    assert model_fingerprint(copy, cache) == build_manifest(copy).fingerprint() != digest


def test_old_whole_file_fingerprint_cache_is_ignored(tmp_path: Path, model_path: Path) -> None:
    """A cache from before manifests (fingerprints.json, shards under the whole-file digest) is not reused."""
    import json

    cache = tmp_path / "cache"
    cache.mkdir()
    old = sha256_file(model_path)
    ident = {"size": model_path.stat().st_size, "mtime_ns": model_path.stat().st_mtime_ns}
    (cache / "fingerprints.json").write_text(json.dumps({str(model_path): {**ident, "sha256": old}}))
    files = extract_shard(model_path, 20, 30, cache)
    assert files.model.fingerprint == build_manifest(model_path).fingerprint() != old
    assert files.path.parent.name == files.model.fingerprint[:16]


def test_vocab_only_file_has_no_tensors(model_path: Path, node_cache: Path) -> None:
    path = extract_vocab(model_path, node_cache)
    reader = GGUFReader(path)
    assert len(reader.tensors) == 0
    assert "tokenizer.chat_template" in reader.fields
    assert path.stat().st_size < 4 * 1024 * 1024


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("15:15", "is empty"),
        ("20:10", "is empty"),
        ("0:31", "outside the model's layers [0, 30)"),
        ("28:40", "outside the model's layers [0, 30)"),
        ("5", "not of the form START:END"),
        ("a:b", "not of the form START:END"),
        ("-1:5", "not of the form START:END"),
    ],
)
def test_bad_layer_ranges_are_refused(spec: str, message: str) -> None:
    with pytest.raises(LayerRangeError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse_layers(spec, 30)


def test_extract_refuses_out_of_range(model_path: Path, node_cache: Path) -> None:
    with pytest.raises(LayerRangeError, match="outside the model's layers"):
        extract_shard(model_path, 25, 31, node_cache)
    with pytest.raises(LayerRangeError, match="is empty"):
        extract_shard(model_path, 3, 3, node_cache)


def test_not_gguf_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(NotGGUFError, match="not a GGUF file"):
        extract_shard(bogus, 0, 1, tmp_path)
    with pytest.raises(NotGGUFError, match="no such file"):
        extract_shard(tmp_path / "missing.gguf", 0, 1, tmp_path)


def test_truncated_gguf_is_refused(tmp_path: Path, model_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes()[:4096])
    with pytest.raises(NotGGUFError, match="damaged GGUF"):
        read_model_meta(cut, tmp_path)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "other.gguf"
    w = GGUFWriter(path, "mamba")
    w.add_uint32("mamba.block_count", 4)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        UnsupportedArchitecture, match="'mamba' is not supported: a recurrent model.*; supported: llama"
    ):
        extract_shard(path, 0, 2, tmp_path)


def test_a_shard_file_is_not_a_source_model(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 0, 15, node_cache)
    with pytest.raises(ShardError, match="already a swarm shard"):
        extract_shard(files.path, 0, 5, node_cache)


def test_cli_extract(model_path: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from node.cli import main

    res = CliRunner().invoke(
        main,
        ["shard", "extract", "--model", str(model_path), "--layers", "0:30:1", "--cache-dir", str(tmp_path)],
    )
    assert res.exit_code != 0 and "not of the form START:END" in res.output
    res = CliRunner().invoke(
        main,
        ["shard", "extract", "--model", str(model_path), "--layers", "20:30", "--cache-dir", str(tmp_path)],
    )
    assert res.exit_code == 0, res.output
    assert "llama-20-30.gguf" in res.output
    supported = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
    assert shard_mod.SUPPORTED_ARCHITECTURES == supported
