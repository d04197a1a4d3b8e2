"""`kvtier serve`: an OpenAI-compatible server with sessions, tenants, KV tiers, a retention
policy and Prometheus metrics.

Module-level imports stay light (argparse only): the CLI imports every command to build its
parser, and `kvtier plan` must not pay for torch or FastAPI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError
from kvtier.workload.flags import add_hidden_alias

if TYPE_CHECKING:
    import uvicorn

    from kvtier.engine import Engine
    from kvtier.server.config import ServerConfig

CONFIG_ENV = "KVTIER_CONFIG"  # as kvtier.policy.config: the file when no --config is given
DEFAULT_CONFIG = "kvtier.toml"


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
    parser.add_argument(
        "--config",
        default=None,
        help="kvtier.toml: [server], [tiers], [policy], [compression] tables "
        f"(default: ${CONFIG_ENV}, else ./{DEFAULT_CONFIG} when present)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--model", default=None, help="local HF folder (default: embedded SmolLM2)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="device KV pool budget")
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
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
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
        "--admin-key", default=None, help="bearer key of /admin (default: loopback clients only)"
    )
    parser.add_argument(
        "--metrics-key", default=None, help="bearer key of /metrics (default: loopback only)"
    )
    parser.add_argument("--max-concurrent-requests", type=int, default=None)
    parser.add_argument(
        "--max-concurrent-requests-per-tenant",
        type=int,
        default=None,
        help="generation requests one tenant may have in flight before 429 (default: half of "
        "--max-concurrent-requests with two or more tenants, else all of it)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longer prompts: 400 (default: the model context less one output token)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=None)
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--graceful-shutdown-s", type=float, default=None)
    parser.add_argument(
        "--body-timeout-s", type=float, default=None, help="408 for a body not in by then (10)"
    )
    parser.add_argument(
        "--max-connections", type=int, default=None, help="open connections before 503 (512)"
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=int,
        default=None,
        help="open connections one client address may hold (default: a quarter of "
        "--max-connections)",
    )
    parser.add_argument(
        "--keep-alive-timeout-s", type=int, default=None, help="idle keep-alive close (5)"
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=None,
        help="close a connection whose request line and headers are not in by then (10)",
    )
    parser.add_argument(
        "--api-docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve /docs, /redoc and /openapi.json (default off)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    from kvtier.server.tier_flags import add_tier_arguments

    add_tier_arguments(parser)
    policy = parser.add_argument_group("retention policy (the [policy] table)")
    policy.add_argument(
        "--policy",
        metavar="NAME",
        help="cost (default), retain, recompute, offload, ttl, a plugin or module:Class",
    )
    policy.add_argument(
        "--policy-set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="set a [policy] key, e.g. interval_s=2 (repeatable)",
    )


def config_path(args: argparse.Namespace) -> str | None:
    """The config file: --config, else $KVTIER_CONFIG, else ./kvtier.toml when present."""
    path = args.config or os.environ.get(CONFIG_ENV)
    if path is None and Path(DEFAULT_CONFIG).is_file():
        path = DEFAULT_CONFIG
    return path


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    from kvtier.server.config import ServerConfig, parse_tenant_flag

    path = config_path(args)
    config = ServerConfig.from_toml(path) if path else ServerConfig()
    for flag in args.tenant:
        tenant = parse_tenant_flag(flag)
        config.tenants[tenant.name] = tenant
    overrides = {
        "model_name": args.served_model_name,
        "admin_key": args.admin_key,
        "metrics_key": args.metrics_key,
        "max_concurrent_requests": args.max_concurrent_requests,
        "max_concurrent_requests_per_tenant": args.max_concurrent_requests_per_tenant,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_body_bytes": args.max_body_bytes,
        "max_output_tokens": args.max_output_tokens,
        "graceful_shutdown_s": args.graceful_shutdown_s,
        "body_timeout_s": args.body_timeout_s,
        "max_connections": args.max_connections,
        "max_connections_per_address": args.max_connections_per_address,
        "keep_alive_timeout_s": args.keep_alive_timeout_s,
        "header_timeout_s": args.header_timeout_s,
        "api_docs": args.api_docs,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(config, name, value)
    config.__post_init__()  # re-validate after the flags
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
    from kvtier.cache.setup import build_engine as build_stack
    from kvtier.cache.setup import load_cache_config
    from kvtier.engine import EngineConfig
    from kvtier.policy.config import load_compression
    from kvtier.server.tier_flags import tier_overrides

    path = config_path(args)
    cache = load_cache_config(
        path,
        policy=args.policy,
        policy_settings=args.policy_set,
        tiers_settings=args.tiers_set,
        tiers_overrides=tier_overrides(args),
    )
    engine_kwargs = {
        # the same file's [compression] table: every request's pipeline ("auto" is refused:
        # a server has not observed its workload when it starts)
        "compression": load_compression(path).build(),
        "model_dir": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_bytes": args.kv_cache_bytes,
        "prefault_kv_pool": args.prefault_kv_pool,
        "paged_decode": args.paged_decode,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "num_threads": args.num_threads,
    }
    config = EngineConfig(**{k: v for k, v in engine_kwargs.items() if v is not None})
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
