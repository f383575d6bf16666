"""`kvmesh pd-proxy --prefill URL --decode URL [--host H --port P]` (also `python -m kvmesh.services.pd_proxy`):
serve the OpenAI completion and chat APIs in front of producer and consumer vLLMs (proxy.py)."""

from __future__ import annotations

import argparse
import sys

from kvmesh.services.pd_proxy.proxy import ProxyConfig, build_app
from kvmesh.shared.service import configure_logging


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, ProxyConfig]:
    parser = argparse.ArgumentParser(prog="kvmesh pd-proxy", description=__doc__)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a producer vLLM (kv_role kv_producer, enable_pd), e.g. http://127.0.0.1:8100; repeat "
                             "for several (taken in turn)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a consumer vLLM (kv_role kv_consumer, enable_pd); repeat for several")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one vLLM request may take")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="largest request body accepted (413 past it)")
    parser.add_argument("--max-connections", type=int, default=256, help="open connections per vLLM")
    args = parser.parse_args(argv)
    for name in ("timeout", "max_body_bytes", "max_connections"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    config = ProxyConfig([url.rstrip("/") for url in args.prefill], [url.rstrip("/") for url in args.decode],
                         args.timeout, args.max_body_bytes, args.max_connections)
    return args, config


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    configure_logging()
    args, config = parse_args(list(sys.argv[1:] if argv is None else argv))
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
