"""Restore from the target without the daemon (a container without systemd, a bench, by hand).

    python -m supervisor.resume --config CFG --list                 # the target's units, one JSON line
    python -m supervisor.resume --config CFG [--checkpoint NAME] [--dry-run]

Restores the newest complete unit (or NAME) into its place under the watched folder, verified
against its manifest, and records it in the sync ledger (so the daemon started later sends none of
it again). Exit 0 done, 1 nothing to restore or the target failed (the reason on stderr), 2 bad
config, 3 when the daemon holds the ledger (use `supervisorctl resume` then).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from supervisor.config import ConfigError, load
from supervisor.config.cluster import for_node


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m supervisor.resume", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg, run_target = for_node(load(args.config), os.environ)  # a node of several: its part
    except ConfigError as e:
        sys.stderr.write("\n".join(e.problems) + "\n")
        return 2
    if not cfg.sync.target or not cfg.sync.watch:
        sys.stderr.write("resume: needs sync.target and sync.watch in the config\n")
        return 2
    from supervisor.store import _log

    def setup_logging() -> None:
        import structlog

        from supervisor.logging_setup import configure

        configure(cfg.log_level, json=True)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))  # stdout: the result

    _log.on_first_use = setup_logging
    _log.min_level = _log.LEVELS.get(str(cfg.log_level).lower(), 0)
    from supervisor.config.target import parse_target
    from supervisor.resume.restore import NothingToRestore, Restorer
    from supervisor.resume.wholerun import run_parts
    from supervisor.store import make_target, target_identity
    from supervisor.store.base import TargetError
    from supervisor.sync.ledger import Ledger, LedgerBusy
    from supervisor.sync.scan import watch_roots

    url = parse_target(cfg.sync.target)
    target = make_target(url, cfg.sync, cfg.state_dir)
    ledger = None
    try:
        if not (args.list or args.dry_run):
            ledger = Ledger(cfg.state_dir, target_identity(url, cfg.sync))
        run = run_parts(run_target, cfg.cluster.nodes, cfg.cluster.rank or 0, cfg.cluster.key_file,
                        lambda u: make_target(parse_target(u), cfg.sync, cfg.state_dir))
        rs = Restorer(target, ledger, watch_roots(cfg.sync.watch), time.time,
                      etag_is_sha=url.kind in ("local", "rsync"), user=cfg.training.user, run=run)
        if args.list:
            out = {"target": url.display(), "units": [u.to_json() for u in rs.survey().units]}
        else:
            out = rs.restore(args.checkpoint, dry_run=args.dry_run).to_json()
    except LedgerBusy as e:
        sys.stderr.write(f"resume: {e}; use `supervisorctl resume`\n")
        return 3
    except (NothingToRestore, TargetError, OSError) as e:
        sys.stderr.write(f"resume: {e}\n")
        return 1
    finally:
        if ledger is not None:
            ledger.close()
        target.close()
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
