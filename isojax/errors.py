"""User-facing errors: the command-line entry points print these as one short line and exit 2."""

import argparse
import errno
import os
import re
import sys

from isojax.log import log


class UserError(Exception):
    """Bad input from the user (missing path, unknown model, corrupt checkpoint, ...).

    The message must be complete and short: the CLI prints `error: <message>` and exits
    with status 2, never a traceback.
    """


class ArgumentParser(argparse.ArgumentParser):
    """argparse as every command uses it: a mistake on the command line (a bad value, an unknown or
    missing option) is one line `error: ...` on stderr and exit status 2, as a UserError is; the
    usage is printed by --help only."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


class Busy(UserError):
    """A folder locked by another isojax process; `holder`: its pid and host (and since when), as it
    wrote them; `clear`: how to remove a lock its dead holder left, where the lock does not go by
    itself (gs://)."""

    def __init__(self, out, holder: dict, clear: str = ""):
        self.holder = holder
        since = f", since {holder['since']}" if holder.get("since") else ""
        super().__init__(f"--out {out} is in use by another isojax run (pid {holder.get('pid', '?')} on "
                         f"{holder.get('host', '?')}{since}); wait for it to end or choose another --out{clear}")


class Preempted(Exception):
    """The run was asked to stop (SIGTERM) and wrote a checkpoint first: exit 143, resumable."""

    exit_code = 143  # 128 + SIGTERM, what a scheduler expects of a job it terminated


OUT_OF_MEMORY = ("the device ran out of memory; lower --batch-tokens, use --no-token-stats or a larger "
                 "'model' axis (--mesh data=N,model=M) to split parameters and accumulators over more devices")

# JAX's pool, grown piece by piece, can hold enough memory in total but no contiguous block for one
# [S, V, D] array of per-token sums: phi-2 on an 80 GB H100 (bench/RESULTS.md 14b)
PIECEWISE_POOL = ("; with XLA_PYTHON_CLIENT_PREALLOCATE=false JAX's pool grows piece by piece and may find no "
                  "contiguous block for the largest accumulator where the plan fits: unset it and run again first")


def _piecewise_pool() -> bool:
    return os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in ("false", "0", "no")


def explain(e: BaseException) -> str | None:
    """The one-line message for an error that is the machine's, not a bug: a full disk (OSError
    ENOSPC, or a library's RESOURCE_EXHAUSTED that says so) or a device out of memory (XLA's
    RESOURCE_EXHAUSTED); None for anything else."""
    text = str(e)
    short_write = isinstance(e, OSError) and re.fullmatch(r"\d+ requested and \d+ written", text)  # numpy's tofile
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text \
            or short_write:
        where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
        return f"disk full{where}: free space (earlier results are intact) and run again"
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return f"cannot write {e.filename or 'a file'}: {e.strerror}"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return OUT_OF_MEMORY + (PIECEWISE_POOL if _piecewise_pool() else "")
    return None


def run_command(body, args) -> int:
    """Run a command-line body: bad input (UserError), a full disk or a device out of memory ->
    one line `error: ...` on stderr and exit status 2; SIGTERM after its checkpoint -> 143;
    Ctrl-C -> 130; anything else is a bug and raises."""
    try:
        body(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        log(str(e))
        return Preempted.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # XLA reports device out-of-memory as a runtime error
        message = explain(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


def exit_with(code: int) -> None:
    """Leave a command-line process with `code`. After an error a background thread may still be
    compiling (the step's plan, run/plan.py, starts before the weights load); finalizing the
    interpreter under it aborts inside XLA ("terminate called ...", SIGABRT instead of the error's
    status), so an error exit skips finalization once stdout and stderr are flushed. Nothing is
    lost: every file isojax writes is complete or absent at any moment."""
    import os
    import sys
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

