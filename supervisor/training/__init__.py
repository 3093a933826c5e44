"""The training wing: the job in tmux, the runner in its pane, its log, its checkpoint names.

Owns starting, watching, stopping and re-adopting the training (`job`), the process that sits in
the tmux pane and records how it ended (`runner`, run as `python -m supervisor.training.runner`),
the tmux CLI on our own socket (`tmux`), following the log (`logfollow`), opening it as root without
following the training user's links (`safeopen`), the job's own environment (`jobenv`) and the Trainer's
checkpoint folder names (`checkpoints`).

Pure: `checkpoints`, `jobenv`. Shell: `job`, `runner`, `tmux`, `logfollow`, `safeopen`.
May import: the core, notify (its words). Imported by: progress, idle, gpu, spot, sync, the daemon.
"""

PURE = ("checkpoints", "jobenv")
