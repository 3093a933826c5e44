"""`python -m supervisor.sync`: the one-shot sync, whose body is an entry point's (cli/sync_once.py)."""

from supervisor.cli.sync_once import main

if __name__ == "__main__":
    raise SystemExit(main())
