"""Logging flags (vLLM's --logging-config and its dotted fields, --log-level,
--log-config-file; pagedllm/log_config.py): precedence, refusals at start-up, the JSON
formatter, a dictConfig file, and configure_logging false. A server logging JSON from
all its processes: tests/entrypoints/test_server_options.py (test_middleware...)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import build_parser, logging_config_from
from pagedllm.errors import ConfigError
from pagedllm.log_config import ENV, JsonFormatter, LoggingConfig, configure


@pytest.fixture
def root_logger():
    """Restore the root logger's handlers and level after a test configures it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def parse(*flags: str) -> LoggingConfig:
    return logging_config_from(build_parser().parse_args(["serve", *flags]))


def test_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    assert parse() == LoggingConfig()
    monkeypatch.setenv(ENV, json.dumps({"log_level": "warning", "formatter": "json"}))
    assert parse() == LoggingConfig(log_level="WARNING", formatter="json")
    assert parse("--logging-config", '{"log_level": "DEBUG"}') == LoggingConfig(
        log_level="DEBUG", formatter="json")
    assert parse("--logging-config", '{"log_level": "DEBUG"}',
                 "--logging-config.log_level", "ERROR").log_level == "ERROR"
    assert parse("--logging-config.log_level", "ERROR",
                 "--log-level", "critical").log_level == "CRITICAL"
    assert parse("--logging-config.configure_logging", "false").configure_logging is False
    conf = tmp_path / "log.json"
    conf.write_text(json.dumps({"version": 1}))
    assert parse("--log-config-file", str(conf)).pylogging_config_file == str(conf)


@pytest.mark.parametrize("flags, message", [
    (["--log-level", "LOUD"], "log_level must be one of"),
    (["--logging-config.formatter", "xml"], "formatter must be one of"),
    (["--logging-config", '{"level": "INFO"}'], "unknown logging config keys"),
    (["--log-config-file", "/nonexistent/log.json"], "pylogging_config_file"),
])
def test_bad_settings_are_start_up_errors(flags, message, monkeypatch):
    """The command exits 2 with the message before loading anything."""
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError, match=message):
        parse(*flags)
    run = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                          *flags], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_json_formatter():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("x.y").makeRecord(
            "x.y", logging.ERROR, __file__, 1, "failed %s", ("once",), sys.exc_info())
    entry = json.loads(JsonFormatter("engine_core").format(record))
    assert entry["message"] == "failed once" and entry["levelname"] == "ERROR"
    assert entry["name"] == "x.y" and entry["pagedllm_process"] == "engine_core"
    assert "ValueError: boom" in entry["exc_info"] and "\n" not in json.dumps(entry)[1:-1]


def test_dict_config_file_and_off(tmp_path, root_logger):
    out = tmp_path / "out.log"
    conf = tmp_path / "log.json"
    conf.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(name)s|%(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(out),
                              "formatter": "plain"}},
        "root": {"handlers": ["file"], "level": "INFO"}}))
    configure(LoggingConfig(pylogging_config_file=str(conf)))
    logging.getLogger("pagedllm.test").info("to the file")
    for h in root_logger.handlers:
        h.flush()
    assert out.read_text() == "pagedllm.test|to the file\n"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.Such"}}}))
    with pytest.raises(ConfigError, match="bad.json"):
        configure(LoggingConfig(pylogging_config_file=str(bad)))
    # configure_logging false: the handlers are left as they are.
    before = list(root_logger.handlers)
    configure(LoggingConfig(configure_logging=False, log_level="DEBUG"))
    assert root_logger.handlers == before and root_logger.level != logging.DEBUG
