"""The disk wing: the training's disk never fills up unnoticed, and frees only what is safe off the machine.

Owns the forecast (`forecast`: free space, checkpoint size and save interval -> "full in ~N" and
whether to alert), the decision which local checkpoints may be deleted (`prune`), and the duty
that watches the filesystems of `sync.watch` and `training.workdir`, alerts, and deletes what
the decision allows once the sync engine has just verified it on the target (`watch`), with
every delete in a journal (`journal`), and the free-space floor of the other filesystems
(`floor`: `alerts.disk_free_min_pct` on `alerts.disk_paths` and the state folder).

Pure: `forecast`, `prune`. Shell: `watch`, `journal`, `probe`, `floor`.
May import: the core, notify, training, sync. Imported by: the daemon.
"""

PURE = ("forecast", "prune")
