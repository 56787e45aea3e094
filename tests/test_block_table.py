"""BlockTable: pool invariants, slot mappings, propagation pairs; compiled core vs uncompiled twin."""

import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

MODULES = ["ouro_fast.core.block_table", "ouro_fast.core_py.block_table"]


@pytest.fixture(params=MODULES)
def mod(request):
    return importlib.import_module(request.param)


def owned_blocks(bt) -> list[int]:
    """Every physical block referenced by a held table entry, over all slots and loops."""
    counts = bt.num_blocks_of
    return [int(b) for s in range(len(counts)) for b in bt.tables[s, :, : counts[s]].ravel()]


def ref_slot(bt, slot: int, loop: int, pos: int) -> int:
    bs = bt.block_size
    return int(bt.tables[slot, loop, pos // bs]) * bs + pos % bs


def check_pool(bt, holds=()) -> None:
    """Every block's refs count its holders (table entries and holds); unheld blocks are the free ones."""
    owned = owned_blocks(bt) + [int(b) for h in holds for b in h.ravel()]
    assert all(0 <= b < bt.num_blocks for b in owned)
    holders = np.bincount(np.asarray(owned, np.int64), minlength=bt.num_blocks)
    assert bt.refs.tolist() == holders.tolist()
    assert bt.num_free_blocks == int((holders == 0).sum())
    for s, n in enumerate(bt.num_blocks_of):
        assert (bt.tables[s, :, n:] == -1).all(), "entries past the held blocks must be -1"


def block_places(bt, holds=()) -> dict[int, set]:
    """block -> the (loop, index) places it fills in tables and holds: a shared block has one place."""
    places: dict[int, set] = {}
    for s, n in enumerate(bt.num_blocks_of):
        for t in range(bt.num_loops):
            for i in range(int(n)):
                places.setdefault(int(bt.tables[s, t, i]), set()).add((t, i))
    for h in holds:
        for (t, i), b in np.ndenumerate(h):
            places.setdefault(int(b), set()).add((t, i))
    return places


def all_mappings(bt) -> np.ndarray:
    """Physical slots of every held position, every slot and loop, via fill_slot_mapping."""
    chunks = []
    for s, n in enumerate(bt.num_blocks_of):
        length = int(n) * bt.block_size
        for t in range(bt.num_loops):
            out = np.full(length, -7, dtype=np.int64)
            bt.fill_slot_mapping(s, t, 0, length, out, 0)
            chunks.append(out)
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)


def prompts_for(block_size: int, max_bps: int) -> list[np.ndarray]:
    """Three prompts of max_bps blocks: the first two share their first block, the third shares nothing."""
    base = np.arange(max_bps * block_size, dtype=np.int32)
    second = base.copy()
    second[block_size:] += 1000
    return [base, second, base + 2000]


def make_machine(
    modname: str,
    num_blocks: int,
    block_size: int,
    num_loops: int,
    max_seqs: int,
    max_bps: int,
    caching: bool = False,
):
    module = importlib.import_module(modname)
    prompts = prompts_for(block_size, max_bps)

    class BlockTableMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.bt = module.BlockTable(num_blocks, block_size, num_loops, max_seqs, max_bps, caching)
            self.model = [0] * max_seqs  # blocks per loop each slot should hold
            self.holds: list[np.ndarray] = []  # hold() results not yet adopted or released
            self.hold_prompt: list[int] = []  # the prompt of each hold's blocks
            self.prompt = [0] * max_seqs  # the prompt whose tokens each slot's blocks hold
            self.content: dict[int, tuple] = {}  # block -> the token prefix its K/V was written for

        def write(self, slot, first):
            """Blocks first.. of the slot are new: their K/V is written for the slot's prompt."""
            for i in range(first, self.model[slot]):
                for t in range(num_loops):
                    b = int(self.bt.tables[slot, t, i])
                    self.content[b] = (t, tuple(prompts[self.prompt[slot]][: (i + 1) * block_size].tolist()))

        @rule(
            slot=st.integers(0, max_seqs - 1),
            num_tokens=st.integers(0, max_bps * block_size + 3),
            which=st.integers(0, 2),
        )
        def allocate(self, slot, num_tokens, which):
            bt = self.bt
            before_tables, before_counts = bt.tables.copy(), bt.num_blocks_of.copy()
            before_free, before_refs = bt.num_free_blocks, bt.refs.copy()
            if not self.model[slot]:
                self.prompt[slot] = which
            need_blocks = -(-num_tokens // block_size)
            if need_blocks > max_bps:
                with pytest.raises(ValueError, match="max_blocks_per_seq"):
                    bt.allocate(slot, num_tokens)
                ok = False
            else:
                needed = bt.blocks_needed(slot, num_tokens)
                assert needed == max(0, need_blocks - self.model[slot]) * num_loops
                ok = bt.allocate(slot, num_tokens)
                assert ok == (needed <= before_free)
            if ok:
                self.model[slot] = max(self.model[slot], need_blocks)
                # Growing never moves blocks already held: their KV stays valid.
                held = before_counts[slot]
                assert (bt.tables[slot, :, :held] == before_tables[slot, :, :held]).all()
                assert bt.num_free_blocks == before_free - needed
                # New blocks come from the unheld ones only: a block in use is never evicted or reused.
                new = bt.tables[slot, :, held : self.model[slot]].ravel()
                assert (before_refs[new] == 0).all() and (bt.cached[new] == -1).all()
                self.write(slot, int(held))
            else:
                assert (bt.tables == before_tables).all() and (bt.num_blocks_of == before_counts).all()
                assert bt.num_free_blocks == before_free

        @rule(slot=st.integers(0, max_seqs - 1))
        def free(self, slot):
            before_free = self.bt.num_free_blocks
            mine = self.bt.tables[slot, :, : self.model[slot]].ravel()
            last_holder = int((self.bt.refs[mine] == 1).sum())
            self.bt.free(slot)
            # Only the blocks no other table or hold has go back to the pool.
            assert self.bt.num_free_blocks == before_free + last_holder
            self.model[slot] = 0
            assert (self.bt.tables[slot] == -1).all()

        @precondition(lambda self: any(self.model))
        @rule(data=st.data())
        def hold(self, data):
            bt = self.bt
            slot = data.draw(st.sampled_from([s for s in range(max_seqs) if self.model[s]]))
            k = data.draw(st.integers(0, self.model[slot]))
            before_refs, before_free = bt.refs.copy(), bt.num_free_blocks
            held = bt.hold(slot, k)
            assert held.dtype == np.int32 and held.tolist() == bt.tables[slot, :, :k].tolist()
            assert (bt.refs[held.ravel()] == before_refs[held.ravel()] + 1).all()
            assert bt.num_free_blocks == before_free
            self.holds.append(held)
            self.hold_prompt.append(self.prompt[slot])

        @precondition(lambda self: bool(self.holds) and not all(self.model))
        @rule(data=st.data())
        def adopt(self, data):
            bt = self.bt
            k = data.draw(st.integers(0, len(self.holds) - 1))
            held, which = self.holds.pop(k), self.hold_prompt.pop(k)
            slot = data.draw(st.sampled_from([s for s in range(max_seqs) if not self.model[s]]))
            self.prompt[slot] = which
            before_refs = bt.refs.copy()
            bt.adopt(slot, held)
            self.model[slot] = held.shape[1]
            assert bt.tables[slot, :, : held.shape[1]].tolist() == held.tolist()
            assert (bt.refs == before_refs).all(), "the hold passes to the table: no count changes"

        @precondition(lambda self: bool(self.holds))
        @rule(data=st.data())
        def release(self, data):
            bt = self.bt
            k = data.draw(st.integers(0, len(self.holds) - 1))
            held = self.holds.pop(k)
            self.hold_prompt.pop(k)
            before_free = bt.num_free_blocks
            last_holder = int((bt.refs[held.ravel()] == 1).sum())
            bt.release(held)
            assert bt.num_free_blocks == before_free + last_holder

        @precondition(lambda self: any(self.model))
        @rule(data=st.data())
        def propagate(self, data):
            bt = self.bt
            held = [s for s in range(max_seqs) if self.model[s]]
            count = data.draw(st.integers(0, 6))
            slots = np.array([data.draw(st.sampled_from(held)) for _ in range(count)], dtype=np.int32)
            pos = np.array(
                [data.draw(st.integers(0, self.model[s] * block_size - 1)) for s in slots], dtype=np.int32
            )
            exits = np.array([data.draw(st.integers(0, num_loops - 1)) for _ in range(count)], dtype=np.int32)
            cap = count * (num_loops - 1)
            src, dst = np.full(cap, -7, np.int64), np.full(cap, -7, np.int64)
            n = bt.fill_propagation(slots, pos, exits, count, src, dst)
            expected = [
                (ref_slot(bt, s, e, p), ref_slot(bt, s, j, p))
                for s, p, e in zip(slots.tolist(), pos.tolist(), exits.tolist())
                for j in range(e + 1, num_loops)
            ]
            assert n == len(expected)
            assert list(zip(src[:n].tolist(), dst[:n].tolist())) == expected

        @precondition(lambda self: caching and any(self.model))
        @rule(data=st.data())
        def cache(self, data):
            bt = self.bt
            slot = data.draw(st.sampled_from([s for s in range(max_seqs) if self.model[s]]))
            tokens = prompts[self.prompt[slot]]
            before_refs, before_free = bt.refs.copy(), bt.num_free_blocks
            n = bt.cache(slot, bt.hash_blocks(tokens, len(tokens)), tokens, 0, self.model[slot])
            assert 0 <= n <= self.model[slot]
            assert (bt.cached[bt.tables[slot, :, :n]] >= 0).all()
            assert (bt.refs == before_refs).all() and bt.num_free_blocks == before_free

        @precondition(lambda self: caching and not all(self.model))
        @rule(data=st.data(), which=st.integers(0, 2), limit=st.integers(0, max_bps), forged=st.booleans())
        def lookup(self, data, which, limit, forged):
            bt = self.bt
            slot = data.draw(st.sampled_from([s for s in range(max_seqs) if not self.model[s]]))
            tokens = prompts[which]
            # Forged: another prompt's hashes, as a collision would give; the tokens still decide.
            keyed = prompts[(which + 1) % 3] if forged else tokens
            before_refs, before_free = bt.refs.copy(), bt.num_free_blocks
            k = bt.lookup(slot, bt.hash_blocks(keyed, len(keyed)), tokens, limit)
            assert 0 <= k <= limit
            self.model[slot], self.prompt[slot] = k, which
            got = bt.tables[slot, :, :k]
            # A hit is K/V written for exactly this prefix, at every loop in its own plane.
            for (t, i), b in np.ndenumerate(got):
                assert self.content[int(b)] == (t, tuple(tokens[: (i + 1) * block_size].tolist()))
            assert (bt.refs[got.ravel()] == before_refs[got.ravel()] + 1).all()
            revived = int((before_refs[got.ravel()] == 0).sum())  # unheld cached blocks held again
            assert bt.num_free_blocks == before_free - revived

        @invariant()
        def pool_is_consistent(self):
            bt = self.bt
            check_pool(bt, self.holds)
            assert bt.num_blocks_of.tolist() == self.model
            assert (bt.refs >= 0).all()
            assert bt.num_free_blocks + int((bt.refs > 0).sum()) == bt.num_blocks
            assert bt.num_cached_blocks == int((bt.cached >= 0).sum())
            if not caching:
                assert (bt.cached == -1).all()

        @invariant()
        def cache_entries_are_whole(self):
            # An entry is one position block at every loop: its blocks are its planes, in loop order.
            bt = self.bt
            for e in np.unique(bt.cached[bt.cached >= 0]).tolist():
                assert bt.cached[e] == e
                planes = np.flatnonzero(bt.cached == e).tolist()
                assert len(planes) == num_loops
                assert len({self.content[b][1] for b in planes}) == 1
                assert sorted(self.content[b][0] for b in planes) == list(range(num_loops))
                assert len({int(bt.refs[b]) for b in planes}) == 1

        @invariant()
        def shared_blocks_keep_their_place(self):
            # A block shared by tables or holds is the same positions of the same loop for each.
            assert all(len(p) == 1 for p in block_places(self.bt, self.holds).values())

        @invariant()
        def mappings_match_tables(self):
            bt = self.bt
            got = all_mappings(bt)
            off = 0
            for n in self.model:  # within one slot, no two positions share a physical slot
                one = got[off : off + n * block_size * num_loops]
                assert len(np.unique(one)) == len(one)
                off += len(one)
            expected = [
                ref_slot(bt, s, t, p)
                for s in range(max_seqs)
                for t in range(num_loops)
                for p in range(self.model[s] * block_size)
            ]
            assert got.tolist() == expected

    return BlockTableMachine


@pytest.mark.parametrize("modname", MODULES)
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("geometry", [(24, 4, 4, 3, 3), (10, 2, 1, 4, 5), (9, 3, 3, 2, 2)])
def test_state_machine(modname, geometry, caching):
    run_state_machine_as_test(
        make_machine(modname, *geometry, caching=caching),
        settings=settings(max_examples=30, stateful_step_count=25, deadline=None),
    )


def test_hand_checked_layout_and_propagation(mod):
    bt = mod.BlockTable(num_blocks=16, block_size=4, num_loops=4, max_seqs=2, max_blocks_per_seq=3)
    assert bt.allocate(0, 5)  # 2 blocks per loop, 8 physical blocks
    assert bt.num_blocks_of.tolist() == [2, 0] and bt.num_free_blocks == 8
    # Fresh pool hands out 0, 1, 2, ...: position block 0 at loops 0..3, then block 1.
    assert bt.tables[0].tolist() == [[0, 4, -1], [1, 5, -1], [2, 6, -1], [3, 7, -1]]
    out = np.zeros(6, np.int64)
    bt.fill_slot_mapping(0, 2, 2, 4, out, 1)  # positions 2..5 at loop 2
    assert out.tolist() == [0, 2 * 4 + 2, 2 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1, 0]
    src, dst = np.zeros(6, np.int64), np.zeros(6, np.int64)
    slots = np.array([0, 0, 0], np.int32)
    positions = np.array([5, 1, 2], np.int32)
    exits = np.array([1, 3, 2], np.int32)
    n = bt.fill_propagation(slots, positions, exits, 3, src, dst)
    # pos 5 exited at loop 1 -> loops 2, 3; pos 1 exited at the last loop -> nothing; pos 2 -> loop 3.
    assert n == 3
    assert src[:n].tolist() == [5 * 4 + 1, 5 * 4 + 1, 2 * 4 + 2]
    assert dst[:n].tolist() == [6 * 4 + 1, 7 * 4 + 1, 3 * 4 + 2]
    assert isinstance(n, int) and isinstance(bt.blocks_needed(1, 1), int)
    assert isinstance(bt.num_free_blocks, int)


def test_tables_are_live_arrays(mod):
    bt = mod.BlockTable(8, 2, 2, 2, 2)
    tables, counts = bt.tables, bt.num_blocks_of
    assert tables.dtype == np.int32 and tables.shape == (2, 2, 2)
    assert counts.dtype == np.int32 and counts.shape == (2,)
    assert bt.allocate(1, 3)
    assert tables is bt.tables and tables[1].tolist() == [[0, 2], [1, 3]] and counts.tolist() == [0, 2]
    bt.free(1)
    assert (tables == -1).all() and counts.tolist() == [0, 0]


def test_allocate_failure_and_limits(mod):
    bt = mod.BlockTable(num_blocks=6, block_size=2, num_loops=3, max_seqs=2, max_blocks_per_seq=2)
    assert bt.allocate(0, 2) and bt.num_free_blocks == 3
    snapshot = bt.tables.copy()
    assert bt.blocks_needed(1, 3) == 6
    assert not bt.allocate(1, 3)  # needs 6, has 3
    assert (bt.tables == snapshot).all() and bt.num_free_blocks == 3 and bt.num_blocks_of.tolist() == [1, 0]
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        bt.allocate(0, 5)
    assert (bt.tables == snapshot).all()
    assert bt.allocate(0, 1) and bt.num_free_blocks == 3  # already covered: no-op
    assert bt.allocate(1, 0) and bt.num_blocks_of.tolist() == [1, 0]
    bt.free(0)
    bt.free(0)  # idempotent
    assert bt.num_free_blocks == 6
    with pytest.raises(ValueError, match="slot"):
        bt.allocate(2, 1)
    with pytest.raises(ValueError, match="slot"):
        bt.free(-1)
    with pytest.raises(ValueError, match="num_tokens"):
        bt.allocate(0, -1)
    with pytest.raises(ValueError):
        mod.BlockTable(4, 0, 1, 1, 1)


def test_bad_mapping_and_propagation_inputs(mod):
    bt = mod.BlockTable(8, 2, 2, 2, 4)
    assert bt.allocate(0, 3)  # covers positions 0..3
    out = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="not allocated"):
        bt.fill_slot_mapping(0, 0, 2, 3, out, 0)
    with pytest.raises(ValueError, match="loop"):
        bt.fill_slot_mapping(0, 2, 0, 1, out, 0)
    with pytest.raises(ValueError, match="too short"):
        bt.fill_slot_mapping(0, 0, 0, 2, out, 3)
    src, dst = np.zeros(1, np.int64), np.zeros(1, np.int64)
    one = np.array([0], np.int32)
    with pytest.raises(ValueError, match="exit loop"):
        bt.fill_propagation(one, one, np.array([2], np.int32), 1, src, dst)
    with pytest.raises(ValueError, match="not allocated"):
        bt.fill_propagation(one, np.array([4], np.int32), one, 1, src, dst)
    with pytest.raises(ValueError, match="not allocated"):
        bt.fill_propagation(np.array([1], np.int32), one, one, 1, src, dst)
    with pytest.raises(ValueError, match="too short"):
        bt.fill_propagation(np.array([0, 0], np.int32), one.repeat(2), one.repeat(2) * 0, 2, src, dst)
    with pytest.raises(ValueError, match="count"):
        bt.fill_propagation(one, one, one, 2, src, dst)


def test_shared_blocks_outlive_their_first_table(mod):
    bt = mod.BlockTable(num_blocks=24, block_size=4, num_loops=2, max_seqs=3, max_blocks_per_seq=4)
    assert bt.allocate(0, 10)  # 3 blocks per loop
    held = bt.hold(0, 2)  # the two full blocks of each loop, for two later tables
    again = bt.hold(0, 2)
    assert held.tolist() == bt.tables[0, :, :2].tolist() and bt.refs[held.ravel()].tolist() == [3] * 4
    bt.free(0)  # the partial block goes back; the held ones stay out of the pool
    assert bt.num_free_blocks == 24 - 4 and bt.refs[held.ravel()].tolist() == [2] * 4
    bt.adopt(1, held)
    bt.adopt(2, again)
    assert bt.allocate(1, 12) and bt.allocate(2, 9)  # each grows with blocks of its own
    assert bt.tables[1, :, :2].tolist() == bt.tables[2, :, :2].tolist() == held.tolist()
    assert bt.tables[1, 0, 2] != bt.tables[2, 0, 2]
    bt.free(1)
    assert bt.refs[held.ravel()].tolist() == [1] * 4 and bt.num_free_blocks == 24 - 4 - 2
    bt.free(2)
    assert bt.num_free_blocks == 24 and not bt.refs.any()


def test_hold_adopt_release_refuse_bad_input(mod):
    bt = mod.BlockTable(num_blocks=16, block_size=2, num_loops=2, max_seqs=2, max_blocks_per_seq=3)
    assert bt.allocate(0, 4)
    with pytest.raises(ValueError, match="holds 2 blocks"):
        bt.hold(0, 3)
    with pytest.raises(ValueError, match="slot"):
        bt.hold(2, 0)
    held = bt.hold(0, 1)
    with pytest.raises(ValueError, match="already holds"):
        bt.adopt(0, held)
    with pytest.raises(ValueError, match="held blocks must be"):
        bt.adopt(1, held[:1])
    with pytest.raises(ValueError, match="not held"):
        bt.release(np.array([[15], [14]], np.int32))  # free blocks: releasing them would corrupt the pool
    assert bt.num_free_blocks == 12
    bt.release(held)
    bt.free(0)
    with pytest.raises(ValueError, match="not held"):
        bt.release(held)  # a hold is dropped once
    assert bt.num_free_blocks == 16 and not bt.refs.any()


def cached_prompt(bt, slot: int, tokens: np.ndarray) -> np.ndarray:
    """Fill an empty slot with `tokens` (cache hits first), register its full blocks; returns the hashes."""
    hashes = bt.hash_blocks(tokens, len(tokens))
    k = bt.lookup(slot, hashes, tokens, len(hashes))
    assert bt.allocate(slot, len(tokens))
    assert bt.cache(slot, hashes, tokens, k, len(hashes)) == len(hashes)
    return hashes


def test_hit_takes_every_loop_of_the_cached_blocks(mod):
    bt = mod.BlockTable(
        num_blocks=32, block_size=4, num_loops=4, max_seqs=3, max_blocks_per_seq=4, caching=True
    )
    tokens = np.arange(14, dtype=np.int32)  # 3 full blocks and a partial one
    hashes = cached_prompt(bt, 0, tokens)
    assert bt.num_cached_blocks == 3 * 4 and bt.num_free_blocks == 32 - 16
    assert bt.lookup(1, hashes, tokens, 2) == 2  # capped by max_blocks
    assert bt.tables[1, :, :2].tolist() == bt.tables[0, :, :2].tolist()
    assert bt.refs[bt.tables[0, :, :2].ravel()].tolist() == [2] * 8
    longer = np.concatenate([tokens[:12], [99, 98, 97, 96]]).astype(np.int32)
    assert bt.lookup(2, bt.hash_blocks(longer, 16), longer, 4) == 3  # the fourth block differs
    bt.free(0)
    bt.free(1)
    bt.free(2)
    # Unheld cached blocks count as free but keep their K/V until the pool needs them.
    assert bt.num_free_blocks == 32 and bt.num_cached_blocks == 12 and not bt.refs.any()
    assert bt.lookup(0, hashes, tokens, 3) == 3 and bt.num_free_blocks == 32 - 12


def test_probe_counts_what_lookup_would_take_and_changes_nothing(mod):
    bt = mod.BlockTable(
        num_blocks=32, block_size=4, num_loops=2, max_seqs=3, max_blocks_per_seq=4, caching=True
    )
    tokens = np.arange(14, dtype=np.int32)
    hashes = cached_prompt(bt, 0, tokens)
    longer = np.concatenate([tokens[:12], [99, 98, 97, 96]]).astype(np.int32)
    before = (bt.num_free_blocks, bt.refs.copy(), bt.tables.copy())
    assert bt.probe(hashes, tokens, 3) == 3 and bt.probe(hashes, tokens, 2) == 2
    assert bt.probe(bt.hash_blocks(longer, 16), longer, 4) == 3  # the fourth block differs
    assert bt.probe(hashes, tokens + 100, 3) == 0  # same hashes, other tokens
    assert bt.num_free_blocks == before[0] and (bt.refs == before[1]).all() and (bt.tables == before[2]).all()
    assert bt.lookup(1, hashes, tokens, 3) == bt.probe(hashes, tokens, 3) == 3


def test_a_hash_collision_is_a_miss(mod):
    bt = mod.BlockTable(
        num_blocks=32, block_size=4, num_loops=2, max_seqs=3, max_blocks_per_seq=4, caching=True
    )
    tokens = np.arange(12, dtype=np.int32)
    hashes = cached_prompt(bt, 0, tokens)
    other = tokens + 100
    assert bt.lookup(1, hashes, other, 3) == 0  # same hashes, other tokens
    bt.free(1)
    # Block 1's tokens match but its parent is not block 0's entry: a forged chain misses there.
    mixed = np.concatenate([other[:4], tokens[4:]]).astype(np.int32)
    forged = bt.hash_blocks(mixed, 12)
    forged[1:] = hashes[1:]
    assert bt.lookup(1, forged, mixed, 3) == 0
    bt.free(1)
    assert bt.lookup(1, hashes, tokens, 3) == 3


def test_eviction_is_least_recently_released_and_never_of_held_blocks(mod):
    bt = mod.BlockTable(
        num_blocks=6, block_size=2, num_loops=2, max_seqs=3, max_blocks_per_seq=3, caching=True
    )
    a, b, c = (np.array([v, v], np.int32) for v in (1, 2, 3))
    ha, hb, hc = (cached_prompt(bt, s, x) for s, x in ((0, a), (1, b), (2, c)))
    assert bt.num_free_blocks == 0
    assert not bt.allocate(0, 4)  # every block is held: nothing to evict
    bt.free(1)
    bt.free(0)
    bt.free(2)
    assert bt.num_free_blocks == 6 and bt.num_cached_blocks == 6
    assert bt.allocate(0, 2)  # evicts b, released first
    assert bt.lookup(1, hb, b, 1) == 0
    assert bt.lookup(1, ha, a, 1) == 1  # a is held again: it outlives c under pressure
    bt.free(2)
    assert bt.allocate(2, 2) and bt.num_cached_blocks == 2  # c goes: a is held
    bt.free(2)
    assert bt.lookup(2, hc, c, 1) == 0
    check_pool(bt)


def test_cache_keeps_the_first_entry_of_equal_content(mod):
    bt = mod.BlockTable(
        num_blocks=16, block_size=2, num_loops=2, max_seqs=2, max_blocks_per_seq=2, caching=True
    )
    tokens = np.array([5, 6, 7, 8], np.int32)
    hashes = cached_prompt(bt, 0, tokens)
    assert bt.allocate(1, 4)  # the same prompt computed again, without a lookup
    assert bt.cache(1, hashes, tokens, 0, 2) == 0
    assert bt.num_cached_blocks == 4 and (bt.cached[bt.tables[1].ravel()] == -1).all()
    bt.free(1)
    assert bt.num_free_blocks == 12  # its blocks went back to the pool, the entries stay
    with pytest.raises(ValueError, match="not cached"):
        assert bt.allocate(1, 4) and bt.cache(1, hashes, tokens, 1, 2)


def test_caching_off_caches_nothing(mod):
    bt = mod.BlockTable(num_blocks=16, block_size=2, num_loops=2, max_seqs=2, max_blocks_per_seq=2)
    tokens = np.array([5, 6, 7, 8], np.int32)
    hashes = bt.hash_blocks(tokens, 4)
    assert bt.allocate(0, 4) and bt.cache(0, hashes, tokens, 0, 2) == 0
    bt.free(0)
    assert bt.lookup(0, hashes, tokens, 2) == 0 and bt.num_free_blocks == 16 and bt.num_cached_blocks == 0


def test_lookup_and_cache_refuse_bad_input(mod):
    bt = mod.BlockTable(
        num_blocks=16, block_size=2, num_loops=2, max_seqs=2, max_blocks_per_seq=2, caching=True
    )
    tokens = np.array([5, 6, 7, 8], np.int32)
    hashes = bt.hash_blocks(tokens, 4)
    assert bt.allocate(0, 2)
    with pytest.raises(ValueError, match="already holds"):
        bt.lookup(0, hashes, tokens, 2)
    with pytest.raises(ValueError, match="do not fill"):
        bt.lookup(1, hashes, tokens[:3], 2)
    with pytest.raises(ValueError, match="holds 1 blocks"):
        bt.cache(0, hashes, tokens, 0, 2)
    with pytest.raises(ValueError, match="slot"):
        bt.lookup(2, hashes, tokens, 1)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 3), st.integers(0, 20)),
        st.tuples(st.just("free"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("prop"), st.integers(0, 3), st.integers(0, 2**16)),
        st.tuples(st.just("hold"), st.integers(0, 3), st.integers(0, 6)),
        st.tuples(st.just("adopt"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("release"), st.just(0), st.integers(0, 3)),
        st.tuples(st.just("lookup"), st.integers(0, 3), st.integers(0, 2)),
        st.tuples(st.just("cache"), st.integers(0, 3), st.integers(0, 2)),
    ),
    max_size=40,
)


