"""The stop wing: every reason to stop the machine goes through one sequence and one rule table, and
the stop itself goes through the provider that bills for the machine.

The stop wing owns every stop, from the ask to the action. `rules` is the one table (one row per
`StopReason`, written with keywords; states.py re-exports it): whether a reason warns first and how
long, whether activity cancels it, whether keepalive moves it, its rank, whether it cuts the final
sync short, how a live training is interrupted, what withdraws it. `runner` is the one door every
wing holds (`request`, `withdraw`, the moments of the reasons that have one); `sequence` holds the
reasons that still stand and decides, as pure functions, which one leads and when a stop begins, is
taken over or ends; `machine` is the stop machine (STOPPING, STOPPED, committed: the stop's fields of
the record the idle guard keeps in idle.json). `driver` runs a stop (the interrupt, the final sync
cut to a moment, the `stop` hooks, the mails of `announce`, the action) in the one `worker`;
`record` keeps its sequence in stop.json, exactly once across kill -9; `actions` are poweroff and
the command; `finalwatch` the final sync watched while it runs.

`providers/` knows each provider (RunPod, vast.ai, Lambda, AWS, GCP, Azure; OCI, Nebius,
DigitalOcean, Hetzner warned about): where this machine is, what a stop means there and what still
bills. `choose` decides what stop.action means here; `confirm` is the one-call-per-attempt state
machine that reads the provider's state back until it says not billed; `carry` runs it.

Pure: `rules`, `sequence`, `machine`, `choose`, `confirm`, `providers.base`. Shell: `runner`, `driver`,
`announce`, `views` (the types both read), `record`, `actions`, `finalwatch`, `worker`, `carry`, `resolve`, `providers`.
May import: the core, notify. Imported by: idle, the daemon, check-config.
"""

PURE = ("rules", "sequence", "machine", "choose", "confirm", "providers.base")
