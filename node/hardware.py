"""What this machine has: CPU cores, RAM, GPUs, llama.cpp backends, free disk (best effort).

GPUs are found through the vendors' tools when they are installed
(``nvidia-smi``, ``rocm-smi``); none of it is required. The llama.cpp
backends come from the loaded library (``cpu`` always; ``gpu-offload`` when the
build can offload layers). Nothing here fails the node: a probe that cannot
run reports nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from proto.announce import Gpu, Hardware

log = logging.getLogger("swarm.node.hardware")


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def nvidia_gpus() -> list[Gpu]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    gpus = []
    for line in out.splitlines():
        name, _, mem = line.rpartition(",")
        try:
            gpus.append(Gpu(name.strip()[:200] or "nvidia", int(float(mem.strip())) * 1024 * 1024))
        except ValueError:
            continue
    return gpus


def rocm_gpus() -> list[Gpu]:
    if shutil.which("rocm-smi") is None:
        return []
    out = _run(["rocm-smi", "--showmeminfo", "vram", "--csv"])
    gpus = []
    for line in out.splitlines()[1:]:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].isdigit():
            gpus.append(Gpu(f"amd {parts[0]}"[:200], int(parts[1])))
    return gpus


def llama_backends() -> list[str]:
    backends = ["cpu"]
    try:
        import llama_cpp

        if llama_cpp.llama_supports_gpu_offload():
            backends.append("gpu-offload")
        if llama_cpp.llama_supports_rpc():
            backends.append("rpc")
    except Exception as err:  # a broken build must not stop the probe
        log.warning("llama.cpp backend probe failed: %s", err)
    return backends


def probe(disk_path: Path) -> Hardware:
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        ram = int(psutil.virtual_memory().total)
    except Exception:  # pragma: no cover - psutil is a declared dependency
        cores, ram = os.cpu_count() or 1, 0
    try:
        disk_path.mkdir(parents=True, exist_ok=True)
        free = int(shutil.disk_usage(disk_path).free)
    except OSError:
        free = 0
    return Hardware(
        cpu_cores=max(1, int(cores)),
        ram_bytes=ram,
        gpus=tuple(nvidia_gpus() + rocm_gpus()),
        backends=tuple(llama_backends()),
        free_disk_bytes=free,
    )
