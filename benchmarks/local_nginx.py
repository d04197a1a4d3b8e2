"""nginx in front of `kvtier serve` replicas with the shipped configuration
(deploy/nginx/kvtier.conf), its ports swapped for the caller's, inside a minimal nginx.conf
that keeps every file nginx writes in one folder. Shared by the replica tests and the
benchmarks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def nginx_config(directory: Path, replicas: list[str], port: int) -> Path:
    """nginx.conf in `directory` routing 127.0.0.1:`port` to `replicas` (host:port each)."""
    shipped = (REPO / "deploy/nginx/kvtier.conf").read_text()
    ours = {
        "server 127.0.0.1:8001 ": f"server {replicas[0]} ",
        "server 127.0.0.1:8002 ": f"server {replicas[1]} ",
        "listen 127.0.0.1:8000;": f"listen 127.0.0.1:{port};",
    }
    for theirs, mine in ours.items():
        assert shipped.count(theirs) == 1, theirs
        shipped = shipped.replace(theirs, mine)
    (directory / "kvtier.conf").write_text(shipped)
    temp = " ".join(
        f"{kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = directory / "nginx.conf"
    main.write_text(
        f"daemon off; worker_processes 1; pid {directory / 'nginx.pid'};\n"
        f"error_log {directory / 'error.log'} warn;\n"
        "events { worker_connections 64; }\n"
        f"http {{ access_log off; {temp} include {directory / 'kvtier.conf'}; }}\n"
    )
    return main


def start_nginx(directory: Path, replicas: list[str], port: int) -> subprocess.Popen:
    """nginx (found on PATH) serving on `port` once it accepts connections."""
    directory.mkdir(parents=True, exist_ok=True)
    config = nginx_config(directory, replicas, port)
    nginx = shutil.which("nginx") or "nginx"
    command = [nginx, "-p", str(directory), "-c", str(config), "-e", str(directory / "e.log")]
    process = subprocess.Popen(command, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError((directory / "error.log").read_text()) from None
            time.sleep(0.05)
