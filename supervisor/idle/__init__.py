"""The idle wing: is anybody or any work on this machine, and when does it stop.

Owns the idle state machine (ACTIVE -> IDLE -> WARNED -> STOPPING -> STOPPED), the probes that feed
it (SSH, tmux, Jupyter, GPU load, the training's log and CPU), the stop sequence and its actions,
and the check for an outer orchestrator that may stop the machine too.

Pure: `machine` (decisions, no I/O, every function handed `now`).
Shell: `activity` (sensors), `orchestrator`, `guard` (the duty that steps the machine), `shared` (the
machine and the last poll, under one lock, for the guard's parts), `stopping` (the stop sequence: the
interrupt, the final sync cut to a cap's moment, the stop hooks, the action), `stop` (the record and the
actions), `announce` (what the guard tells the owner), `finalwatch` (the final sync at a run's end, its
failure told at once).
May import: the core, notify, training, progress, hooks, stop. Imported by: the daemon (and the CLI's words).
"""

PURE = ("machine",)
