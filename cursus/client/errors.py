"""Typed SDK exceptions mirroring the Wire v2 error classes (spec section 7, facts A7).

Every exception the SDK raises on purpose is a :class:`CursusError`. Broker ERROR replies become the subclass
of their error class (``ValidationError``, ``AuthorizationError``, ``RoutingError``, ``AvailabilityError``,
``ConflictError``, ``FencingError``, ``NotFoundError``, ``InternalError``), or a more specific subclass of it
for the codes a client acts on (``NotLeaderError``, ``OffsetOutOfRangeError``, ``ProducerFencedError``, ...).
Client-side failures (connection lost, timeouts, closed clients) use the same hierarchy with their own codes,
so ``except AvailabilityError`` catches "the broker is unreachable right now" whichever side noticed it.

Each exception carries:

* ``code``: the error code (``topic_not_found``, ``NOT_LEADER``, ...);
* ``error_class``: a :class:`cursus.wire.ErrorClass`;
* ``retryable``: the broker's (or our) retry eligibility signal: the same logical operation may be
  attempted again after applying the reply's instructions. It is never a promise that a blind retry is safe;
* ``fields``: the typed error's key/value fields (``leader``, ``earliest``, ...);
* ``message``: free text, possibly empty.

``str(exc)`` is the rendered wire form ``ERROR: <code> class=<class> retryable=<bool> k=v ... <message>``,
exactly what ``cursusctl`` prints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from cursus.wire import ErrorClass, Frame, ProtocolError, Status, TypedError, classify, decode_error

__all__ = [
    "VersionConflictError",
    "AuthenticationError",
    "AuthorizationError",
    "AvailabilityError",
    "BrokerUnavailableError",
    "BufferFullError",
    "ClientClosedError",
    "ConflictError",
    "CursusError",
    "DeliveryFailedError",
    "DeliveryTimeoutError",
    "DeliveryUnknownError",
    "FencingError",
    "InternalError",
    "NotCoordinatorError",
    "NotFoundError",
    "NotLeaderError",
    "OffsetOutOfRangeError",
    "ProducerFencedError",
    "ProtocolViolationError",
    "RequestTimeoutError",
    "RoutingError",
    "SequenceError",
    "TlsError",
    "TopicNotFoundError",
    "UnsupportedFeatureError",
    "ValidationError",
    "error_from_ack",
    "error_from_frame",
    "error_from_typed",
]


class CursusError(Exception):
    """Base of every SDK error: a broker ERROR reply or a client-side failure.

    Args:
        code: error code, non-empty.
        message: free text (may be empty).
        error_class: class of the error; default: the broker registry's class for ``code``.
        retryable: retry eligibility; default: the registry's flag for ``code``.
        fields: typed error fields (string keys and values).
    """

    #: The class a subclass stands for; ``CursusError`` itself uses the registry.
    default_class: ClassVar[ErrorClass | None] = None

    def __init__(self, code: str, message: str = "", *, error_class: ErrorClass | None = None,
                 retryable: bool | None = None, fields: Mapping[str, str] | None = None) -> None:
        registry_class, registry_retryable = classify(code)
        self.code = code
        self.error_class: ErrorClass = ErrorClass(
            error_class if error_class is not None else (self.default_class or registry_class))
        self.retryable: bool = registry_retryable if retryable is None else bool(retryable)
        self.fields: dict[str, str] = {str(k): str(v) for k, v in (fields or {}).items()}
        self.message = message
        super().__init__(self.render())

    @property
    def typed(self) -> TypedError:
        """The error as a wire :class:`~cursus.wire.TypedError`."""
        return TypedError(self.code, self.error_class, self.retryable, self.message, dict(self.fields))

    def render(self) -> str:
        """``ERROR: <code> class=<class> retryable=<bool> k=v ... <message>`` (facts A7)."""
        return self.typed.render()

    def __str__(self) -> str:
        return self.render()

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes despite keyword-only arguments
        return (_rebuild, (type(self), self.code, self.message, int(self.error_class), self.retryable,
                           dict(self.fields)))


def _rebuild(cls: type[CursusError], code: str, message: str, error_class: int, retryable: bool,
             fields: dict[str, str]) -> CursusError:
    err = cls.__new__(cls)
    CursusError.__init__(err, code, message, error_class=ErrorClass(error_class), retryable=retryable,
                         fields=fields)
    return err


class ValidationError(CursusError):
    """The request is invalid (syntax, value, state precondition). Correct it; do not repeat it unchanged."""

    default_class = ErrorClass.VALIDATION


class AuthorizationError(CursusError):
    """Authentication is missing or the principal may not do this. Fail closed."""

    default_class = ErrorClass.AUTHORIZATION


class RoutingError(CursusError):
    """The request reached the wrong broker; follow the redirect fields and retry."""

    default_class = ErrorClass.ROUTING


class AvailabilityError(CursusError):
    """A broker or subsystem is temporarily unavailable (or unreachable); back off and retry if safe."""

    default_class = ErrorClass.AVAILABILITY


class ConflictError(CursusError):
    """The request conflicts with authoritative state; refresh state and decide what to send."""

    default_class = ErrorClass.CONFLICT


class FencingError(CursusError):
    """Producer epoch, group generation, member or ownership is stale; recreate state or rejoin."""

    default_class = ErrorClass.FENCING


class NotFoundError(CursusError):
    """The topic, partition, group or transaction does not exist."""

    default_class = ErrorClass.NOT_FOUND


class InternalError(CursusError):
    """The broker (or the SDK) could not classify a safe recovery action. Fail closed."""

    default_class = ErrorClass.INTERNAL


# ------------------------------------------------------------------------------------------ specific codes


def _int_field(fields: Mapping[str, str], key: str) -> int | None:
    """``fields[key]`` as an int; None when it is missing or not an integer."""
    try:
        return int(fields[key])
    except (KeyError, ValueError):
        return None


def _split_address(text: str) -> tuple[str, int] | None:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class NotLeaderError(RoutingError):
    """``NOT_LEADER leader=host:port``: the partition (or Raft) leader is elsewhere.

    ``leader`` is the advertised address as ``(host, port)``, or None when the broker did not name one.
    """

    @property
    def leader(self) -> tuple[str, int] | None:
        """The leader address named by the broker, or None."""
        return _split_address(self.fields.get("leader", ""))


class NotCoordinatorError(RoutingError):
    """``NOT_COORDINATOR host= port=``: group or transaction commands belong to another broker."""

    @property
    def coordinator(self) -> tuple[str, int] | None:
        """The coordinator address ``(host, port)``, or None when the fields are missing or invalid."""
        host, port = self.fields.get("host", ""), self.fields.get("port", "")
        if not host or not port.isdigit():
            return None
        return host, int(port)


class OffsetOutOfRangeError(ConflictError):
    """``OFFSET_OUT_OF_RANGE requested= earliest= latest=``: the offset is below the retained log or past
    its end. ``requested``, ``earliest`` and ``latest`` are ints (None when the broker omitted them)."""

    @property
    def requested(self) -> int | None:
        """The offset that was asked for."""
        return _int_field(self.fields, "requested")

    @property
    def earliest(self) -> int | None:
        """The first retained offset."""
        return _int_field(self.fields, "earliest")

    @property
    def latest(self) -> int | None:
        """The next readable offset (the high-water mark)."""
        return _int_field(self.fields, "latest")


class ProducerFencedError(FencingError):
    """``producer_fenced`` / ``stale_producer_epoch``: a newer producer session owns this producer id.
    Terminal for the producer instance (spec section 9)."""


class SequenceError(ConflictError):
    """``idempotency_gap`` / ``sequence_out_of_order``: the broker refused an idempotent batch's sequence
    numbers. Terminal for the producer instance: records may have been lost between sessions."""


class VersionConflictError(ConflictError):
    """``version_conflict current= expected=``: an event-store append's expected version is not the
    aggregate's current version + 1 (optimistic concurrency); nothing was written. ``current`` and
    ``expected`` are ints (None when the broker omitted them)."""

    @property
    def current(self) -> int | None:
        return _int_field(self.fields, "current")

    @property
    def expected(self) -> int | None:
        return _int_field(self.fields, "expected")


class TopicNotFoundError(NotFoundError):
    """``topic_not_found``: the topic does not exist (create it first)."""


class UnsupportedFeatureError(ValidationError):
    """``UNSUPPORTED_FEATURE command=NAME``: this broker does not serve the command (yet)."""


class AuthenticationError(AuthorizationError):
    """``authentication_required`` / ``authentication_failed``: the connection is not authenticated."""


# ------------------------------------------------------------------------------------- client-side errors


class _ClientSideError(CursusError):
    """A failure the SDK noticed itself: each subclass names its code (``client_code``) and retry flag
    (``client_retryable``); it is raised with a message and optional fields only. Mixed in after the error
    class base (``class X(AvailabilityError, _ClientSideError)``), so the public hierarchy is unchanged."""

    client_code: ClassVar[str]
    client_retryable: ClassVar[bool] = False

    def __init__(self, message: str = "", *, fields: Mapping[str, str] | None = None) -> None:
        super().__init__(self.client_code, message, retryable=self.client_retryable, fields=fields)


class BrokerUnavailableError(AvailabilityError, _ClientSideError):
    """The SDK could not reach a broker (connect refused, connection dropped) within its retry budget.

    Code ``broker_unavailable``, retryable. For a request that was sent and whose outcome is unknown,
    :class:`DeliveryUnknownError` is raised instead.
    """

    client_code = "broker_unavailable"
    client_retryable = True


class RequestTimeoutError(AvailabilityError, _ClientSideError, TimeoutError):
    """No reply within the request timeout (code ``client_timeout``, retryable). The connection was closed,
    because a late reply would be mistaken for the next request's."""

    client_code = "client_timeout"
    client_retryable = True


