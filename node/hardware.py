"""What this machine has: CPU cores, RAM, GPUs, llama.cpp backends, free disk (best effort).

GPUs are found through the vendors' tools when they are installed
(``nvidia-smi``, ``rocm-smi``), else through llama.cpp's own device list;
none of it is required. The backends list ``cpu`` always, and the GPU backend
(``cuda``, ``vulkan``, ``metal`` ...) plus ``gpu-offload`` only when this node
actually offloads layers of its shard (a build that could offload but does
not says nothing about it). Nothing here fails the node: a probe that cannot
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


def llama_backends(offloading: str | None = None) -> list[str]:
    """``cpu``, plus the GPU backend and ``gpu-offload`` when ``offloading`` names the backend in use."""
    backends = ["cpu"]
    if offloading:
        backends += [offloading.split("+")[0][:64], "gpu-offload"]
    try:
        import llama_cpp

        if llama_cpp.llama_supports_rpc():
            backends.append("rpc")
    except Exception as err:  # a broken build must not stop the probe
        log.warning("llama.cpp backend probe failed: %s", err)
    return backends


def llama_gpus() -> list[Gpu]:
    try:
        from node.llama_runtime import offload_devices

        return [Gpu((d.description or d.name)[:200], d.total_bytes) for d in offload_devices()]
    except Exception as err:  # a broken build must not stop the probe
        log.warning("llama.cpp device probe failed: %s", err)
        return []


def probe(disk_path: Path, offloading: str | None = None) -> Hardware:
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
        gpus=tuple(nvidia_gpus() + rocm_gpus() or llama_gpus()),
        backends=tuple(llama_backends(offloading)),
        free_disk_bytes=free,
    )
