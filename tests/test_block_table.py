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


def make_machine(modname: str, num_blocks: int, block_size: int, num_loops: int, max_seqs: int, max_bps: int):
    module = importlib.import_module(modname)

    class BlockTableMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.bt = module.BlockTable(num_blocks, block_size, num_loops, max_seqs, max_bps)
            self.model = [0] * max_seqs  # blocks per loop each slot should hold
            self.holds: list[np.ndarray] = []  # hold() results not yet adopted or released

        @rule(slot=st.integers(0, max_seqs - 1), num_tokens=st.integers(0, max_bps * block_size + 3))
        def allocate(self, slot, num_tokens):
            bt = self.bt
            before_tables, before_counts = bt.tables.copy(), bt.num_blocks_of.copy()
            before_free = bt.num_free_blocks
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

        @precondition(lambda self: bool(self.holds) and not all(self.model))
        @rule(data=st.data())
        def adopt(self, data):
            bt = self.bt
            held = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
            slot = data.draw(st.sampled_from([s for s in range(max_seqs) if not self.model[s]]))
            before_refs = bt.refs.copy()
            bt.adopt(slot, held)
            self.model[slot] = held.shape[1]
            assert bt.tables[slot, :, : held.shape[1]].tolist() == held.tolist()
            assert (bt.refs == before_refs).all(), "the hold passes to the table: no count changes"

        @precondition(lambda self: bool(self.holds))
        @rule(data=st.data())
        def release(self, data):
            bt = self.bt
            held = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
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

        @invariant()
        def pool_is_consistent(self):
            check_pool(self.bt, self.holds)
            assert self.bt.num_blocks_of.tolist() == self.model

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
@pytest.mark.parametrize("geometry", [(24, 4, 4, 3, 3), (10, 2, 1, 4, 5), (9, 3, 3, 2, 2)])
def test_state_machine(modname, geometry):
    run_state_machine_as_test(
        make_machine(modname, *geometry),
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


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 3), st.integers(0, 20)),
        st.tuples(st.just("free"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("prop"), st.integers(0, 3), st.integers(0, 2**16)),
        st.tuples(st.just("hold"), st.integers(0, 3), st.integers(0, 6)),
        st.tuples(st.just("adopt"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("release"), st.just(0), st.integers(0, 3)),
    ),
    max_size=40,
)


def run_trace(modname: str, ops) -> list:
    """Applies a trace of operations and records every observable result."""
    bt = importlib.import_module(modname).BlockTable(30, 3, 4, 4, 6)
    log, holds = [], []
    for op, slot, arg in ops:
        if op in ("hold", "adopt", "release"):
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
            )
        )
    return log


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_compiled_matches_twin(ops):
    assert run_trace(MODULES[0], ops) == run_trace(MODULES[1], ops)


def test_compiled_module_is_really_compiled():
    compiled = importlib.import_module(MODULES[0])
    assert compiled.__file__.endswith((".so", ".pyd"))
    assert importlib.import_module(MODULES[1]).__file__.endswith(".py")


def test_unused_block_constant_matches_the_twin():
    """Compiled, UNUSED_BLOCK is a C constant (a cpdef enum) that stays a module attribute."""
    compiled, twin = (importlib.import_module(m) for m in MODULES)
    assert compiled.UNUSED_BLOCK == twin.UNUSED_BLOCK == -1 and type(compiled.UNUSED_BLOCK) is int
