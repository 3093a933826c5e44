from __future__ import annotations

from . import Mail, describe_exit


def restarted(exit_code: int | None, signal: str | None, delay_s: float, command: str, log_path: str) -> Mail:
    """The run failed and restart = "on-failure" starts it again after `delay_s`."""
    return Mail(f"training failed ({describe_exit(exit_code, signal)}); restarting in {int(delay_s)}s",
                f"Command: {command}\nLog: {log_path}\n")
