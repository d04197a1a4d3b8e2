"""`kvtier serve`: an OpenAI-compatible server with sessions, tenants and Prometheus metrics.

Module-level imports stay light (argparse only): the CLI imports every command to build its
parser, and `kvtier plan` must not pay for torch or FastAPI.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.server.config import ServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None, help="TOML file with a [server] (and [compression]) table"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="local HF folder (default: embedded SmolLM2)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="device KV pool budget")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME:API_KEY[:QUOTA_BYTES]",
        help="a tenant (repeatable); none = one anonymous tenant, no key needed",
    )
    parser.add_argument("--admin-key", default=None, help="bearer key of the /admin API")
    parser.add_argument("--max-concurrent-requests", type=int, default=None)
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    parser.add_argument("--max-body-bytes", type=int, default=None)
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--graceful-shutdown-s", type=float, default=None)
    parser.add_argument("--log-level", default="info")


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    from kvtier.server.config import ServerConfig, parse_tenant_flag

    config = ServerConfig.from_toml(args.config) if args.config else ServerConfig()
    for flag in args.tenant:
        tenant = parse_tenant_flag(flag)
        config.tenants[tenant.name] = tenant
    overrides = {
        "model_name": args.served_model_name,
        "admin_key": args.admin_key,
        "max_concurrent_requests": args.max_concurrent_requests,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_body_bytes": args.max_body_bytes,
        "max_output_tokens": args.max_output_tokens,
        "graceful_shutdown_s": args.graceful_shutdown_s,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(config, name, value)
    config.__post_init__()  # re-validate after the flags
    return config


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.engine import Engine, EngineConfig
    from kvtier.policy.config import load_compression
    from kvtier.server.app import create_app

    server_config = build_server_config(args)
    engine_kwargs = {
        # the same file's [compression] table: every request's pipeline ("auto" is refused:
        # a server has not observed its workload when it starts)
        "compression": load_compression(args.config).build(),
        "model_dir": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_bytes": args.kv_cache_bytes,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "num_threads": args.num_threads,
    }
    engine = Engine(EngineConfig(**{k: v for k, v in engine_kwargs.items() if v is not None}))
    app = create_app(engine, server_config)
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(server_config.graceful_shutdown_s),
        )
    finally:
        engine.close()
    return 0
