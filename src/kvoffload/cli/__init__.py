"""The ``kvoffload`` command line: the only part of the package that writes to the terminal."""
