"""The compiled admission modules: built where a C compiler is found, skipped (the same code
in pure Python runs instead) where not."""

from setuptools import Extension, setup

MINI_TIER_HEADERS = [
    "src/kvoffload/admission/_recency.h",
    "src/kvoffload/admission/_mini_tier.h",
]
PENDING_TIER_HEADERS = [*MINI_TIER_HEADERS, "src/kvoffload/admission/_pending_tier.h"]

setup(
    ext_modules=[
        Extension(
            "kvoffload.admission._lru_tier",
            ["src/kvoffload/admission/_lru_tier.c"],
            depends=MINI_TIER_HEADERS,
            optional=True,
        ),
        Extension(
            "kvoffload.admission._s3fifo_tier",
            ["src/kvoffload/admission/_s3fifo_tier.c"],
            depends=PENDING_TIER_HEADERS,
            optional=True,
        ),
        Extension(
            "kvoffload.admission._arc_tier",
            ["src/kvoffload/admission/_arc_tier.c"],
            depends=PENDING_TIER_HEADERS,
            optional=True,
        ),
        Extension(
            "kvoffload.admission._sieve_tier",
            ["src/kvoffload/admission/_sieve_tier.c"],
            depends=PENDING_TIER_HEADERS,
            optional=True,
        ),
        Extension(
            "kvoffload.admission._slru_tier",
            ["src/kvoffload/admission/_slru_tier.c"],
            depends=PENDING_TIER_HEADERS,
            optional=True,
        ),
        Extension(
            "kvoffload.admission._reuse_counts",
            ["src/kvoffload/admission/_reuse_counts.c"],
            depends=["src/kvoffload/admission/_recency.h"],
            optional=True,
        ),
        Extension(
            "kvoffload.admission._ghost",
            ["src/kvoffload/admission/_ghost.c"],
            depends=["src/kvoffload/admission/_recency.h"],
            optional=True,
        ),
        Extension(
            "kvoffload.admission._sketch",
            ["src/kvoffload/admission/_sketch.c"],
            optional=True,
        ),
        Extension(
            "kvoffload.policies._block_loops",
            ["src/kvoffload/policies/_block_loops.c"],
            optional=True,
        ),
    ]
)
