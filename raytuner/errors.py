"""The one line a failed command prints: the real exception and its message, also when it was
raised inside a Ray task, actor or training worker (where the user sees a wrapper such as
``RayTaskError(UserCodeException)`` around a traceback held only as text); and whether it was
a ``ConfigError`` (exit 2) wherever it was raised."""

from __future__ import annotations

import contextlib
import gc
import re
import traceback

# "SomeError: message" or "package.module.SomeError: message" as a traceback's last line
_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)): (.+)$")
_WRAPPERS = ("RayTaskError", "RayActorError", "UserCodeException", "TrainingFailedError")


def _chain(error: BaseException) -> list[BaseException]:
    """The exception and what it wraps: Ray's ``cause``, a worker group's failures, the
    ``raise ... from`` chain."""
    seen, out, todo = set(), [], [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        # Ray's ``cause``; Ray Train's UserExceptionWithTraceback keeps a worker's in _base_exc
        inner = [getattr(e, "cause", None), getattr(e, "_base_exc", None), e.__cause__]
        inner += list((getattr(e, "worker_failures", None) or {}).values())
        todo += [i for i in inner if isinstance(i, BaseException)]
    return out


def release(error: BaseException) -> None:
    """Let go of what a failure's tracebacks hold of the Ray work it ended, the error itself
    kept: the locals of every finished frame in its whole chain (causes, contexts, Ray's
    ``cause``; the traceback's text and line numbers stay). A failed Ray Data stream leaves a
    suspended ``ObjectRefGenerator`` in one of those frames; its ObjectRefs' lineage keeps the
    stream's actors alive (an encoder and its CPUs or GPU) for as long as the error is held: a
    notebook's last exception, pytest's ``raises``. Measured: a failed preprocess's encoder
    actor still held its CPU 14 s later before; now the CPU is free at once and the actor's
    process gone within 6 s."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        _clear(e.__traceback__)
        inner = (e.__cause__, e.__context__, getattr(e, "cause", None))
        todo += [i for i in inner if isinstance(i, BaseException)]
    gc.collect()  # the stream's executor and its operators hold one another


def _clear(tb) -> None:
    """The locals of every frame of traceback ``tb`` and of their callers (a frame raised in Ray
    Data's executor thread links to that thread's frames), less those still running."""
    for frame, _ in traceback.walk_tb(tb):
        while frame is not None:
            with contextlib.suppress(RuntimeError):  # still running: this thread's callers
                frame.clear()
            frame = frame.f_back


def root_line(error: BaseException) -> str:
    """``Type: message`` of the exception that started it all, on one line."""
    for e in _chain(error):
        raised = [m for line in str(e).splitlines() if (m := _RAISED.match(line.strip()))]
        raised = [m for m in raised if not m.group(1).split(".")[-1].startswith(_WRAPPERS)]
        if raised:
            name, message = raised[-1].groups()
            return f"{name.split('.')[-1]}: {message}"
    # the innermost exception that says something (Ray Data re-raises a dead actor's error
    # ``from`` an empty marker exception)
    chain = _chain(error)
    inner = next((e for e in reversed(chain) if str(e).strip()), chain[-1])
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0] if text else ''}".rstrip(": ")


def config_error(error: BaseException) -> str | None:
    """The message of the ``ConfigError`` a failure started with, raised in this process or in
    a Ray task, actor or training worker (a job the user must change: exit 2 however deep it
    was found), else None."""
    from raytuner.config.loader import ConfigError

    for e in _chain(error):
        if isinstance(e, ConfigError) and not type(e).__name__.startswith(_WRAPPERS):
            return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    name, _, message = root_line(error).partition(": ")
    return message if name == ConfigError.__name__ else None


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (or `ray job stop`): its message says where it can resume; the
    CLI prints it as one line and exits 130."""


class WorkerDied(RuntimeError):
    """A training worker's process died (killed, out of memory, crashed): the message names the
    worker and where the run can resume, not the collateral errors of the workers it left."""


class TrainingStopped(RuntimeError):
    """The training workers stopped a run that could not go on meaning anything (a loss or
    weights no longer finite): the message names the step and the checkpoint kept."""


_PID = re.compile(r"\bpid[:=]\s*(\d+)")
_IP = re.compile(r"\bip: (\S+)|node_ip='([^']+)'")


def dead_worker(error: BaseException) -> str | None:
    """Which worker of a failed Ray Train run died, from the run's error (a worker group's
    failures by rank): a worker whose process ended fails its health check with the actor's
    death, while the others fail at their next collective (gloo's "Connection reset by peer",
    NCCL's abort) because of it. None when no worker died. Ray does not say which signal ended
    the process; its node's preemption and its memory monitor's kills it does say."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank, failure in sorted(failures.items()):
        death = getattr(failure, "health_check_failure", failure)
        if not any(c.__name__ == "RayActorError" for c in type(death).__mro__):
            continue
        text = f"{failure}\n{death}"
        pid, ip = _PID.search(text), _IP.search(text)
        where = f"pid {pid.group(1)}" if pid else "its process"
        where += f" on {ip.group(1) or ip.group(2)}" if ip else ""
        if getattr(death, "preempted", False):
            why = "its node was preempted"
        elif "low on memory" in text:
            why = "Ray's memory monitor killed it (its node ran low on memory)"
        else:
            why = (
                "its process ended without an error of its own: killed (a SIGKILL, the "
                "kernel's OOM killer: see dmesg on its node) or crashed"
            )
        others = [str(r) for r in sorted(failures) if r != rank]
        tail = ""
        if others:
            many = len(others) > 1
            tail = (
                f" (worker{'s' if many else ''} {', '.join(others)} failed only because "
                f"{'they' if many else 'it'} lost {'their' if many else 'its'} connection to it)"
            )
        return f"training worker {rank} ({where}) died: {why}{tail}"
    return None
