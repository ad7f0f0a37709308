"""Command parameters as data: declare once, parse and validate once, hand handlers a typed object.

Each command's arguments are a frozen dataclass whose fields are declared with :func:`param`; the field
order is the validation order (so the first error a request gets is stable and matches the spec's
examples). :func:`parse_args` turns a request's CRQ2 fields into that dataclass or raises the spec's
typed error; handlers never touch raw strings. The same table renders HELP and ``docs/commands.md``.

Field rules (facts B1.4, decision 8):

* a field is looked up by its name, then by each alias, in order; an empty value counts as absent unless
  the parameter says otherwise (``empty_ok``);
* an absent required field raises ``missing_<name>`` (or the parameter's ``missing`` code) with
  ``command=``; an absent optional field takes its default;
* a malformed value raises ``invalid_<name>`` (or ``invalid``) with ``command=`` and ``value=``;
* ``strict`` argument types refuse unknown fields with ``invalid_field``; authentication fields
  (``principal``, ``auth_token``) are allowed on every command.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from cursus.parsing import I64_MAX, I64_MIN, parse_int
from cursus.wire.errors import BrokerError

#: Fields every command may carry (authentication); never part of an argument object.
AUTH_FIELDS = frozenset({"principal", "auth_token"})
#: Values a lenient flag (``kind="flag"``) reads as true; anything else is false, never an error.
TRUTHY = frozenset({"true", "1", "yes"})

#: A custom converter: (raw value, command name) -> value; raises BrokerError with the spec's code.
Converter = Callable[[str, str], Any]


@dataclass(frozen=True, slots=True)
class Param:
    """How one CRQ2 field becomes one typed argument.

    Attributes:
        name: the wire field name (``seqNum``, ``max_bytes``); the dataclass attribute may differ.
        kind: ``"str"`` (as sent), ``"int"`` (strict ASCII integer in ``[minimum, maximum]``), ``"bool"``
            (``true``/``false``, any case), ``"flag"`` (lenient boolean, see :data:`TRUTHY`), ``"choice"``
            (one of ``choices``, exact), ``"csv"`` (comma list, blanks dropped, as a tuple) or ``"custom"``
            (``convert``).
        required: absent -> ``missing`` error.
        aliases: other accepted field names, tried in order after ``name``.
        empty_ok: an empty value is a value (``message=``), not an absence.
        invalid, missing: error codes; default ``invalid_<name>`` / ``missing_<name>``.
        convert: the converter of ``kind="custom"`` (it raises its own typed errors).
        doc: one line for HELP and docs/commands.md.
    """

    name: str
    kind: str = "str"
    required: bool = False
    aliases: tuple[str, ...] = ()
    minimum: int = I64_MIN
    maximum: int = I64_MAX
    choices: tuple[str, ...] = ()
    empty_ok: bool = False
    invalid: str | None = None
    missing: str | None = None
    convert: Converter | None = None
    doc: str = ""

    def raw(self, fields: Mapping[str, str]) -> str | None:
        """The first present value among ``name`` and ``aliases`` (None when absent)."""
        for key in (self.name, *self.aliases):
            value = fields.get(key)
            if value is not None and (value != "" or self.empty_ok):
                return value
        return None

    def parse(self, raw: str, command: str) -> Any:
        """Convert one present value. Raises BrokerError (``invalid`` code) when malformed."""
        kind = self.kind
        if kind == "str":
            return raw
        if kind == "int":
            value = parse_int(raw, minimum=self.minimum, maximum=self.maximum)
            if value is None:
                raise self._invalid(raw, command)
            return value
        if kind == "bool":
            lowered = raw.lower()
            if lowered not in ("true", "false"):
                raise self._invalid(raw, command)
            return lowered == "true"
        if kind == "flag":
            return raw.lower() in TRUTHY
        if kind == "choice":
            if raw not in self.choices:
                raise self._invalid(raw, command)
            return raw
        if kind == "csv":
            return tuple(p for p in (part.strip() for part in raw.split(",")) if p)
        if kind == "custom":
            assert self.convert is not None, self.name
            return self.convert(raw, command)
        raise AssertionError(f"unknown parameter kind {kind!r}")

    def _invalid(self, raw: str, command: str) -> BrokerError:
        return BrokerError.of(self.invalid or f"invalid_{self.name}", command=command, value=raw)

    def missing_error(self, command: str) -> BrokerError:
        return BrokerError.of(self.missing or f"missing_{self.name}", command=command)

    def describe(self) -> str:
        """``name=<kind>`` as HELP shows it (``[name=<kind>]`` when optional)."""
        kind = "|".join(self.choices) if self.kind == "choice" else self.kind
        text = f"{self.name}=<{kind}>"
        return text if self.required else f"[{text}]"


def param(name: str | None = None, *, default: Any = None, **spec: Any) -> Any:
    """Declare a dataclass field as a command parameter (see :class:`Param`; ``name`` defaults to the
    attribute name). ``default`` is the value of an absent optional field."""
    return dataclasses.field(default=default, metadata={"param_name": name, "param_spec": spec})


class Args:
    """Base of every argument dataclass.

    An absent optional parameter takes its declared default (None unless stated), so presence-aware
    commands (CREATE's patch) declare their optional fields with the default None.

    Class attributes:
        STRICT: refuse unknown fields with ``invalid_field`` (CREATE, ALTER_TOPIC_CONFIG).
    """

    STRICT: ClassVar[bool] = False


A = TypeVar("A", bound=Args)
_PARAMS: dict[type, tuple[tuple[str, Param], ...]] = {}


def params_of(args_type: type[Args]) -> tuple[tuple[str, Param], ...]:
    """(attribute, Param) pairs of an argument dataclass, in validation order (cached)."""
    cached = _PARAMS.get(args_type)
    if cached is None:
        pairs = []
        for f in dataclasses.fields(args_type):  # type: ignore[arg-type]
            if "param_spec" in f.metadata:
                pairs.append((f.name, Param(f.metadata["param_name"] or f.name, **f.metadata["param_spec"])))
        cached = _PARAMS[args_type] = tuple(pairs)
    return cached


def _takes_positionals(args_type: type[Args]) -> bool:
    return any(f.name == "positionals" for f in dataclasses.fields(args_type))  # type: ignore[arg-type]


def parse_args(args_type: type[A], fields: Mapping[str, str], command: str,
               positionals: Sequence[str] = ()) -> A:
    """Validate ``fields`` against ``args_type`` and build it.

    ``positionals`` are handed to a ``positionals`` attribute when the type declares one (BATCH_COMMIT's
    alias); otherwise they are ignored, as the reference does.

    Raises:
        BrokerError: ``invalid_field`` (strict types), then each parameter's ``missing``/``invalid`` error in
            declaration order.
    """
    pairs = params_of(args_type)
    if args_type.STRICT:
        known = {key for _, p in pairs for key in (p.name, *p.aliases)}
        unknown = sorted(set(fields) - known - AUTH_FIELDS)
        if unknown:
            raise BrokerError.of("invalid_field", command=command, field=unknown[0],
                                 reason=f"unknown {command} field")
    values: dict[str, Any] = {}
    for attr, p in pairs:
        raw = p.raw(fields)
        if raw is None:
            if p.required:
                raise p.missing_error(command)
            continue
        values[attr] = p.parse(raw, command)
    if positionals and _takes_positionals(args_type):
        values["positionals"] = tuple(positionals)
    return args_type(**values)


def usage(command: str, args_type: type[Args]) -> str:
    """One HELP line: ``COMMAND name=<kind> [opt=<kind>] ...``."""
    return " ".join([command, *(p.describe() for _, p in params_of(args_type))])
