"""Distributed-mode configuration: every refusal names the missing key."""

from __future__ import annotations

import pytest

from cursus.broker.config import ConfigError, load_config

GOOD = {
    "ENABLED_DISTRIBUTION": "true", "INTERNAL_AUTH_TOKEN": "s3cret", "INTERNAL_USE_TLS": "true",
    "INTERNAL_TLS_CERT_PATH": "n.crt", "INTERNAL_TLS_KEY_PATH": "n.key", "INTERNAL_TLS_CA_PATH": "ca.crt",
    "STATIC_CLUSTER_MEMBERS": "a@127.0.0.1:9001,b@127.0.0.1:9002,c@127.0.0.1:9003",
    "INTERNAL_BROKER_PORT": "9301",
}


def test_good_cluster_config_and_mode_defaults():
    cfg = load_config(environ=GOOD)
    assert cfg.enabled_distribution and cfg.min_insync_replicas == 2
    assert cfg.static_cluster_members == ("a@127.0.0.1:9001", "b@127.0.0.1:9002", "c@127.0.0.1:9003")
    assert load_config(environ={}).min_insync_replicas == 1
    assert load_config(environ={"ENABLE_DISTRIBUTION": "1", **{k: v for k, v in GOOD.items()
                                                            if k != "ENABLED_DISTRIBUTION"}}).enabled_distribution


@pytest.mark.parametrize(("drop", "change", "key"), [
    ("INTERNAL_AUTH_TOKEN", {}, "internal_auth_token"),
    (None, {"INTERNAL_AUTH_TOKEN": "two words"}, "internal_auth_token"),
    ("INTERNAL_USE_TLS", {}, "internal_use_tls"),
    ("INTERNAL_TLS_CA_PATH", {}, "internal_tls_ca_path"),
    ("INTERNAL_BROKER_PORT", {}, "internal_broker_port"),
    ("STATIC_CLUSTER_MEMBERS", {}, "static_cluster_members"),
    (None, {"STATIC_CLUSTER_MEMBERS": "a@nohostport"}, "static_cluster_members"),
    (None, {"RAFT_HEARTBEAT_MS": "500"}, "raft_election_timeout_min_ms"),
])
def test_distributed_mode_refusals_name_the_key(drop, change, key):
    env = {k: v for k, v in GOOD.items() if k != drop} | change
    with pytest.raises(ConfigError, match=key):
        load_config(environ=env)


def test_insecure_transport_allowed_only_when_asked():
    env = {k: v for k, v in GOOD.items() if k != "INTERNAL_USE_TLS"} | {"ALLOW_INSECURE_CLUSTER_TRANSPORT": "true"}
    assert load_config(environ=env).allow_insecure_cluster_transport
