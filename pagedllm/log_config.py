"""How the processes log: vLLM's `--logging-config` (log_level, formatter text or json,
configure_logging, pylogging_config_file).

The command line resolves one `LoggingConfig`, applies it, and puts it in the
environment (PAGEDLLM_LOGGING_CONFIG, JSON) so the engine processes it spawns (one per
data parallel replica) apply the same: the setting travels the way a child process
inherits anything, and a user can set the variable instead of the flags. uvicorn adds no
handlers of its own (server.py passes log_config=None), so its records go through the
same root handler: one format, and one JSON object per line with `json`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.config
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.config import dataclass_from_dict
from pagedllm.errors import ConfigError

ENV = "PAGEDLLM_LOGGING_CONFIG"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATTERS = ("text", "json")
DATE_FORMAT = "%m-%d %H:%M:%S"


@dataclass(frozen=True)
class LoggingConfig:
    log_level: str = "INFO"
    """The root logger's level when no pylogging_config_file is given."""
    formatter: str = "text"
    """"text": `LEVEL date logger: message`; "json": one JSON object a record (asctime,
    levelname, name, processName, process, message, pagedllm_process, exc_info)."""
    configure_logging: bool = True
    """False: configure nothing (the application embedding pagedllm does)."""
    pylogging_config_file: str | None = None
    """A JSON file for logging.config.dictConfig, applied instead of the built-in setup."""

    def __post_init__(self) -> None:
        if not isinstance(self.log_level, str) or self.log_level.upper() not in LEVELS:
            raise ConfigError(f"logging log_level must be one of {LEVELS}, "
                              f"got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.upper())
        if self.formatter not in FORMATTERS:
            raise ConfigError(f"logging formatter must be one of {FORMATTERS}, "
                              f"got {self.formatter!r}")
        if not isinstance(self.configure_logging, bool):
            raise ConfigError(f"logging configure_logging must be true or false, "
                              f"got {self.configure_logging!r}")
        if self.pylogging_config_file is not None:
            _read_dict_config(self.pylogging_config_file)  # refused at start-up

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoggingConfig:
        return dataclass_from_dict(cls, values, "logging config")

    @classmethod
    def from_env(cls) -> LoggingConfig:
        """The config a parent process put in the environment, else the defaults."""
        text = os.environ.get(ENV)
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV} is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise ConfigError(f"{ENV} must be a JSON object, got {text!r}")
        return cls.from_dict(values)

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _read_dict_config(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"logging pylogging_config_file {path!r}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"logging pylogging_config_file {path!r} must hold a JSON "
                          f"object (a logging.config.dictConfig schema)")
    return config


class JsonFormatter(logging.Formatter):
    """One JSON object per record, for log collectors."""

    def __init__(self, process_name: str) -> None:
        super().__init__(datefmt=DATE_FORMAT)
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry = {"asctime": self.formatTime(record, self.datefmt),
                 "levelname": record.levelname, "name": record.name,
                 "processName": record.processName, "process": record.process,
                 "message": record.getMessage(),
                 "pagedllm_process": self.process_name}
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(config: LoggingConfig, process_name: str = "api_server",
              prefix: str = "") -> None:
    """Set up the root logger of this process as `config` says. `process_name`: the
    process's role in JSON lines ("api_server", "engine_core", "engine_core_dp1");
    `prefix`: what begins its text lines ("[DP1] " for a data parallel replica)."""
    if not config.configure_logging:
        return
    if config.pylogging_config_file is not None:
        try:
            logging.config.dictConfig(_read_dict_config(config.pylogging_config_file))
        except (ValueError, TypeError, AttributeError, ImportError) as e:
            raise ConfigError(f"logging pylogging_config_file "
                              f"{config.pylogging_config_file!r}: {e}") from e
        return
    if config.formatter == "json":
        formatter: logging.Formatter = JsonFormatter(process_name)
    else:
        formatter = logging.Formatter(
            f"{prefix}%(levelname)s %(asctime)s %(name)s: %(message)s", DATE_FORMAT)
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.log_level)
