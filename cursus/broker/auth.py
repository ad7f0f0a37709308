"""Token authentication and coarse permissions (spec section 8 "Authorization"; facts B4, B8). Pure: no I/O.

* :class:`SaslUser` is one configured principal: its name, its permission set and a SHA-256 digest of its
  token (the token itself is not kept). ``repr`` never shows the digest.
* :func:`parse_users` reads the ``sasl_users`` configuration (a YAML list of ``{principal, token,
  permissions}`` mappings, or the environment form ``principal:token:perm|perm,...``) and raises
  ``ValueError`` naming the entry (never echoing a token) when it is invalid.
* :func:`authenticate` compares a presented principal and token with every user in constant time (digests
  of equal length, ``hmac.compare_digest``, no early exit over the users).
* :data:`COMMAND_PERMISSIONS` is the permission table: for every command the permissions a client needs,
  all of them (CONSUME/STREAM ``topic.read`` + ``group``; TXN_PUBLISH ``transaction`` + ``topic.write``;
  SEND_OFFSETS_TO_TXN ``transaction`` + ``group``; DELETE/TRUNCATE ``admin``). An empty entry means the
  command needs no authentication (AUTH, HELP, EXIT, NEGOTIATE). A command missing from the table needs
  ``admin`` (fail closed).
* :func:`topic_allows` is the per-topic policy: ``deny_read`` / ``deny_write`` refuse everybody,
  ``acl`` lets through only authenticated principals named in ``read_acl`` / ``write_acl`` (``*`` = any
  authenticated principal), ``open`` everybody.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from cursus.wire import Command

ADMIN = "admin"
TOPIC_READ = "topic.read"
TOPIC_WRITE = "topic.write"
GROUP = "group"
TRANSACTION = "transaction"
ALL = "*"
#: Every permission a configured user may hold (``*`` grants all of them).
PERMISSIONS: tuple[str, ...] = (ADMIN, TOPIC_READ, TOPIC_WRITE, GROUP, TRANSACTION, ALL)

_A, _R, _W, _G, _T = (ADMIN,), (TOPIC_READ,), (TOPIC_WRITE,), (GROUP,), (TRANSACTION,)

COMMAND_PERMISSIONS: Mapping[Command, tuple[str, ...]] = MappingProxyType({
    # connection commands: no authentication needed
    Command.AUTH: (),
    Command.NEGOTIATE: (),
    Command.EXIT: (),
    Command.HELP: (),
    # topic administration and cluster operations
    Command.CREATE: _A,
    Command.ALTER_TOPIC_CONFIG: _A,
    Command.DELETE: _A,
    Command.TRUNCATE: _A,
    Command.LIST_CLUSTER: _A,
    Command.CLUSTER_STATUS: _A,
    Command.ELECT_LEADER: _A,
    # topic reads
    Command.LIST: _R,
    Command.DESCRIBE: _R,
    Command.METADATA: _R,
    Command.LIST_OFFSETS: _R,
    Command.BROWSE_MESSAGES: _R,
    Command.READ_STREAM: _R,
    Command.READ_STREAM_HISTORY: _R,
    Command.READ_SNAPSHOT: _R,
    Command.STREAM_VERSION: _R,
    Command.AGGREGATE_REPLAY_PROOF: _R,
    Command.AGGREGATE_EVENT_RANGE_READ: _R,
    Command.CONSUME: (TOPIC_READ, GROUP),
    Command.STREAM: (TOPIC_READ, GROUP),
    # topic writes
    Command.PUBLISH: _W,
    Command.APPEND_STREAM: _W,
    Command.SAVE_SNAPSHOT: _W,
    # groups
    Command.REGISTER_GROUP: _G,
    Command.JOIN_GROUP: _G,
    Command.SYNC_GROUP: _G,
    Command.HEARTBEAT: _G,
    Command.LEAVE_GROUP: _G,
    Command.COMMIT_OFFSET: _G,
    Command.BATCH_COMMIT: _G,
    Command.FETCH_OFFSET: _G,
    Command.GROUP_STATUS: _G,
    Command.LIST_GROUPS: _G,
    Command.FIND_COORDINATOR: _G,  # transaction with transactional_id= (see required_permissions)
    # transactions
    Command.INIT_PRODUCER_ID: _T,
    Command.BEGIN_TXN: _T,
    Command.END_TXN: _T,
    Command.TXN_STATUS: _T,
    Command.TXN_PUBLISH: (TRANSACTION, TOPIC_WRITE),
    Command.TXN_APPEND_STREAM: (TRANSACTION, TOPIC_WRITE),
    Command.SEND_OFFSETS_TO_TXN: (TRANSACTION, GROUP),
    # broker-to-broker commands are refused on the client listener before this table is consulted;
    # listed as admin so that nothing here is ever open.
    Command.REPLICATE_MESSAGE: _A,
    Command.REPLICATE_SNAPSHOT: _A,
    Command.LIST_SNAPSHOTS: _A,
    Command.FETCH_SNAPSHOT: _A,
    Command.CATCHUP_SNAPSHOTS: _A,
    Command.RAFT_APPLY: _A,
    Command.INTERNAL_BATCH: _A,
    Command.JOIN_CLUSTER: _A,
    Command.LEAVE_CLUSTER: _A,
    Command.HEARTBEAT_CLUSTER: _A,
    Command.REPLICA_CATCHUP: _A,
})
"""Command -> every permission a client needs for it (spec section 8; empty: no authentication)."""

_TXN_ID_FIELDS = ("transactional_id", "txn", "transaction")


def required_permissions(command: Command, fields: Mapping[str, str]) -> tuple[str, ...]:
    """The permissions ``command`` with request ``fields`` needs (all of them).

    FIND_COORDINATOR for a transactional id needs ``transaction`` instead of ``group``; a command missing from
    :data:`COMMAND_PERMISSIONS` needs ``admin``.
    """
    if command is Command.FIND_COORDINATOR and any(fields.get(key) for key in _TXN_ID_FIELDS):
        return _T
    return COMMAND_PERMISSIONS.get(command, _A)


def missing_permission(granted: frozenset[str], required: Iterable[str]) -> str | None:
    """The first of ``required`` that ``granted`` lacks (``*`` grants all), else None."""
    if ALL in granted:
        return None
    for permission in required:
        if permission not in granted:
            return permission
    return None


def topic_operation(required: Sequence[str]) -> str | None:
    """``read`` / ``write`` when ``required`` includes ``topic.read`` / ``topic.write`` (the topic ACL to
    check after the coarse permissions), else None."""
    if TOPIC_WRITE in required:
        return "write"
    if TOPIC_READ in required:
        return "read"
    return None


def acl_allows(acl: Iterable[str], principal: str | None) -> bool:
    """Whether an authenticated ``principal`` (None: anonymous) is in ``acl`` (``*``: any authenticated)."""
    if not principal:
        return False
    return any(entry == ALL or entry == principal for entry in acl)


def topic_allows(auth_policy: str, read_acl: Iterable[str], write_acl: Iterable[str], operation: str,
                 principal: str | None) -> bool:
    """The topic policy for ``operation`` (``read`` | ``write``) by ``principal`` (None: not authenticated).

    ``open`` allows, ``deny_read`` / ``deny_write`` refuse that operation to everybody, ``acl`` allows only
    principals in the operation's list; an unknown policy refuses (fail closed).
    """
    if auth_policy == "open":
        return True
    if auth_policy == "deny_read":
        return operation != "read"
    if auth_policy == "deny_write":
        return operation != "write"
    if auth_policy == "acl":
        return acl_allows(read_acl if operation == "read" else write_acl, principal)
    return False


# ----------------------------------------------------------------------------------------------- users


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True, repr=False)
class SaslUser:
    """One configured principal. ``token_digest`` is SHA-256 of its token; ``repr`` hides it."""

    principal: str
    permissions: frozenset[str]
    principal_digest: bytes
    token_digest: bytes

    def __repr__(self) -> str:
        return f"SaslUser(principal={self.principal!r}, permissions={sorted(self.permissions)!r}, token=<redacted>)"


def _valid_name(text: str) -> bool:
    """A principal: 1-255 printable ASCII characters without whitespace, ``,`` or ``=`` (it appears in ACL
    lists and in ``key=value`` replies)."""
    return 0 < len(text) <= 255 and all(33 <= ord(ch) <= 126 and ch not in ",=" for ch in text)


def _valid_token(text: str) -> bool:
    """A token: 1-4096 characters without whitespace or control characters."""
    return 0 < len(text) <= 4096 and not any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in text)


def make_user(principal: Any, token: Any, permissions: Any, where: str = "sasl_users") -> SaslUser:
    """Validate one user. Raises ``ValueError`` naming ``where`` and the principal, never the token."""
    if not isinstance(principal, str) or not _valid_name(principal):
        raise ValueError(f"{where}: principal must be 1-255 printable ASCII characters without spaces, ',' or '='")
    if not isinstance(token, str) or not _valid_token(token):
        raise ValueError(f"{where} (principal {principal}): token must be a non-empty string without whitespace")
    if isinstance(permissions, str):
        permissions = [p for p in permissions.replace("|", ",").split(",")]
    if not isinstance(permissions, (list, tuple)):
        raise ValueError(f"{where} (principal {principal}): permissions must be a list")
    names = [str(p).strip().lower() for p in permissions if str(p).strip()]
    if not names:
        raise ValueError(f"{where} (principal {principal}): every user needs a non-empty permissions list "
                         f"(of {', '.join(PERMISSIONS)})")
    unknown = [p for p in names if p not in PERMISSIONS]
    if unknown:
        raise ValueError(f"{where} (principal {principal}): unknown permission {unknown[0]!r} "
                         f"(expected {', '.join(PERMISSIONS)})")
    return SaslUser(principal, frozenset(names), _digest(principal), _digest(token))


def _parse_env_form(text: str) -> list[tuple[Any, Any, Any, str]]:
    """``principal:token:perm|perm,...`` (the environment form) -> raw entries."""
    entries = []
    for index, item in enumerate(part.strip() for part in text.split(",")):
        if not item:
            continue
        where = f"sasl_users entry {index + 1}"
        principal, sep, rest = item.partition(":")
        token, sep2, perms = rest.rpartition(":")
        if not sep or not sep2:
            raise ValueError(f"{where} (principal {principal or '?'}): expected principal:token:permission[|permission...]"
                             " (every user needs a non-empty permissions list)")
        entries.append((principal, token, perms, where))
    return entries


def parse_users(raw: Any) -> tuple[SaslUser, ...]:
    """The ``sasl_users`` setting: a list of ``{principal, token, permissions}`` mappings (YAML), a JSON list
    in a string, or the environment form ``principal:token:perm|perm,...``; empty (None, ``""``, ``[]``) is
    no users.

    Raises:
        ValueError: a malformed entry, a missing or empty permission list, an unknown permission or a
            duplicate principal (the message names the entry and principal, never a token).
    """
    if raw is None or raw == "" or raw == []:
        return ()
    entries: list[tuple[Any, Any, Any, str]] = []
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("["):
            try:
                raw = json.loads(text)
            except ValueError:
                raise ValueError("sasl_users: not a valid JSON list") from None
        else:
            entries = _parse_env_form(text)
    if not entries:
        if not isinstance(raw, (list, tuple)):
            raise ValueError("sasl_users: expected a list of {principal, token, permissions}")
        for index, item in enumerate(raw):
            where = f"sasl_users entry {index + 1}"
            if not isinstance(item, Mapping):
                raise ValueError(f"{where}: expected a mapping with principal, token and permissions")
            extra = sorted(set(map(str, item)) - {"principal", "token", "permissions"})
            if extra:
                raise ValueError(f"{where}: unknown key {extra[0]!r} (expected principal, token, permissions)")
            entries.append((item.get("principal"), item.get("token"), item.get("permissions"), where))
    users: list[SaslUser] = []
    seen: set[str] = set()
    for principal, token, permissions, where in entries:
        user = make_user(principal, token, permissions if permissions is not None else [], where)
        if user.principal in seen:
            raise ValueError(f"{where}: principal {user.principal} is configured twice")
        seen.add(user.principal)
        users.append(user)
    return tuple(users)


def authenticate(users: Sequence[SaslUser], principal: str, token: str) -> SaslUser | None:
    """The user whose principal and token both match, else None.

    Constant time in the presented values: both are hashed to fixed-length digests and compared with
    :func:`hmac.compare_digest` against every configured user (no early exit), so neither the position of
    a matching user nor the length or prefix of its token shows in the timing.
    """
    principal_digest = _digest(principal)
    token_digest = _digest(token)
    found: SaslUser | None = None
    for user in users:
        same_principal = hmac.compare_digest(principal_digest, user.principal_digest)
        same_token = hmac.compare_digest(token_digest, user.token_digest)
        if same_principal & same_token:
            found = user
    return found
