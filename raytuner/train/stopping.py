"""`ray job stop` of a training driver: Ray's job supervisor sends the driver SIGTERM (the CLI
handles it as Ctrl-C: the run aborts and the command says where it can resume, exit 130) and
SIGKILLs it ``RAY_JOB_STOP_WAIT_TIME_S`` later (``runtime.job_stop_wait_s``). A driver given too
little time to stop its workers says where the run stands and exits itself just before that,
so the job's log always ends with that line."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

from raytuner import runtime

log = logging.getLogger("raytuner.train")

# what `ray job stop` needs to stop a run cleanly on a small machine: the controller aborts the
# workers, the validation actor closes its files, the driver reads the run folder (measured:
# tests/operate/test_job_submit.py, docs/cluster.md); jobs/runtime_env.yaml gives it more
STOP_NEEDS_S = 20
# the driver's own exit comes this long before Ray's SIGKILL: time to print and exit
MARGIN_S = 1.5


def warn_if_short() -> None:
    """At the start of a `ray job submit` run: say so when `ray job stop` would SIGKILL the
    driver before its workers can stop, and what to set."""
    wait = runtime.job_stop_wait_s()
    if wait is not None and wait < STOP_NEEDS_S:
        log.warning(
            "`ray job stop` gives this driver %g s before Ray kills it "
            "(RAY_JOB_STOP_WAIT_TIME_S), too little to stop the workers cleanly (about %d s): "
            "on a stop it says where the run stands after %g s and exits. Set "
            'RAY_JOB_STOP_WAIT_TIME_S: "60" under env_vars of the runtime env '
            "(jobs/runtime_env.yaml does)",
            *(wait, STOP_NEEDS_S, max(0.5, wait - MARGIN_S)),
        )


def exit_before_sigkill(where: Callable[[], str]) -> threading.Timer | None:
    """Once a `ray job submit` run is interrupted: a timer that, unless cancelled (the run
    stopped in time), prints ``raytuner: train interrupted: <where()>`` and exits 130 shortly
    before Ray's SIGKILL; None outside such a driver (Ctrl-C: a second one exits at once)."""
    wait = runtime.job_stop_wait_s()
    if wait is None:
        return None
    grace = max(0.5, wait - MARGIN_S)

    def give_up() -> None:
        print(
            f"raytuner: train interrupted: {where()} (the workers did not stop within "
            f"{grace:g} s of `ray job stop`, RAY_JOB_STOP_WAIT_TIME_S = {wait:g})",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(130)

    timer = threading.Timer(grace, give_up)
    timer.daemon = True
    timer.start()
    return timer
