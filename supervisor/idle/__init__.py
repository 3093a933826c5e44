"""The idle wing: is anybody or any work on this machine, and when its idle clock asks for a stop.

Owns the idle machine (ACTIVE -> IDLE -> WARNED and the idle clock; STOPPING and STOPPED are the
stop wing's), the probes that feed it (SSH, tmux, Jupyter, GPU load, the training's log and CPU), a
run's end (its final sync and mail, then `finished` or `failed` asked with its grace), `keepalive`,
and the check for an outer orchestrator that may stop the machine too. Its warning asks for `idle`
(or `stalled`) like every other wing asks for its reason; the stop itself is supervisor.stop's.

Pure: `machine` (decisions, no I/O, every function handed `now`).
Shell: `activity` (sensors), `orchestrator`, `guard` (the duty that steps the machine, and where the
stop door lands), `shared` (the record and the last poll, under one lock, for the guard's parts and
the stop driver), `announce` (the idle warning, a cancelled stop, a run's end), `facts` (its config
view and the status blocks). `stop`, `stopping`, `finalwatch`: the names of modules that moved to
the stop wing, kept for old imports.
May import: the core, notify, training, progress, hooks, stop. Imported by: the daemon (and the CLI's words).
"""

PURE = ("machine",)
