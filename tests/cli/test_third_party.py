"""`cli.third_party.quiet_ray`: Ray's start-up notices leave stderr for the run's log."""

import io
import logging
from pathlib import Path

from disagmoe.cli.third_party import LOG_FILE, quiet_ray


def test_ray_notices_go_to_the_log_and_other_ray_messages_still_reach_the_console(tmp_path):
    logger = logging.getLogger("ray")
    console = logging.StreamHandler(io.StringIO())
    logger.addHandler(console)
    before = list(logger.handlers)
    try:
        path = quiet_ray(tmp_path)
        assert quiet_ray(tmp_path) == path == tmp_path / LOG_FILE  # idempotent: one file handler
        child = logging.getLogger("ray._private.authentication.authentication_token_setup")
        child.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ...")
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        child.warning("a Ray warning a user can act on")
        shown = console.stream.getvalue()
        assert "Token authentication" not in shown and "Started a local" not in shown
        assert "a Ray warning a user can act on" in shown
        kept = path.read_text()
        assert "Token authentication is enabled" in kept and "Started a local Ray instance" in kept
        # one run log in the process, this run's (an earlier test's in the same worker is replaced)
        logs = [h for h in logger.handlers if getattr(h, "disagmoe_log", False)]
        assert [Path(h.baseFilename) for h in logs] == [path.resolve()]
    finally:
        for handler in logger.handlers[:]:
            if handler not in before or handler is console:
                logger.removeHandler(handler)
                handler.close()
        for handler in logger.handlers:
            handler.filters = [f for f in handler.filters if type(f).__name__ != "DropNotices"]
