"""What one source says about a run's progress: the value every parser hands the record. Pure.

Its own module so that the parsers of each family of output (supervisor.progress.parse for the
Hugging Face Trainer and TSUP lines, supervisor.progress.steplines for Lightning's bars and printed
step counters, the tracker readers) build the same thing without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

MAX_STEPS_SANE = 10**12
MAX_TOKENS_SANE = 10**18
MAX_EPOCHS_SANE = 10**6


@dataclass(frozen=True)
class Observation:
    """What one line (or one trainer_state.json) says. None = it does not say."""

    step: int | None = None
    max_steps: int | None = None
    epoch: float | None = None
    num_epochs: float | None = None
    loss: float | None = None
    learning_rate: float | None = None
    tokens: int | None = None          # cumulative tokens processed in the run
    tokens_err: float = 0.0            # +- on `tokens` when it was printed rounded ('1.235e+06')
    tokens_per_s: float | None = None
    steps_per_s: float | None = None   # a rate the trainer itself measured (tqdm's it/s)
    finished: bool = False             # the trainer says the run completed
    at: float | None = None            # when the line says it was printed (TSUP `time`)
    bar: bool = False                  # step/max_steps come from a tqdm bar (may be an eval bar)
    # A bar that counts one epoch (Lightning's "Epoch 1: 45%| 18/40"): step/max_steps are then that
    # epoch's n/total, and this is (the epoch as printed, the epochs the run makes or None, how the
    # printed epochs are numbered: 0 from zero, 1 from one, None not known from this line alone).
    # The record turns it into the run's step, counting the epochs it saw go by.
    epoch_bar: tuple[int, int | None, int | None] | None = None
    source: str = ""                   # tsup | tqdm | log | banner | trainer_state | a tracker

    def merged(self, later: Observation) -> Observation:
        """This observation updated by a later one: the later one's known fields win."""
        changes = {}
        for f in fields(self):
            v = getattr(later, f.name)
            if f.name in ("finished", "bar"):
                if v:
                    changes[f.name] = v
            elif f.name == "tokens_err":
                if later.tokens is not None:
                    changes[f.name] = v
            elif f.name == "epoch_bar":
                if v is not None or later.bar:
                    changes[f.name] = v  # a later plain bar is not the earlier epoch's
            elif v is not None and v != "":
                changes[f.name] = v
        return replace(self, **changes)

    def empty(self) -> bool:
        return all(getattr(self, f.name) in (None, False, 0.0, "") for f in fields(self)
                   if f.name not in ("source", "tokens_err"))
