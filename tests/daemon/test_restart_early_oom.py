"""Issue 23, item 7: an OOM printed in the first second of a run, while the daemon was killed (-9)
right after `run`, is alerted once the daemon is back, exactly once (real daemon, real tmux)."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.daemon.test_restart_gap import OOM, config, events, followed_to_end
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@pytest.mark.parametrize("older_log", [False, True], ids=["first-log", "log-replaced"])
def test_oom_in_the_first_second_after_run_with_the_daemon_killed_is_alerted_once(tmp_path, make_daemon,
                                                                                   older_log):
    log = tmp_path / "train.log"
    d = make_daemon(config(tmp_path))
    if older_log:   # a log from before, replaced under the same name before this run
        log.write_text("an older run\n")
        wait_until(lambda: followed_to_end(d, log), 20, what="the older log followed")
        log.unlink()
    job = f"echo 'Traceback (most recent call last):'; echo '{OOM}'; sleep 300"
    t0 = time.monotonic()
    # the socket request `supervisorctl run` makes (the CLI then watches the job's first seconds,
    # longer than this test may let the daemon live)
    d.req("run", {"argv": ["bash", "-c", job]})
    d.kill9()
    assert time.monotonic() - t0 < 1.5, "the daemon should die within a second or so of `run`"
    wait_until(lambda: log.exists() and OOM in log.read_text(), 20, what="the OOM in the log")
    d.start()
    wait_until(lambda: events(d, "cuda_oom"), 20, what="the OOM alert after the restart")
    wait_until(lambda: followed_to_end(d, log), 20, what="the log followed to its end")
    d.kill9()               # and again: it is not alerted a second time
    d.start()
    with open(log, "a") as f:
        f.write("later\n")
    wait_until(lambda: followed_to_end(d, log), 20, what="the log followed after the second restart")
    assert len(events(d, "cuda_oom")) == 1
