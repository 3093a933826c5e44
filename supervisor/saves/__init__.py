"""The saves wing: what a trainer's save is and when it is whole, read the same way by every wing.

Owns each trainer's rule for its saves (`formats`: HF Trainer, Lightning, Accelerate, DeepSpeed,
Megatron, Orbax, NeMo 2, torch.distributed.checkpoint ...), the verdict on a folder or a file
(`complete`: quiet, marker, format check, temp names), folders that go up whole whatever the globs
select (`wholes`: NeMo 2, a model saved below the top), what looks like a save that no include
selects (`unselected`), a save's manifest as a document (`manifest_doc`: its files, digest, format)
and a save of a run on several machines, whole only when every node's part is (`parts`). A single
checkpoint file its trainer rewrites in place (nanoGPT's ckpt.pt) or replaces by rename (Lightning's
last.ckpt) is held still while it goes up (`snapshot`, its folders `snapdir`: a Target wrapper the sync
worker sends through), and its saves here are counted against the target's (`counts`, told to sync's
targethealth through a Protocol). It knows nothing of what is selected or when it is sent: sync decides that,
resume reads the manifests back, the cluster wing asks whether a run's save is whole.

Pure: `formats`, `complete`, `unselected`, `manifest_doc`, `parts`. Shell: `wholes` (`downloaded`
looks at the disk), `snapshot`, `snapdir`, `counts`.
May import: the core, store (the Target a snapshot is sent through, the manifest's name). Imported by:
sync, resume, cluster.
"""

PURE = ("formats", "complete", "unselected", "manifest_doc", "parts")
