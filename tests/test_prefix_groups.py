"""prefix_classes: which decode lanes share leading blocks, and how long the shared run is."""

import numpy as np

from ouro_fast.engine.gpu.prefix_groups import prefix_classes

BS = 4


def tables_of(rows, loops=2, mb=8):
    """Tables [lanes, loops, mb] from each lane's loop-0 blocks; loop t's block is block + 100 * t."""
    t = np.full((len(rows), loops, mb), -1, np.int32)
    for i, blocks in enumerate(rows):
        for j in range(loops):
            t[i, j, : len(blocks)] = np.asarray(blocks) + 100 * j
    return t


def test_lanes_with_the_same_leading_blocks_form_a_class():
    t = tables_of([[1, 2, 3, 9], [1, 2, 3, 10, 11], [5, 6], [1, 2, 7]])
    live = np.ones(4, bool)
    pos = np.array([15, 18, 5, 10])
    cls, lens = prefix_classes(t, live, pos, BS, min_saved=1)
    assert cls.tolist() == [0, 0, -1, 0]
    assert lens.tolist() == [2 * BS, 0]  # lane 3 shares two blocks only


def test_a_prefix_never_reaches_a_members_position():
    t = tables_of([[1, 2, 3, 4], [1, 2, 3, 4]])
    cls, lens = prefix_classes(t, np.ones(2, bool), np.array([16, 9]), BS, min_saved=1)
    assert cls.tolist() == [0, 0] and lens[0] == 2 * BS  # position 9 lies in block 2


def test_blocks_must_be_shared_at_every_loop():
    t = tables_of([[1, 2, 3], [1, 2, 3]])
    t[1, 1, 1] = 77  # loop 1's second block differs
    cls, lens = prefix_classes(t, np.ones(2, bool), np.array([12, 12]), BS, min_saved=1)
    assert cls.tolist() == [0, 0] and lens[0] == BS


def test_idle_lanes_and_small_savings_form_no_class():
    t = tables_of([[1, 2], [1, 2], [3, 4], [3, 4]])
    live = np.array([True, False, True, True])
    cls, lens = prefix_classes(t, live, np.full(4, 8), BS, min_saved=8)
    assert cls.tolist() == [-1, -1, 0, 0] and lens.tolist() == [8, 0]
    cls, lens = prefix_classes(t, live, np.full(4, 8), BS, min_saved=9)
    assert (cls == -1).all() and not lens.any()


def test_the_classes_that_save_most_come_first_and_the_rest_get_none():
    rows = [[1, 2]] * 2 + [[3, 4, 5]] * 3 + [[6, 7, 8]] * 2
    t = tables_of(rows)
    cls, lens = prefix_classes(t, np.ones(7, bool), np.full(7, 12), BS, max_classes=2, min_saved=1)
    assert cls.tolist() == [-1, -1, 0, 0, 0, 1, 1]
    assert lens.tolist() == [12, 12]
