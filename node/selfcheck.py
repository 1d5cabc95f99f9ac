"""Check that the installed llama.cpp runs on this CPU: ``python -m node.selfcheck``.

Runs one decode of the bundled test model in a child process, so an illegal
instruction (a llama.cpp build for a newer CPU) becomes a clear message
instead of a crash in the middle of a node.
"""

from __future__ import annotations

import signal
import subprocess
import sys

_CHILD = """
import numpy as np
from node.testmodel import test_model_path
from node.llama_runtime import ContextSettings, llama_build_info
from node.reference import ReferenceModel
settings = ContextSettings(n_seq_max=1, n_ctx=256, n_batch=64, n_ubatch=64)
with ReferenceModel(test_model_path(), settings) as ref:
    logits = ref.prefill([1, 2, 3])
    assert np.isfinite(logits).all()
from node.llama_runtime import offload_devices
devices = [f"{d.name} ({d.description}, {d.free_bytes // 2**20} MiB free)" for d in offload_devices()]
print("GPU offload: " + (", ".join(devices) or "none (a CPU build, or no device)"))
print(llama_build_info())
"""


def main() -> int:
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        lines = proc.stdout.strip().splitlines()
        print("llama.cpp self-check passed:", lines[-1])
        print(lines[-2])
        return 0
    if proc.returncode == -signal.SIGILL:
        print(
            "llama.cpp self-check FAILED: the installed llama-cpp-python uses CPU instructions this machine "
            "cannot execute (SIGILL). Rebuild it for this CPU, for example:\n"
            "  pip cache remove llama_cpp_python\n"
            "  CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON' "
            "pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36",
            file=sys.stderr,
        )
    else:
        print(
            f"llama.cpp self-check FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
