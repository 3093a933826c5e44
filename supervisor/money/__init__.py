"""The money wing: caps that save first (a spend cap, a deadline, a runtime cap).

Works back from the earliest cap: at the cap's moment minus the time a clean stop needs (the
training's measured save time + stop_grace + the expected final-sync time + a margin) it asks the
idle wing's one stop sequence to stop for that cap (a stop reason, not a second path), and it mails
the projection at `budget.warn_at`. `supervisorctl budget` changes a cap at run time (money.json).

With `budget.scope = "run"` the caps count every machine, node and resume of the run, from the
run's ledger on the sync target (`_run/ledger/`, one record per machine boot).

Pure: `plan` (when to warn and when to act, from the caps, the lead time and `now`), `runmoney`
(the run's money from its ledger records). Shell: `guard` (the duty: reads uptime, progress,
checkpoints and sync figures; mails; asks for the stop), `runledger` (this boot's record written,
every boot's read back, on the target).
May import: the core, notify, training, progress, sync (its targets, for the ledger). Imported by:
the daemon (wiring, status, metrics).
"""

PURE = ("plan", "runmoney")
