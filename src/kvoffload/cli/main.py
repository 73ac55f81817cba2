"""Entry point of the ``kvoffload`` command, and of ``python -m kvoffload``.

Kept light: Ctrl-C and SIGTERM are set up before the command's own modules load
(numpy, the simulator, the tiers: a third of a second), so that an interrupt
while they import ends the command as a later one does, with one line and
status 130, not a traceback from deep inside an import.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvoffload.cli.interrupts import INTERRUPTED, INTERRUPTED_STATUS, one_interrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    with one_interrupt():
        try:
            from kvoffload.cli import app
        except KeyboardInterrupt:
            print(INTERRUPTED, file=sys.stderr)
            return INTERRUPTED_STATUS
        return app.run(list(sys.argv[1:] if argv is None else argv))
