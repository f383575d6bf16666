"""`kvmesh pd-proxy --prefill URL --decode URL [--host H --port P]` (also `python -m kvmesh.services.pd_proxy`):
serve the OpenAI completion and chat APIs in front of producer and consumer vLLMs (proxy.py). One process serves
one host:port."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvmesh.services.pd_proxy.proxy import ProxyConfig, build_app
from kvmesh.shared import options_cli
from kvmesh.shared.ops.http_gate import resolve_token
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.ops.service import configure_logging
from kvmesh.shared.tls import client_context_of, server_context, server_context_of

TOKEN_ENV = "KVMESH_PD_PROXY_TOKEN"
TOKEN_FILE_ENV = "KVMESH_PD_PROXY_TOKEN_FILE"
POSITIVE = {"timeout_s": "--timeout", "max_body_bytes": "--max-body-bytes", "max_connections": "--max-connections",
            "large_body_bytes": "--large-body-bytes", "max_large_bodies": "--max-large-bodies",
            "max_json_depth": "--max-json-depth"}

log = logging.getLogger("kvmesh.pd_proxy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh pd-proxy", description=__doc__)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a producer vLLM (kv_role kv_producer, enable_pd), e.g. http://127.0.0.1:8100; repeat "
                             "for several (taken in turn)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a consumer vLLM (kv_role kv_consumer, enable_pd); repeat for several")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    options_cli.add_flags(parser, ProxyConfig)
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"read the token from this file (its first line; or set ${TOKEN_FILE_ENV})")
    parser.add_argument("--tls-cert", type=Path, default=None,
                        help="serve over HTTPS only (TLS 1.2+) with this certificate (with --tls-key)")
    parser.add_argument("--tls-key", type=Path, default=None, help="key file of --tls-cert (mode 0600)")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, ProxyConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    values = options_cli.values(ProxyConfig, args)
    try:
        server_context_of(args.tls_cert, args.tls_key, "--tls-cert", "--tls-key")
        client_context_of(values["tls_ca"], "--tls-ca")
    except ConfigError as exc:
        parser.error(str(exc))
    for name, flag in POSITIVE.items():
        if values[name] <= 0:
            parser.error(f"{flag} must be > 0")
    if values["large_body_queue"] < 0:
        parser.error("--large-body-queue must be >= 0")
    notices: list[str] = []
    values["auth_token"] = resolve_token(parser, args.auth_token, args.auth_token_file, TOKEN_ENV, TOKEN_FILE_ENV,
                                         notices, "the pd-proxy token")
    for notice in notices:
        log.warning("%s", notice)
    config = ProxyConfig([url.rstrip("/") for url in args.prefill], [url.rstrip("/") for url in args.decode],
                         **values)
    return args, config


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    configure_logging()
    args, config = parse_args(list(sys.argv[1:] if argv is None else argv))
    server = uvicorn.Config(build_app(config), host=args.host, port=args.port, log_level="warning",
                            ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key)
    if args.tls_cert is not None and args.tls_key is not None:
        server.load()
        server.ssl = server_context(args.tls_cert, args.tls_key)  # TLS 1.2+, follows its files (rotation)
    uvicorn.Server(server).run()


if __name__ == "__main__":
    main()
