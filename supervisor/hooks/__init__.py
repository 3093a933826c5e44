"""The hooks wing: `[[hooks]]` commands run at events (finish, idle_warning, stop, preemption,
final_sync_done, alert).

Each hook runs as the daemon's user (root) with a clean environment (a fixed PATH, HOME, LANG and the
event's facts as TRAIN_SUPERVISOR_* variables: never the daemon's secrets), in its own process group,
killed at its `timeout`. A failing or timed-out hook is alerted. A `required` hook on `stop` holds the
stop as a failed final sync does; the idle wing's stop sequence asks `run_blocking` and decides.

Pure: `env` (the environment a hook gets: a function of the facts alone).
Shell: `runner` (runs the commands, alerts on failure).
May import: the core, notify. Imported by: idle (the stop), the daemon (the other events).
"""

PURE = ("env",)
