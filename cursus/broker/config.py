"""Broker configuration: one table of keys, four sources.

Every key the broker understands is a row of :data:`SETTINGS` (name, type, default, unit, meaning). The
documentation page ``docs/configuration.md`` is generated from the same table, so it cannot drift.

Sources, lowest precedence first (facts decision 15): built-in defaults < YAML config file (``--config`` or
``CONFIG_PATH``; flat keys) < environment variables (the upper-case key name, plus the reference broker's
irregular aliases) < command-line flags. An unknown key or an invalid value raises :class:`ConfigError`
naming the key; a reference-broker key that Cursus-py does not implement is accepted with a warning.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cursus.broker.auth import parse_users

MIB = 1024 * 1024


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names the key."""


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip(), 10)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def _parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        number = float(value if isinstance(value, int | float) else str(value).strip())
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _parse_members(value: Any) -> tuple[str, ...]:
    """``static_cluster_members``: a YAML list or a comma-separated string of ``<id>@<host>:<port>``."""
    items = value if isinstance(value, (list, tuple)) else [] if value in (None, "") else str(value).split(",")
    members = tuple(str(item).strip() for item in items if str(item).strip())
    for member in members:
        member_id, at, address = member.partition("@")
        host, colon, port = address.rpartition(":")
        if not (member_id and at and host and colon and port.isdigit()):
            raise ValueError(f"expected <broker-id>@<host>:<raft_port>, got {member!r}")
    return members


def _parse_str(value: Any) -> str:
    if isinstance(value, (dict, list)):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return str(value)


