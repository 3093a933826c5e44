"""The job's environment: the job's own, never the daemon's.

The daemon runs as root with the keys it needs in its environment (AWS_SECRET_ACCESS_KEY, HF_TOKEN,
TRAIN_SUPERVISOR_SMTP_PASSWORD). A job that inherited them, running as `training.user`, could read
the bucket's keys and plant a manifest for the next restore, or delete what the disk guard pruned
locally. So the job's environment is built here, from:

- a `supervisorctl run` caller's whole environment (their venv, PATH, exports), or, for the
  configured command, a few harmless names of the daemon's own (PATH, the locale, TERM, TZ, TMPDIR;
  HOME/USER/LOGNAME only when the job runs as the daemon's own user);
- `training.pass_env`: names of the daemon's environment passed on purpose (HF_TOKEN for a gated
  base model, WANDB_API_KEY);
- what the daemon adds (TRAIN_SUPERVISOR_RESUME_FROM) and `training.env`, the owner's explicit word.

Whatever of that still holds a value the daemon keeps as a secret (its registry in redact) is
withheld, unless its name is in pass_env or training.env: a `run` from a root shell that exported
the S3 keys hands them to no training user. Pure: the caller passes the environments and secrets.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

# The daemon's own variables a configured job gets by default: what a shell and CUDA need, nothing
# that is anyone's credential.
BASE_NAMES = frozenset({"PATH", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "SHELL", "HOSTNAME",
                        "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
                        "CUDA_DEVICE_ORDER"})
BASE_PREFIXES = ("LC_",)
IDENTITY = ("HOME", "USER", "LOGNAME")   # the runner sets the training user's own


def base(daemon_env: Mapping[str, str], as_other_user: bool) -> dict[str, str]:
    names = BASE_NAMES if as_other_user else BASE_NAMES | set(IDENTITY)
    return {k: v for k, v in daemon_env.items() if k in names or k.startswith(BASE_PREFIXES)}


def job_env(daemon_env: Mapping[str, str], *, caller: Mapping[str, str] | None, config_env: Mapping[str, str],
            extra: Mapping[str, str], pass_env: Collection[str], secrets: Collection[str],
            as_other_user: bool, reserved: Collection[str] = ()) -> tuple[dict[str, str], list[str]]:
    """(the job's whole environment, the names withheld because they held a secret of the daemon's).
    `reserved`: names only `extra` may set (the resume hint), dropped from the caller's."""
    start = dict(caller) if caller is not None else base(daemon_env, as_other_user)
    passed = {k: daemon_env[k] for k in pass_env if k in daemon_env}
    caller_own = {k: v for k, v in (caller or {}).items() if k not in extra and k not in reserved}
    for k in reserved:
        start.pop(k, None)
    # training.env wins over what the daemon adds; a `run` caller's own shell wins over both
    env = {**start, **passed, **extra, **config_env, **caller_own}
    chosen = set(pass_env) | set(config_env)
    held = set(secrets)
    withheld = sorted(k for k, v in env.items() if k not in chosen and v and v.strip() in held)
    for k in withheld:
        del env[k]
    return env, withheld
