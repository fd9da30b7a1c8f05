"""Third-party notices a user cannot act on, kept out of a run's normal output.

Ray's driver logs through the `ray` logger to stderr: a notice on every start that token
authentication is on (this project's documented default for the embedded cluster: README,
"Network") and that it started a local instance. `quiet_ray` drops those (`NOTICES`) from Ray's
console handlers and keeps every record of the `ray` logger, those included, in
`<out_dir>/ray-driver.log`. Anything else Ray says (a warning you can act on, an error) still
reaches stderr.
"""

from __future__ import annotations

import logging
from pathlib import Path

from disagmoe.runtime.out_dir import RAY_DRIVER_LOG

NOTICES = (
    "Token authentication is enabled for this Ray cluster",
    "Started a local Ray instance",
    "Connected to Ray cluster",
)
LOG_FILE = RAY_DRIVER_LOG  # in out_dir: a fresh run sets it aside with the earlier run's other outputs


class DropNotices(logging.Filter):
    """Refuses the records whose message starts with one of `NOTICES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(NOTICES)


def quiet_ray(out_dir: Path) -> Path:
    """Install the filter on Ray's console handlers and the log file (idempotent); returns the
    log's path. Imports ray (which sets up its logger on import)."""
    import ray  # noqa: F401 (configures the `ray` logger's handlers)

    logger = logging.getLogger("ray")
    path = Path(out_dir) / LOG_FILE
    for handler in logger.handlers:
        if getattr(handler, "disagmoe_log", False):
            continue
        if not any(isinstance(f, DropNotices) for f in handler.filters):
            handler.addFilter(DropNotices())
    for handler in [h for h in logger.handlers if getattr(h, "disagmoe_log", False)]:
        if Path(handler.baseFilename) == path.resolve():
            return path
        logger.removeHandler(handler)  # an earlier run's log, in this process (tests)
        handler.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(path, delay=True)
    file_handler.disagmoe_log = True
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(file_handler)
    return path
