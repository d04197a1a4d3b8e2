"""`kvtier serve`: an OpenAI-compatible server with sessions, tenants, KV tiers, a retention
policy and Prometheus metrics.

Module-level imports stay light (argparse only): the CLI imports every command to build its
parser, and `kvtier plan` must not pay for torch or FastAPI.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtier.engine.config import DTYPE_HELP, DTYPES
from kvtier.errors import KvtierError
from kvtier.workload.flags import add_hidden_alias

if TYPE_CHECKING:
    import uvicorn

    from kvtier.engine import Engine
    from kvtier.settings.load import Settings
    from kvtier.settings.server import ServerConfig

SETTINGS_TABLES = ("tiers", "scheduling", "policy", "compression", "server")


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.settings.flags import add_config_argument, add_table_arguments

    add_config_argument(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--model", default=None, help="local HF folder (default: embedded SmolLM2)")
    parser.add_argument(
        "--served-model-name", default=None, help="model id clients send ([server] model_name)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help=DTYPE_HELP,
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--prefault-kv-pool",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fault the KV pool's pages in on a background thread after start (default on: "
        "the first restores run at copy speed; the budget is resident at once)",
    )
    parser.add_argument(
        "--paged-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU decodes read K/V straight from the pool, no gather, C++ compiler needed "
        "(default on where it builds; --no-paged-decode: gather + SDPA; docs/engine.md)",
    )
    threads = parser.add_argument(
        "--threads", dest="num_threads", type=int, default=None, help="torch threads (default all)"
    )
    add_hidden_alias(parser, threads, "--num-threads")  # the spelling serve used before
    parser.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME:API_KEY[:QUOTA_BYTES]",
        help="a tenant (repeatable); none = one anonymous tenant, no key needed",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    for table in SETTINGS_TABLES:
        add_table_arguments(parser, table)


def settings_of(args: argparse.Namespace) -> Settings:
    """The effective settings (file, environment, flags), read once per run."""
    from kvtier.settings.flags import from_args

    # kept on the namespace: the server's and the engine's parts are built at different
    # moments, and a second read could differ (a key file created, the environment changed)
    cached = getattr(args, "_settings", None)
    if cached is None:
        cached = args._settings = from_args(args, SETTINGS_TABLES)
    return cached


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    from kvtier.settings.server import parse_tenant_flag

    config = settings_of(args).server
    for flag in args.tenant:
        tenant = parse_tenant_flag(flag)
        config.tenants[tenant.name] = tenant
    if args.served_model_name is not None:
        config.model_name = args.served_model_name
    config.__post_init__()  # re-validate with the command line's tenants
    return config


def uvicorn_config(
    app: Any, config: ServerConfig, sock: socket.socket, log_level: str = "info"
) -> uvicorn.Config:
    """How uvicorn serves the app on `sock`: the connection limits and timeouts of `config`."""
    import uvicorn

    from kvtier.server.connections import ConnectionLimits, guarded_protocol

    host, port = sock.getsockname()[:2]
    limits = ConnectionLimits(
        config.max_connections, config.address_connection_limit, config.header_timeout_s
    )
    return uvicorn.Config(
        app,
        host=host,  # only named in uvicorn's start-up line: it serves on `sock`
        port=port,
        log_level=log_level,
        lifespan="on",
        http=guarded_protocol(limits),
        ws="none",  # no WebSocket routes; an upgraded connection would leave the guard's count
        limit_concurrency=config.max_connections,
        timeout_keep_alive=config.keep_alive_timeout_s,
        timeout_graceful_shutdown=int(config.graceful_shutdown_s),
    )


def listen(host: str, port: int) -> socket.socket:
    """Bind the server's socket now, before the model loads: a taken port or a bad host is
    a one-line error, not a traceback after a minute of start-up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn does itself
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise KvtierError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    server_config = build_server_config(args)
    with listen(args.host, args.port) as sock:
        serve(args, server_config, sock)
    return 0


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine with its tiers and retention policy, from the config file and the flags:
    the one place `kvtier serve` builds it. Bad settings fail here, before the model loads."""
    from kvtier.cache.setup import CacheConfig
    from kvtier.cache.setup import build_engine as build_stack
    from kvtier.engine import EngineConfig

    settings = settings_of(args)
    engine_kwargs = {
        # the [compression] table: every request's pipeline ("auto" is refused: a server has
        # not observed its workload when it starts)
        "compression": settings.compression.build(),
        "model_dir": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "prefault_kv_pool": args.prefault_kv_pool,
        "paged_decode": args.paged_decode,
        "num_threads": args.num_threads,
        **settings.scheduling,
    }
    config = EngineConfig(**{k: v for k, v in engine_kwargs.items() if v is not None})
    cache = None
    if settings.tiers is not None:
        cache = CacheConfig(settings.tiers, settings.policy.name, settings.policy)
    for warning in settings.warnings():
        print(f"kvtier: warning: {warning}", file=sys.stderr, flush=True)
    return build_stack(config, cache)


def serve(args: argparse.Namespace, server_config: ServerConfig, sock: socket.socket) -> None:
    import logging

    import uvicorn

    from kvtier.server.app import create_app
    from kvtier.server.summary import startup_summary

    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")
    engine = build_engine(args)
    app = create_app(engine, server_config)
    server = uvicorn.Server(uvicorn_config(app, server_config, sock, args.log_level))
    with signals_held(server):
        try:
            host, port = sock.getsockname()[:2]
            address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            print(startup_summary(engine, server_config, address), file=sys.stderr, flush=True)
            server.run(sockets=[sock])
        finally:
            engine.close()


@contextlib.contextmanager
def signals_held(server: uvicorn.Server) -> Iterator[None]:
    """Hold SIGTERM and SIGINT until the block is done, then raise them again.

    uvicorn shuts down gracefully on either and then raises it again, which with the default
    handlers ends the process there: before the engine closes, and so before a persistent disk
    tier receives what memory holds (`tiers.shutdown_flush_s`). One that comes while uvicorn
    is not listening for it (starting, or stopped) stops `server` all the same; a second one
    ends the process at once, as it would have."""
    held: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def hold(sig: int, frame: object) -> None:
        if held:
            signal.signal(sig, previous[sig])
            signal.raise_signal(sig)
        held.append(sig)
        server.should_exit = True

    for sig in previous:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in held:
            signal.raise_signal(sig)
