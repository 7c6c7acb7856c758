"""A real S3-API server on loopback (moto in server mode) and a fault-injecting HTTP proxy to put in front of it."""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}


class MotoServer:
    """`python -m moto.server` on an ephemeral loopback port; stop() always kills it."""

    def __init__(self, log_path: Path, timeout_s: float = 60):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not (match := re.search(r"Running on http://127\.0\.0\.1:(\d+)", Path(log_path).read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto did not start:\n{Path(log_path).read_text()}")
            time.sleep(0.1)
        self.port = int(match.group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        while True:  # the port is printed just before it accepts: wait for a real answer
            try:
                urllib.request.urlopen(self.url + "/", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def s3_error(code: str, status: int) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected by the test '
            f"proxy</Message><RequestId>0</RequestId></Error>").encode()


class FaultProxy:
    """Forwards HTTP to `upstream`; `fault(method, path)` may answer "503", "403", "reset" (RST before any reply),
    "reset-body" (RST after half the body), "slow:<s>" (reply after s seconds), "corrupt" (flip the last byte of
    the request body on its way) or "corrupt-reply" (flip a byte of the reply's body). `gate(method, path)`, if
    given, returns a context manager held around the forwarding (outside the proxy's lock: it may wait for other
    requests). Every request is logged, with its headers in `headers_seen`."""

    def __init__(self, upstream_port: int, fault=lambda method, path: None, gate=None):
        self.fault, self.gate, self.upstream_port = fault, gate, upstream_port
        self.log: list[tuple[str, str, str]] = []
        self.headers_seen: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def relay(self):
                body = self._read_body()
                with proxy.lock:
                    action = proxy.fault(self.command, self.path)
                    proxy.log.append((self.command, self.path, action or "forward"))
                    proxy.headers_seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                if action in ("503", "403"):
                    code = {"503": "ServiceUnavailable", "403": "AccessDenied"}[action]
                    return self._reply(int(action), [("Content-Type", "application/xml")], s3_error(code, int(action)))
                if action == "reset":
                    return self._reset()
                if action and action.startswith("slow:"):
                    time.sleep(float(action[5:]))
                if action == "corrupt" and body:  # the bytes change on the way: only a read-back can tell
                    body = body[:-1] + bytes([body[-1] ^ 0x01])
                with proxy.gate(self.command, self.path) if proxy.gate else contextlib.nullcontext():
                    status, headers, data = self._forward(body)
                if action == "corrupt-reply" and data:
                    data = data[:-1] + bytes([data[-1] ^ 0x01])
                if action == "reset-body" and len(data) > 1:
                    self.send_response_only(status)
                    for name, value in headers:
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    return self._reset()
                self._reply(status, headers, data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self, body: bytes):
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                keep = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP | {"content-length"}]
                if self.command == "HEAD":  # no body, but the object's length is the answer
                    keep.append(("Content-Length", resp.getheader("Content-Length", "0")))
                return resp.status, keep, data

            def _reply(self, status: int, headers, data: bytes):
                self.send_response_only(status)
                for name, value in headers:
                    self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _reset(self):
                self.wfile.flush()
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def requests(self, method: str | None = None) -> list[tuple[str, str, str]]:
        with self.lock:
            return [r for r in self.log if method is None or r[0] == method]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
