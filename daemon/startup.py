"""A command's start-up without the cyclic garbage collector.

Starting `specd generate` or `specd serve` creates about a million objects that live as
long as the process (torch's import above all: modules, functions, dispatch tables). The
collector's generations fill up as they are created, so it ran ~400 times during start-up,
its full collections scanning all of them: ~0.25 s of a 1.4 s start to the first token on
the project's CPU, to free ~7,500 objects (~1 MB). Reference counting frees everything else
as before.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block (imports, model loading) with the cyclic collector off; then move
    every object alive to the permanent generation (`gc.freeze`), where later collections,
    a serving daemon's included, no longer scan them, and turn the collector back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    except BaseException:
        # A failed start-up's traceback (a partly loaded model in its frames) is not frozen.
        if enabled:
            gc.enable()
        raise
    gc.freeze()
    if enabled:
        gc.enable()