class DeliveryUnknownError(AvailabilityError, _ClientSideError):
    """The connection failed after a non-idempotent request was written: the broker may or may not have
    applied it (code ``delivery_unknown``, not retryable, since a blind retry could duplicate it)."""

    client_code = "delivery_unknown"


class DeliveryTimeoutError(AvailabilityError, TimeoutError):
    """A record accepted by a producer's ``send`` was never written: its ``delivery_timeout_s`` (counted
    from ``send``) passed while it waited to be sent (code ``delivery_timeout``, retryable: the broker never
    saw it, so sending it again cannot duplicate it)."""

    def __init__(self, message: str = "", *, fields: Mapping[str, str] | None = None) -> None:
        super().__init__("delivery_timeout", message, retryable=True, fields=fields)


class BufferFullError(AvailabilityError, _ClientSideError):
    """The producer's record buffer stayed full for ``max_block_s`` (code ``buffer_full``, retryable)."""

    client_code = "buffer_full"
    client_retryable = True


class ClientClosedError(ValidationError, _ClientSideError):
    """The producer, consumer, admin client or connection was closed (code ``client_closed``)."""

    client_code = "client_closed"


class ProtocolViolationError(InternalError, _ClientSideError):
    """The broker's reply was not valid Wire v2 or not the documented reply shape (code ``protocol_error``).
    The connection it arrived on was closed."""

    client_code = "protocol_error"


