"""Moved to the stop wing (issue 51): the record and sequence are `supervisor.stop.record`, the
actions `supervisor.stop.actions`. Kept for the imports that name this module."""

from supervisor.stop.actions import (  # noqa: F401
    COMMAND_TIMEOUT_S,
    describe_action,
    poweroff,
    proc_ctime,
    read_exit,
    start_command,
    stop_how,
)
from supervisor.stop.providers.aws import ec2_stop, imds_instance  # noqa: F401
from supervisor.stop.providers.base import StopActionError  # noqa: F401
from supervisor.stop.record import (  # noqa: F401
    MAX_ACTION_ATTEMPTS,
    P,
    StopRecord,
    StopSequence,
    may_act_without_sync,
    move,
    sync_summary,
)
