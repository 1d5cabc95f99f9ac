"""What this machine has: CPU cores, RAM, GPUs, llama.cpp backends, free disk (best effort).

GPUs are found through the vendors' tools when they are installed
(``nvidia-smi``, ``rocm-smi``), else through llama.cpp's own device list;
none of it is required. The free device memory the KV pool is sized by
(:func:`offload_rooms`) comes from llama.cpp's device API
(``ggml_backend_dev_memory``), falling back to ``nvidia-smi``'s
``memory.free`` for a CUDA device llama.cpp reports no memory of. The
backends list ``cpu`` always, and the GPU backend
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from node.capacity import DeviceRoom
from proto.announce import Gpu, Hardware

if TYPE_CHECKING:
    from node.llama_runtime import Device

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


def nvidia_free_bytes() -> list[int]:
    """Free memory of each NVIDIA GPU, in ``nvidia-smi``'s order; [] without the tool."""
    if shutil.which("nvidia-smi") is None:
        return []
    found = []
    for line in _run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"]).splitlines():
        try:
            found.append(int(float(line.strip())) * 1024 * 1024)
        except ValueError:
            continue
    return found


def llama_offload_targets(devices: Sequence[Device]) -> list[Device]:
    """Of ggml's devices, those llama.cpp spreads offloaded layers over by default: the dedicated
    GPUs, or the integrated ones where there is no dedicated GPU."""
    gpus = [d for d in devices if d.kind == "gpu"]
    return gpus or [d for d in devices if d.kind == "igpu"]


def offload_rooms(
    devices: Sequence[Device], vendor_free: Callable[[], list[int]] = nvidia_free_bytes
) -> list[DeviceRoom]:
    """The free memory of each device llama.cpp offloads to (llama.cpp's own figure), in its order;
    a CUDA device it reports no memory of takes ``nvidia-smi``'s figure for the same index among
    the CUDA devices (best effort: CUDA's device order may differ from ``nvidia-smi``'s), else 0."""
    rooms, cuda_index, vendor = [], 0, None
    for d in llama_offload_targets(devices):
        free = d.free_bytes
        if d.backend == "cuda":
            if free <= 0:
                vendor = vendor_free() if vendor is None else vendor
                free = vendor[cuda_index] if cuda_index < len(vendor) else 0
            cuda_index += 1
        rooms.append(DeviceRoom(f"{d.name} ({d.description})" if d.description else d.name, max(0, free)))
    return rooms


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
