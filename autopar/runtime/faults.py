"""Fault injection, a test hook only: a rank SIGKILLs itself at a chosen point, on the first
attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted job runs
through. Set in the environment of ``autopar run`` / torchrun::

    AUTOPAR_FAULT_KILL_AT_STEP=RANK:STEP   rank RANK dies before optimizer step STEP
    AUTOPAR_FAULT_KILL_IN_SAVE=RANK:STEP   rank RANK dies while the checkpoint of STEP is being
                                           written (its shards on disk, before the manifest)

Nothing reads these outside the two points; they are not options and not for users.
"""

from __future__ import annotations

import os
import signal
import sys
from enum import Enum


class Fault(str, Enum):
    """Where a rank can be killed; the value is the variable that asks for it."""

    STEP = "AUTOPAR_FAULT_KILL_AT_STEP"
    SAVE = "AUTOPAR_FAULT_KILL_IN_SAVE"


def kill_if(fault: Fault, rank: int, step: int) -> None:
    """SIGKILL this process if ``fault``'s variable names this rank and step, on a first attempt."""
    wanted = os.environ.get(fault.value, "")
    if not wanted or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return
    who, _, when = wanted.partition(":")
    if who.strip() == str(rank) and when.strip() == str(step):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
