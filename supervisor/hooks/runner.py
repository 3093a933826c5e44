"""Running the `[[hooks]]` commands: one process group each, a clean environment, killed at its
timeout; a failure is an alert. `fire` runs in the background (nothing waits on a hook there);
`run_blocking` is the stop's: it waits and says which required hook failed."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from supervisor.config import HookConfig
from supervisor.hooks.env import hook_env
from supervisor.notify.mails import money as words
from supervisor.status import Block
from supervisor.status.misc import HooksBlock

log = structlog.get_logger("hooks")

KILL_AFTER_S = 5.0  # SIGTERM to the group at the timeout, SIGKILL this much later
OUTPUT_TAIL = 2000


@dataclass(frozen=True)
class HookResult:
    run: str
    event: str
    required: bool
    ok: bool
    why: str = ""         # "exited 3", "timed out after 10s and was killed"
    output: str = ""
    seconds: float = 0.0


def run_one(h: HookConfig, event: str, facts: dict[str, object], home: str = "/root",
            limit: float | None = None) -> HookResult:
    """Run one hook to its end or its timeout, or `limit` if shorter (then its whole process group
    is killed)."""
    t0 = time.monotonic()
    timeout = h.timeout if limit is None else max(0.5, min(h.timeout, limit))
    try:
        p = subprocess.Popen(["/bin/sh", "-c", h.run], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=hook_env(event, facts, home), cwd="/",
                             start_new_session=True, close_fds=True)
    except OSError as e:
        return HookResult(h.run, event, h.required, False, f"could not start: {e}")
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out = b""
        try:
            out, _ = p.communicate(timeout=KILL_AFTER_S)
        except (subprocess.TimeoutExpired, ValueError):
            pass
        return HookResult(h.run, event, h.required, False, f"timed out after {timeout:g}s and was killed",
                          _tail(out), time.monotonic() - t0)
    dt = time.monotonic() - t0
    if p.returncode != 0:
        return HookResult(h.run, event, h.required, False, f"exited {p.returncode}", _tail(out), dt)
    return HookResult(h.run, event, h.required, True, "", _tail(out), dt)


def _kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(KILL_AFTER_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(b: bytes | None) -> str:
    return (b or b"").decode("utf-8", "replace")[-OUTPUT_TAIL:].strip()


class Hooks:
    """The configured hooks, by event. `alert(key, subject, body)` reports a failure (Alerts.event)."""

    def __init__(self, hooks: list[HookConfig], alert: Callable[[str, str, str], None] | None = None,
                 facts: Callable[[], dict[str, object]] | None = None):
        self.hooks = list(hooks)
        self._alert = alert
        self._facts = facts
        self.results: list[HookResult] = []  # the last few, for status and tests
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def for_event(self, event: str) -> list[HookConfig]:
        return [h for h in self.hooks if event in h.events]

    def _all_facts(self, facts: dict[str, object]) -> dict[str, object]:
        base: dict[str, object] = {}
        if self._facts is not None:
            try:
                base = dict(self._facts())
            except Exception:  # noqa: BLE001 - a hook still runs with the facts it was handed
                log.exception("hook_facts_failed")
        base.update(facts)
        return base

    def run_blocking(self, event: str, facts: dict[str, object], limit: float | None = None) -> list[HookResult]:
        """Every hook of `event`, one after another, each to its end or timeout (all of them within
        `limit` seconds when given); failures alerted."""
        out = []
        all_facts = self._all_facts(facts)
        t0 = time.monotonic()
        for i, h in enumerate(self.for_event(event)):
            left = None if limit is None else limit - (time.monotonic() - t0)
            r = run_one(h, event, all_facts, limit=left)
            self._record(i, r)
            out.append(r)
        return out

    def fire(self, event: str, facts: dict[str, object]) -> None:
        """Run the hooks of `event` in the background (an event that nothing waits on)."""
        if not self.for_event(event):
            return
        t = threading.Thread(target=self.run_blocking, args=(event, facts), name=f"hooks-{event}", daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def wait(self, timeout: float) -> bool:
        """Wait for background hooks (tests; shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def _record(self, i: int, r: HookResult) -> None:
        with self._lock:
            self.results = (self.results + [r])[-20:]
        if r.ok:
            log.info("hook_ok", hook=r.run, hook_event=r.event, seconds=round(r.seconds, 2))
            return
        log.error("hook_failed", hook=r.run, hook_event=r.event, why=r.why, required=r.required)
        if self._alert is not None and r.event != "alert":  # a failing alert hook must not feed itself
            mail = words.hook_failed(r.event, r.run, r.why, r.output, r.required)
            try:
                self._alert(f"hook:{r.event}:{i}", mail.subject, mail.body)
            except Exception:  # noqa: BLE001
                log.exception("hook_alert_failed")

    def status(self) -> list[dict]:
        with self._lock:
            return [{"run": r.run, "event": r.event, "required": r.required, "ok": r.ok, "why": r.why,
                     "seconds": round(r.seconds, 2)} for r in self.results[-10:]]

    def status_blocks(self) -> tuple[Block, ...]:
        return (HooksBlock.of({"hooks": self.status()}),)