@dataclass(frozen=True, slots=True)
class Setting:
    """One configuration key: its parser, default, unit and meaning, and a range check."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    unit: str
    doc: str
    minimum: int | None = None
    choices: tuple[str, ...] | None = None
    env_aliases: tuple[str, ...] = ()

    def coerce(self, raw: Any, source: str | None = None) -> Any:
        """Parse and check ``raw``. ``source`` names where it came from (``environment variable X``, a file)
        for the message. Raises :class:`ConfigError` naming the key, the source and the expected form."""
        where = f"{self.name} (from {source})" if source else self.name
        try:
            value = self.parse(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid value for {where}: {exc}{_hint(raw, source)}") from None
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"invalid value for {where}: must be >= {self.minimum}, got {value}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"invalid value for {where}: must be one of {', '.join(self.choices)}, got {value!r}")
        return value


def _hint(raw: Any, source: str | None) -> str:
    """What to do about a value Kubernetes injected: ``<SERVICE>_PORT=tcp://<ip>:<port>`` for every Service
    in the namespace, so a Service named ``broker`` sets ``BROKER_PORT`` to a URL."""
    if source and source.startswith("environment variable") and str(raw).startswith(("tcp://", "udp://")):
        return ("; this looks like a Kubernetes service link (a Service named after the variable's prefix "
                "sets it): set the variable to a plain number in the pod spec, rename the Service, or set "
                "enableServiceLinks: false")
    return ""


_B, _I, _S = _parse_bool, _parse_int, _parse_str

#: The single table of supported keys. Timers are all configurable so tests can use short values.
SETTINGS: tuple[Setting, ...] = (
    Setting("host", _S, "0.0.0.0", "address", "Bind address of the client listener."),
    Setting("broker_port", _I, 9000, "port", "Client listener port (Wire v2). 0 picks a free port.", 0),
    Setting("health_check_port", _I, 9080, "port", "HTTP health port (/live, /ready). 0 picks a free port; -1 disables.", -1),
    Setting("exporter_port", _I, 9100, "port", "Prometheus metrics port. 0 picks a free port; -1 disables.", -1),
    Setting("advertised_host", _S, "", "host", "Host handed to clients in METADATA, FIND_COORDINATOR and redirects. Empty: the bind address, or 127.0.0.1 for a wildcard bind."),
    Setting("broker_id", _S, "", "id", "This broker's id in the metadata registry (replicas, ISR, FIND_COORDINATOR). Empty: `<advertised_host>-<port>` with the bound client port."),
    Setting("log_dir", _S, "broker-logs", "path", "Data directory (topic logs, manifest, offsets)."),
    Setting("recovery_threads", _I, 0, "threads", "Threads that open partitions (log recovery, producer-state rebuild) at startup and on CREATE. 0: min(4, CPUs).", 0),
    Setting("log_segment_bytes", _I, 1 << 30, "bytes", "Roll a partition segment when it would exceed this size.", 4096),
    Setting("log_segment_roll_ms", _I, 7 * 24 * 3600 * 1000, "ms", "Roll a partition segment when its first chunk is older than this.", 1),
    Setting("log_index_interval_bytes", _I, 4096, "bytes", "Log bytes between two sparse offset-index entries.", 1),
    Setting("log_recovery_point_interval_ms", _I, 1000, "ms", "How often partition checkpoints (recovery point, HWM) are written.", 1),
    Setting("log_retention_hours", _I, 168, "hours", "Broker default time retention; -1 keeps forever.", -1),
    Setting("log_retention_ms", _I, -1, "ms", "Broker default time retention in ms; overrides log_retention_hours when >= 0.", -1),
    Setting("log_retention_bytes", _I, -1, "bytes", "Broker default size retention per partition; -1 keeps all.", -1),
    Setting("log_retention_check_interval_ms", _I, 300_000, "ms", "Interval of the retention task.", 1),
    Setting("topic_cleanup_retry_interval_ms", _I, 10_000, "ms", "How often node-local cleanup of a deleted or truncated topic that failed (storage reset or removal, group offsets, transaction references; `cleanup_pending=true`) is retried.", 10),
    Setting("partition_open_retry_backoff_ms", _I, 1_000, "ms", "Backoff before a failed open of a local partition replica (corrupt log that cannot be repaired, I/O error) is retried; doubles per failure up to 60 times this value.", 10),
    Setting("partition_open_max_attempts", _I, 8, "attempts", "Failed opens of one local partition replica before the reconciler gives up on it (logged, `cursus_partition_open_failures_total{outcome=\"gave_up\"}`) until a restart, a new topic generation or an explicit wait for it.", 1),
    Setting("max_message_bytes", _I, 1 * MIB, "bytes", "Largest single record the broker accepts.", 64),
    Setting("max_client_connections", _I, 1000, "connections", "Concurrent client connections; further clients wait in the accept backlog (with client_idle_timeout_ms, idle clients cannot hold every slot for long).", 1),
    Setting("client_idle_timeout_ms", _I, 600_000, "ms", "Close a client connection with no request in flight for this long (as Kafka's connections.max.idle.ms, 10 min; an open STREAM or long poll is not idle); the SDK reopens such a connection before its next request; 0 never closes idle connections.", 0),
    Setting("max_inflight_request_bytes", _I, 256 * MIB, "bytes", "Broker-wide budget for request payloads being read or handled (encoded + decoded).", 2 * 64 * MIB),
    Setting("producer_state_ttl_ms", _I, 1_800_000, "ms", "Idle time after which an idempotent producer's sequence state expires.", 1),
    Setting("transaction_timeout_ms", _I, 60_000, "ms", "An open transaction not ended within this long after BEGIN_TXN is aborted by the coordinator (durable prepare_abort, abort markers).", 1),
    Setting("transactional_id_expiration_ms", _I, 604_800_000, "ms", "A finished transaction keeps its participants and offsets this long; then only a compact epoch tombstone of its id remains (re-initialization still gets the next epoch).", 1),
    Setting("transaction_state_max_bytes", _I, 60 * 1024, "bytes", "Largest encoded coordinator state of one transactional id (its participant partitions and staged offsets, in its largest later form): a TXN_PUBLISH to a new partition or a SEND_OFFSETS_TO_TXN that would exceed it is refused with transaction_too_large before anything changes. In a cluster it is also capped by the Raft command limit (64 KiB per TxnSync).", 1024),
    Setting("transaction_journal_compact_records", _I, 256, "records", "Compact __transaction_state.journal (rewrite the latest record per transactional id) once this many records are superseded.", 1),
    Setting("min_insync_replicas", _I, 0, "replicas", "Broker default minimum ISR for acks=all. 0: 2 in a cluster, 1 standalone.", 0),
    Setting("default_replication_factor", _I, 3, "replicas", "Replication factor for topics created without one (capped at the active brokers standalone, which records 1).", 1),
    Setting("default_partitions", _I, 4, "partitions", "Partition count for topics created without one.", 1),
    Setting("log_cleanup_policy", _S, "delete", "policy", "Broker default cleanup policy for new topics.", choices=("delete",)),
    Setting("consume_max_bytes_limit", _I, 16 * MIB, "bytes", "Upper bound on a CONSUME/STREAM reply's records (caps max_bytes; must stay below the 64 MiB frame limit).", 1),
    Setting("client_request_timeout_ms", _I, 30_000, "ms", "Deadline for receiving a request's payload once its header arrived, and for writing a reply; a connection that misses it is closed.", 1),
    Setting("consume_default_max_bytes", _I, 1 * MIB, "bytes", "CONSUME reply byte limit when the request gives no max_bytes.", 1),
    Setting("use_tls", _B, False, "bool", "Serve the client listener over TLS (1.2 minimum)."),
    Setting("tls_cert_path", _S, "", "path", "PEM certificate chain of the client listener."),
    Setting("tls_key_path", _S, "", "path", "PEM private key of the client listener."),
    Setting("tls_ca_path", _S, "", "path", "PEM CA bundle; when set, clients must present a certificate it signed."),
    Setting("tls_handshake_timeout_ms", _I, 10_000, "ms", "A client that does not finish the TLS handshake in time is dropped.", 1),
    Setting("enable_sasl", _B, False, "bool", "Require token authentication (`AUTH principal= token=` or inline `principal= auth_token=`) and the permissions of `sasl_users` on the client listener (see docs/security.md)."),
    Setting("sasl_users", parse_users, (), "list", "Users of token authentication: a YAML list of `{principal, token, permissions}` (permissions: `admin`, `topic.read`, `topic.write`, `group`, `transaction`, `*`; a non-empty list each), or in the environment (`SASL_USERS`) `principal:token:perm\\|perm,...` or a JSON list. Tokens are secrets: never logged or shown."),
    Setting("auth_failure_delay_ms", _I, 100, "ms", "A failed AUTH (or inline credentials) is answered `authentication_failed` after this fixed delay (slows guessing; the connection stays usable).", 0),
    Setting("shutdown_grace_ms", _I, 10_000, "ms", "How long a clean shutdown waits for in-flight requests.", 0),
    Setting("consumer_session_timeout_ms", _I, 30_000, "ms", "A group member without a heartbeat for this long is removed and its group rebalances.", 1),
    Setting("offsets_topic_num_partitions", _I, 1, "partitions", "Partitions of the internal __consumer_offsets topic (used only when it is created).", 1),
    Setting("offsets_topic_segment_bytes", _I, 4 * MIB, "bytes", "Segment size of __consumer_offsets (the log cleaner compacts closed segments only, so small segments keep replay short).", 4096),
    Setting("max_stream_connections", _I, 1000, "streams", "Concurrent STREAM requests; further ones get too_many_connections.", 1),
    Setting("stream_timeout_ms", _I, 1_800_000, "ms", "Close a STREAM (reason=timeout) after this long without client activity (stream open, member heartbeat, group commit).", 1),
    Setting("stream_keepalive_ms", _I, 3000, "ms", "Idle STREAMs get an empty keepalive frame this often; values above 3000 are capped at 3000.", 1),
    Setting("stream_batch_wait_ms", _I, 100, "ms", "How long a woken STREAM waits for a fuller batch before sending.", 0),
    Setting("offload_threshold_bytes", _I, 256 * 1024, "bytes", "Payloads and replies at least this large are checksummed, (de)compressed and parsed, and partition reads expected this large are done, on the offload threads instead of the event loop; 0 offloads all.", 0),
    Setting("offload_threads", _I, 2, "threads", "Threads of the offload pool (see offload_threshold_bytes).", 1),
    Setting("enabled_distribution", _B, False, "bool", "Run as a member of a Raft metadata cluster (see docs/cluster.md).", env_aliases=("ENABLE_DISTRIBUTION",)),
    Setting("raft_port", _I, 9001, "port", "Raft (metadata) listener port on advertised_host; always mutual TLS.", 1),
    Setting("internal_broker_port", _I, 0, "port", "Port of the internal broker-to-broker listener (gRPC, replication fetches); 0 is off.", 0),
    Setting("internal_advertised_address", _S, "", "address", "`host:port` other brokers dial for internal requests, registered in the broker registry. Empty: `<advertised_host>:<internal_broker_port>`."),
    Setting("static_cluster_members", _parse_members, (), "list", "Every cluster member as `<broker-id>@<host>:<raft_port>` (YAML list or comma-separated); this broker's id must be among them."),
    Setting("bootstrap_cluster", _B, False, "bool", "Accepted for the reference's deployments; with static membership every member takes part in the first election from empty Raft directories, so it changes nothing yet."),
    Setting("transaction_coordinator_shards", _I, 50, "shards", "Transaction-coordinator shards, fixed when the cluster is created; a broker configured with another count is refused.", 1),
    Setting("internal_auth_token", _S, "", "token", "Shared secret of broker-to-broker requests; required (non-empty, no whitespace) in a cluster."),
    Setting("internal_auth_token_next", _S, "", "token", "The next internal token during a rotation: accepted as well as internal_auth_token (secret, never logged). Empty: none."),
    Setting("internal_use_tls", _B, False, "bool", "Mutual TLS for broker-to-broker traffic (Raft and internal requests). Required in a cluster unless allow_insecure_cluster_transport."),
    Setting("internal_tls_cert_path", _S, "", "path", "PEM certificate of this node for internal TLS (`cursusctl certs` writes `<broker-id>.crt`)."),
    Setting("internal_tls_key_path", _S, "", "path", "PEM private key of this node for internal TLS."),
    Setting("internal_tls_ca_path", _S, "", "path", "PEM CA that signs every member's internal certificate."),
    Setting("allow_insecure_cluster_transport", _B, False, "bool", "Tests only: start a cluster without internal_use_tls. The Raft transport itself is always mutual TLS, so the internal TLS paths are still needed."),
    Setting("raft_election_timeout_min_ms", _I, 400, "ms", "Lower bound of the randomized Raft election timeout (must exceed 3 x raft_heartbeat_ms).", 1),
    Setting("raft_election_timeout_max_ms", _I, 1000, "ms", "Upper bound of the randomized Raft election timeout; also how long a leader cut off from a majority keeps believing it leads.", 1),
    Setting("raft_heartbeat_ms", _I, 100, "ms", "Raft AppendEntries (heartbeat and batching) period.", 1),
    Setting("raft_poll_interval_ms", _I, 50, "ms", "Idle wait of the Raft tick thread; a submitted command wakes it at once, and commands submitted meanwhile travel as one batch.", 1),
    Setting("raft_snapshot_min_entries", _I, 5000, "entries", "Snapshot the metadata state after this many applied Raft entries (and raft_snapshot_interval_ms).", 1),
    Setting("raft_snapshot_interval_ms", _I, 300_000, "ms", "Minimum time between two metadata snapshots.", 1),
    Setting("metadata_commit_timeout_ms", _I, 5000, "ms", "How long a metadata mutation waits for its Raft commit; after it the outcome is unknown (retry is safe: the request id applies once).", 1),
    Setting("broker_heartbeat_interval_ms", _I, 1000, "ms", "How often a cluster broker commits its liveness heartbeat, and the controller checks for missed ones.", 1),
    Setting("broker_session_timeout_ms", _I, 3000, "ms", "The controller marks a broker inactive (it leaves every ISR) when no heartbeat of it was applied for this long.", 1),
    Setting("replica_lag_time_max_ms", _I, 10_000, "ms", "A follower that has not caught up to the leader's LEO for this long leaves the ISR (a committed ISR change).", 1),
    Setting("replica_fetch_max_bytes", _I, 1 * MIB, "bytes", "Bytes a leader serves per partition in one replica fetch (the first chunk may exceed it, so progress is always possible).", 1),
    Setting("replica_fetch_response_max_bytes", _I, 8 * MIB, "bytes", "Bytes a leader serves in one replica fetch response over all partitions.", 1),
    Setting("replica_fetch_wait_max_ms", _I, 500, "ms", "How long a leader holds a replica fetch that has nothing new (long poll).", 0),
    Setting("replica_isr_check_interval_ms", _I, 1000, "ms", "How often a partition leader checks its followers' lag and proposes ISR shrinks and expansions.", 10),
    Setting("replica_fetch_backoff_ms", _I, 100, "ms", "Wait after a failed replica fetch or a failed committed-HWM submit before retrying.", 1),
    Setting("replica_ack_timeout_ms", _I, 10_000, "ms", "How long an acks=all PUBLISH waits for the captured ISR and the committed HWM; then it answers replication_unavailable outcome=unknown (retryable: idempotent retries deduplicate).", 1),
    Setting("replica_hwm_commits_in_flight", _I, 2, "commands", "CommitHwm metadata commands a broker keeps in flight at once (pipelined; candidates that move while all are busy are coalesced into the next).", 1),
    Setting("loop_probe_interval_ms", _I, 100, "ms", "How often the stall probe checks the event loop's lateness (cursus_event_loop_max_stall_seconds).", 1),
    Setting("log_cleanup_interval", _parse_float, 300.0, "s", "How often the log cleaner checks compacted topics' partitions (cleanup_policy compact or delete,compact); seconds, fractions allowed.", 0),
    Setting("log_min_cleanable_dirty_ratio", _parse_float, 0.5, "ratio", "Clean a compacted partition once this share of its cleanable bytes (closed segments below the HWM and LSO) was never cleaned; 0 cleans at every check.", 0),
    Setting("log_cleaner_delete_retention_ms", _I, 86_400_000, "ms", "A tombstone (keyed record with an empty value) survives cleaning this long after its append, so lagging consumers see the delete.", 0),
    Setting("log_cleaner_io_max_bytes_per_second", _I, 64 * MIB, "bytes/s", "Log cleaner read plus write rate limit; 0 is unlimited.", 0),
    Setting("eventstore_checkpoint_interval_events", _I, 10_000, "events", "Write a partition's stream-index checkpoint after this many newly indexed events (a restart rescans the committed log only from the checkpoint).", 1),
    Setting("eventstore_max_read_events", _I, 100_000, "events", "Most events one READ_STREAM or AGGREGATE_EVENT_RANGE_READ returns.", 1),
    Setting("eventstore_index_interval_ms", _I, 1000, "ms", "How often every event-sourcing partition (leader or follower) indexes its newly committed events in the background, so a new leader serves at once; 0 indexes only on demand.", 0),
    Setting("max_in_flight_requests_per_connection", _I, 5, "requests", "PUBLISH requests of one connection that may wait for their durability (or replication) at once while the broker reads the next ones; replies still leave in request order. 1 serves one request at a time.", 1),
)

SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}

#: Reference-broker keys that are accepted (with a warning) but have no effect here yet.
REFERENCE_KEYS_NOT_IMPLEMENTED: frozenset[str] = frozenset(
    {
        "enable_exporter", "discovery_port", "disk_flush_batch_size",
        "linger_ms", "disk_flush_interval_ms", "disk_write_timeout_ms", "channel_buffer_size", "compression_type",
        "log_index_size_bytes", "log_min_cleanable_dirty_ratio", "log_cleanup_interval",
        "raft_snapshot_threshold", "raft_trailing_logs",
        "enable_idempotence",
        "transaction_recovery_batch_size",
        "consumer_heartbeat_check_ms", "stream_timeout", "stream_heartbeat_interval",
        "max_inflight_requests", "observation_grpc_port",
    }
)


#: Keys Cursus-py once had and no longer uses: accepted with a warning (old config files keep working).
RETIRED_KEYS: Mapping[str, str] = {
    "offsets_compaction_min_records": "__consumer_offsets is compacted by the log cleaner "
                                      "(log_min_cleanable_dirty_ratio, log_cleanup_interval)",
}


#: Keys whose values are secrets: never logged, redacted in ``repr`` (``sasl_users`` keeps only token
#: digests, and its users' ``repr`` hides those).
SECRET_KEYS: frozenset[str] = frozenset({"internal_auth_token", "internal_auth_token_next"})


@dataclass(frozen=True, slots=True, repr=False)
class BrokerConfig:
    """Resolved configuration. Field names are the configuration keys (see :data:`SETTINGS`). Its ``repr``
    redacts :data:`SECRET_KEYS`."""

    values: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def __repr__(self) -> str:
        shown = {k: ("<redacted>" if k in SECRET_KEYS and v else v) for k, v in self.values.items()}
        return f"BrokerConfig(values={shown!r}, warnings={self.warnings!r})"

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def advertised(self) -> str:
        """The host clients are told to connect to; never a wildcard address."""
        if self.values["advertised_host"]:
            return str(self.values["advertised_host"])
        host = str(self.values["host"])
        return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    def replace(self, **changes: Any) -> BrokerConfig:
        merged = dict(self.values)
        for key, raw in changes.items():
            merged[key] = SETTINGS_BY_NAME[key].coerce(raw)
        return dataclasses.replace(self, values=merged)


def _env_names(setting: Setting) -> tuple[str, ...]:
    return (setting.name.upper(), *setting.env_aliases)


def load_config(
    *,
    config_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> BrokerConfig:
    """Resolve the configuration from defaults, a YAML file, the environment and flag overrides.

    Args:
        config_path: flat YAML file; when None, ``CONFIG_PATH`` from ``environ`` is used if set.
        environ: environment mapping (defaults to ``os.environ``); upper-case key names override the file.
        overrides: values from command-line flags (highest precedence); None values are ignored.

    Raises:
        ConfigError: unreadable file, non-mapping YAML, unknown key, or invalid value (message names the key).
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {s.name: s.default for s in SETTINGS}
    warnings: list[str] = []

    path = config_path if config_path is not None else env.get("CONFIG_PATH") or None
    if path is not None:
        import yaml

        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must be a flat mapping of keys to values")
        for key, raw in loaded.items():
            key = str(key)
            if key in SETTINGS_BY_NAME:
                values[key] = SETTINGS_BY_NAME[key].coerce(raw, f"config file {path}")
            elif key in REFERENCE_KEYS_NOT_IMPLEMENTED:
                warnings.append(f"config key {key} is not implemented by Cursus-py and is ignored")
            elif key in RETIRED_KEYS:
                warnings.append(f"config key {key} is no longer used and is ignored: {RETIRED_KEYS[key]}")
            else:
                raise ConfigError(f"unknown config key {key} in {path}")

    for setting in SETTINGS:
        for env_name in _env_names(setting):
            if env_name in env:
                values[setting.name] = setting.coerce(env[env_name], f"environment variable {env_name}")
    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key in RETIRED_KEYS:
            warnings.append(f"config key {key} is no longer used and is ignored: {RETIRED_KEYS[key]}")
            continue
        if key not in SETTINGS_BY_NAME:
            raise ConfigError(f"unknown config key {key}")
        values[key] = SETTINGS_BY_NAME[key].coerce(raw, "the command line")
    if values["consume_max_bytes_limit"] > 48 * MIB:
        raise ConfigError("invalid value for consume_max_bytes_limit: at most 48 MiB, so replies fit a 64 MiB frame")
    if values["enable_sasl"] and not values["sasl_users"]:
        raise ConfigError("enable_sasl=true needs sasl_users: at least one {principal, token, permissions} entry")
    if values["min_insync_replicas"] == 0:
        values["min_insync_replicas"] = 2 if values["enabled_distribution"] else 1
    if values["enabled_distribution"]:
        _check_distribution(values)
    return BrokerConfig(values=values, warnings=tuple(warnings))


