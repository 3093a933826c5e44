"""The owner's entry points: `supervisorctl` (main), the config checker, the config reference
generator, the control-socket client and the status text, and the one-shot sync (`sync_once`, run as
`python -m supervisor.sync`; `sync_stamp` answers its no-change pass without the engine).

The top of the house, with the daemon package: it may import every wing; no wing imports it."""
