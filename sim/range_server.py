"""A static file server on loopback for fetch tests and benchmarks: Range or not, misbehaving on request.

It serves files from a mapping ``url path -> local file`` and counts every body
byte it sends per path. Misbehaviours, all off by default: ``ranges=False``
(answers 200 with the whole file, as ``python -m http.server`` does),
``truncate_to`` (serves the file as if it were that long), ``corrupt``
(``{offset: n}``: the byte at that offset of the model is flipped in the first
``n`` answers that cover it), ``rate_bytes_per_s`` (throttle), ``drop_after``
(the first answer is cut off after that many bytes) and ``on_first_range``
(a callback run once, before the first range answer's body).

A test and benchmark tool (tests/node/test_fetch.py, sim/bench_join.py), so it
may use threads (the product may not): one per connection, for the life of the
``with`` block.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
CHUNK = 64 * 1024


class RangeServer:
    def __init__(self, files: dict[str, Path]) -> None:
        self.files = dict(files)
        self.ranges = True
        self.truncate_to: int | None = None
        self.corrupt: dict[int, int] = {}
        self.rate_bytes_per_s = 0.0
        self.drop_after: int | None = None
        self.on_first_range: Callable[[], None] | None = None
        self.sent: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                server._serve(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> RangeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reset_counts(self) -> None:
        with self._lock:
            self.sent.clear()
            self.requests.clear()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        with self._lock:
            self.requests.append((path, h.headers.get("Range", "")))
        local = self.files.get(path)
        if local is None:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        size = local.stat().st_size
        if self.truncate_to is not None and path.endswith(".gguf"):
            size = min(size, self.truncate_to)
        want = _RANGE.match(h.headers.get("Range", "")) if self.ranges else None
        if want is None:
            start, end, status = 0, size - 1, 200
        else:
            start = int(want.group(1))
            end = int(want.group(2)) if want.group(2) else size - 1
            if start >= size:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{size}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            end = min(end, size - 1)
            status = 206
        h.send_response(status)
        h.send_header("Content-Length", str(end - start + 1))
        h.send_header("Accept-Ranges", "bytes" if self.ranges else "none")
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            hook, self.on_first_range = self.on_first_range, None
            if hook is not None:
                hook()
        h.end_headers()
        drop, self.drop_after = (self.drop_after, None) if status == 206 else (None, self.drop_after)
        t0 = time.monotonic()
        sent = 0
        with open(local, "rb") as fh:
            pos = start
            while pos <= end:
                n = min(CHUNK, end - pos + 1)
                fh.seek(pos)
                data = bytearray(fh.read(n))
                for off, times in list(self.corrupt.items()):
                    if pos <= off < pos + n and times > 0 and path.endswith(".gguf"):
                        data[off - pos] ^= 0xFF
                        with self._lock:
                            self.corrupt[off] = times - 1
                if drop is not None and sent + len(data) > drop:
                    data = data[: max(0, drop - sent)]
                try:
                    h.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(data)
                with self._lock:
                    self.sent[path] = self.sent.get(path, 0) + len(data)
                if drop is not None and sent >= drop:
                    h.close_connection = True
                    h.wfile.flush()
                    h.connection.shutdown(2)
                    return
                pos += n
                if self.rate_bytes_per_s > 0:
                    ahead = sent / self.rate_bytes_per_s - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
