"""The spot wing: a preemptible machine about to be taken.

Owns the metadata-service notices (`notices`: EC2, GCP, Azure), what a notice means and what the
next boot says about it (`decide`), and the shell that alerts, signals the training to save and
follows the emergency sync (`guard`).

Pure: `decide`. Shell: `notices`, `guard`.
May import: the core, notify, training. Imported by: the daemon.
"""

PURE = ("decide",)
