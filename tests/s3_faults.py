"""A fault-injecting HTTP proxy for an S3 API server on loopback (the moto server of
tests/test_s3.py): what a real object store does under load.

Each request is forwarded to the server, or answered with a fault drawn from a seeded
generator keyed by (method, path, query, how many times that request was seen), so a run meets
the same faults whatever the order of its concurrent requests:
- `slowdown`: 503 with S3's `SlowDown` XML error body (not forwarded);
- `delay`: no answer for `delay_s` (longer than the client's read timeout), then the connection
  is closed (not forwarded, so a late copy never overwrites a newer write);
- `cut`: GET only: forwarded, then the response is cut halfway through its body.
A request is faulted at most `max_faults_per_request` times, so a client that retries succeeds.
`cut_when(method, query)` drops the connection of every matching request before it is
forwarded (an upload cut midway).
"""

from __future__ import annotations

import contextlib
import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>FAULT</RequestId><HostId>FAULT</HostId></Error>"
)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class FaultProxy:
    """A threaded proxy on 127.0.0.1 in front of `upstream` (`http://host:port`)."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        slowdown: float = 0.0,
        delay: float = 0.0,
        cut: float = 0.0,
        delay_s: float = 3.0,
        max_faults_per_request: int = 2,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.seed, self.delay_s, self.max_faults = seed, delay_s, max_faults_per_request
        self.rates = {"slowdown": slowdown, "delay": delay, "cut": cut}
        self.cut_when = None  # (method, query) -> bool: drop before forwarding
        self.counts: dict[str, int] = {"slowdown": 0, "delay": 0, "cut": 0, "dropped": 0}
        self._seen: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _fault(self, method: str, target: str) -> str | None:
        with self._lock:
            key = (method, target)
            seen = self._seen.get(key, 0)
            self._seen[key] = seen + 1
        if seen >= self.max_faults:
            return None
        draw = random.Random(f"{self.seed}:{method}:{target}:{seen}").random()
        for name, rate in self.rates.items():
            if name == "cut" and method != "GET":
                continue
            if draw < rate:
                with self._lock:
                    self.counts[name] += 1
                return name
            draw -= rate
        return None

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            break
                        chunks.append(chunk)
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _drop(self) -> None:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(2)

            def _handle(self) -> None:
                body = self._body()
                query = urlsplit(self.path).query
                if proxy.cut_when is not None and proxy.cut_when(self.command, query):
                    with proxy._lock:
                        proxy.counts["dropped"] += 1
                    return self._drop()
                fault = proxy._fault(self.command, self.path)
                if fault == "slowdown":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN_BODY)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN_BODY)
                    return
                if fault == "delay":
                    time.sleep(proxy.delay_s)
                    return self._drop()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    status, reason, got = response.status, response.reason, response.getheaders()
                finally:
                    upstream.close()
                self.send_response(status, reason)
                for name, value in got:
                    if name.lower() not in HOP_HEADERS | {"content-length"}:
                        self.send_header(name, value)
                length = dict((k.lower(), v) for k, v in got).get("content-length")
                if self.command == "HEAD":  # the object's size, no body
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if fault == "cut" and len(payload) > 1:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    return self._drop()
                self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler
