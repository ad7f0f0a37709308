"""Configuration: precedence, validation messages, the generated reference page."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cursus.broker.config import SETTINGS, ConfigError, load_config
from tests.conftest import REPO_ROOT


def test_defaults():
    cfg = load_config(environ={})
    assert cfg.broker_port == 9000 and cfg.health_check_port == 9080 and cfg.exporter_port == 9100
    assert cfg.client_idle_timeout_ms == 600_000 and cfg.max_client_connections == 1000
    assert cfg.advertised == "127.0.0.1"  # wildcard bind is never handed out


def test_precedence_defaults_file_env_flags(tmp_path):
    path = tmp_path / "broker.yaml"
    path.write_text("broker_port: 9100\nlog_dir: /from/file\nmax_message_bytes: 2048\n")
    cfg = load_config(config_path=path, environ={"BROKER_PORT": "9200", "LOG_DIR": "/from/env"},
                      overrides={"broker_port": 9300, "log_dir": None})
    assert cfg.broker_port == 9300  # flag beats env beats file
    assert cfg.log_dir == "/from/env"  # env beats file; a None flag is ignored
    assert cfg.max_message_bytes == 2048  # file beats default


def test_config_path_from_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("host: 127.0.0.2\n")
    assert load_config(environ={"CONFIG_PATH": str(path)}).advertised == "127.0.0.2"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("brokr_port: 1\n", "unknown config key brokr_port"),
        ("broker_port: abc\n", "invalid value for broker_port"),
        ("max_client_connections: 0\n", "invalid value for max_client_connections"),
        ("log_cleanup_policy: compact\n", "invalid value for log_cleanup_policy"),
        ("- a\n- b\n", "must be a flat mapping"),
        ("enable_sasl: maybe\n", "invalid value for enable_sasl"),
    ],
)
def test_invalid_values_name_the_key(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_config(config_path=path, environ={})


def test_reference_key_accepted_with_warning(tmp_path):
    path = tmp_path / "ref.yaml"
    path.write_text("discovery_port: 8000\n")
    cfg = load_config(config_path=path, environ={})
    assert any("discovery_port" in w for w in cfg.warnings)


def test_retired_key_accepted_with_warning(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("offsets_compaction_min_records: 150\n")
    cfg = load_config(config_path=path, environ={}, overrides={"offsets_compaction_min_records": 9})
    assert sum("offsets_compaction_min_records is no longer used" in w for w in cfg.warnings) == 2
    assert "offsets_compaction_min_records" not in cfg.values


def test_env_invalid_value_names_key():
    with pytest.raises(ConfigError, match="client_idle_timeout_ms"):
        load_config(environ={"CLIENT_IDLE_TIMEOUT_MS": "-5"})


def test_configuration_page_is_generated_from_the_table():
    generated = subprocess.run([sys.executable, "-m", "cursus.broker.config"], capture_output=True, text=True,
                               check=True).stdout
    page = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert page == generated, "regenerate: python -m cursus.broker.config > docs/configuration.md"
    for setting in SETTINGS:
        assert f"`{setting.name}`" in page


def test_broker_cli_rejects_bad_config(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cursus.cli.broker", "--log-dir", str(tmp_path),
                           "--set", "nope=1"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown config key nope" in proc.stderr


def test_an_environment_value_error_names_the_variable_and_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(environ={"BROKER_PORT": "tcp://10.0.0.1:9000"})
    message = str(err.value)
    assert message.startswith("invalid value for broker_port (from environment variable BROKER_PORT): "
                              "expected an integer, got 'tcp://10.0.0.1:9000'")
    assert "Kubernetes service link" in message and "enableServiceLinks: false" in message
    assert "invalid literal" not in message
    with pytest.raises(ConfigError, match=r"max_client_connections \(from the command line\): must be >= 1"):
        load_config(environ={}, overrides={"max_client_connections": 0})
