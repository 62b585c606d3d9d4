"""`turnout` in this process: cli.main with its stdout, stderr and the turnout logger's lines captured, in
the order they were written, as a CompletedProcess. The commands and their exit codes are the console
script's; a test that needs a process of its own (signals, the environment of a fresh interpreter, the
console script's entry) runs the script instead."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess

from turnout import cli


def run_cli(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """cli.main(argv): returncode, stdout and stderr (log records formatted as the console script's)."""
    out, err = io.StringIO(), io.StringIO()
    log = logging.StreamHandler(err)
    log.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("turnout").addHandler(log)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        logging.getLogger("turnout").removeHandler(log)
    if check:
        assert rc == 0, err.getvalue()
    return subprocess.CompletedProcess(["turnout", *argv], rc, out.getvalue(), err.getvalue())
