"""`python -m embark_runtime.launch TORCHRUN-ARGS`: torchrun, as the generated launch.sh
runs it, without its traceback when the ranks failed with a user error.

The trainer ends with exit code 2 after saying what the user must change
(`train.py: error: ...`, once when every rank shares it). torchrun then adds its own
ChildFailedError traceback (some fifty lines about the launcher) and exits 1. When every
failed rank exited with 2, this wrapper exits 2 with the ranks' messages alone; any
other failure (a crash, a signal, a Python traceback of a rank) is torchrun's as before.
(The ranks that had not exited yet are stopped with SIGTERM: they count as the first.)
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence

USER_ERROR = 2
"""The trainer's exit code for a user's mistake (embark_runtime.trainer.EXIT_USER_ERROR)."""


class _QuietOnUserErrors(logging.Filter):
    """Drops the launcher's lines about ranks that exited with a user error (and the
    SIGTERMs that stop the others then): the ranks have said what went wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return f"(exitcode: {USER_ERROR})" not in text and "closing signal SIGTERM" not in text


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    quiet = _QuietOnUserErrors()
    for name in ("torch.distributed.elastic", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(quiet)
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        # torchrun stops the other ranks with SIGTERM once the first one exits
        others = {f.exitcode for f in e.failures.values()} - {USER_ERROR, -signal.SIGTERM}
        if first.exitcode == USER_ERROR and not others:
            return USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
