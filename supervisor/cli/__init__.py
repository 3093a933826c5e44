"""The owner's entry points: `supervisorctl` (main), the config checker, the config reference
generator, the control-socket client and the status text.

The top of the house, with the daemon package: it may import every wing; no wing imports it."""
