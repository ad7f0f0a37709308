"""``cursusctl``: command-line client for Cursus brokers, built on the SDK (:mod:`cursus.client`).

Usage::

    cursusctl [--broker HOST:PORT] [--compression none|gzip|snappy|lz4] [--timeout 10s]
              [--tls-ca FILE] [--tls-cert FILE --tls-key FILE]
              [--principal P [--auth-token-env VAR] | --credentials-file FILE]
              [--json] COMMAND ...

    topic create NAME [--partitions N] [--idempotent] [--min-isr N|default] ...
    topic alter NAME --min-isr N|default
    topic delete NAME [--if-exists]
    topic truncate NAME [--expected-revision N]
    topic list
    topic describe NAME
    produce TOPIC [--file F] [--key K | --key-sep SEP] [--acks 0|1|all] [--partition N] [--idempotent]
    consume TOPIC [--partition N ...] [--offset N | --from-beginning] [--follow] [--max N]
                  [--format text|json|hex]
    consume TOPIC --group G [--from-beginning | --reset earliest|latest|error] [--mode poll|stream]
                  [--follow] [--max N] [--client-id ID]
    group list
    group describe GROUP
    group offsets GROUP
    offsets TOPIC [--partition N]
    metadata TOPIC
    raw COMMAND [key=value ...]
    certs --out DIR --nodes N [--host H ...]   (development CA + node certificates; no broker needed)

The broker defaults to ``$CURSUS_BROKER`` or 127.0.0.1:9000. Credentials (sent as ``AUTH`` on connect, never
printed): ``--principal`` with the token from ``--auth-token-env VAR`` (or ``$CURSUS_TOKEN`` /
``$CURSUS_TOKEN_FILE``), a ``--credentials-file`` (YAML ``principal:`` and ``token:``), or the environment
alone (``$CURSUS_PRINCIPAL`` + ``$CURSUS_TOKEN``, ``$CURSUS_CREDENTIALS_FILE``). Global flags may also follow the subcommand.
Output: aligned tables on a terminal, plain ``key=value`` lines when piped, JSON with ``--json``.
Exit codes: 0 success, 1 broker or runtime error (the rendered ``ERROR: code class= retryable= ...`` line
is printed), 2 usage error.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import re
import stat
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import IO, Any

from cursus import __version__
from cursus.client.admin import Admin, TopicMetadata, merge_group_offsets
from cursus.client.connection import (
    DEFAULT_ADDRESS,
    Backoff,
    Client,
    ConnectionOptions,
    compression_of,
    json_reply,
    make_ssl_context,
    ok_fields,
    ok_text_fields,
    parse_address,
)
from cursus.client.consumer import Consumer
from cursus.client.credentials import CredentialsError, resolve_credentials
from cursus.client.errors import (
    BrokerUnavailableError,
    CursusError,
    DeliveryFailedError,
    RequestTimeoutError,
    error_from_frame,
)
from cursus.client.group import GroupConsumer, GroupMembership
from cursus.client.producer import Producer
from cursus.client.records import ConsumerRecord, RecordMetadata, decode_consumed_batch
from cursus.client.signals import sigterm_exits
from cursus.wire import (
    Command,
    CommandPayload,
    CommandTextError,
    Frame,
    ProtocolError,
    Status,
    decode_batch,
    encode_crq2,
    is_cbv2,
    parse_command_text,
)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: A person is waiting: give up on an unreachable broker after about a second.
CLI_BACKOFF = Backoff(initial_s=0.1, max_s=0.5, attempts_max=3)


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


# ------------------------------------------------------------------------------------------ arguments


def parse_duration(text: str) -> float:
    """``10s``, ``500ms``, ``2m``, ``1h`` or a plain number of seconds -> seconds (float, > 0).

    Raises ``argparse.ArgumentTypeError`` for anything else.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (use e.g. 10s, 500ms, 2m)")
    value = float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[match.group(2) or "s"]
    if value <= 0:
        raise argparse.ArgumentTypeError("duration must be positive")
    return value


def _address(text: str) -> str:
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _compression(text: str) -> str:
    try:
        compression_of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.lower()


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _start_offset(text: str) -> str | int:
    """``--offset``: ``start``/``beginning``/``earliest``, ``end``/``latest``, or an integer."""
    named = {"start": "earliest", "beginning": "earliest", "earliest": "earliest", "end": "latest",
             "latest": "latest"}
    if text in named:
        return named[text]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not start, end, N or -N") from None


def _record_format(text: str) -> str:
    """``--format``: a named format or a template with at least one ``%`` directive."""
    if text in ("text", "json", "hex") or "%" in text:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not text, json, hex or a template such as '%p %o %k %v\\n'")


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


_GLOBAL_DEFAULTS: dict[str, Any] = {
    "broker": None, "compression": "none", "timeout": 10.0, "tls": False, "tls_insecure": False, "tls_ca": None,
    "tls_cert": None,
    "tls_key": None, "principal": None, "auth_token_env": None, "credentials_file": None, "json": False,
}


