"""Authentication and authorization of client requests, before dispatch (spec section 8 "Authorization").

With ``enable_sasl=false`` nothing here refuses a request (topic ``deny_read`` / ``deny_write`` / ``acl``
policies are still enforced by the handlers, where the topic is known; an ``acl`` topic then admits
nobody, since nobody is authenticated). With ``enable_sasl=true`` every request, in this order:

1. inline credentials: ``principal=`` and ``auth_token=`` on any command but AUTH authenticate the
   connection (both or neither: ``invalid_auth``); wrong ones answer ``authentication_failed`` after
   ``auth_failure_delay_ms`` and leave the connection anonymous;
2. authentication: a command whose permission list (:data:`cursus.broker.auth.COMMAND_PERMISSIONS`) is not
   empty needs an authenticated connection (``authentication_required command=``);
3. coarse permissions: every listed permission (``NOT_AUTHORIZED_FOR_OPERATION command= permission=``);
4. the topic ACL: for a command needing ``topic.read`` / ``topic.write`` whose ``topic=`` names an existing
   topic, its policy (``NOT_AUTHORIZED_FOR_TOPIC topic= operation=``). A CBV2 PUBLISH carries its topic in
   the batch header: the produce handler checks it there.

Only then does the handler run, so a redirect (``NOT_LEADER``, ``NOT_COORDINATOR``) or ``topic_not_found``
is only ever shown to a client allowed to ask. Internal commands never get here: the session refuses them
on the client listener first (``internal_command_unauthorized``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cursus.broker.auth import (
    authenticate,
    missing_permission,
    required_permissions,
    topic_allows,
    topic_operation,
)
from cursus.broker.request import NO_REPLY, Answer, Handler, Request, SessionInfo
from cursus.wire import Command, scan_batch
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.auth")


def _shown(principal: str) -> str | None:
    """``principal`` when it is safe to echo in a reply or a log line, else None."""
    if 0 < len(principal) <= 255 and all(33 <= ord(ch) <= 126 and ch not in ",=\"'" for ch in principal):
        return principal
    return None


async def reject_credentials(broker: Any, session: SessionInfo, principal: str, command: Command) -> BrokerError:
    """A failed authentication: the connection becomes anonymous, the failure is counted
    (``cursus_auth_failures_total{reason="bad_credentials"}``), and after ``auth_failure_delay_ms`` the
    ``authentication_failed`` error to raise is returned. The token is never logged."""
    session.sign_out()
    broker.metrics.child(broker.metrics.auth_failures_total, "bad_credentials").inc()
    log.info("authentication failed for principal %s from %s", _shown(principal) or "<unprintable>", session.peer)
    delay_ms = broker.config.auth_failure_delay_ms
    if delay_ms > 0:
        await asyncio.sleep(delay_ms / 1000.0)
    return BrokerError.of("authentication_failed", command=command.name, principal=_shown(principal))


async def sign_in(broker: Any, session: SessionInfo, principal: str, token: str, command: Command) -> str:
    """Authenticate ``session`` as ``principal`` with ``token``; returns the principal.

    Raises:
        BrokerError: ``authentication_failed`` (after the fixed delay; the session is then anonymous).
    """
    user = authenticate(broker.config.sasl_users, principal, token)
    if user is None:
        raise await reject_credentials(broker, session, principal, command)
    session.sign_in(user.principal, user.permissions)
    return user.principal


def incomplete_credentials(broker: Any, command: Command) -> BrokerError:
    """``invalid_auth``: only one of principal and token was given (counted, no delay: not a guess)."""
    broker.metrics.child(broker.metrics.auth_failures_total, "incomplete_credentials").inc()
    return BrokerError.of("invalid_auth", command=command.name, reason="principal_and_token_required")


async def authorize(broker: Any, req: Request) -> None:
    """Steps 1-4 of the module docstring for one request; returns when it may be dispatched.

    Raises:
        BrokerError: ``invalid_auth``, ``authentication_failed``, ``authentication_required``,
            ``NOT_AUTHORIZED_FOR_OPERATION`` or ``NOT_AUTHORIZED_FOR_TOPIC`` (all fail closed).
    """
    config = broker.config
    if not config.enable_sasl:
        return
    command, session, fields = req.command, req.session, req.fields
    if command is not Command.AUTH:
        principal, token = fields.get("principal") or "", fields.get("auth_token") or ""
        if principal or token:
            if not (principal and token):
                raise incomplete_credentials(broker, command)
            await sign_in(broker, session, principal, token, command)
    required = required_permissions(command, fields)
    if not required:
        return
    if not session.authenticated:
        raise BrokerError.of("authentication_required", command=command.name)
    missing = missing_permission(session.permissions, required)
    if missing is not None:
        raise BrokerError.of("NOT_AUTHORIZED_FOR_OPERATION", command=command.name, permission=missing)
    operation = topic_operation(required)
    topic = fields.get("topic")
    if operation is not None and topic:
        defn = broker.metadata.get(topic)
        if defn is not None:
            pol = defn.policy
            if not topic_allows(pol.auth_policy, pol.read_acl, pol.write_acl, operation, session.principal):
                raise BrokerError.of("NOT_AUTHORIZED_FOR_TOPIC", topic=defn.name, operation=operation)


def _acks_none(broker: Any, req: Request) -> bool:
    """Whether a PUBLISH suppresses its reply (acks=0 / none): then a refusal must stay silent too."""
    from cursus.broker.args import ACK_MODES

    raw = req.get("acks")
    if req.batch is not None:
        raw = scan_batch(req.batch).acks  # failure path only; an undecodable batch closes the connection
    return ACK_MODES.get((raw or "").strip().lower()) == "none"


def guarded(command: Command, handler: Handler) -> Handler:
    """``handler`` behind :func:`authorize`. A refused acks=0 PUBLISH gets no reply (it never reads one)."""

    async def run(broker: Any, req: Request) -> Answer:
        try:
            await authorize(broker, req)
        except BrokerError as exc:
            if command is Command.PUBLISH and _acks_none(broker, req):
                broker.metrics.child(broker.metrics.publish_acks_total, "none", exc.error.code).inc()
                return NO_REPLY
            raise
        return await handler(broker, req)

    run.__name__ = run.__qualname__ = getattr(handler, "__name__", "handler")
    run.__doc__ = handler.__doc__
    return run
