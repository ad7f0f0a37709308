"""Connection-level commands: AUTH, EXIT, HELP."""

from __future__ import annotations

from cursus.broker.args import AuthArgs, NoArgs
from cursus.broker.core import Broker
from cursus.broker.handlers.access import incomplete_credentials, sign_in
from cursus.broker.request import Reply, Request
from cursus.wire import Command
from cursus.wire.errors import BrokerError
from cursus.wire.responses import ok_text


def _printable(text: str) -> bool:
    return 0 < len(text) <= 255 and all(33 <= ord(ch) <= 126 for ch in text)


async def handle_auth(broker: Broker, req: Request, args: AuthArgs) -> bytes:
    """AUTH principal= token=: ``OK principal=P authenticated=true`` and the connection is authenticated.

    With ``enable_sasl=false`` (facts decision 10) the connection stays anonymous and the reply says
    ``authenticated=false``. Raises ``invalid_auth`` (principal or token missing, or an unprintable
    principal), ``authentication_failed`` (after ``auth_failure_delay_ms``; the connection is then anonymous
    and stays usable).
    """
    if not broker.config.enable_sasl:
        if args.principal and not _printable(args.principal):
            raise BrokerError.of("invalid_auth", command="AUTH", reason="unprintable_principal")
        return ok_text(("principal", args.principal), ("authenticated", False))
    if not (args.principal and args.token):
        raise incomplete_credentials(broker, Command.AUTH)
    principal = await sign_in(broker, req.session, args.principal, args.token, Command.AUTH)
    return ok_text(("principal", principal), ("authenticated", True))


async def handle_exit(broker: Broker, req: Request, args: NoArgs) -> Reply:
    """EXIT: reply OK, then the session closes the connection (facts B1.6)."""
    return Reply(ok_text(), close=True)


async def handle_help(broker: Broker, req: Request, args: NoArgs) -> bytes:
    """HELP: the commands this broker serves, in command-id order."""
    from cursus.broker.handlers import HANDLERS

    names = [c.name for c in sorted(HANDLERS)]
    return ok_text(("commands", ",".join(names)))
