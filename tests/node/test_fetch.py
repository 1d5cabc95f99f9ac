"""Fetching only a shard's bytes from a Range-capable HTTP server on loopback, and every way it can go wrong.

The server is ``tests/node/range_server.py`` (a real HTTP server on 127.0.0.1);
the client is the real ``swarm-node shard extract`` (in-process through click,
or as a subprocess for the killed download).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from node.cli import main
from node.fingerprint import local_manifest
from node.manifest import Manifest
from node.shard import extract_shard
from sim.range_server import RangeServer

pytestmark = pytest.mark.slow  # fetches shards of the real model file over HTTP

MODEL = "/models/smollm2.gguf"


@pytest.fixture(scope="module")
def published(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The test model and its manifest, as an operator publishes them (swarm-node model manifest)."""
    d = tmp_path_factory.mktemp("published")
    manifest = d / "smollm2.gguf.manifest.json"
    res = CliRunner().invoke(
        main, ["model", "manifest", str(model_path), "-o", str(manifest), "--cache-dir", str(d)]
    )
    assert res.exit_code == 0, res.output
    return {MODEL: model_path, MODEL + ".manifest.json": manifest}


@pytest.fixture
def server(published: dict[str, Path]) -> RangeServer:
    with RangeServer(published) as s:
        yield s


def extract(url: str, layers: str, cache: Path, *extra: str) -> tuple[int, str]:
    res = CliRunner().invoke(
        main, ["shard", "extract", "--model", url, "--layers", layers, "--cache-dir", str(cache), *extra]
    )
    return res.exit_code, res.output + (str(res.exception) if res.exception and res.exit_code != 1 else "")


def shard_outputs(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "shards").rglob("*") if p.is_file() and not p.name.startswith("."))


@pytest.mark.parametrize("layers", ["10:20", "0:10", "20:30"])
def test_url_shard_is_byte_identical_and_fetches_only_its_bytes(
    server: RangeServer, model_path: Path, node_cache: Path, tmp_path: Path, layers: str
) -> None:
    start, end = map(int, layers.split(":"))
    local = extract_shard(model_path, start, end, node_cache)
    code, out = extract(server.url(MODEL), layers, tmp_path)
    assert code == 0, out
    assert "fetched" in out
    manifest = local_manifest(model_path, node_cache)
    remote_files = [
        tmp_path / "shards" / manifest.fingerprint()[:16] / p.name
        for p in (local.path, local.embeddings_path)
        if p
    ]
    for mine, theirs in zip(remote_files, filter(None, (local.path, local.embeddings_path)), strict=True):
        assert mine.read_bytes() == theirs.read_bytes(), mine.name
    shard_bytes = local.size_bytes()
    sent = server.sent[MODEL]
    # The bound: at most 1.1 x the shard's size plus the header.
    assert sent <= 1.1 * shard_bytes + manifest.header_size, (sent, shard_bytes)
    assert sent < 0.7 * model_path.stat().st_size
    print(f"\n[{layers}] fetched {sent} bytes for a {shard_bytes}-byte shard: {sent / shard_bytes:.3f}")
    # Nothing half-written remains, and a second run fetches nothing.
    assert not list((tmp_path / "shards").rglob("*.partial"))
    server.reset_counts()
    code, out = extract(server.url(MODEL), layers, tmp_path)
    assert code == 0 and "already complete" in out, out
    assert server.sent.get(MODEL, 0) == 0


def test_server_without_range_support_is_refused_at_once(server: RangeServer, tmp_path: Path) -> None:
    server.ranges = False
    code, out = extract(server.url(MODEL), "10:20", tmp_path)
    assert code == 1
    assert "ignores Range requests" in out and "needs a server that honours Range" in out
    # Not a whole-file download: the connection is dropped after the headers.
    assert server.sent.get(MODEL, 0) < 8 * 1024 * 1024
    assert shard_outputs(tmp_path) == []


def test_truncated_file_on_the_server(server: RangeServer, model_path: Path, tmp_path: Path) -> None:
    server.truncate_to = model_path.stat().st_size - 1000
    code, out = extract(server.url(MODEL), "20:30", tmp_path)
    assert code == 1
    assert "truncated or is another file" in out, out
    assert [p for p in shard_outputs(tmp_path) if p.suffix == ".gguf"] == []


def _tensor_offset(model_path: Path, node_cache: Path, name: str) -> int:
    m = local_manifest(model_path, node_cache)
    return m.tensor(name).offset + 1000


def test_a_wrong_byte_is_refused_and_fetched_again(
    server: RangeServer, model_path: Path, node_cache: Path, tmp_path: Path
) -> None:
    server.corrupt = {_tensor_offset(model_path, node_cache, "blk.12.ffn_down.weight"): 1}
    code, out = extract(server.url(MODEL), "10:20", tmp_path)
    assert code == 0, out
    assert "1 tensor(s) refused and fetched again" in out
    local = extract_shard(model_path, 10, 20, node_cache)
    mine = next(p for p in shard_outputs(tmp_path) if p.name == local.path.name)
    assert mine.read_bytes() == local.path.read_bytes()