def _global_options(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a flag given after the subcommand must not be reset by the subparser's default.
    group = parser.add_argument_group("connection and output")
    group.add_argument("--broker", type=_address, default=argparse.SUPPRESS,
                       help=f"broker address host:port (default: $CURSUS_BROKER or {DEFAULT_ADDRESS})")
    group.add_argument("--compression", type=_compression, default=argparse.SUPPRESS,
                       help="preferred compression: none, gzip, snappy, lz4 (default: none)")
    group.add_argument("--timeout", type=parse_duration, default=argparse.SUPPRESS,
                       help="connect and request timeout, e.g. 10s, 500ms (default: 10s)")
    group.add_argument("--tls", action="store_true", default=argparse.SUPPRESS,
                       help="TLS, verifying the broker against the system trust store")
    group.add_argument("--tls-ca", default=argparse.SUPPRESS, metavar="FILE", help="CA bundle (enables TLS)")
    group.add_argument("--tls-insecure", action="store_true", default=argparse.SUPPRESS,
                       help="TLS without verifying the broker's certificate (development only)")
    group.add_argument("--tls-cert", default=argparse.SUPPRESS, metavar="FILE", help="client certificate (PEM)")
    group.add_argument("--tls-key", default=argparse.SUPPRESS, metavar="FILE", help="client key (PEM)")
    group.add_argument("--principal", default=argparse.SUPPRESS, help="authenticate as this principal")
    group.add_argument("--auth-token-env", default=argparse.SUPPRESS, metavar="VAR",
                       help="environment variable holding the principal's token (default: CURSUS_TOKEN)")
    group.add_argument("--credentials-file", default=argparse.SUPPRESS, metavar="FILE",
                       help="YAML file with principal: and token: (default: $CURSUS_CREDENTIALS_FILE)")
    group.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")


class _Parser(argparse.ArgumentParser):
    """An argument parser that takes options only as spelled: argparse's prefix matching would read
    ``--key k1`` as ``--key-sep k1`` (subparsers inherit the class, so this holds for every subcommand)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``cursusctl`` argument parser."""
    common = _Parser(add_help=False)
    _global_options(common)
    parser = _Parser(prog="cursusctl", parents=[common],
                                     description="Command-line client for Cursus brokers (Wire v2).")
    parser.add_argument("--version", action="version", version=f"cursusctl {__version__} (Cursus Wire v2)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    topic = commands.add_parser("topic", help="create, alter, delete, truncate, list or describe topics")
    topic_commands = topic.add_subparsers(dest="topic_command", required=True, metavar="ACTION")
    create = topic_commands.add_parser("create", parents=[common], help="create topics (or patch them)")
    create.add_argument("names", nargs="+", metavar="NAME")
    create.add_argument("--if-not-exists", action="store_true",
                        help="leave an existing topic as it is (exit 0) instead of patching it")
    create.add_argument("--partitions", type=_positive)
    create.add_argument("--replication-factor", type=_positive)
    create.add_argument("--min-isr", help="minimum in-sync replicas override, or 'default'")
    create.add_argument("--idempotent", action="store_true", default=None)
    create.add_argument("--event-sourcing", action="store_true", default=None)
    create.add_argument("--cleanup-policy", choices=["delete", "compact", "delete,compact"],
                        help="delete, or compact / delete,compact (latest record per key; not for event sourcing)")
    create.add_argument("--retention-hours", type=_non_negative)
    create.add_argument("--retention-bytes", type=_non_negative)
    create.add_argument("--partitioner", choices=["hash_key", "round_robin"])
    create.add_argument("--auth-policy", choices=["open", "deny_write", "deny_read", "acl"],
                        help="open, deny_write, deny_read or acl (read/write ACLs, see docs/security.md)")
    create.add_argument("--read-acl", help="comma-separated principals")
    create.add_argument("--write-acl", help="comma-separated principals")
    alter = topic_commands.add_parser("alter", parents=[common],
                                      help="change a topic's partitions, retention, policies or min ISR")
    alter.add_argument("name")
    alter.add_argument("--partitions", type=_positive, help="new partition count (can only grow)")
    alter.add_argument("--min-isr", help="minimum in-sync replicas override, or 'default' to remove it")
    alter.add_argument("--cleanup-policy", choices=["delete", "compact", "delete,compact"],
                       help="delete, or compact / delete,compact (not for event sourcing)")
    alter.add_argument("--retention-hours", type=_non_negative, help="time retention override (0: broker default)")
    alter.add_argument("--retention-bytes", type=_non_negative,
                       help="size retention per partition override (0: broker default)")
    alter.add_argument("--partitioner", choices=["hash_key", "round_robin"])
    alter.add_argument("--auth-policy", choices=["open", "deny_write", "deny_read", "acl"])
    alter.add_argument("--read-acl", help="comma-separated principals ('' clears the list)")
    alter.add_argument("--write-acl", help="comma-separated principals ('' clears the list)")
    delete = topic_commands.add_parser("delete", parents=[common], help="delete topics and their data")
    delete.add_argument("names", nargs="+", metavar="NAME")
    delete.add_argument("--if-exists", action="store_true")
    truncate = topic_commands.add_parser("truncate", parents=[common],
                                         help="remove every record of a topic but keep its definition")
    truncate.add_argument("name")
    truncate.add_argument("--expected-revision", type=_positive,
                          help="refuse unless the topic is at this revision (default: the current one)")
    topic_commands.add_parser("list", parents=[common], help="list topics")
    describe = topic_commands.add_parser("describe", parents=[common], help="definition and partition state")
    describe.add_argument("name")

    produce = commands.add_parser("produce", parents=[common], help="produce lines from stdin or a file")
    produce.add_argument("topic")
    produce.add_argument("--file", help="read records from this file (default: stdin), one per line")
    keying = produce.add_mutually_exclusive_group()
    keying.add_argument("--key", "-k", help="the key of every record")
    keying.add_argument("--key-sep", help="split each line into key and value at the first SEP")
    produce.add_argument("--acks", default=None, choices=["0", "1", "all", "-1"], help="default 1 (all with --idempotent)")
    produce.add_argument("--partition", type=_non_negative, help="send every record to this partition")
    produce.add_argument("--idempotent", action="store_true", help="idempotent producer (acks=all)")
    produce.add_argument("--batch-size", type=_positive, default=1000, help="records per batch (default 1000)")
    produce.add_argument("--linger-ms", type=_non_negative, default=5, help="batch linger (default 5 ms)")
    produce.add_argument("--progress", choices=["auto", "bar", "lines", "off"], default="auto",
                         help="progress on stderr: records, rate, and bytes read of the total with a percentage "
                              "when the input size is known (a file or stdin redirected from one); auto (the "
                              "default) draws a bar on a terminal, lines prints one line a second (for logs)")

    consume = commands.add_parser("consume", parents=[common], help="print records of a topic")
    consume.add_argument("topic")
    consume.add_argument("--partition", type=_non_negative, action="append",
                         help="partition to read (repeatable; default: all)")
    start = consume.add_mutually_exclusive_group()
    start.add_argument("--offset", type=_start_offset, metavar="start|end|N|-N",
                       help="where to start: start (the default, as rpk and kcat), end, an offset N (an error "
                            "when outside the partition), or -N: N records before the end")
    start.add_argument("--from-beginning", action="store_true", help="start at the earliest offset (--offset start)")
    consume.add_argument("--follow", "-f", action="store_true", help="keep waiting for new records")
    consume.add_argument("--max", type=_positive, help="stop after this many records")
    consume.add_argument("--format", type=_record_format, default="text", metavar="text|json|hex|TEMPLATE",
                         help="text (the value), json (one document per record), hex, or a template: %%t topic, "
                              "%%p partition, %%o offset, %%k key, %%v value, %%d timestamp (ms), %%%% a percent "
                              "sign, \\n \\t; e.g. '%%p %%o %%k %%v\\n'")
    consume.add_argument("--key-sep", help="text format: print KEY<SEP>VALUE")
    consume.add_argument("--wait-ms", type=_non_negative, default=500, help="long-poll time (default 500)")
    consume.add_argument("--isolation", choices=["read_committed", "read_uncommitted"], default="read_committed")
    grouped = consume.add_argument_group("consumer group (with --group)")
    grouped.add_argument("--group", help="consume as a member of this consumer group: start at its committed "
                                         "offsets, commit after printing, leave on exit")
    grouped.add_argument("--reset", choices=["earliest", "latest", "error"],
                         help="where partitions without a committed offset start (default: earliest, as "
                              "the broker's CONSUME group=; --from-beginning is the same)")
    grouped.add_argument("--mode", choices=["poll", "stream"], help="read with CONSUME long polls (default) "
                                                                    "or STREAM push delivery")
    grouped.add_argument("--client-id", default=None,
                         help="member id prefix (default: cursusctl-<random>, unique per run)")

    group = commands.add_parser("group", help="list consumer groups, describe them, show their offsets and lag")
    group_commands = group.add_subparsers(dest="group_command", required=True, metavar="ACTION")
    group_commands.add_parser("list", parents=[common], help="list consumer groups")
    group_describe = group_commands.add_parser("describe", parents=[common],
                                               help="state, generation, members and their assignments")
    group_describe.add_argument("group")
    group_offsets = group_commands.add_parser("offsets", parents=[common],
                                              help="committed offset, log end (HWM), lag and owner per partition")
    group_offsets.add_argument("group")

    txn = commands.add_parser("txn", help="transaction coordinator state")
    txn_commands = txn.add_subparsers(dest="txn_command", required=True, metavar="ACTION")
    txn_status = txn_commands.add_parser("status", parents=[common],
                                         help="state, epoch, messages, participants, offsets of a transactional id")
    txn_status.add_argument("transactional_id", metavar="ID")

    offsets = commands.add_parser("offsets", parents=[common], help="earliest/latest/LEO/HWM per partition")
    offsets.add_argument("topic")
    offsets.add_argument("--partition", type=_non_negative)

    metadata = commands.add_parser("metadata", parents=[common],
                                   help="partition leaders and topic policy (every topic without TOPIC)")
    metadata.add_argument("topic", nargs="?", help="one topic (default: a cluster-wide view, as kcat -L)")

    raw = commands.add_parser("raw", parents=[common], help="send any command text and print the reply")
    raw.add_argument("raw_command", metavar="COMMAND")
    raw.add_argument("raw_args", nargs=argparse.REMAINDER, metavar="key=value")
    certs = commands.add_parser("certs", parents=[common], help="write a development CA and node certificates")
    certs.add_argument("--out", required=True, metavar="DIR", help="directory for ca.crt/ca.key/node-N.crt/key")
    certs.add_argument("--nodes", type=int, required=True, metavar="N", help="number of nodes (node-1..node-N)")
    certs.add_argument("--host", action="append", metavar="H",
                       help="host or IP in every node certificate (repeatable; default 127.0.0.1, localhost)")
    cluster_status = commands.add_parser("cluster-status", parents=[common],
                                         help="brokers, Raft leader, partitions; exit 1 when unhealthy")
    cluster_status.add_argument("--unhealthy", action="store_true", help="list only unhealthy partitions")
    _event_parsers(commands, common)
    return parser



def _finish_globals(args: argparse.Namespace) -> None:
    for key, value in _GLOBAL_DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    if args.broker is None:
        args.broker = os.environ.get("CURSUS_BROKER") or DEFAULT_ADDRESS
        try:
            parse_address(args.broker)
        except ValueError as exc:
            raise UsageError(f"CURSUS_BROKER: {exc}") from None


def connection_options(args: argparse.Namespace) -> ConnectionOptions:
    """ConnectionOptions from the global flags. Raises ``UsageError`` for inconsistent flags."""
    ssl_context = None
    if args.tls or args.tls_insecure or args.tls_ca or args.tls_cert or args.tls_key:
        if bool(args.tls_cert) != bool(args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        if args.tls_insecure and args.tls_ca:
            raise UsageError("--tls-insecure verifies nothing: drop --tls-ca, or drop --tls-insecure")
        try:
            ssl_context = make_ssl_context(args.tls_ca, args.tls_cert, args.tls_key, verify=not args.tls_insecure)
        except (OSError, ValueError) as exc:
            raise UsageError(f"TLS files: {exc}") from None
    token = None
    if args.auth_token_env:
        if not args.principal:
            raise UsageError("--auth-token-env needs --principal")
        token = os.environ.get(args.auth_token_env)
        if token is None:
            raise UsageError(f"environment variable {args.auth_token_env} is not set")
    if args.credentials_file and args.principal:
        raise UsageError("--credentials-file names the principal: drop --principal")
    try:
        creds = resolve_credentials(args.principal, token, credentials_file=args.credentials_file)
    except CredentialsError as exc:
        raise UsageError(str(exc)) from None
    return ConnectionOptions(compression=compression_of(args.compression), timeout_s=args.timeout,
                             ssl_context=ssl_context, principal=creds.principal if creds else None,
                             token=creds.token if creds else None, backoff=CLI_BACKOFF)


# ------------------------------------------------------------------------------------------ output


class Output:
    """Renders results: JSON (``--json``), rich tables (terminal) or ``key=value`` lines (pipes)."""

    def __init__(self, json_mode: bool, stream: IO[str] | None = None) -> None:
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()

    def json(self, doc: Any) -> None:
        """One JSON document on one line."""
        self.stream.write(json.dumps(doc, ensure_ascii=False) + "\n")

    def line(self, text: str) -> None:
        """A plain line."""
        self.stream.write(text + "\n")

    def fields(self, title: str, values: dict[str, Any]) -> None:
        """One object: a two-column table on a terminal, one ``key=value ...`` line otherwise."""
        if self.tty:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=title, show_header=False)
            table.add_column("field", style="bold")
            table.add_column("value")
            for key, value in values.items():
                table.add_row(key, _plain(value))
            Console(file=self.stream).print(table)
        else:
            self.line(" ".join(f"{key}={_plain(value)}" for key, value in values.items()))

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Rows: an aligned table on a terminal, one ``col=value ...`` line per row otherwise."""
        rows = list(rows)
        if self.tty:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=title)
            for column in columns:
                table.add_column(column)
            for row in rows:
                table.add_row(*(_plain(v) for v in row))
            Console(file=self.stream).print(table)
        else:
            for row in rows:
                self.line(" ".join(f"{c}={_plain(v)}" for c, v in zip(columns, row, strict=True)))


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return ",".join(_plain(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def error_document(error: CursusError) -> dict[str, Any]:
    """The ``--json`` form of an error."""
    return {"status": "ERROR", "code": error.code, "class": error.error_class.label,
            "retryable": error.retryable, "fields": dict(error.fields), "message": error.message,
            "rendered": error.render()}


# ------------------------------------------------------------------------------------------ commands


def next_step(error: CursusError) -> str | None:
    """What to do about ``error`` (printed after the ERROR line), or None when the line says it all."""
    f = error.fields
    if error.code == "topic_not_found":
        return f"no topic {f.get('topic', '')!s}; create it with: cursusctl topic create {f.get('topic', 'NAME')}"
    if error.code in ("topic_delete_blocked", "topic_truncate_blocked") and f.get("transactional_id"):
        return (f"transaction {f['transactional_id']} still references the topic; end it (END_TXN) or wait for "
                "its timeout, then try again")
    if error.code in ("topic_delete_blocked", "topic_truncate_blocked") and f.get("group"):
        members = f.get("members") or "its members"
        timeout = f"{int(f['session_timeout_ms']) // 1000} s" if f.get("session_timeout_ms", "").isdigit() \
            else "the session timeout"
        return (f"consumer group {f['group']} still has members ({members}); stop them (they leave at once) "
                f"or wait {timeout} for their sessions to expire, then try again")
    if error.code == "group_not_found":
        return "no such group; see the groups with: cursusctl group list"
    if error.code == "OFFSET_OUT_OF_RANGE" and "earliest" in f:
        return (f"the partition holds offsets {f['earliest']} to {f.get('latest', '?')}: start with --offset "
                "start, end, -N or an offset in that range")
    return None


def cmd_topic(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``topic create|alter|delete|truncate|list|describe``."""
    with Admin(args.broker, options=options) as admin:
        action = args.topic_command
        if action == "create":
            for name in args.names:  # several topics: one after the other, stopping at the first error
                _create_topic(admin, args, name, out)
        elif action == "alter":
            _alter_topic(admin, args, out)
        elif action == "delete":
            for name in args.names:
                result = admin.delete_topic(name, if_exists=args.if_exists)
                if out.json_mode:
                    out.json(result.to_dict())
                else:
                    out.fields("deleted", result.to_dict())
        elif action == "truncate":
            truncated = admin.truncate_topic(args.name, expected_revision=args.expected_revision)
            if out.json_mode:
                out.json(truncated.to_dict())
            else:
                out.fields("truncated", truncated.to_dict())
        elif action == "list":
            names = admin.list_topics()
            if out.json_mode:
                out.json({"topics": names, "count": len(names)})
            elif out.tty:
                out.table(f"{len(names)} topic(s)", ["topic"], [[n] for n in names])
            else:
                for name in names:
                    out.line(name)
        else:
            description = admin.describe_topic(args.name)
            if out.json_mode:
                out.json(description.to_dict())
            else:
                summary = {"topic": description.topic, "revision": description.revision,
                           "partitions": description.partitions,
                           "replication_factor": description.replication_factor,
                           "idempotent": description.idempotent, "event_sourcing": description.event_sourcing,
                           "lifecycle_epoch": description.lifecycle_epoch,
                           "min_in_sync_replicas": description.min_in_sync_replicas or "default",
                           **description.policy}
                out.fields(f"topic {description.topic}", summary)
                out.table("partitions", ["partition", "leader", "replicas", "isr", "leo", "hwm"],
                          [[p.id, p.leader, p.replicas, p.isr, p.leo, p.hwm] for p in description.partition_states])
    return EXIT_OK


def _create_topic(admin: Admin, args: argparse.Namespace, name: str, out: Output) -> None:
    """CREATE one topic (or patch it, or leave it with ``--if-not-exists``) and show the result."""
    before = admin.metadata(name).revision if name in admin.list_topics() else None
    if before is not None and args.if_not_exists:
        doc = {"result": "exists", "topic": name, "revision": before}
        if out.json_mode:
            out.json(doc)
        else:
            out.fields(f"topic {name}", doc)
        return
    config = admin.create_topic(
        name, args.partitions, idempotent=args.idempotent, event_sourcing=args.event_sourcing,
        replication_factor=args.replication_factor, min_in_sync_replicas=args.min_isr,
        cleanup_policy=args.cleanup_policy, retention_hours=args.retention_hours,
        retention_bytes=args.retention_bytes, partitioner=args.partitioner, auth_policy=args.auth_policy,
        read_acl=args.read_acl, write_acl=args.write_acl)
    # CREATE of an existing topic patches it: say which of the three happened
    outcome = "created" if before is None else ("unchanged" if config.revision == before else "updated")
    _show_config(out, {"result": outcome, **config.to_dict()}, f"topic {config.topic}")


def _alter_topic(admin: Admin, args: argparse.Namespace, out: Output) -> None:
    """``topic alter NAME --partitions/--min-isr/--retention-*/--cleanup-policy/...``: the mutable settings of
    an existing topic (Admin.alter_topic); says whether the revision changed."""
    settings = {"partitions": args.partitions, "cleanup_policy": args.cleanup_policy,
                "retention_hours": args.retention_hours, "retention_bytes": args.retention_bytes,
                "partitioner": args.partitioner, "auth_policy": args.auth_policy,
                "read_acl": args.read_acl, "write_acl": args.write_acl}
    if all(v is None for v in settings.values()) and args.min_isr is None:
        raise UsageError("topic alter needs at least one setting: --partitions, --min-isr, --cleanup-policy, "
                         "--retention-hours, --retention-bytes, --partitioner, --auth-policy, --read-acl, "
                         "--write-acl")
    before = admin.metadata(args.name).revision
    config = admin.alter_topic(args.name, min_in_sync_replicas=args.min_isr, **settings)
    outcome = "unchanged" if config.revision == before else "updated"
    _show_config(out, {"result": outcome, **config.to_dict()}, f"topic {config.topic}")


def _show_config(out: Output, doc: dict[str, Any], title: str) -> None:
    if out.json_mode:
        out.json(doc)
        return
    extra = doc.pop("extra", {}) or {}
    if doc.get("min_in_sync_replicas") is None:
        doc["min_in_sync_replicas"] = "default"
    out.fields(title, {**doc, **extra})


def _open_input(path: str | None) -> tuple[IO[bytes], int | None]:
    """The input stream and its size in bytes when known (a file, or stdin redirected from a regular file;
    None for a pipe or a terminal)."""
    stream = open(path, "rb") if path else sys.stdin.buffer
    try:
        info = os.fstat(stream.fileno())
        size = info.st_size if stat.S_ISREG(info.st_mode) else None
        if size is not None:
            size = max(0, size - stream.tell())
    except (OSError, ValueError, io.UnsupportedOperation):
        size = None
    return stream, size


def _read_lines(stream: IO[bytes]) -> Iterator[tuple[bytes, int]]:
    """Lines without their line ending, each with the number of input bytes it took."""
    for line in stream:
        taken = len(line)
        if line.endswith(b"\n"):
            line = line[:-1]
            if line.endswith(b"\r"):
                line = line[:-1]
        yield line, taken


def _size_text(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


class _Progress:
    """Produce progress on stderr: records, records/s and, when the input size is known (a file or a sized
    stdin), bytes read of the total and the percentage. ``mode``: ``bar`` (a rich bar, for terminals),
    ``lines`` (a plain line at most every ``interval_s`` and a last one at the end, for logs), or ``off``."""

    def __init__(self, mode: str, topic: str, total_bytes: int | None, interval_s: float = 1.0) -> None:
        self.mode = mode
        self.topic = topic
        self.total_bytes = total_bytes
        self.interval_s = interval_s
        self.records = 0
        self.read_bytes = 0
        self._progress: Any = None
        self._started = self._last_line = time.monotonic()
        if mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            columns: list[Any] = [SpinnerColumn(), TextColumn("[bold]{task.description}")]
            if total_bytes is not None:
                columns += [BarColumn(), TaskProgressColumn(), TimeRemainingColumn()]
            columns += [TextColumn("{task.fields[records]:,} records"), TextColumn("{task.fields[rate]:,.0f} rec/s"),
                        TimeElapsedColumn()]
            self._progress = Progress(*columns, console=Console(file=sys.stderr), transient=True)
            self._task = self._progress.add_task(f"producing to {topic}", total=total_bytes, records=0, rate=0.0)
            self._progress.start()

    def percent(self) -> float | None:
        """Input read so far in percent of the known size (None when unknown)."""
        if self.total_bytes is None:
            return None
        return 100.0 if self.total_bytes == 0 else min(100.0, 100.0 * self.read_bytes / self.total_bytes)

    def text(self) -> str:
        """``N records (R rec/s)`` plus ``, X of Y (P%)`` when the size is known."""
        elapsed = max(1e-6, time.monotonic() - self._started)
        line = f"producing to {self.topic}: {self.records:,} records ({self.records / elapsed:,.0f} rec/s)"
        percent = self.percent()
        if percent is not None:
            assert self.total_bytes is not None
            line += f", {_size_text(self.read_bytes)} of {_size_text(self.total_bytes)} ({percent:.0f}%)"
        return line

    def update(self, records: int, read_bytes: int) -> None:
        self.records, self.read_bytes = records, read_bytes
        if self._progress is not None:
            elapsed = max(1e-6, time.monotonic() - self._started)
            self._progress.update(self._task, completed=read_bytes, records=records, rate=records / elapsed)
        elif self.mode == "lines" and time.monotonic() - self._last_line >= self.interval_s:
            self._last_line = time.monotonic()
            print(self.text(), file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        elif self.mode == "lines":
            print(self.text(), file=sys.stderr, flush=True)


class _ProduceTally:
    """Per-partition counts and offset ranges of delivered records (futures are folded in as they finish,
    so memory stays bounded by the producer's buffer)."""

    def __init__(self) -> None:
        self.pending: collections.deque[Future[RecordMetadata]] = collections.deque()
        self.delivered = 0
        self.failed = 0
        self.partitions: dict[int, dict[str, Any]] = {}

    def add(self, future: Future[RecordMetadata]) -> None:
        self.pending.append(future)
        if len(self.pending) >= 20_000:
            self.fold(finished_only=True)

    def fold(self, *, finished_only: bool) -> None:
        while self.pending and (not finished_only or self.pending[0].done()):
            future = self.pending.popleft()
            if future.exception() is not None:
                self.failed += 1
                continue
            meta = future.result()
            self.delivered += 1
            entry = self.partitions.setdefault(meta.partition, {"records": 0, "first_offset": meta.offset,
                                                                "last_offset": meta.offset})
            entry["records"] += 1
            if meta.offset is not None:
                entry["first_offset"] = min(entry["first_offset"], meta.offset)
                entry["last_offset"] = max(entry["last_offset"], meta.offset)


def cmd_produce(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``produce TOPIC``: one record per input line; prints a summary (fails with exit 1 if any record failed)."""
    sep = args.key_sep.encode("utf-8") if args.key_sep else None
    acks = args.acks if args.acks is not None else ("all" if args.idempotent else "1")
    if args.idempotent and acks not in ("all", "-1"):
        raise UsageError("--idempotent needs --acks all")
    producer = Producer(args.broker, acks=acks, idempotent=args.idempotent, batch_size=args.batch_size,
                        linger_ms=args.linger_ms, options=options)
    stream, total_bytes = _open_input(args.file)
    mode = args.progress
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() and not out.json_mode else "off"
    progress = _Progress(mode, args.topic, total_bytes)
    started = time.monotonic()
    tally = _ProduceTally()
    failure: CursusError | None = None
    read_bytes = records_read = 0
    try:
        for index, (line, taken) in enumerate(_read_lines(stream)):
            read_bytes += taken
            key = args.key
            value = line
            if sep is not None and sep in line:
                raw_key, value = line.split(sep, 1)
                key = raw_key.decode("utf-8", "replace")
            tally.add(producer.send(args.topic, value, key=key, partition=args.partition))
            if index % 1000 == 999:
                progress.update(index + 1, read_bytes)
            records_read = index + 1
        try:
            producer.flush()
        except DeliveryFailedError as exc:
            failure = exc
    finally:
        if args.file:
            stream.close()
        progress.update(records_read, read_bytes)
        progress.stop()
        try:
            producer.close()
        except DeliveryFailedError as exc:
            failure = failure or exc
    tally.fold(finished_only=False)
    elapsed = max(1e-9, time.monotonic() - started)
    summary = {"topic": args.topic, "records": tally.delivered, "failed": tally.failed,
               "seconds": round(elapsed, 3), "records_per_s": round(tally.delivered / elapsed),
               "input_bytes": read_bytes, **({"input_size": total_bytes} if total_bytes is not None else {}),
               "partitions": {str(p): v for p, v in sorted(tally.partitions.items())}}
    if out.json_mode:
        out.json(summary)
    else:
        out.fields("produced", {k: v for k, v in summary.items() if k != "partitions"})
        out.table("partitions", ["partition", "records", "first_offset", "last_offset"],
                  [[p, v["records"], v["first_offset"], v["last_offset"]] for p, v in sorted(tally.partitions.items())])
    if failure is not None:
        raise failure
    return EXIT_OK


def record_document(record: ConsumerRecord) -> dict[str, Any]:
    """The JSON form of a consumed record: value as UTF-8 text (invalid bytes replaced) plus base64."""
    import base64

    doc: dict[str, Any] = {"topic": record.topic, "partition": record.partition, "offset": record.offset,
                           "key": record.key, "value": record.value.decode("utf-8", "replace"),
                           "value_base64": base64.b64encode(record.value).decode("ascii")}
    for name in ("timestamp", "producer_id", "event_type", "schema_version", "aggregate_version", "metadata",
                 "event_id", "payload_digest", "transactional_id", "transaction_state"):
        value = getattr(record, name)
        if value is not None:
            doc[name] = value
    if record.producer_id is not None:
        doc["seq_num"] = record.seq_num
        doc["producer_epoch"] = record.producer_epoch
    return doc


_TEMPLATE = re.compile(r"%[tpokvd%]|\\[nt\\]")


def render_template(template: str, record: ConsumerRecord) -> str:
    """A record through a kcat/rpk-style template (``%t %p %o %k %v %d %%``, ``\\n \\t \\\\``); other
    text is copied. The result has no newline added."""
    values = {"%t": record.topic, "%p": str(record.partition), "%o": str(record.offset), "%k": record.key or "",
              "%v": record.value.decode("utf-8", "replace"),
              "%d": "" if record.timestamp is None else str(record.timestamp), "%%": "%",
              "\\n": "\n", "\\t": "\t", "\\\\": "\\"}
    return _TEMPLATE.sub(lambda m: values[m.group(0)], template)


def _format_record(record: ConsumerRecord, fmt: str, key_sep: str | None) -> str:
    """One record as printed: a template as rendered, the named formats as one line."""
    if "%" in fmt:
        return render_template(fmt, record)
    return _format_line(record, fmt, key_sep) + "\n"


def _format_line(record: ConsumerRecord, fmt: str, key_sep: str | None) -> str:
    if fmt == "json":
        return json.dumps(record_document(record), ensure_ascii=False)
    if fmt == "hex":
        return f"{record.partition}\t{record.offset}\t{record.key or ''}\t{record.value.hex()}"
    text = record.value.decode("utf-8", "replace")
    if key_sep is not None:
        return f"{record.key or ''}{key_sep}{text}"
    return text


def cmd_consume(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``consume TOPIC``: print records until the end (or forever with ``--follow``, or ``--max``)."""
    if args.group is not None:
        return _consume_group(args, options, out)
    if args.reset is not None or args.mode is not None:
        raise UsageError("--reset and --mode need --group")
    start: str | int = "earliest" if args.offset is None else args.offset  # from the start, as rpk and kcat
    fmt = "json" if out.json_mode else args.format
    # An explicit offset outside the partition's offsets is an error (exit 1), never a silent jump or nothing.
    reset = "error" if isinstance(start, int) and start >= 0 else "earliest"
    consumer = Consumer(args.topic, args.broker, partitions=args.partition, start=start, auto_offset_reset=reset,
                        isolation_level=args.isolation, wait_ms=args.wait_ms, options=options)
    count = 0
    try:
        records = consumer.records(max_records=args.max, until_end=not args.follow)
        for record in records:
            out.stream.write(_format_record(record, fmt, args.key_sep))
            count += 1
            if count % 1000 == 0:
                out.stream.flush()
        out.stream.flush()
    except KeyboardInterrupt:
        out.stream.flush()
    finally:
        consumer.close()
    return EXIT_OK


def _consume_group(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``consume TOPIC --group G``: a :class:`GroupConsumer` member that prints what it reads and commits
    ``last printed offset + 1`` after each printed batch (at least once: nothing unprinted is committed).

    Without ``--follow`` it stops once its partitions reach the end they had when the command started (or
    when a poll of ``--wait-ms`` finds nothing); it leaves the group on exit (also on Ctrl-C).
    """
    if args.partition or args.offset is not None:
        raise UsageError("--group reads the partitions the group assigns, from its committed offsets: "
                         "--partition and --offset do not apply")
    if args.from_beginning and args.reset not in (None, "earliest"):
        raise UsageError("--from-beginning means --reset earliest")
    reset = args.reset or "earliest"
    mode = args.mode or "poll"
    fmt = "json" if out.json_mode else args.format
    ends: dict[int, int] | None = None
    if not args.follow:
        with Admin(args.broker, options=options) as admin:  # the end as of the start (topic_not_found here)
            ends = {o.partition: o.latest for o in admin.list_offsets(args.topic)}
    consumer = GroupConsumer(args.topic, args.group, args.broker,
                             client_id=args.client_id or f"cursusctl-{os.urandom(3).hex()}", mode=mode,
                             auto_commit=False, auto_offset_reset=reset, isolation_level=args.isolation,
                             wait_ms=args.wait_ms, options=options)
    # Stop on an empty read too (a partition whose tail holds only transaction markers never moves the
    # printed position to its end); STREAM threads may still be connecting, so give them longer.
    idle_limit_s = args.wait_ms / 1000.0 if mode == "poll" else max(2.0, 2 * args.wait_ms / 1000.0)
    poll_timeout_s = max(args.wait_ms, 50) / 1000.0
    count = 0
    try:
        consumer.assignment()  # join now: errors (topic_not_found, ...) surface before any output
        idle_since = time.monotonic()
        while args.max is None or count < args.max:
            if ends is not None:
                positions = consumer.positions()
                if all(positions.get(p, 0) >= ends.get(p, 0) for p in consumer.assignment()):
                    break
            membership = (consumer.generation, tuple(consumer.assignment()))
            records = consumer.poll(poll_timeout_s)
            if membership != (consumer.generation, tuple(consumer.assignment())):
                idle_since = time.monotonic()  # a rebalance: new partitions, new positions
            if not records:
                if ends is not None and time.monotonic() - idle_since >= idle_limit_s:
                    break
                continue
            idle_since = time.monotonic()
            if args.max is not None:
                records = records[:args.max - count]
            if ends is not None:
                records = [r for r in records if r.offset < ends.get(r.partition, 0)]
            if not records:
                continue
            for record in records:
                out.stream.write(_format_record(record, fmt, args.key_sep))
            out.stream.flush()
            count += len(records)
            _commit_printed(consumer, records[0].partition, records[-1].offset + 1)
    except KeyboardInterrupt:
        out.stream.flush()
    finally:
        consumer.close()  # auto_commit=False: commits nothing more, leaves the group
    return EXIT_OK


def _commit_printed(consumer: GroupConsumer, partition: int, offset: int) -> None:
    try:
        consumer.commit({partition: offset})
    except CursusError as exc:
        if not GroupMembership.is_rejoin_error(exc):
            raise
        # The membership ended (rebalance): the next poll rejoins; the new owner may print these again.
        print(f"cursusctl: commit of {consumer.topic}/{partition} not accepted ({exc.code}); rejoining",
              file=sys.stderr)


def _group_status(client: Client, group: str) -> dict[str, Any]:
    return json_reply(client.call(Command.GROUP_STATUS, {"group": group}))


def _assignment_text(member: dict[str, Any], multi_topic: bool) -> list[Any]:
    if multi_topic:
        return list(member.get("topic_assignments") or [])
    return list(member.get("assignments") or [])


def cmd_group(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``group list|describe|offsets``: LIST_GROUPS and GROUP_STATUS."""
    with Client(args.broker, options) as client:
        if args.group_command == "list":
            text = ok_fields(client.call(Command.LIST_GROUPS)).get("groups", "")
            names = [name for name in text.split(",") if name]
            if out.json_mode:
                out.json({"groups": names, "count": len(names)})
            elif out.tty:
                out.table(f"{len(names)} group(s)", ["group"], [[n] for n in names])
            else:
                for name in names:
                    out.line(name)
            return EXIT_OK
        status = _group_status(client, args.group)
        if args.group_command == "offsets":  # log ends from the partition leaders, not the coordinator's replica
            with Admin(client=client) as admin:
                topics = sorted({str(o.get("topic")) for o in status.get("offsets") or []})
                rows = merge_group_offsets(status, {t: admin.list_offsets(t) for t in topics})
            offsets = [{"topic": r.topic, "partition": r.partition, "committed_offset": r.committed,
                        "log_end_offset": r.log_end, "lag": r.lag, "owner": r.owner} for r in rows]
    name = status.get("group_name", args.group)
    members = status.get("members") or []
    if args.group_command == "describe":
        if out.json_mode:
            out.json(status)
            return EXIT_OK
        subscription = status.get("subscription") or {}
        topics = status.get("topics") or []
        summary = {"group": name, "state": status.get("state"), "generation": status.get("generation"),
                   "epoch": status.get("epoch"), "subscription": subscription.get("type"), "topics": topics}
        if subscription.get("pattern") is not None:
            summary["pattern"] = subscription["pattern"]
        summary.update({"partitions": status.get("partition_count"), "members": len(members),
                        "last_rebalance": status.get("last_rebalance")})
        out.fields(f"group {name}", summary)
        multi_topic = len(topics) > 1
        out.table("members", ["member", "assignments", "last_heartbeat"],
                  [[m.get("member_id"), _assignment_text(m, multi_topic), m.get("last_heartbeat")]
                   for m in members])
        return EXIT_OK
    total_lag = sum(int(o.get("lag") or 0) for o in offsets)
    if out.json_mode:
        out.json({"group": name, "state": status.get("state"), "generation": status.get("generation"),
                  "total_lag": total_lag, "offsets": offsets})
        return EXIT_OK
    out.table(f"group {name}: generation {status.get('generation')}, {status.get('state')}, lag {total_lag}",
              ["topic", "partition", "committed", "log_end", "lag", "owner"],
              [[o.get("topic"), o.get("partition"), o.get("committed_offset"), o.get("log_end_offset"),
                o.get("lag"), o.get("owner")] for o in offsets])
    return EXIT_OK


def cmd_txn(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``txn status ID``: TXN_STATUS on the id's coordinator (FIND_COORDINATOR, redirects followed)."""
    with Client(args.broker, options) as client:
        address = None
        try:
            found = ok_fields(client.call(Command.FIND_COORDINATOR, {"transactional_id": args.transactional_id}))
            address = (found["host"], int(found["port"]))
        except (CursusError, KeyError, ValueError):
            address = None  # tolerated: ask the broker given
        fields = ok_fields(client.call(Command.TXN_STATUS, {"transactional_id": args.transactional_id},
                                       address=address))
    if out.json_mode:
        out.json(fields)
    else:
        out.fields(f"transaction {args.transactional_id}", fields)
    return EXIT_OK


def cmd_offsets(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``offsets TOPIC``: earliest/latest/LEO/HWM per partition."""
    with Admin(args.broker, options=options) as admin:
        entries = admin.list_offsets(args.topic, args.partition)
    if out.json_mode:
        out.json({"topic": args.topic, "partitions": [e.to_dict() for e in entries]})
    else:
        out.table(f"offsets {args.topic}", ["partition", "earliest", "latest", "leo", "hwm"],
                  [[e.partition, e.earliest, e.latest, e.leo, e.hwm] for e in entries])
    return EXIT_OK


def cmd_metadata(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``metadata TOPIC``: topic policy and partition leaders/epochs; without TOPIC every topic's
    partitions, leaders and epochs and the brokers leading them (``kcat -L``, ``rpk cluster info``)."""
    if args.topic is None:
        return _cluster_metadata(args, options, out)
    with Admin(args.broker, options=options) as admin:
        metadata: TopicMetadata = admin.metadata(args.topic)
    if out.json_mode:
        out.json(metadata.to_dict())
        return EXIT_OK
    doc = metadata.to_dict()
    leaders, epochs = doc.pop("leaders"), doc.pop("epochs")
    extra = doc.pop("extra", {}) or {}
    out.fields(f"topic {metadata.topic}", {**doc, **extra})
    out.table("partitions", ["partition", "leader", "epoch"],
              [[p, leaders[p] if p < len(leaders) else None, epochs[p] if p < len(epochs) else None]
               for p in range(metadata.partitions)])
    return EXIT_OK


def _cluster_metadata(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    with Admin(args.broker, options=options) as admin:
        topics = [admin.metadata(name) for name in admin.list_topics()]
    rows: list[list[Any]] = [[m.topic, p, m.leaders[p] if p < len(m.leaders) else None,
                              m.epochs[p] if p < len(m.epochs) else None] for m in topics for p in range(m.partitions)]
    brokers = sorted({str(row[2]) for row in rows if row[2]})
    if out.json_mode:
        out.json({"brokers": brokers, "topics": [m.to_dict() for m in topics]})
        return EXIT_OK
    out.fields("cluster", {"brokers": ",".join(brokers) or "-", "topics": len(topics), "partitions": len(rows)})
    out.table("partitions", ["topic", "partition", "leader", "epoch"], rows)
    return EXIT_OK


def cmd_raw(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``raw COMMAND key=value ...``: send the command text and print the reply payload."""
    text = " ".join([args.raw_command, *args.raw_args])
    try:
        command, payload = parse_command_text(text)
    except CommandTextError as exc:
        raise UsageError(str(exc)) from None
    address = parse_address(args.broker)
    try:
        conn = options.connect(address)
    except (OSError, ProtocolError) as exc:
        raise BrokerUnavailableError(f"cannot connect to {args.broker}: {exc}") from None
    with conn:
        try:
            if command == Command.PUBLISH and payload.get("acks", "").strip().lower() in ("0", "none"):
                conn.send(command, encode_crq2(payload))  # the broker never replies to acks=0
                if out.json_mode:
                    out.json({"status": "SENT"})
                return EXIT_OK
            frame = conn.request(command, encode_crq2(payload))
        except TimeoutError:
            raise RequestTimeoutError(f"no reply to {command.name} from {args.broker}") from None
        except (OSError, ProtocolError) as exc:
            raise BrokerUnavailableError(f"{command.name} to {args.broker} failed: {exc}") from None
    if frame.status == Status.ERROR:
        error = error_from_frame(frame)
        if out.json_mode:
            out.json(error_document(error))
        else:
            out.line(error.render())  # the reply, as the reference tool prints it
        return EXIT_FAILURE
    return _print_reply(frame.payload, out)


def _print_reply(payload: bytes, out: Output) -> int:
    if is_cbv2(payload):
        _, _, records = decode_consumed_batch(payload, skip_control=False)
        if out.json_mode:
            out.json({"status": "OK", "records": [record_document(r) for r in records]})
        else:
            out.line(f"OK records={len(records)}")
            for record in records:
                out.line(json.dumps(record_document(record), ensure_ascii=False))
        return EXIT_OK
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = payload.hex()
    if out.json_mode:
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            out.json(doc)
        else:
            try:
                out.json({"status": "OK", "fields": ok_text_fields(text), "text": text})
            except ValueError:
                out.json({"status": "OK", "text": text})
    else:
        out.line(text)
    return EXIT_OK


def cmd_certs(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``certs``: write a development CA and one mTLS certificate per node (:mod:`cursus.cluster.certs`)."""
    from pathlib import Path

    from cursus.cluster.certs import generate_cluster_certs, node_ids  # cryptography: only for this command

    if args.nodes < 1:
        raise UsageError("--nodes must be at least 1")
    try:
        written = generate_cluster_certs(Path(args.out), node_ids(args.nodes),
                                         args.host or ("127.0.0.1", "localhost"))
    except FileExistsError as exc:
        raise UsageError(str(exc)) from None
    out.line(f"ca {written.ca_cert}")
    for files in written.nodes:
        out.line(f"{files.node_id} cert={files.cert} key={files.key}")
    return EXIT_OK


def _status_doc(frame: Frame) -> dict[str, Any]:
    if frame.status == Status.ERROR:
        raise error_from_frame(frame)
    text = frame.payload.decode("utf-8")
    if not text.startswith("OK cluster="):
        raise ValueError(f"unexpected CLUSTER_STATUS reply: {text[:80]}")
    return json.loads(text[len("OK cluster="):])


def _merge_replica_lag(doc: dict[str, Any], options: ConnectionOptions) -> None:
    """Only a partition's leader knows its followers' lag: ask every other active broker for its
    CLUSTER_STATUS and copy the ``replica_lag`` of the partitions it leads (best effort, short timeout)."""
    rows = {p["key"]: p for p in doc.get("partitions", [])}
    for broker in doc.get("brokers", []):
        if broker.get("status") != "active" or not broker.get("client_addr"):
            continue
        if all("replica_lag" in p for p in rows.values() if p["leader"] == broker["id"]):
            continue
        try:
            client = Client(broker["client_addr"], options)
            try:
                other = _status_doc(client.call(Command.CLUSTER_STATUS, timeout_s=3.0, follow_redirects=False))
            finally:
                client.close()
        except Exception:  # an unreachable broker: its partitions show no lag
            continue
        for p in other.get("partitions", []):
            if p["key"] in rows and p["leader"] == broker["id"] and "replica_lag" in p:
                rows[p["key"]]["replica_lag"] = p["replica_lag"]


def cmd_cluster_status(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``cluster-status``: CLUSTER_STATUS as tables (unhealthy rows marked ``UNHEALTHY``) or ``--json``, with
    each follower's lag (records and seconds behind its leader, asked of every leader); exit code 1 when the
    cluster is unhealthy (no Raft leader, an inactive broker, a leaderless or under-replicated partition)."""
    client = Client(args.broker, options)
    try:
        doc = _status_doc(client.call(Command.CLUSTER_STATUS))
    finally:
        client.close()
    _merge_replica_lag(doc, options)
    healthy = bool(doc.get("healthy"))
    if out.json_mode:
        out.json(doc)
        return EXIT_OK if healthy else EXIT_FAILURE
    out.fields("cluster", {key: doc.get(key) for key in (
        "healthy", "raft_leader", "raft_state", "raft_term", "raft_commit_index", "raft_applied_index",
        "active_brokers", "inactive_brokers", "partition_count", "leaderless_partitions",
        "under_replicated_partitions")})
    out.table("brokers", ["state", "id", "status", "client_addr", "internal_addr"],
              [["ok" if b["status"] == "active" else "UNHEALTHY", b["id"], b["status"], b.get("client_addr", ""),
                b.get("addr", "")] for b in doc.get("brokers", [])])
    partitions = [p for p in doc.get("partitions", []) if not (args.unhealthy and p["healthy"])]
    out.table("partitions", ["state", "partition", "leader", "epoch", "replicas", "isr", "committed_hwm", "reasons"],
              [["ok" if p["healthy"] else "UNHEALTHY", p["key"], p["leader"] or "-", p["leader_epoch"],
                ",".join(p["replicas"]), ",".join(p["isr"]), p["committed_hwm"], ",".join(p.get("reasons", []))]
               for p in partitions])
    out.table("replica lag", ["partition", "replica", "in_isr", "lag_records", "lag_s"],
              [[p["key"], replica, "yes" if replica in p["isr"] else "NO", lag["records"], lag["seconds"]]
               for p in partitions for replica, lag in p.get("replica_lag", {}).items()])
    return EXIT_OK if healthy else EXIT_FAILURE


def _event_parsers(commands: Any, common: argparse.ArgumentParser) -> None:
    """``events append|read|version|snapshot`` and ``browse TOPIC`` (docs/event-sourcing.md)."""
    events = commands.add_parser("events", help="event-sourcing streams: append, read, version, snapshot")
    actions = events.add_subparsers(dest="events_command", required=True, metavar="ACTION")
    append = actions.add_parser("append", parents=[common], help="append one event (optimistic version)")
    append.add_argument("topic")
    append.add_argument("key")
    append.add_argument("payload")
    append.add_argument("--version", type=_positive, required=True, help="the version the event takes")
    append.add_argument("--type", default="", dest="event_type", help="event type (e.g. OrderCreated)")
    append.add_argument("--schema-version", type=_non_negative, default=1)
    append.add_argument("--metadata", default="", help="JSON metadata")
    append.add_argument("--event-id", default=None, help="event id (aggregate replay topics)")
    read = actions.add_parser("read", parents=[common], help="snapshot and events of an aggregate")
    read.add_argument("topic")
    read.add_argument("key")
    read.add_argument("--from-version", type=_positive, default=1)
    version = actions.add_parser("version", parents=[common], help="the aggregate's current version")
    version.add_argument("topic")
    version.add_argument("key")
    snapshot = actions.add_parser("snapshot", parents=[common],
                                  help="read the latest snapshot, or save one with --save STATE --version N")
    snapshot.add_argument("topic")
    snapshot.add_argument("key")
    snapshot.add_argument("--save", default=None, metavar="STATE")
    snapshot.add_argument("--version", type=_positive, default=None)
    browse = commands.add_parser("browse", parents=[common], help="committed records of a partition (BROWSE_MESSAGES)")
    browse.add_argument("topic")
    browse.add_argument("--partition", type=_non_negative, default=0)
    browse.add_argument("--offset", type=_non_negative, default=None)
    browse.add_argument("--limit", type=_positive, default=100)


def cmd_events(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``events append|read|version|snapshot``."""
    from cursus.client.events import EventStore

    with EventStore(args.broker, args.topic, options=options) as store:
        action = args.events_command
        if action == "append":
            result = store.append(args.key, args.payload, expected_version=args.version, event_type=args.event_type,
                                  schema_version=args.schema_version, metadata=args.metadata or None,
                                  event_id=args.event_id, producer_id="cursusctl" if args.event_id else None,
                                  seq_num=int(time.time() * 1000) if args.event_id else None)
            doc: dict[str, Any] = {"version": result.version, "offset": result.offset, "partition": result.partition}
            out.json(doc) if out.json_mode else out.fields(f"append {args.key}", doc)
        elif action == "read":
            agg = store.read(args.key, args.from_version)
            snap = {"version": agg.snapshot.version, "payload": agg.snapshot.payload} if agg.snapshot else None
            events = [{"version": e.version, "offset": e.offset, "event_type": e.event_type,
                       "schema_version": e.schema_version, "metadata": e.metadata,
                       "payload": e.payload.decode("utf-8", "replace")} for e in agg.events]
            if out.json_mode:
                out.json({"key": args.key, "partition": agg.partition, "snapshot": snap, "events": events})
            else:
                if snap is not None:
                    out.line(f"snapshot version={snap['version']} payload={snap['payload']}")
                out.table(f"events {args.key}", ["version", "offset", "event_type", "payload"],
                          [[e["version"], e["offset"], e["event_type"], e["payload"]] for e in events])
        elif action == "version":
            doc = {"key": args.key, "version": store.version(args.key)}
            out.json(doc) if out.json_mode else out.fields(f"version {args.key}", doc)
        else:
            if args.save is not None:
                if args.version is None:
                    raise UsageError("snapshot --save needs --version")
                store.save_snapshot(args.key, args.version, args.save)
            found = store.read_snapshot(args.key)
            doc = {"key": args.key, "version": found.version if found else None,
                   "payload": found.payload if found else None}
            out.json(doc) if out.json_mode else out.fields(f"snapshot {args.key}", doc)
    return EXIT_OK


def cmd_browse(args: argparse.Namespace, options: ConnectionOptions, out: Output) -> int:
    """``browse TOPIC``: BROWSE_MESSAGES (two frames: next_offset, then a CBV2 batch); commits nothing."""
    fields = {"topic": args.topic, "partition": str(args.partition), "limit": str(args.limit)}
    if args.offset is not None:
        fields["offset"] = str(args.offset)
    with Client(args.broker, options) as client:
        conn = client.connection()
        request_id = conn.send(Command.BROWSE_MESSAGES, encode_crq2(CommandPayload((), fields)))
        first = conn.receive(request_id, Command.BROWSE_MESSAGES)
        if first.status == Status.ERROR:
            raise error_from_frame(first)
        envelope = json.loads(first.payload)
        batch = conn.receive(request_id, Command.BROWSE_MESSAGES)
    records = decode_batch(batch.payload).records if batch.payload else []
    rows = [{"offset": r.offset, "key": r.key, "event_type": r.event_type, "version": r.aggregate_version,
             "payload": bytes(r.payload).decode("utf-8", "replace")} for r in records]
    if out.json_mode:
        out.json({"topic": args.topic, "partition": args.partition, "next_offset": envelope.get("next_offset"),
                  "records": rows})
    else:
        out.table(f"browse {args.topic}/{args.partition}", ["offset", "key", "event_type", "version", "payload"],
                  [[r["offset"], r["key"], r["event_type"], r["version"], r["payload"]] for r in rows])
        out.line(f"next_offset={envelope.get('next_offset')}")
    return EXIT_OK


_HANDLERS = {"cluster-status": cmd_cluster_status, "topic": cmd_topic, "produce": cmd_produce, "consume": cmd_consume, "group": cmd_group,
             "offsets": cmd_offsets, "metadata": cmd_metadata, "raw": cmd_raw, "certs": cmd_certs, "txn": cmd_txn,
             "events": cmd_events, "browse": cmd_browse}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cursusctl``; returns the exit code (0 ok, 1 broker/runtime error, 2 usage error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    if args.command is None:  # bare ``cursusctl``: what it can do
        parser.print_help()
        return EXIT_OK
    out: Output | None = None
    try:
        _finish_globals(args)
        out = Output(args.json)
        options = connection_options(args)
        with sigterm_exits():  # SIGTERM unwinds like Ctrl-C: a group member leaves its group (exit 143)
            return _HANDLERS[args.command](args, options, out)
    except UsageError as exc:
        print(f"cursusctl: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CursusError as exc:
        if out is not None and out.json_mode:
            out.json(error_document(exc))
        print(exc.render(), file=sys.stderr)
        hint = next_step(exc)
        if hint:
            print(f"cursusctl: {hint}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")  # silence the flush at exit
        except OSError:
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as exc:
        print(f"cursusctl: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