class TlsError(AuthorizationError):
    """The connection's TLS does not match the broker's, so no retry can succeed until the configuration
    changes (never retryable; the SDK's retry loops stop at once). Codes:

    * ``tls_required``: a plaintext client on a TLS listener ("the server requires TLS");
    * ``tls_client_certificate_required``: the broker requires a client certificate (mutual TLS) and none
      was given;
    * ``tls_client_certificate_refused``: the broker refused the client certificate given;
    * ``tls_certificate_verify_failed``: the broker's certificate failed verification (unknown CA, expired,
      wrong host name); ``fields["reason"]`` is OpenSSL's verify message.
    """

    def __init__(self, code: str, message: str = "", *, fields: Mapping[str, str] | None = None) -> None:
        super().__init__(code, message, retryable=False, fields=fields)


class DeliveryFailedError(CursusError):
    """Raised by ``Producer.flush()``/``close()`` when records failed since the previous flush.

    ``errors`` holds the distinct failures (first one first) and ``failed_count`` the number of records
    whose delivery failed. Code ``delivery_failed``; class and retryable are the first error's.
    """

    def __init__(self, errors: list[BaseException], failed_count: int) -> None:
        first = errors[0] if errors else None
        first_class = first.error_class if isinstance(first, CursusError) else ErrorClass.INTERNAL
        first_retryable = first.retryable if isinstance(first, CursusError) else False
        self.errors = list(errors)
        self.failed_count = failed_count
        summary = f"{failed_count} record(s) failed; first: {first}"
        super().__init__("delivery_failed", summary, error_class=first_class, retryable=first_retryable,
                         fields={"failed": str(failed_count)})


