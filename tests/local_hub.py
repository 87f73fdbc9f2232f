"""A local stand-in for the Hugging Face Hub, reached through HF_ENDPOINT: nothing leaves the machine.

It answers `/{repo}/resolve/{revision}/{file}` (HEAD and GET, with Range) with the headers
huggingface_hub reads (X-Repo-Commit, ETag, Content-Length), and the Hub's error codes for a missing or
gated repository. A repo may also be set to cut its download midway or to serve different bytes.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_ROUTE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")


@dataclass
class HubRepo:
    revision: str
    files: dict[str, Path]
    mode: str = "ok"  # "ok", "gated", "cut" (stops after half the bytes) or "corrupt" (one byte changed)


@dataclass
class LocalHub:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)  # "METHOD path" of every request, in order

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append(f"{handler.command} {handler.path}")
        match = _ROUTE.match(handler.path.split("?")[0])
        repo = self.repos.get(match["repo"]) if match else None
        if repo is None:
            return _error(handler, 404, "RepoNotFound", "Repository not found")
        if repo.mode == "gated":
            return _error(handler, 403, "GatedRepo", "Access to this repository is restricted")
        if match["revision"] not in (repo.revision, "main") or match["file"] not in repo.files:
            return _error(handler, 404, "EntryNotFound", "Entry not found")
        data = repo.files[match["file"]].read_bytes()
        if repo.mode == "corrupt":
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start, status = 0, 200
        if ranged := re.match(r"bytes=(\d+)-", handler.headers.get("Range", "")):
            start, status = int(ranged[1]), 206
        handler.send_response(status)
        handler.send_header("X-Repo-Commit", repo.revision)
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("Content-Length", str(len(data) - start))
        handler.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if body:
            part = data[start:]
            if repo.mode == "cut":
                part = part[:len(part) // 2]
            try:
                handler.wfile.write(part)
            except (BrokenPipeError, ConnectionResetError):
                pass
            if repo.mode == "cut":
                handler.close_connection = True


def _error(handler: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    data = f'{{"error": "{message}"}}'.encode()
    handler.send_response(status)
    handler.send_header("X-Error-Code", code)
    handler.send_header("X-Error-Message", message)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)
