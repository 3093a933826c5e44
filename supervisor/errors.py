"""The errors that cross from the daemon's side to the command line, and where the config lives, with
no import behind them: the one-shot commands (`supervisorctl status`) catch them and find the socket
without loading the config's schema or the server."""

from __future__ import annotations

DEFAULT_PATH = "/etc/train-supervisor/config.toml"
ENV_VAR = "TRAIN_SUPERVISOR_CONFIG"
DEFAULT_SOCKET = "/run/train-supervisor/control.sock"


class RequestError(Exception):
    """A control-socket request that is understood but cannot be done; its message goes back to the
    client. Here, not in control.py, so a wing that answers a request never imports the server."""


class ConfigError(Exception):
    """Raised with every problem found; each line names the key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ClientError(Exception):
    """supervisorctl could not get an answer: the message, and the exit code it leaves with."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
