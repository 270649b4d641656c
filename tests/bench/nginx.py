"""nginx as a reverse proxy to the bench's tool, when nginx is installed: the yardstick for
what a proxy written in C costs. One worker process (the gateway has one event loop), upstream
keep-alive, no access log, the request body buffered as the gateway does."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CONFIG = """\
{user}
worker_processes 1;
daemon off;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    keepalive_requests 1000000;
    upstream tool {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port} reuseport;
        location / {{
            proxy_pass http://tool;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


def binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def nginx(root: Path, upstream_port: int) -> Iterator[str | None]:
    """nginx proxying to the tool; yields its URL, or None when nginx is not installed."""
    path = binary()
    if path is None:
        yield None
        return
    root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    user = "user root;" if os.geteuid() == 0 else ""
    config = root / "nginx.conf"
    config.write_text(CONFIG.format(user=user, root=root, port=port, upstream_port=upstream_port))
    proc = subprocess.Popen([path, "-p", str(root), "-c", str(config)])
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {(root / 'error.log').read_text()}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()
