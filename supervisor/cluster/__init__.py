"""The cluster wing: one run on several machines.

Owns which node this is (`nodes.identity`, from [cluster] or the engines' environment: torchrun,
SkyPilot, dstack, RunPod), where its part of the run lives on the target (`node-<k>/`), the
heartbeats every node writes under `_cluster/` and what they say of each node (`nodes.judge`), and
the duty that writes them, reads the others' and asks the one stop door for `node_lost` when a
node is lost (`watch`). The nodes meet through the sync target: no server of our own.

Pure: `nodes`. Shell: `watch`.
May import: the core, notify, training, sync. Imported by: the daemon.
"""

PURE = ("nodes",)