def run_trace(modname: str, ops, caching: bool = False) -> list:
    """Applies a trace of operations and records every observable result."""
    bt = importlib.import_module(modname).BlockTable(30, 3, 4, 4, 6, caching)
    prompts = prompts_for(3, 6)
    log, holds = [], []
    for op, slot, arg in ops:
        if op in ("lookup", "cache"):
            tokens = prompts[arg]
            hashes = bt.hash_blocks(tokens, len(tokens))
            try:
                if op == "lookup":
                    log.append(("lookup", bt.lookup(slot, hashes, tokens, 6)))
                else:
                    log.append(("cache", bt.cache(slot, hashes, tokens, 0, int(bt.num_blocks_of[slot]))))
            except ValueError:
                log.append((op, "ValueError"))
        elif op in ("hold", "adopt", "release"):
            try:
                if op == "hold":
                    holds.append(bt.hold(slot, arg))
                elif holds:
                    held = holds.pop(arg % len(holds))
                    bt.adopt(slot, held) if op == "adopt" else bt.release(held)
            except ValueError:
                log.append((op, "ValueError"))
        elif op == "alloc":
            try:
                log.append(("alloc", bt.blocks_needed(slot, arg), bt.allocate(slot, arg)))
            except ValueError:
                log.append(("alloc", "ValueError"))
        elif op == "free":
            bt.free(slot)
        elif int(bt.num_blocks_of[slot]):
            rng = np.random.default_rng(arg)
            length = int(bt.num_blocks_of[slot]) * 3
            pos = rng.integers(0, length, size=5).astype(np.int32)
            exits = rng.integers(0, 4, size=5).astype(np.int32)
            src, dst = np.zeros(15, np.int64), np.zeros(15, np.int64)
            n = bt.fill_propagation(np.full(5, slot, np.int32), pos, exits, 5, src, dst)
            log.append(("prop", n, src[:n].tolist(), dst[:n].tolist()))
        log.append(
            (
                bt.tables.tolist(),
                bt.num_blocks_of.tolist(),
                bt.num_free_blocks,
                bt.refs.tolist(),
                all_mappings(bt).tolist(),
                bt.cached.tolist(),
                bt.num_cached_blocks,
            )
        )
    return log


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, caching=st.booleans())
def test_compiled_matches_twin(ops, caching):
    assert run_trace(MODULES[0], ops, caching) == run_trace(MODULES[1], ops, caching)


def test_compiled_module_is_really_compiled():
    compiled = importlib.import_module(MODULES[0])
    assert compiled.__file__.endswith((".so", ".pyd"))
    assert importlib.import_module(MODULES[1]).__file__.endswith(".py")


def test_unused_block_constant_matches_the_twin():
    """Compiled, UNUSED_BLOCK is a C constant (a cpdef enum) that stays a module attribute."""
    compiled, twin = (importlib.import_module(m) for m in MODULES)
    assert compiled.UNUSED_BLOCK == twin.UNUSED_BLOCK == -1 and type(compiled.UNUSED_BLOCK) is int