def test_a_byte_that_stays_wrong_fails_clearly(
    server: RangeServer, model_path: Path, node_cache: Path, tmp_path: Path
) -> None:
    server.corrupt = {_tensor_offset(model_path, node_cache, "blk.12.ffn_down.weight"): 100}
    code, out = extract(server.url(MODEL), "10:20", tmp_path)
    assert code == 1
    assert "blk.12.ffn_down.weight" in out and "does not match the model's manifest" in out, out
    assert "nothing was published" in out
    assert [p for p in shard_outputs(tmp_path) if p.suffix == ".gguf"] == []


def test_a_dropped_connection_is_resumed(
    server: RangeServer, model_path: Path, node_cache: Path, tmp_path: Path
) -> None:
    server.drop_after = 5 * 1024 * 1024
    code, out = extract(server.url(MODEL), "10:20", tmp_path)
    assert code == 0, out
    local = extract_shard(model_path, 10, 20, node_cache)
    mine = next(p for p in shard_outputs(tmp_path) if p.name == local.path.name)
    assert mine.read_bytes() == local.path.read_bytes()
    assert len([r for r in server.requests if r[0] == MODEL and r[1]]) >= 3  # header, cut-off run, the rest


def test_no_manifest_for_a_url_is_a_clear_error(published: dict[str, Path], tmp_path: Path) -> None:
    with RangeServer({MODEL: published[MODEL]}) as bare:
        code, out = extract(bare.url(MODEL), "10:20", tmp_path)
        assert code == 1
        assert "no manifest for this model" in out and "--manifest" in out
        code, out = extract(
            bare.url(MODEL), "10:20", tmp_path, "--manifest", str(published[MODEL + ".manifest.json"])
        )
        assert code == 0, out


def test_a_forged_manifest_header_is_refused(
    published: dict[str, Path], model_path: Path, tmp_path: Path
) -> None:
    obj = Manifest.from_bytes(published[MODEL + ".manifest.json"].read_bytes()).to_json()
    obj["header"]["sha256"] = "0" * 64
    forged = tmp_path / "forged.json"
    import json

    forged.write_text(json.dumps(obj))
    with RangeServer({MODEL: model_path}) as bare:
        code, out = extract(bare.url(MODEL), "10:20", tmp_path / "c", "--manifest", str(forged))
    assert code == 1 and "header bytes do not match the manifest" in out, out


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A real small filesystem (tmpfs of ``request.param`` MiB, default 72) as the node's cache."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = f"size={getattr(request, 'param', 72)}m"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_not_enough_disk_is_refused_before_writing(server: RangeServer, small_disk: Path) -> None:
    # The last shard is about 54 MB: with the 64 MB margin it cannot fit in 72 MB.
    code, out = extract(server.url(MODEL), "20:30", small_disk)
    assert code == 1
    assert "not enough free disk" in out and "MB free" in out, out
    assert shard_outputs(small_disk) == []


@pytest.mark.parametrize("small_disk", [100], indirect=True)
def test_disk_filling_up_while_fetching(server: RangeServer, small_disk: Path) -> None:
    # The middle shard (22 MB) passes the check (22 + 67 < 104 MB); then something else fills the disk.
    filler = small_disk / "filler"

    def fill() -> None:
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * (1 << 20))
            except OSError:
                pass

    # The first range request is the header; fill once tensor data starts flowing.
    server.on_first_range = lambda: setattr(server, "on_first_range", fill)
    code, out = extract(server.url(MODEL), "10:20", small_disk)
    assert code == 1
    assert "the disk filled up" in out and "partial files were removed" in out, out
    assert [p for p in shard_outputs(small_disk) if "gguf" in p.name] == []


def test_a_killed_download_resumes(
    published: dict[str, Path], model_path: Path, node_cache: Path, tmp_path: Path
) -> None:
    local = extract_shard(model_path, 20, 30, node_cache)
    with RangeServer(published) as server:
        server.rate_bytes_per_s = 8 * 1024 * 1024
        cmd = [sys.executable, "-m", "node.cli", "shard", "extract", "--model", server.url(MODEL),
               "--layers", "20:30", "--cache-dir", str(tmp_path)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while server.sent.get(MODEL, 0) < 30 * 1024 * 1024 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        first = server.sent.get(MODEL, 0)
        assert first >= 30 * 1024 * 1024
        assert [p for p in shard_outputs(tmp_path) if p.suffix == ".gguf"] == []  # nothing published
        assert list((tmp_path / "shards").rglob("*.partial"))  # ... but the work so far is kept
        server.rate_bytes_per_s = 0
        server.reset_counts()
        code, out = extract(server.url(MODEL), "20:30", tmp_path)
        assert code == 0, out
        again = server.sent[MODEL]
    mine = next(p for p in shard_outputs(tmp_path) if p.name == local.path.name)
    assert mine.read_bytes() == local.path.read_bytes()
    # Resumed: the first run's state (saved every 16 MiB) kept at least 16 MiB of its 30 MB.
    assert again <= local.size_bytes() - 16 * 1024 * 1024
    print(f"\nkilled after {first} bytes; the resumed run fetched {again} bytes")
