"""The money of a run across machines: every node and every resume. Pure.

Each machine boot of the run keeps one record on the target, `_run/ledger/<host>-<boot>.json`,
rewritten at least every minute with the seconds it has billed so far and its price. A machine
that dies without a word still counts up to its last record. The run's money is the sum of the
records (this machine's own counted from its clock, fresher than its record).

The caps of `budget.scope = "run"` reuse plan.py unchanged: with N nodes billing now at `price`
each, the run is one machine billing N x price whose "uptime" is the run's money at that rate.
So max_cost is reached when the run's money reaches it, and max_runtime counts the run's hours
(its machine-hours over its nodes: a 2-node run 3 h, then resumed on 2 more machines for 1 h, has
run 4 h).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from supervisor.untrusted import Unreadable, float_or_none, int_or_none, json_doc

LEDGER = "_run/ledger"
RECORD_FORMAT = "train-supervisor-run-boot/1"
RECORD_MAX = 16 << 10
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Boot:
    """One machine boot of the run, as its record says."""

    host: str
    boot_id: str
    rank: int
    since: float          # wall time its billing began
    seconds: float        # billed so far
    price: float | None   # per hour, of this machine
    currency: str
    updated: float        # wall time of the record

    @property
    def key(self) -> str:
        return record_key(self.host, self.boot_id)

    @property
    def spent(self) -> float | None:
        return None if self.price is None else self.price * max(0.0, self.seconds) / 3600.0


def record_key(host: str, boot_id: str) -> str:
    """The record's name inside LEDGER."""
    return f"{_SAFE.sub('_', host)[:64] or 'host'}-{_SAFE.sub('_', boot_id)[:40] or 'boot'}.json"


def record_doc(b: Boot, run_id: str) -> bytes:
    return json.dumps({"format": RECORD_FORMAT, "run_id": run_id, "host": b.host, "boot_id": b.boot_id,
                       "rank": b.rank, "since": round(b.since, 3), "seconds": round(b.seconds, 1),
                       "price_per_hour": b.price, "currency": b.currency, "updated": round(b.updated, 3)}).encode()


def parse_record(data: bytes, run_id: str) -> Boot | None:
    """A record of this run, or None for anything else (another run's, a stranger's file); a
    damaged one is None too: it is named by the caller, never summed."""
    if len(data) > RECORD_MAX:
        return None
    try:
        d = json_doc(data, limit=RECORD_MAX, what="a run record")
    except Unreadable:
        return None
    if not isinstance(d, dict) or d.get("format") != RECORD_FORMAT or d.get("run_id") != run_id:
        return None
    since, upd = float_or_none(d.get("since"), lo=0), float_or_none(d.get("updated"), lo=0)
    secs = float_or_none(d.get("seconds"), lo=0, hi=10 * 365 * 86400)
    price = d.get("price_per_hour")
    if since is None or upd is None or secs is None:
        return None
    if price is not None and (price := float_or_none(price, lo=0, hi=1e6)) is None:
        return None
    return Boot(str(d.get("host") or "")[:253], str(d.get("boot_id") or "")[:80],
                int_or_none(d.get("rank"), hi=1 << 20) or 0, since, secs, price,
                str(d.get("currency") or "")[:8], upd)


@dataclass(frozen=True)
class RunMoney:
    spent: float | None       # the run's money (None: no price known for some machine)
    seconds: float            # machine-seconds
    machines: tuple[Boot, ...]


def totals(records: list[Boot], me: Boot) -> RunMoney:
    """Every boot of the run, this one as its own clock says (its stored record may lag)."""
    boots = {b.key: b for b in records}
    boots[me.key] = me
    ordered = tuple(sorted(boots.values(), key=lambda b: (b.since, b.rank, b.key)))
    prices = [b.spent for b in ordered]
    spent = None if any(p is None for p in prices) else sum(p for p in prices if p is not None)
    return RunMoney(spent, sum(max(0.0, b.seconds) for b in ordered), ordered)


def as_one_machine(run: RunMoney, nodes: int, price: float | None) -> tuple[float, float | None]:
    """(uptime, price_per_hour) for plan.py: the run as one machine billing `nodes` x `price`."""
    n = max(1, nodes)
    if price and run.spent is not None:
        return run.spent * 3600.0 / (n * price), n * price
    return run.seconds / n, None if price is None else n * price
