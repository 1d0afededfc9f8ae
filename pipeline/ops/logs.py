"""The worker's logs: one line per event on stderr, as text or as one JSON object per line."""
from __future__ import annotations

import json
import logging
import time

from pipeline.cli.config import WorkerConfig


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, stage (the role), pid,
    logger, message, and the traceback as `exception` when there is one."""

    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {"time": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname, "stage": self.role,
                "pid": record.process, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(cfg: WorkerConfig, role: str) -> None:
    """This process's logging: one line per event on stderr, with time, level, role (a
    stage's name, "supervisor" or "worker"), pid, logger and message; level and format
    (text, or one JSON object per line) from cfg."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter(role) if cfg.log_format == "json" else logging.Formatter(
        f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(cfg.log_level.upper())
