"""A QrunPredictor whose replica dies once, for tests/test_ray.py (its own module so that only a
test with Ray imports qrun.ray_batch)."""

from __future__ import annotations

import os

import pyarrow as pa

from qrun.ray_batch import QrunPredictor


class DiesOnceAfterAnswering(QrunPredictor):
    """The first replica to answer a batch dies before returning it: the costliest moment, work
    done and not delivered. `marker` is the file that says a replica has died (Ray restarts the
    actor, which must not die again)."""

    def __init__(self, marker: str, **kwargs):
        super().__init__(**kwargs)
        self.marker = marker

    def __call__(self, batch: pa.Table) -> pa.Table:
        answered = super().__call__(batch)
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return answered
        os._exit(1)
