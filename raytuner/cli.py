"""The `raytuner` command. Exit codes: 0 ok, 2 bad config or usage, 1 runtime failure."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from raytuner import api, quiet
from raytuner.cli_args import parser
from raytuner.config import ConfigError, JobConfig, load_job

log = logging.getLogger("raytuner")



def print_report(report: dict) -> None:
    from raytuner.preprocess.worklist import report_lines

    print("\n".join(report_lines(report)))


def _reported(report: dict, report_path: str | None) -> None:
    print_report(report)
    if report_path:
        Path(report_path).write_text(json.dumps(report, indent=2))


def _trained(summary: dict) -> None:
    exported = f"LoRA: {summary['lora']}" if "lora" in summary else f"model: {summary['model']}"
    print(
        f"trained {summary['step']} steps, loss {summary['first_loss']:.4f} -> "
        f"{summary['loss']:.4f}; {exported}"
    )


def do_cache(job: JobConfig, family, args: argparse.Namespace) -> int:
    from raytuner.data import cache, verify

    version = cache.Version(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    if args.action == "gc":
        for path in verify.collect(job.data.cache, version, args.min_age_s, args.dry_run):
            print(f"{'would delete' if args.dry_run else 'deleted'} {path}")
        return 0
    bad = verify.verify(version)
    for b in bad:
        print(f"bad {b['path']}: {b['problem']}")
    if bad and args.repair:
        from raytuner import runtime
        from raytuner.preprocess.job import update_cache

        runtime.connect()
        for path in verify.quarantine(version, bad):
            print(f"quarantined {path} as {path}.corrupt")
        pre = job.preprocess
        print_report(update_cache(job.model, job.data, pre, job.train.name, family=family))
        bad = verify.verify(version)
    print(f"{version.root}: {'ok' if not bad else f'{len(bad)} bad file(s)'}")
    return 1 if bad else 0


def do_sample(job: JobConfig, args: argparse.Namespace) -> None:
    if not (args.prompt or args.prompts_file):
        raise ConfigError("raytuner sample: give --prompt TEXT (repeatable) or --prompts-file")
    files = api.sample(
        job, args.prompt, prompts_file=args.prompts_file or "", checkpoint=args.checkpoint,
        seeds=args.seed or [0], steps=args.steps, width=args.width or 0,
        height=args.height or 0, out=args.out, frames=args.frames or 0, fps=args.fps or 0.0,
        merged=not args.no_merge,
        references=args.reference,
    )  # fmt: skip
    for path in files:
        print(f"wrote {path}")


def do_plan(job: JobConfig, args: argparse.Namespace) -> int:
    from raytuner.tools.plan.report import print_plan

    result = api.plan(job, args.gpu_memory)
    if args.json:
        print(json.dumps(result))
    else:
        print_plan(result)
    return 0


def do_bench(job: JobConfig, family, args: argparse.Namespace) -> None:
    if args.action == "preprocess":
        from raytuner.tools.bench.preprocess import bench_preprocess

        bench_preprocess(
            job, family, args.images, args.json, args.rounds, (args.clips, args.frames)
        )
    elif args.action == "train":
        from raytuner.tools.bench.train import bench_train

        bench_train(job, family, args.steps, args.json, args.rounds)
    elif args.action == "feed":
        from raytuner.tools.bench.feed import bench_feed

        bench_feed(job, family, args.rows, args.workers, args.steps, args.json, args.workdir)
    else:
        from raytuner.tools.bench.step import bench_step

        bench_step(job, family, args.steps, args.json, args.warmup, not args.no_plan)


def _dispatch(args: argparse.Namespace) -> int:
    """Each command's API call checks the job once (``api.check``); commands the API does not
    cover (cache, bench) check it through ``api.check`` themselves."""
    if args.command == "demo":
        from raytuner.demo import run_demo

        run_demo(args.workdir)
        return 0
    if args.command == "bench" and args.action == "gpu":
        from raytuner.tools.bench.gpu import bench_gpu

        families = [f for f in args.families.split(",") if f]
        only = [n for n in args.only.split(",") if n]
        return bench_gpu(
            families, args.jobs, args.out, args.budget_s, args.dry_run, only, args.workdir
        )
    job = load_job(args.job, args.overrides)
    if args.command == "check":
        api.check(job)
        print(json.dumps(job.to_dict(), indent=2))
    elif args.command == "cache":
        # verify and gc read the committed cache; --repair encodes the bad rows' images again
        images = args.action == "verify" and args.repair
        return do_cache(job, api.check(job, reads_images=images), args)
    elif args.command == "bench":
        # the job's own images: bench train's cache, bench preprocess --images 0
        images = args.action == "train" or (args.action == "preprocess" and args.images <= 0)
        do_bench(job, api.check(job, reads_images=images), args)
    elif args.command == "sample":
        do_sample(job, args)
    elif args.command == "plan":
        return do_plan(job, args)
    elif args.command == "preprocess":
        _reported(api.preprocess(job), args.report)
    elif args.command == "train":
        _trained(api.train(job))
    elif args.command == "run":
        _trained(api.run(job, on_report=lambda report: _reported(report, args.report)))
    return 0


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM (what `ray job stop` sends a job's driver) handled as Ctrl-C while the command
    runs: the training run aborts cleanly and the command says where it can resume.
    ``runtime.connect`` keeps this handler in place across ``ray.init``, which replaces it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _as_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _as_ctrl_c(signum, frame) -> None:
    """What Ctrl-C does now: the SIGINT handler in place is called here, not reached by raising
    SIGINT, which a `ray job submit` driver never receives (Ray blocks SIGINT in its worker
    processes, and the job's entrypoint inherits the mask)."""
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):  # SIG_DFL / SIG_IGN: stop as the default Ctrl-C does
        raise KeyboardInterrupt
    handler(signal.SIGINT, frame)


