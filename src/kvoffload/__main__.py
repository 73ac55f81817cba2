"""``python -m kvoffload``: the same as the ``kvoffload`` command."""

from kvoffload.cli.main import main

raise SystemExit(main())
