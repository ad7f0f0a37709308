"""Connection-level commands: AUTH, EXIT, HELP."""

from __future__ import annotations

from cursus.broker.args import AuthArgs, NoArgs
from cursus.broker.core import Broker
from cursus.broker.request import Reply, Request
from cursus.wire.responses import ok_text


async def handle_auth(broker: Broker, req: Request, args: AuthArgs) -> bytes:
    """AUTH with authentication disabled (facts decision 10): stay anonymous, say so."""
    return ok_text(("principal", args.principal), ("authenticated", False))


async def handle_exit(broker: Broker, req: Request, args: NoArgs) -> Reply:
    """EXIT: reply OK, then the session closes the connection (facts B1.6)."""
    return Reply(ok_text(), close=True)


async def handle_help(broker: Broker, req: Request, args: NoArgs) -> bytes:
    """HELP: the commands this broker serves, in command-id order."""
    from cursus.broker.handlers import HANDLERS

    names = [c.name for c in sorted(HANDLERS)]
    return ok_text(("commands", ",".join(names)))
