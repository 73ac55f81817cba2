"""Adapters that run kvoffload inside serving engines; each imports its engine lazily."""
