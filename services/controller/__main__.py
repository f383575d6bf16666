"""Entry point: `lmcache_controller --host localhost --port 9000 --monitor-port 9001` (also `kvmesh controller`,
`python -m kvmesh.services.controller`; LMCache's --monitor-ports, --config, --health-check-interval and
--lmcache-worker-timeout too: config.py).

Main thread, one event loop (uvloop when installed): reads flags, starts a ControllerService (embedded NATS
unless --nats-url, NATS subscriptions, uvicorn), and waits for SIGTERM/SIGINT to stop it cleanly.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

from kvmesh.services.controller.config import ControllerConfig, parse_args
from kvmesh.services.controller.service import ControllerService
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.ops.service import configure_logging

log = logging.getLogger("kvmesh.controller")


async def _run(config: ControllerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = ControllerService(config)
    try:
        await service.start()
    except KVMeshError as exc:
        log.error("%s", exc)
        return 1
    # Everything allocated so far lives as long as the process: keep it out of the GC's full scans (the index
    # itself is never scanned: it holds only bytes and ints).
    gc.freeze()
    log.info("controller ready: REST %s, NATS %s (controller_url for engines)", service.url, service.nats_url)
    try:
        while not stop.is_set() and not service.http_done:
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
    finally:
        log.info("controller stopping")
        await service.stop()
    return 0 if stop.is_set() else 1


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(config.log_level)
    for notice in config.notices:  # LMCache settings that mean nothing here, once each
        log.warning("%s", notice)
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        code = runner.run(_run(config))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
