"""Bind and serve the twin of a config over HTTP (uvicorn) until SIGINT/SIGTERM."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from domain.config import ServingConfig
from domain.twin.startup import start
from twin_http.service import TwinService

READY_LINE = "The server is fired up and ready to roll!"


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _write_port(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n", encoding="utf-8")
    tmp.replace(path)


def serve(config: ServingConfig, host: str = "127.0.0.1", port: int = 0,
          port_file: Path | None = None, speedup: float = 1.0, record: bool = False) -> int:
    """Start the twin of ``config`` and serve it until SIGINT/SIGTERM; returns the exit code.

    Prints the twin startup's log (the engine's lines) to stdout. A config the engine refuses
    returns the engine's exit code after its error line, without binding.

    Raises:
        OSError: the address cannot be bound.
        ValueError: a non-positive speedup.
    """
    import uvicorn

    boot = start(config)
    lines = [x for x in boot.log if x != READY_LINE]
    for line in lines:
        print(line, flush=True)
    if not boot.ready or boot.fit is None:
        return boot.exit_code or 1
    service = TwinService(config, boot.fit, speedup, record=record)
    sock = bind(host, port)
    bound = sock.getsockname()[1]

    def ready() -> None:
        if port_file is not None:
            _write_port(port_file, bound)
        shown = f"[{host}]" if ":" in host else host
        args = config.router_args([])
        flags = [] if args is None else args[args.index("--policy") + 2:]
        routed = ("" if config.replicas < 2 else
                  " behind a Kubernetes Service (a random replica per connection)" if args is None
                  else f" behind the {config.router_policy} router"
                  + (f" ({' '.join(flags)})" if flags else ""))
        print(f"twin: {config.replicas} replica(s) of config {config.config_id()}{routed} at "
              f"http://{shown}:{bound}, speedup {speedup:g}x", flush=True)
        print(READY_LINE, flush=True)

    server = uvicorn.Server(uvicorn.Config(
        service.app(ready), log_level="warning", access_log=False,
        timeout_graceful_shutdown=1, lifespan="on"))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1