def _check_distribution(values: Mapping[str, Any]) -> None:
    """Distributed mode needs an internal token and authenticated transport (facts B7 "Internal security")."""
    token = values["internal_auth_token"]
    if not token or any(ch.isspace() for ch in token):
        raise ConfigError("internal_auth_token is required in distributed mode (non-empty, no whitespace)")
    if any(ch.isspace() for ch in values["internal_auth_token_next"]):
        raise ConfigError("invalid value for internal_auth_token_next: no whitespace allowed")
    if not values["internal_use_tls"] and not values["allow_insecure_cluster_transport"]:
        raise ConfigError("internal_use_tls is required in distributed mode "
                          "(or allow_insecure_cluster_transport, for tests only)")
    for key in ("internal_tls_cert_path", "internal_tls_key_path", "internal_tls_ca_path"):
        if not values[key]:
            raise ConfigError(f"{key} is required in distributed mode: the Raft transport is always mutual TLS")
    if not values["internal_broker_port"]:
        raise ConfigError("internal_broker_port is required in distributed mode: followers fetch records "
                          "from partition leaders over it")
    if not values["static_cluster_members"]:
        raise ConfigError("static_cluster_members is required in distributed mode")
    if not values["raft_election_timeout_min_ms"] > 3 * values["raft_heartbeat_ms"]:
        raise ConfigError("invalid value for raft_election_timeout_min_ms: must exceed 3 x raft_heartbeat_ms")
    if not values["raft_election_timeout_max_ms"] > values["raft_election_timeout_min_ms"]:
        raise ConfigError("invalid value for raft_election_timeout_max_ms: must exceed raft_election_timeout_min_ms")


