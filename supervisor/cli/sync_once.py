"""Run the sync engine without the daemon, from the same config.

    python -m supervisor.sync --config CFG --once            # upload what is complete, verify, exit
    python -m supervisor.sync --config CFG --final /w/out    # the stop logic's final sync, by hand
    python -m supervisor.sync --config CFG --serve           # watch and upload until SIGTERM

Exit status 0 when the target holds everything asked for, 1 when it does not (the reason on
stderr), 2 for a bad config, 3 when the daemon already runs the sync for this target. The result
is printed as one JSON line on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading

from supervisor.cli import sync_stamp as stamp
from supervisor.clock import SystemClock
from supervisor.config import ConfigError, load, nothing_watched
from supervisor.config.cluster import for_node
from supervisor.store import _log
from supervisor.sync.policy import excluded_roots


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m supervisor.sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--once", action="store_true", help="upload what is complete now, then exit")
    mode.add_argument("--final", nargs="+", metavar="PATH", help="final sync of these folders")
    mode.add_argument("--serve", action="store_true", help="keep watching until SIGTERM")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--log-level", default=None)
    args = ap.parse_args(argv)
    try:
        cfg, _run = for_node(load(args.config), os.environ)  # a node of several: its part
        if not args.final and nothing_watched(cfg):
            raise ConfigError(nothing_watched(cfg))  # "in sync, 0 files" would be a lie
    except ConfigError as e:
        for p in e.problems:
            sys.stderr.write(p + "\n")
        return 2

    def setup_logging() -> None:
        import structlog

        from supervisor.logging_setup import configure

        configure(args.log_level or cfg.log_level, json=True)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))  # stdout: the result

    _log.on_first_use = setup_logging
    _log.min_level = _log.LEVELS.get(str(args.log_level or cfg.log_level).lower(), 0)
    clock = SystemClock()
    alerts = None  # a one-shot run is over long before `fail_alert_after`: its failure is its exit status
    if args.serve:
        from supervisor.notify.alerts import Alerts

        alerts = Alerts(cfg.alerts, clock, cfg.state_dir)
    roots = [w for w in cfg.sync.watch if w]
    excluded = excluded_roots(cfg, os.environ)
    settings = (dataclasses.asdict(cfg.sync), cfg.state_dir, excluded)  # what shapes a pass besides the files
    if args.once and (hit := stamp.answer(settings, cfg.state_dir, roots)) is not None:
        sys.stdout.write(json.dumps(hit) + "\n")  # nothing changed since a pass that left it all on the target
        return 0
    from supervisor.sync.engine import engine_for

    engine = engine_for(cfg, clock, alerts, excluded=excluded)
    if engine.enabled and engine.ledger is None:
        sys.stderr.write(f"{engine.status()['last_error']}\n")
        return 3
    if not args.once:
        engine.start(watch=args.serve)
    settled: dict | None = None
    try:
        if args.once:
            stamp.forget(cfg.state_dir)
            tree = stamp.tree_digest(roots)  # before the scan: what the pass will have seen at most
            r = engine.once(args.timeout)
            answer = dataclasses.asdict(r)
            sys.stdout.write(json.dumps(answer) + "\n")
            if not r.ok:
                sys.stderr.write(f"sync failed: {r.error}\n")
            p = engine.board.pending
            if r.ok and engine.enabled and not (r.unsynced or r.partial_units or r.damaged or p.files or p.waiting):
                settled = {"answer": answer, "tree": tree}
            return 0 if r.ok else 1
        if args.serve:
            stop = threading.Event()
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, lambda *_: stop.set())
            while not stop.wait(1.0):
                pass
            return 0
        r = engine.final_sync(args.final, args.timeout)
        sys.stdout.write(json.dumps(dataclasses.asdict(r)) + "\n")
        if not r.ok:
            sys.stderr.write(f"sync failed: {r.error}\n")
        return 0 if r.ok else 1
    finally:
        engine.close()
        if settled is not None and engine.ledger is not None:
            try:
                stamp.write(settings, cfg.state_dir, roots, str(engine.ledger.dir), settled["answer"],
                            settled["tree"])
            except OSError:
                stamp.forget(cfg.state_dir)  # no stamp: the next pass runs the engine


if __name__ == "__main__":
    raise SystemExit(main())
