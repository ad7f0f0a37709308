"""Token users, the permission table and topic policies (cursus.broker.auth), and their configuration."""

from __future__ import annotations

import pytest

from cursus.broker.auth import (
    ADMIN,
    COMMAND_PERMISSIONS,
    GROUP,
    PERMISSIONS,
    TOPIC_READ,
    TOPIC_WRITE,
    TRANSACTION,
    acl_allows,
    authenticate,
    missing_permission,
    parse_users,
    required_permissions,
    topic_allows,
    topic_operation,
)
from cursus.broker.config import ConfigError, load_config
from cursus.broker.handlers import HANDLERS
from cursus.broker.request import SessionInfo
from cursus.wire import Command

SECRET = "tok-Zq81-secret"


def test_permission_table_is_total_and_uses_known_permissions():
    assert set(COMMAND_PERMISSIONS) == set(Command)
    for command, required in COMMAND_PERMISSIONS.items():
        assert set(required) <= set(PERMISSIONS) - {"*"}, command
    # every served command is behind the guard and needs what the table says (internal ones never run)
    assert set(HANDLERS) <= set(COMMAND_PERMISSIONS)


def test_combined_rules_from_the_spec():
    assert COMMAND_PERMISSIONS[Command.CONSUME] == (TOPIC_READ, GROUP)
    assert COMMAND_PERMISSIONS[Command.STREAM] == (TOPIC_READ, GROUP)
    assert COMMAND_PERMISSIONS[Command.TXN_PUBLISH] == (TRANSACTION, TOPIC_WRITE)
    assert COMMAND_PERMISSIONS[Command.SEND_OFFSETS_TO_TXN] == (TRANSACTION, GROUP)
    assert COMMAND_PERMISSIONS[Command.DELETE] == (ADMIN,)
    assert COMMAND_PERMISSIONS[Command.TRUNCATE] == (ADMIN,)
    for command in (Command.AUTH, Command.HELP, Command.EXIT, Command.NEGOTIATE):
        assert COMMAND_PERMISSIONS[command] == ()
    assert required_permissions(Command.FIND_COORDINATOR, {"group": "g"}) == (GROUP,)
    for key in ("transactional_id", "txn", "transaction"):
        assert required_permissions(Command.FIND_COORDINATOR, {key: "t"}) == (TRANSACTION,)


def test_missing_permission_and_wildcard():
    assert missing_permission(frozenset({TOPIC_READ}), (TOPIC_READ, GROUP)) == GROUP
    assert missing_permission(frozenset({TOPIC_READ, GROUP}), (TOPIC_READ, GROUP)) is None
    assert missing_permission(frozenset({"*"}), (ADMIN, TRANSACTION)) is None
    assert missing_permission(frozenset(), ()) is None
    assert topic_operation((TRANSACTION, TOPIC_WRITE)) == "write"
    assert topic_operation((TOPIC_READ, GROUP)) == "read"
    assert topic_operation((GROUP,)) is None


@pytest.mark.parametrize(("policy", "op", "principal", "allowed"), [
    ("open", "read", None, True), ("open", "write", None, True),
    ("deny_read", "read", "alice", False), ("deny_read", "write", "alice", True),
    ("deny_write", "write", "alice", False), ("deny_write", "read", None, True),
    ("acl", "read", "alice", True), ("acl", "read", "bob", False), ("acl", "read", None, False),
    ("acl", "write", "bob", True), ("acl", "write", "alice", False),
    ("bogus", "read", "alice", False),
])
def test_topic_policy(policy, op, principal, allowed):
    assert topic_allows(policy, ("alice",), ("bob",), op, principal) is allowed


def test_acl_wildcard_needs_an_authenticated_principal():
    assert acl_allows(("*",), "anyone")
    assert not acl_allows(("*",), None)
    assert not acl_allows(("*",), "")
    assert not acl_allows((), "alice")