def render_markdown() -> str:
    """The configuration reference page (``docs/configuration.md`` body) from :data:`SETTINGS`."""
    lines = [
        "| key | default | unit | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        default = "`" + str(s.default).lower() + "`" if isinstance(s.default, bool) else f"`{s.default}`"
        if s.default == "":
            default = "(empty)"
        lines.append(f"| `{s.name}` | {default} | {s.unit} | {s.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m cursus.broker.config > docs/configuration.md
    print(
        "# Configuration\n\n"
        "Generated from `cursus/broker/config.py` (`python -m cursus.broker.config > docs/configuration.md`);\n"
        "a test fails when this page and the code disagree.\n\n"
        "Sources, lowest precedence first: defaults, the flat YAML file (`--config FILE` or `CONFIG_PATH`),\n"
        "environment variables (the upper-case key, e.g. `BROKER_PORT=9000`), command-line flags\n"
        "(`--port`, `--host`, `--log-dir`, `--health-port`, `--metrics-port`, `--advertised-host`, and\n"
        "`--set key=value` for any key). An unknown key or an invalid value stops startup with a message naming\n"
        "the key; a key of the reference broker that Cursus-py does not implement is accepted with a warning,\n"
        f"and so is a retired key ({', '.join(f'`{k}`' for k in sorted(RETIRED_KEYS))}).\n"
    )
    print(render_markdown(), end="")
