"""User-facing errors: the command-line entry points print these as one short line and exit 2."""


class UserError(Exception):
    """Bad input from the user (missing path, unknown model, corrupt checkpoint, ...).

    The message must be complete and short: the CLI prints `error: <message>` and exits
    with status 2, never a traceback.
    """


def run_command(body, args) -> int:
    """Run a command-line body: bad input (UserError) or a device out of memory -> one line
    `error: ...` on stderr and exit status 2; Ctrl-C -> 130; anything else is a bug and raises."""
    import sys
    try:
        body(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # XLA reports device out-of-memory as a runtime error
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            print("error: the device ran out of memory; lower --batch-tokens or use --no-token-stats",
                  file=sys.stderr)
            return 2
        raise
    return 0
