"""Where a file a user named is written (the compiler's -o and the trainer's exports).

A result is written atomically: a temporary file in the same folder, renamed over the old
one. A rename must not land on what is not a regular file: over a device (/dev/null,
/dev/full), a FIFO or a terminal it would put a regular file in its place, and over a
symbolic link it would replace the link. `output_target` says where the rename goes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def output_target(path: Path) -> Path | None:
    """Where a user-named output is written atomically: the file itself or, through a
    symbolic link to a file, the file it names (the link stays a link). None when the
    path is a stream (a device such as /dev/null, a pipe, a terminal, /dev/stdout on one),
    which is written in place."""
    try:
        st = os.stat(path)  # follows links
    except OSError:
        return path  # nothing there yet (or unreadable: the write says why)
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return Path(os.path.realpath(path)) if os.path.islink(path) else path
    return None