# ------------------------------------------------------------------------------------------- conversion

_BY_CLASS: dict[ErrorClass, type[CursusError]] = {
    ErrorClass.VALIDATION: ValidationError,
    ErrorClass.AUTHORIZATION: AuthorizationError,
    ErrorClass.ROUTING: RoutingError,
    ErrorClass.AVAILABILITY: AvailabilityError,
    ErrorClass.CONFLICT: ConflictError,
    ErrorClass.FENCING: FencingError,
    ErrorClass.NOT_FOUND: NotFoundError,
    ErrorClass.INTERNAL: InternalError,
}

_BY_CODE: dict[str, type[CursusError]] = {
    "NOT_LEADER": NotLeaderError,
    "NOT_PARTITION_LEADER": NotLeaderError,
    "NOT_COORDINATOR": NotCoordinatorError,
    "OFFSET_OUT_OF_RANGE": OffsetOutOfRangeError,
    "producer_fenced": ProducerFencedError,
    "stale_producer_epoch": ProducerFencedError,
    "idempotency_gap": SequenceError,
    "sequence_out_of_order": SequenceError,
    "topic_not_found": TopicNotFoundError,
    "TOPIC_NOT_FOUND": TopicNotFoundError,
    "UNSUPPORTED_FEATURE": UnsupportedFeatureError,
    "version_conflict": VersionConflictError,
    "authentication_required": AuthenticationError,
    "AUTHENTICATION_REQUIRED": AuthenticationError,
    "authentication_failed": AuthenticationError,
}

#: Error codes after which an idempotent producer must stop (facts A6 PUBLISH, spec section 9).
TERMINAL_PRODUCER_CODES = frozenset({"producer_fenced", "stale_producer_epoch", "idempotency_gap",
                                     "sequence_out_of_order"})


def error_from_typed(err: TypedError) -> CursusError:
    """The exception for a decoded typed error: the code's specific class when it matches the error class,
    else the class's generic exception."""
    cls = _BY_CODE.get(err.code)
    error_class = ErrorClass(err.error_class)
    if cls is None or cls.default_class != error_class:
        cls = _BY_CLASS[error_class]
    exc = cls.__new__(cls)
    CursusError.__init__(exc, err.code, err.message, error_class=error_class, retryable=err.retryable,
                         fields=err.fields)
    return exc


def error_from_frame(frame: Frame) -> CursusError:
    """The exception for an ERROR-status reply frame.

    A payload that is not a valid typed error becomes :class:`ProtocolViolationError`. Calling this on a
    non-ERROR frame is a programming error (``ValueError``).
    """
    if frame.status != Status.ERROR:
        raise ValueError(f"frame status is {frame.status.name}, not ERROR")
    try:
        return error_from_typed(decode_error(frame.payload))
    except ProtocolError as exc:
        return ProtocolViolationError(f"undecodable ERROR payload from {frame.command.name}: {exc}")


def error_from_ack(doc: Mapping[str, Any]) -> CursusError:
    """The exception for a PUBLISH AckResponse JSON whose ``status`` is not ``OK`` (facts A6).

    Reads ``error_code`` (else the second token of ``error``), ``error_class``, ``retryable`` and
    ``error_fields``; missing values fall back to the registry.
    """
    text = str(doc.get("error") or "")
    code = str(doc.get("error_code") or "")
    if not code:
        tokens = text.replace("ERROR:", " ").split()
        code = tokens[0] if tokens else "broker_error"
    label = doc.get("error_class")
    error_class = ErrorClass.from_label(str(label)) if label else None
    if error_class is None:
        error_class = classify(code)[0]
    raw_fields = doc.get("error_fields")
    fields = {str(k): v if isinstance(v, str) else json.dumps(v)
              for k, v in (raw_fields.items() if isinstance(raw_fields, Mapping) else ())}
    retryable = doc.get("retryable")
    typed = TypedError(code, error_class, bool(retryable) if isinstance(retryable, bool) else classify(code)[1],
                       text if text and not text.startswith("ERROR") else "", fields)
    return error_from_typed(typed)
