"""``cursus-broker``: run one broker node in the foreground.

Exit codes: 0 after a clean shutdown, 2 for a configuration error, 1 when startup fails (locked or corrupt
log dir, unreadable manifest, port in use).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from cursus.broker.config import ConfigError, load_config
from cursus.broker.fdlimit import raise_open_file_limit

log = logging.getLogger("cursus")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cursus-broker", description="Run a Cursus-py broker (Wire v2).")
    p.add_argument("--config", help="flat YAML config file (also CONFIG_PATH)")
    p.add_argument("--log-dir", dest="log_dir", help="data directory (log_dir)")
    p.add_argument("--host", help="bind address of the listeners (default 0.0.0.0)")
    p.add_argument("--port", dest="broker_port", type=int, help="client port (broker_port, default 9000)")
    p.add_argument("--health-port", dest="health_check_port", type=int, help="health HTTP port (default 9080)")
    p.add_argument("--metrics-port", dest="exporter_port", type=int, help="Prometheus port (default 9100)")
    p.add_argument("--advertised-host", dest="advertised_host",
                   help="host handed to clients (default: bind address, or 127.0.0.1 for a wildcard)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any configuration key (repeatable); see docs/configuration.md")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    overrides: dict[str, object] = {
        "log_dir": args.log_dir, "host": args.host, "broker_port": args.broker_port,
        "health_check_port": args.health_check_port, "exporter_port": args.exporter_port,
        "advertised_host": args.advertised_host,
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"cursus-broker: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key.strip()] = value
    try:
        config = load_config(config_path=args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"cursus-broker: configuration error: {exc}", file=sys.stderr)
        return 2
    for warning in config.warnings:
        log.warning("%s", warning)
    log.info("open-file limit: %d", raise_open_file_limit())
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional (not on every platform)
        loop_factory = None
    # The storage writer thread shares the GIL with the event loop; a short switch interval lets a busy
    # loop hand the GIL to the writer promptly, so group commits are not starved (measured: ~3x under load).
    sys.setswitchinterval(0.0005)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_run(config))


async def _run(config: object) -> int:
    from cursus.broker.server import BrokerServer

    server = BrokerServer(config)  # type: ignore[arg-type]
    try:
        await server.start()
    except Exception as exc:  # startup failures end the process with a clear message
        log.error("startup failed: %s", exc)
        await server.shutdown()
        return 1
    await server.run_until_stopped()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
