"""The cluster wing: one run on several machines.

Owns which node this is (`nodes.identity`, from [cluster] or the engines' environment: torchrun,
SkyPilot, dstack, RunPod), where its part of the run lives on the target (`node-<k>/`), the
heartbeats every node writes under `_cluster/` and what they say of each node (`nodes.judge`), and
the duty that writes them, reads the others' and asks the one stop door for `node_lost` when a
node is lost (`watch`). The nodes meet through the sync target: no server of our own.

Rank 0 also writes the run-wide records (`records`): a unit once every node's part is verified
or provably absent and the union of the parts covers every rank. Heartbeats and records are signed
with `cluster.key_file` when the run has one (untrusted/signed.py).

Pure: `nodes`. Shell: `watch`, `records`, `view` (`status --cluster`).
May import: the core, notify, training, sync. Imported by: the daemon.
"""

PURE = ("nodes",)