def entry() -> None:
    """The `raytuner` command (and `python -m raytuner`): ``main``'s exit code; a command that
    was interrupted ends at once on another Ctrl-C while Ray shuts down at exit."""
    code = main()
    if code == 130:
        _again_exits_at_once()
    sys.exit(code)


def _again_exits_at_once() -> None:
    """Once an interrupted command has said where it stands, another Ctrl-C (Ray shutting down
    at exit) ends the process at once, exit 130, as it does while the run stops: not a
    KeyboardInterrupt inside Ray's shutdown, after which the interpreter crashed (exit -11,
    seen in tests/train/test_interrupt.py) and may leave the local Ray behind."""
    if threading.current_thread() is not threading.main_thread():
        return

    def exit_now(signum, frame) -> None:
        from raytuner import runtime

        print("raytuner: interrupted again: exiting at once", file=sys.stderr, flush=True)
        runtime.kill_started_processes()
        os._exit(130)

    signal.signal(signal.SIGINT, exit_now)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
        return int(e.code or 0)
    # commands that start Ray: the C++ lines of Ray that read as errors and are none are left
    # out of stderr (``quiet.STDERR_LINES``)
    filtered = args.command not in ("check", "plan")
    stderr = quiet.stderr_filtered() if filtered else contextlib.nullcontext()
    try:
        with _sigterm_interrupts(), stderr:
            code = _dispatch(args)
    except KeyboardInterrupt as e:  # Ctrl-C, or `ray job stop` (SIGTERM): one line, exit 130
        where = f": {e}" if str(e) else ""
        print(f"raytuner: {args.command} interrupted{where}", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # the one place that turns any failure into exit 2 or 1 + a reason
        return failed(args.command, getattr(args, "job", None), e)
    return code


def failed(command: str, job_file: str | None, error: Exception) -> int:
    """Print the one line of a failed command and return its exit code: 2 for a bad job
    (a ConfigError, wherever it was raised: here, or in a Ray task, actor or training worker),
    naming ``job_file`` once in front; else 1 with the exception that started it."""
    from raytuner.errors import config_error, root_line

    if (message := config_error(error)) is not None:
        if job_file and not message.startswith(job_file):
            message = f"{job_file}: {message}"
        print(f"raytuner: config error: {message}", file=sys.stderr)
        return 2
    if os.environ.get("RAYTUNER_DEBUG"):
        raise error
    print(f"raytuner: {command} failed: {root_line(error)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
