"""One concurrency idiom per process: threads and runtime crossings only where a foreign runtime forces them.

Every service runs everything it does in one trio thread. The exceptions are
listed in :data:`ALLOWED`, each with its reason (docs/concurrency.md has the
same list). Two checks keep it so:

- statically, an AST scan of the product packages finds every use of a
  thread or another runtime (``threading``, ``concurrent.futures``,
  ``asyncio``, ``trio_asyncio``, ``multiprocessing``, ``trio.to_thread``,
  ``trio.from_thread``, ``run_sync_soon``, ``call_soon_threadsafe``,
  ``run_coroutine_threadsafe``, ``start_guest_run``) and fails on any that is
  not allowed for its module -- and on an allowance no longer used;
- at run time, a real tracker, two real nodes and a gateway serve a streamed
  chat completion and stop, with ``threading.Thread.start`` recording the
  stack of every thread started (through a ``sitecustomize`` put on their
  ``PYTHONPATH``); each thread must come from an allowed module, or from
  grpcio itself (its completion-queue poller).
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import httpx
import pytest

from sim.procs import Supervisor, wait_http

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "node", "tracker", "gateway", "proto")

ALLOWED: dict[str, dict[str, str]] = {
    "common.grpc_adapter": {
        "asyncio": "the grpcio adapter: grpc.aio runs on trio-asyncio's loop inside the trio thread",
        "trio_asyncio": "the grpcio adapter (the same)",
    },
    "common.files": {"trio.to_thread": "blocking file I/O (port files, atomic writes, reads)"},
    "node.scheduler": {"trio.to_thread": "llama.cpp compute: the engine's one thread, limiter of one"},
    "node.daemon": {
        "trio.to_thread": "llama.cpp start-up, start-up benchmark and close; the hardware probe; shard "
        "extraction (reads and hashes the model file)"
    },
    "node.kvsparse": {
        "threading": "sparse KV streams: one short-lived thread drops the KV buffer's pages while "
        "llama.cpp clears it at context creation (no trio, no llama.cpp call in it)"
    },
    "node.draft_model": {
        "threading": "llama.cpp compute of the draft model: its one drafting thread (bounded queue, the only "
        "user of the draft context), so drafting runs beside the event loop"
    },
    "tracker.gatekeeper": {"trio.to_thread": "the database driver (SQLAlchemy is blocking)"},
    "tracker.service": {"trio.to_thread": "route search and snapshot builds (CPU work off the event loop)"},
    "tracker.server": {"trio.to_thread": "opening and closing the database"},
    "common.discovery": {
        "asyncio": "zeroconf speaks asyncio: a private loop",
        "threading": "zeroconf: the private loop's one thread",
        "trio.to_thread": "zeroconf: blocking calls into that loop",
        "call_soon_threadsafe": "zeroconf: stopping the private loop from the calling thread",
        "run_coroutine_threadsafe": "zeroconf: running a call on the private loop",
    },
    "gateway.vocab_store": {"trio.to_thread": "llama.cpp vocabularies: loading and tokenizing"},
    "gateway.template_sandbox": {
        "trio.to_thread": "chat templates: starting a worker process, and the blocking pipe to it"
    },
}

_MODULES = {"threading", "_thread", "concurrent", "concurrent.futures", "asyncio", "trio_asyncio"}
_MODULES |= {"multiprocessing"}
_ATTRIBUTES = {"run_sync_soon", "call_soon_threadsafe", "run_coroutine_threadsafe", "start_guest_run"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def uses(source: str) -> set[str]:
    """The thread and runtime constructs ``source`` uses (the keys of :data:`ALLOWED`'s entries)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name if alias.name in _MODULES else alias.name.split(".")[0]
                if top in _MODULES:
                    found.add("concurrent.futures" if top == "concurrent" else top)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if node.module in _MODULES or top in _MODULES:
                found.add("concurrent.futures" if top == "concurrent" else top)
            if node.module == "trio":
                found |= {f"trio.{a.name}" for a in node.names if a.name in ("to_thread", "from_thread")}
            if node.module.startswith("trio.lowlevel"):
                found |= {a.name for a in node.names if a.name in _ATTRIBUTES}
        elif isinstance(node, ast.Attribute):
            if node.attr in ("to_thread", "from_thread") and isinstance(node.value, ast.Name):
                if node.value.id == "trio":
                    found.add(f"trio.{node.attr}")
            if node.attr in _ATTRIBUTES:
                found.add(node.attr)
    return found


def product_modules() -> dict[str, set[str]]:
    out = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found = uses(path.read_text())
            if found:
                out[_module_name(path)] = found
    return out


def test_the_scan_sees_every_construct() -> None:
    source = textwrap.dedent(
        """
        import threading, asyncio as aio
        from concurrent.futures import ThreadPoolExecutor
        import trio_asyncio
        from multiprocessing import Process
        import trio
        from trio import from_thread
        async def f(token, loop):
            await trio.to_thread.run_sync(print)
            token.run_sync_soon(print)
            loop.call_soon_threadsafe(print)
            trio.lowlevel.start_guest_run(f)
        """
    )
    assert uses(source) == {
        "threading",
        "asyncio",
        "concurrent.futures",
        "trio_asyncio",
        "multiprocessing",
        "trio.from_thread",
        "trio.to_thread",
        "run_sync_soon",
        "call_soon_threadsafe",
        "start_guest_run",
    }
    assert uses("import trio\nasync def f():\n    await trio.sleep(0)\n") == set()


def test_threads_and_runtime_crossings_only_where_allowed() -> None:
    found = product_modules()
    unexpected = {
        module: sorted(kinds - set(ALLOWED.get(module, {})))
        for module, kinds in found.items()
        if kinds - set(ALLOWED.get(module, {}))
    }
    assert unexpected == {}, (
        "threads or other runtimes outside the allowed adapters (add a reason to ALLOWED in "
        f"tests/common/test_threads.py and docs/concurrency.md only for a foreign runtime): {unexpected}"
    )
    stale = {
        module: sorted(set(kinds) - found.get(module, set()))
        for module, kinds in ALLOWED.items()
        if set(kinds) - found.get(module, set())
    }
    assert stale == {}, f"allowances no module uses any more (remove them): {stale}"


# ------------------------------------------------------------------------- at run time

HOOK = """
\"\"\"Test hook (tests/common/test_threads.py): record the stack of every threading.Thread.start and
of every trio.to_thread.run_sync call (a thread cache reuses threads, so starts alone miss users).\"\"\"
import json, os, sys, threading

import trio

_out = os.environ["SWARM_THREAD_LOG_DIR"]


def _record(kind, name):
    stack = []
    frame = sys._getframe(2)
    while frame is not None:
        stack.append(frame.f_globals.get("__name__", "?") + ":" + frame.f_code.co_name)
        frame = frame.f_back
    entry = {"kind": kind, "pid": os.getpid(), "argv": sys.argv[:2], "name": name, "stack": stack}
    with open(os.path.join(_out, "threads-%d.jsonl" % os.getpid()), "a") as fh:
        fh.write(json.dumps(entry) + "\\n")


_start = threading.Thread.start


def _recording_start(self, *args, **kwargs):
    _record("thread", self.name)
    return _start(self, *args, **kwargs)


_run_sync = trio.to_thread.run_sync


async def _recording_run_sync(sync_fn, *args, **kwargs):
    _record("to_thread", getattr(sync_fn, "__qualname__", repr(sync_fn)))
    return await _run_sync(sync_fn, *args, **kwargs)


threading.Thread.start = _recording_start
trio.to_thread.run_sync = _recording_run_sync
"""

# Frames that only hand a thread start on (the creator is further out).
_MACHINERY = ("threading", "concurrent.futures", "trio._core._thread_cache", "trio._threads", "contextlib")


def classify(stack: list[str]) -> tuple[str, str]:
    """``(starter, project_module)``: the innermost frame outside the thread machinery, and the
    innermost frame in one of this project's packages ("" if none)."""
    modules = [entry.split(":")[0] for entry in stack]
    starter = next((m for m in modules if not m.startswith(_MACHINERY)), "?")
    project = next((m for m in modules if m.split(".")[0] in PRODUCT), "")
    return starter, project


def allowed_start(stack: list[str]) -> bool:
    starter, project = classify(stack)
    if starter.split(".")[0] == "grpc":
        return True  # grpcio's own threads (its completion-queue poller)
    if starter.startswith("trio._socket"):
        return True  # getaddrinfo in trio's worker thread (DNS)
    return project in ALLOWED and any(
        kind in ALLOWED[project] for kind in ("trio.to_thread", "threading", "trio_asyncio")
    )


@pytest.mark.slow
def test_a_real_swarm_starts_threads_only_where_allowed(
    tmp_path: Path, model_path: Path, node_cache: Path
) -> None:
    hook_dir, log_dir = tmp_path / "hook", tmp_path / "threads"
    hook_dir.mkdir()
    log_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = {"PYTHONPATH": str(hook_dir), "SWARM_THREAD_LOG_DIR": str(log_dir)}
    with Supervisor(tmp_path / "swarm") as sup:
        tracker = sup.start_tracker(env=env).ready(60)
        nodes = [
            sup.start_node(
                name,
                model=model_path,
                layers=layers,
                tracker_url=tracker.url,
                max_sessions=2,
                session_kv_tokens=512,
                cache_dir=node_cache,
                env=env,
            )
            for name, layers in (("a", "0:15"), ("b", "15:30"))
        ]
        for node in nodes:
            node.ready(120)
        gateway = sup.start_gateway(tracker_url=tracker.url, env=env).ready(60)
        listed = wait_http(gateway, f"{gateway.url}/v1/models", 120, ok=lambda r: bool(r.json()["data"]))
        model = listed.json()["data"][0]["id"]
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Name a color."}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            }
            with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                assert any(line.startswith("data: [DONE]") for line in reply.iter_lines())
        codes = {svc.name: svc.stop() for svc in (gateway, *nodes, tracker)}
        assert codes == {"gateway": 0, "a": 0, "b": 0, "tracker": 0}
    lines = [line for f in sorted(log_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]
    records = [json.loads(line) for line in lines]
    assert len({r["pid"] for r in records}) >= 4, "the hook saw too few processes (is it installed?)"
    threads = [r for r in records if r["kind"] == "thread"]
    bad = [(r["argv"], r["name"], r["stack"][:12]) for r in threads if not allowed_start(r["stack"])]
    assert bad == [], json.dumps(bad, indent=1)
    calls = [r for r in records if r["kind"] == "to_thread"]
    callers = {classify(r["stack"])[1] for r in calls}
    not_allowed = sorted(c for c in callers if "trio.to_thread" not in ALLOWED.get(c, {}))
    assert not_allowed == [], [
        (r["name"], r["stack"][:8]) for r in calls if classify(r["stack"])[1] in not_allowed
    ]
    # The hook sees the allowed users at work: compute, tokenizing, the database, port files.
    assert {"node.scheduler", "gateway.vocab_store", "tracker.gatekeeper", "common.files"} <= callers, callers
