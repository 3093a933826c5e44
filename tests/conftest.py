# Shared fixtures live in tests/fixtures/*.py, one module per real server or fake; register here.
# Besides: every test's processes end with it, and the session ends with none left (see below).
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.procs import kill_under

pytest_plugins = [
    "tests.fixtures.s3",
    "tests.fixtures.fake_hub",
    "tests.fixtures.sshd",
    "tests.fixtures.hf_writer",
    "tests.fixtures.sync_engine",
    "tests.fixtures.smtp",
    "tests.fixtures.clock",
    "tests.fixtures.daemon",
    "tests.fixtures.nvml",
    "tests.fixtures.smtp_tls",
    "tests.fixtures.idle",
    "tests.fixtures.http_receiver",
    "tests.fixtures.inproc",
    "tests.fixtures.providers",
]

# (test id, what was still running) for the summary; a runner ignores SIGHUP and SIGTERM by design,
# so a test that only kills tmux or the daemon leaves its training behind.
_LEFT_BY_TESTS: list[tuple[str, list[str]]] = []
_TMP_BEFORE: set[str] = set()


def _join_alert_threads(timeout: float = 10.0) -> None:
    """An Alerts delivers in short-lived threads (one may start the next); one still running when
    its test ends logs its "alert_mailed" line into the next test's output, or onto the terminal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [t for t in threading.enumerate() if t.name.startswith("alerts-") and t.is_alive()]
        if not busy:
            return
        for t in busy:
            t.join(max(0.0, deadline - time.monotonic()))


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item):
    # innermost, so still inside the test's output capture: a thread that logs after it (while
    # pytest prints the test's dot with capture suspended) would write onto the terminal
    yield
    _join_alert_threads()


@pytest.fixture(autouse=True)
def _ends_what_it_started(request):
    yield
    _join_alert_threads()
    from supervisor.redact import forget_registered

    forget_registered()  # a secret one test registered must not mask another test's text
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is not None:
        left = kill_under(tmp)
        if left:
            _LEFT_BY_TESTS.append((request.node.nodeid, left))


@pytest.fixture(autouse=True, scope="session")
def _session_leaves_nothing_running(tmp_path_factory):
    """Torn down last, after every server fixture: whatever still runs from this session's temp
    folders now was left by a fixture's teardown, and fails the run (after being killed)."""
    base = tmp_path_factory.getbasetemp()
    yield
    left = kill_under(base)
    if left:
        pytest.fail("processes of this test session were still running at its end (killed now):\n  "
                    + "\n  ".join(left), pytrace=False)


def pytest_sessionstart(session):
    _TMP_BEFORE.update(os.listdir(tempfile.gettempdir()))


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if _LEFT_BY_TESTS:
        tr.write_sep("=", "tests that left processes running (ended by tests/conftest.py)", yellow=True)
        for nodeid, left in _LEFT_BY_TESTS:
            tr.write_line(f"{nodeid}:")
            for p in left:
                tr.write_line(f"    {p}")
    tmp = Path(tempfile.gettempdir())
    new = sorted(n for n in set(os.listdir(tmp)) - _TMP_BEFORE if not n.startswith("pytest-of-"))
    if new:
        tr.write_sep("=", f"new in {tmp} since the session started (the tests', or another program's)", yellow=True)
        for n in new[:30]:
            tr.write_line(f"    {tmp / n}")
