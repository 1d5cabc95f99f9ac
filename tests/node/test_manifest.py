"""Model manifests: the header scanner, digests, strict parsing, and plans that gguf's writer agrees with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from node.errors import ManifestError
from node.manifest import Manifest, NeedMoreBytes, build_manifest, read_header_bytes, scan_header
from node.shard import extract_shard


@pytest.mark.slow  # reads the real model file
def test_scan_header_agrees_with_gguf_reader(model_path: Path) -> None:
    header = read_header_bytes(model_path)
    layout = scan_header(header)
    reader = GGUFReader(model_path)
    assert layout.header_size == reader.data_offset == len(header)
    assert [(t.name, t.offset, t.size) for t in layout.tensors] == [
        (t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors
    ]


def test_scan_header_asks_for_more_bytes(model_path: Path) -> None:
    header = read_header_bytes(model_path)
    for cut in (3, 100, len(header) // 2, len(header) - 40):
        with pytest.raises(NeedMoreBytes) as more:
            scan_header(header[:cut])
        assert cut < more.value.total <= len(header)
    with pytest.raises(ManifestError, match="not a GGUF file"):
        scan_header(b"PK\x03\x04" + bytes(100))


def test_manifest_digest_and_checks(model_path: Path) -> None:
    m = build_manifest(model_path)
    assert m.file_size == model_path.stat().st_size
    assert sum(m.layer_bytes(30)) + sum(m.global_bytes().values()) == sum(t.size for t in m.tensors)
    again = Manifest.from_bytes(m.canonical_bytes(), m.fingerprint())
    assert again == m
    header = read_header_bytes(model_path)
    assert m.check_header(header).header_size == m.header_size
    broken = bytearray(header)
    broken[200] ^= 1
    with pytest.raises(ManifestError, match="header bytes do not match"):
        m.check_header(bytes(broken))
    with pytest.raises(ManifestError, match="is not the model fingerprint"):
        Manifest.from_bytes(m.canonical_bytes(), "0" * 64)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.update(extra=1), "manifest keys must be"),
        (lambda o: o.update(format=2), "format 2"),
        (lambda o: o["tensors"][1].update(offset=0), "overlaps"),
        (lambda o: o["tensors"][0].update(sha256="X" * 64), "sha256 must be 64 lowercase hex"),
        (lambda o: o["tensors"].append(dict(o["tensors"][0])), "unique"),
        (lambda o: o.update(file_size=10), "overlaps|larger than the file"),
    ],
)
def test_manifest_parsing_is_strict(model_path: Path, mutate, message: str) -> None:
    obj = build_manifest(model_path).to_json()
    mutate(obj)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_bytes(json.dumps(obj).encode())


@pytest.mark.slow  # writes shard files of the real model
@pytest.mark.parametrize(("start", "end"), [(0, 10), (10, 20), (20, 30)])
def test_planned_files_are_what_gguf_writer_writes(
    model_path: Path, node_cache: Path, start: int, end: int
) -> None:
    """The plan-based writer (header + pieces at offsets + zero padding) gives exactly the bytes gguf's
    own writer produces for the same metadata and tensors."""
    files = extract_shard(model_path, start, end, node_cache)
    for path in filter(None, (files.path, files.embeddings_path)):
        reader = GGUFReader(path)
        out = path.with_suffix(".ref")
        writer = GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        for t in reader.tensors:
            data = np.asarray(t.data)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert out.read_bytes() == path.read_bytes()
