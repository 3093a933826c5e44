"""The run's money ledger on the sync target: this machine's record written, every machine's read.

One record per machine boot under `_run/ledger/` (runmoney.py), rewritten every WRITE_EVERY so a
machine that dies without a word still counts up to its last record. The others' are read back
from one listing: only the records whose version changed since the last look (their ETag on S3,
size and mtime on a folder or over rsync) are fetched again, so a run resumed hundreds of times
pays one LIST and a GET per live machine, not a GET per boot; a target that lists no versions has
its records read again every REREAD_EVERY looks. Every record goes through the untrusted readers
(runmoney.parse_record): a damaged one is named, never summed, never the ledger's failure. A
target that fails keeps the last figures and says so. Active when the run spans machines
(`cluster.nodes` > 1) or `budget.scope = "run"` asks for it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from supervisor.interfaces import Duty
from supervisor.money import runmoney as rm

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.config import ClusterConfig

log = structlog.get_logger("money")

WRITE_EVERY = 30.0   # seconds (the daemon's run_ledger duty): at least once a minute, as the record promises
RECORDS_MAX = 4096   # boots read back (a run resumed that often is summed over its newest records)
REREAD_EVERY = 10    # looks after which a record whose version the target cannot say is read again


class RunLedger:
    def __init__(self, cluster: ClusterConfig, price_per_hour: float | None, currency: str, run_target: str,
                 clock: Clock, hostname: str, target_at: Callable[[str], object]):
        self.rank = cluster.rank or 0
        self.price_per_hour, self.currency = price_per_hour, currency
        self.clock = clock
        self.hostname = hostname
        self.run_id = cluster.run_id or run_target
        # rooted at the ledger: its listing is the records alone, never the run's checkpoints
        self.target = target_at(f"{run_target.rstrip('/')}/{rm.LEDGER}")
        self._lock = threading.Lock()
        self._records: list[rm.Boot] = []
        self._read_once = False
        self.error = ""
        self.damaged: list[str] = []
        # key -> (its version as listed, the record read, damaged, the look it was read at)
        self._cache: dict[str, tuple[tuple[int, str], rm.Boot | None, bool, int]] = {}
        self._looks = 0
        self.gets = 0  # records fetched since start (status, tests)

    def me(self) -> rm.Boot:
        boot_id, uptime = self.clock.boot()
        now = self.clock.time()
        return rm.Boot(self.hostname, boot_id, self.rank, now - uptime, uptime, self.price_per_hour, self.currency,
                       now)

    def poll(self) -> None:
        from supervisor.store.base import reader

        me = self.me()
        try:
            self.target.write_object(me.key, rm.record_doc(me, self.run_id))  # type: ignore[attr-defined]
            rd = reader(self.target)
            got, damaged = self._read_changed(rd, me.key)
        except Exception as e:  # noqa: BLE001 - a failing target keeps the last figures
            if str(e) != self.error:
                log.warning("run_ledger_failed", error=str(e))
            self.error = str(e)
            return
        with self._lock:
            self._records, self._read_once, self.error, self.damaged = got, True, "", damaged

    def _read_changed(self, rd: object, mine: str) -> tuple[list[rm.Boot], list[str]]:
        """Every record of the run, fetching only those whose listed version changed (this boot's
        own is counted from its clock: never fetched)."""
        self._looks += 1
        lv = getattr(rd, "list_versions", None)
        listed = lv() if callable(lv) else {k: (v, "") for k, v in rd.list_keys().items()}  # type: ignore[attr-defined]
        keys = sorted(k for k in listed if "/" not in k and k.endswith(".json") and k != mine)[-RECORDS_MAX:]
        got, damaged = [], []
        cache: dict[str, tuple[tuple[int, str], rm.Boot | None, bool, int]] = {}
        for k in keys:
            version = listed[k]
            c = self._cache.get(k)
            if c is not None and c[0] == version and (version[1] or self._looks - c[3] < REREAD_EVERY):
                cache[k] = c
            else:
                data = rd.read_file(k)  # type: ignore[attr-defined]
                self.gets += 1
                b = rm.parse_record(data, self.run_id) if data is not None else None
                bad = b is None and data is not None and b'"run_id"' in data and self.run_id.encode() in data
                cache[k] = (version, b, bad, self._looks)  # ours by its words, yet not a record: named, never summed
            if cache[k][1] is not None:
                got.append(cache[k][1])
            elif cache[k][2]:
                damaged.append(k)
        self._cache = cache
        return got, damaged

    def money(self) -> rm.RunMoney | None:
        """The run's money now (None until the ledger was read once)."""
        with self._lock:
            if not self._read_once:
                return None
            records = list(self._records)
        return rm.totals(records, self.me())

    def words(self) -> str:
        """The finish mail's line: the run's total across its machines."""
        m = self.money()
        if m is None:
            return ""
        hours = m.seconds / 3600.0
        cost = "" if m.spent is None else f"{m.spent:.2f} {self.currency}, "
        return (f"The run so far: {cost}{hours:.1f} machine-hours on {len(m.machines)} machine boot"
                f"{'s' if len(m.machines) != 1 else ''} (the ledger on the target, _run/ledger/).")

    def status(self) -> dict:
        m = self.money()
        return {"run_spent": None if m is None else (None if m.spent is None else round(m.spent, 4)),
                "machine_hours": None if m is None else round(m.seconds / 3600.0, 3),
                "machines": [] if m is None else [
                    {"host": b.host, "rank": b.rank, "boot_id": b.boot_id, "since": b.since,
                     "seconds": round(b.seconds, 1), "spent": None if b.spent is None else round(b.spent, 4),
                     "updated": b.updated} for b in m.machines],
                "ledger_error": self.error, "ledger_damaged": list(self.damaged[:10]), "ledger_reads": self.gets}

    def close(self) -> None:
        close = getattr(self.target, "close", None)
        if callable(close):
            close()

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("run_ledger", WRITE_EVERY, self.poll),)  # this boot's money on the target, every boot's read back
