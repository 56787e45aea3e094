"""Which decode lanes share a prompt prefix: the classes that the lanes' cascade attention reads once.

Lanes whose requests hit the same prefix-cache entries (or share a prompt) hold the same physical blocks
at the start of their tables, at every loop. A class is such a set of lanes with the run of leading blocks
that all of them hold; on the device a class splits into one group per loop plane
(kernels/cascade_attention.py). Pure numpy on the engine-owner thread, recomputed only when the lanes
change.
"""

from __future__ import annotations

import numpy as np

# Classes a launch can carry (each becomes one group per loop on the device).
MAX_CLASSES = 2
# A class pays for the extra launch per layer when its lanes skip at least this many prefix positions'
# reads a step between them ((lanes - 1) x prefix length).
MIN_SAVED_POSITIONS = 1024


def prefix_classes(tables: np.ndarray, live: np.ndarray, positions: np.ndarray, block_size: int,
                   max_classes: int = MAX_CLASSES, min_saved: int | None = None,
                   ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(class [lanes] int32, -1 for none; prefix length [max_classes] int32, in positions, 0 unused).

    tables [lanes, loops, MB]: each lane's block tables (-1 unused); live [lanes]: lanes that decode;
    positions [lanes]: each lane's position now (a prefix ends at or before it). A class's prefix is the
    longest run of leading blocks that every member holds at every loop; classes that save the most reads
    come first. min_saved: MIN_SAVED_POSITIONS by default."""
    min_saved = MIN_SAVED_POSITIONS if min_saved is None else min_saved
    lanes = tables.shape[0]
    cls = np.full(lanes, -1, np.int32)
    lens = np.zeros(max_classes, np.int32)
    idx = np.flatnonzero(live & (tables[:, 0, 0] >= 0))
    if len(idx) < 2:
        return cls, lens
    keys, inverse, counts = np.unique(tables[idx, 0, 0], return_inverse=True, return_counts=True)
    found = []
    for k in np.flatnonzero(counts >= 2):
        members = idx[inverse == k]
        t = tables[members]
        same = ((t == t[0]).all(axis=0) & (t[0] >= 0)).all(axis=0)  # per block index, at every loop
        run = int(np.argmin(same)) if not same.all() else len(same)
        blocks = min(run, int(positions[members].min()) // block_size)
        saved = (len(members) - 1) * blocks * block_size
        if blocks and saved >= min_saved:
            found.append((saved, blocks, members))
    found.sort(key=lambda f: -f[0])
    for c, (_, blocks, members) in enumerate(found[:max_classes]):
        cls[members] = c
        lens[c] = blocks * block_size
    return cls, lens
