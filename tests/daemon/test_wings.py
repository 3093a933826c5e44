"""The list of wings (supervisor.daemon.wings): the orders the daemon derives from it, the start-up
errors it gives, and that a new wing is one line."""

from __future__ import annotations

import ast
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.clock import FakeClock
from supervisor.config import from_dict
from supervisor.daemon.main import Daemon
from supervisor.daemon.wings import WINGS, Phase, Wing, WiringError, build_order, duty_order
from supervisor.interfaces import Duty
from supervisor.status import Block

PKG = Path(__file__).resolve().parents[2] / "supervisor"


def w(name: str, *needs: str, **kw) -> Wing:
    return Wing(name, "", lambda h: object(), needs=needs, **kw)


def test_build_order_follows_needs_and_keeps_list_order_between_equals():
    order = [x.name for x in build_order([w("a", "c"), w("b"), w("c"), w("d", "a")])]
    assert order == ["b", "c", "a", "d"]


def test_a_circle_of_needs_is_a_start_up_error_that_names_it():
    with pytest.raises(WiringError, match=r"circle: (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)"):
        build_order([w("a", "b"), w("b", "c"), w("c", "a"), w("d")])


def test_an_unknown_or_twice_declared_wing_is_named():
    with pytest.raises(WiringError, match="wing a names nope"):
        build_order([w("a", "nope")])
    with pytest.raises(WiringError, match="declared twice: a"):
        build_order([w("a"), w("a")])


def test_the_real_list_builds_every_wing_after_what_it_needs():
    order = [x.name for x in build_order(WINGS)]
    assert sorted(order) == sorted(x.name for x in WINGS)
    for x in WINGS:
        for n in x.needs:
            assert order.index(n) < order.index(x.name), (x.name, n)


def test_duties_run_by_phase_then_list_order():
    order = [x.name for x in duty_order(WINGS)]
    # what senses before what judges; the alerts after every judge, so an alert raised this instant goes out
    assert order[:4] == ["training", "gpu", "follower", "progress"]
    assert order.index("stall") < order.index("guard") and order.index("money") < order.index("guard")
    assert all(order.index("alerts") > order.index(x.name) for x in WINGS if x.phase is not None and x.phase < Phase.TELL)
    phases = [next(x.phase for x in WINGS if x.name == n) for n in order]
    assert phases == sorted(phases)


def test_every_wing_names_the_config_section_it_reads():
    import dataclasses

    from supervisor.config import Config

    sections = {f.name for f in dataclasses.fields(Config)}
    for x in WINGS:
        assert x.section in sections, f"wing {x.name}: section {x.section!r} is not a config section"


def config(tmp_path: Path) -> dict:
    (tmp_path / "out").mkdir(exist_ok=True)
    return from_dict({
        "state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "run" / "control.sock"),
        "training": {"command": "", "on_finish": "none"},
        "sync": {"target": str(tmp_path / "target"), "watch": [str(tmp_path / "out")]},
        "stop": {"action": "dry-run"},
        "idle": {"count_ssh": False, "count_tmux_clients": False},
    })


@dataclass
class DoorbellBlock(Block):
    """Its block of status --json, typed like every other (supervisor/status/)."""

    KEY = "doorbell"
    rung: int = 0
    training: str | None = None


class Doorbell:
    """A wing as a newcomer writes it: a status block, a duty, a verb; built from the training."""

    def __init__(self, training):
        self.training, self.rung = training, 0

    def status_blocks(self) -> tuple[Block, ...]:
        return (DoorbellBlock(rung=self.rung, training=self.training.info().state.value),)

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("doorbell", 5.0, self.ring),)

    def ring(self) -> None:
        self.rung += 1

    def verbs(self) -> dict:
        return {"doorbell": lambda a: {"rung": self.rung}}


def test_a_new_wing_is_one_line(tmp_path):
    line = Wing("doorbell", "training", lambda h: Doorbell(h.training), needs=("training",), phase=Phase.REPORT)
    d = Daemon(config(tmp_path), clock=FakeClock(start=time.time()), wings=(*WINGS, line))
    try:
        d.start(schedule=False)
        for duty in d.duties():
            if duty.name == "doorbell":
                duty.run()
        assert d.status()["doorbell"] == {"rung": 1, "training": d.training.info().state.value}
        assert d._handlers()["doorbell"]({}) == {"rung": 1}
        names = [x.name for x in d.duties()]
        assert names.index("doorbell") > names.index("alerts")  # REPORT comes after TELL
    finally:
        d.shutdown()


def test_a_builder_that_reaches_a_wing_it_did_not_name_fails_at_start_up(tmp_path):
    line = Wing("nosy", "training", lambda h: Doorbell(h.gpu), needs=("training",))
    with pytest.raises(WiringError, match="wing nosy is built from gpu but its line does not need it"):
        Daemon(config(tmp_path), clock=FakeClock(start=time.time()), wings=(*WINGS, line))


# Threads that live as long as one request, one send, one hook or one stop: begun and ended by the
# work they do, not by the daemon. Every other thread is declared on its wing's line (Wing.threads).
SHORT_LIVED = {
    "facts",            # a webhook body's status, asked aside with a deadline
    "resume",           # one restore before one training start
    "resume-ahead",     # the restore's read-ahead, for one restore
    "idle-worker",      # one stop's steps
    "stop-resume",      # the training started again after one withdrawn stop
    "final-sync",       # one stop's final sync, watched
    "hooks-",           # one hook's run
    "send-",            # one message to one channel
    "alerts-",          # one alert's sends
    "trackio-read",     # one bounded read of a tracker's database
    "watch-appear",     # waits for one watched folder to appear
    "rsync-progress",   # one rsync's progress
    "s3-prepare",       # the S3 client built ahead of the first upload, once
    "rsync-hash",       # hashes one batch while rsync sends it
    "health-preflight", # the boot's preflight, once
    "control-conn",     # one control-socket connection
    "control",          # the daemon's own control socket (the house's, not a wing's)
    "metrics-http-",    # the metrics listener's request workers (declared with metrics-http)
}


def thread_names() -> dict[str, str]:
    """Every `threading.Thread(..., name=...)` in the package: its name's literal start -> file."""
    out = {}
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "threading.Thread":
                kw = {k.arg: k.value for k in node.keywords}
                if "name" not in kw:
                    continue
                v = kw["name"]
                text = v.value if isinstance(v, ast.Constant) else re.split(r"\{", ast.unparse(v).strip("f'\""))[0]
                out[str(text)] = str(p.relative_to(PKG))
    return out


def test_every_long_lived_thread_is_declared_by_its_wing():
    declared = {t for x in WINGS for t in x.threads}
    for name, where in thread_names().items():
        assert name in declared or name in SHORT_LIVED, (
            f"{where} starts thread {name!r}: declare it on its wing's line in supervisor/daemon/wings.py "
            "(threads=...), or add it to SHORT_LIVED here with why it ends on its own")
    for x in WINGS:
        if x.threads:
            assert x.start and x.close, f"wing {x.name} declares threads but not how they start and stop"


def test_the_architecture_page_shows_every_line_of_the_list():
    page = (PKG.parent / "docs" / "architecture.md").read_text()
    for x in WINGS:
        row = f"| `{x.name}` | `[{x.section}]` | {', '.join(x.needs) or '—'} |"
        assert row in page, f"docs/architecture.md: the list of wings lacks or misstates {x.name} ({row})"