def test_users_parse_and_authenticate_in_constant_time_shape():
    users = parse_users([{"principal": "alice", "token": SECRET, "permissions": ["admin", "Topic.Read"]},
                         {"principal": "bob", "token": "b-tok", "permissions": ["*"]}])
    assert [u.principal for u in users] == ["alice", "bob"]
    assert users[0].permissions == frozenset({ADMIN, TOPIC_READ})
    assert authenticate(users, "alice", SECRET) is users[0]
    assert authenticate(users, "bob", "b-tok") is users[1]
    assert authenticate(users, "alice", "b-tok") is None  # another user's token
    assert authenticate(users, "alice", SECRET + "x") is None
    assert authenticate(users, "carol", SECRET) is None
    assert authenticate(users, "", "") is None
    assert authenticate((), "alice", SECRET) is None
    assert SECRET not in repr(users) and "redacted" in repr(users[0])
    assert not hasattr(users[0], "token")  # only a digest is kept


def test_environment_form_and_json_form():
    users = parse_users(f"alice:{SECRET}:admin|topic.write, bob:t:with:colons:group")
    assert users[0].permissions == frozenset({ADMIN, TOPIC_WRITE})
    assert authenticate(users, "bob", "t:with:colons") is users[1]
    assert parse_users('[{"principal": "c", "token": "t", "permissions": ["group"]}]')[0].principal == "c"
    assert parse_users("") == () and parse_users(None) == () and parse_users([]) == ()


@pytest.mark.parametrize(("raw", "message"), [
    (f"alice:{SECRET}", "non-empty permissions"),  # the reference's SASL_USERS=principal:token form
    (f"alice:{SECRET}:", "non-empty permissions"),
    (f"alice:{SECRET}:root", "unknown permission 'root'"),
    ([{"principal": "alice", "token": SECRET}], "non-empty permissions"),
    ([{"principal": "alice", "token": SECRET, "permissions": []}], "non-empty permissions"),
    ([{"principal": "alice", "token": "", "permissions": ["admin"]}], "token must be"),
    ([{"principal": "al ice", "token": SECRET, "permissions": ["admin"]}], "principal must be"),
    ([{"principal": "alice", "token": SECRET, "permissions": ["admin"], "role": "x"}], "unknown key 'role'"),
    ([{"principal": "a", "token": SECRET, "permissions": ["admin"]},
      {"principal": "a", "token": "other", "permissions": ["admin"]}], "configured twice"),
    ("[not json", "JSON"),
    ({"principal": "a"}, "expected a list"),
])
def test_invalid_users_fail_startup_without_echoing_tokens(raw, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_users(raw)
    assert SECRET not in str(info.value)


def test_config_keys_and_startup_checks(tmp_path):
    with pytest.raises(ConfigError, match="sasl_users"):
        load_config(environ={"ENABLE_SASL": "true"})
    with pytest.raises(ConfigError, match="sasl_users .*principal alice") as info:
        load_config(environ={"ENABLE_SASL": "true", "SASL_USERS": f"alice:{SECRET}"})
    assert SECRET not in str(info.value)
    path = tmp_path / "broker.yaml"
    path.write_text(f"enable_sasl: true\nauth_failure_delay_ms: 7\nsasl_users:\n"
                    f"  - principal: alice\n    token: {SECRET}\n    permissions: [admin, group]\n")
    config = load_config(config_path=path, environ={})
    assert config.enable_sasl and config.auth_failure_delay_ms == 7
    assert authenticate(config.sasl_users, "alice", SECRET) is not None
    assert SECRET not in repr(config) and SECRET not in str(config)
    assert not config.warnings  # sasl_users is implemented, no "not implemented" warning
    # the environment overrides the file
    config = load_config(config_path=path, environ={"SASL_USERS": "bob:other:*"})
    assert [u.principal for u in config.sasl_users] == ["bob"]


def test_session_sign_in_and_out():
    session = SessionInfo(peer="p")
    assert session.authenticated_principal is None
    session.sign_in("alice", frozenset({ADMIN}))
    assert session.authenticated and session.authenticated_principal == "alice"
    session.sign_out()
    assert not session.authenticated and session.principal is None and session.permissions == frozenset()
