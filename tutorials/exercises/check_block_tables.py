"""Checker of exercise 8 (block_tables.py): block tables, ref counts and
prefix-cache hits.

    python -m pytest tutorials/exercises/check_block_tables.py \\
        --solution my_tables.py

After every call the pool's and the cache's own invariants must hold
(``BlockPool.check_integrity``, ``PrefixCache.check_integrity``: ref counts
equal the tables naming a block, free + held == total, cached blocks form a
chain at the head of each table); the last test runs random calls on your
class and on minicb's ``BlockManager`` side by side.
"""

import random

import _reference
import pytest
from _checking import pick


@pytest.fixture
def Tables(solution):
    return pick(solution, "BlockTables", _reference.BlockTables)


def ok(t) -> None:
    """The pool's and the cache's invariants, against your tables."""
    try:
        t.pool.check_integrity(t.tables, "pool")
        t.cache.check_integrity(t.tables, t.block_size)
    except AssertionError as e:
        pytest.fail(f"an invariant broke (tables {t.tables}): {e}")


def prompt(n: int, first: int = 10) -> list[int]:
    return list(range(first, first + n))


def test_a_new_table_takes_the_blocks_it_needs(Tables):
    t = Tables(8, 4)
    got = t.allocate("a", 9)
    ok(t)
    assert got == [0, 1, 2] and t.tables["a"] == [0, 1, 2], (
        f"9 positions in blocks of 4 need 3 blocks; a new table takes them "
        f"from the pool (pool.take(), lowest first): got {got}, table "
        f"{t.tables.get('a')}")
    assert t.pool.num_free == 5


def test_a_table_grows_only_by_the_blocks_it_lacks(Tables):
    t = Tables(8, 4)
    t.allocate("a", 9)
    for n, new in ((10, []), (12, []), (13, [3]), (5, [])):
        got = t.allocate("a", n)
        ok(t)
        assert got == new, (
            f"a table of 3 blocks grown to cover {n} positions took {got}: "
            f"it takes only the blocks it lacks ({new}), and never shrinks")


def test_allocation_is_all_or_nothing(Tables):
    t = Tables(4, 4)
    t.allocate("a", 8)
    assert t.can_allocate("b", 8) and not t.can_allocate("b", 12), \
        "2 blocks are free: 8 positions fit, 12 do not"
    with pytest.raises(ValueError):
        t.allocate("b", 12)
    ok(t)
    assert not t.tables.get("b") and t.pool.num_free == 2, (
        f"allocate('b', 12) with 2 free blocks must raise and change "
        f"nothing; it left table {t.tables.get('b')} and "
        f"{t.pool.num_free} free blocks: check before taking any")


def test_free_gives_every_block_back(Tables):
    t = Tables(8, 4)
    t.allocate("a", 9)
    t.allocate("b", 2)
    n = t.free("a")
    ok(t)
    assert n == 3 and "a" not in t.tables and t.pool.num_free == 7, \
        f"free('a') returned {n}, left {t.tables}, {t.pool.num_free} free"
    assert t.free("nobody") == 0, "freeing a request with no table returns 0"


def test_only_full_computed_blocks_are_cached(Tables):
    t = Tables(8, 4)
    tokens = prompt(9)
    t.allocate("a", 9)
    got = [t.cache_full("a", tokens, 6), t.cache_full("a", tokens, 9)]
    ok(t)
    assert got == [1, 1], (
        f"6 computed positions fill block 0 only (1 cached), 9 fill blocks "
        f"0 and 1 (1 more; block 2 holds 1 token, not full): you cached "
        f"{got}")


def test_a_hit_leaves_the_last_token_to_compute(Tables):
    t = Tables(8, 4)
    tokens = prompt(9)
    t.allocate("a", 9)
    t.cache_full("a", tokens, 9)
    cases = [(tokens, [0, 1]), (tokens[:8], [0]), (tokens[:5], [0]),
             (tokens[:4], []), (tokens[:4] + [99] * 6, [0])]
    for toks, want in cases:
        got = t.hits(toks)
        assert got == want, (
            f"blocks 0 and 1 cache tokens {tokens[:8]}; a request of "
            f"{len(toks)} tokens {toks} hits {want}, you said {got}: a hit "
            "is never the whole request, its last token is always computed")


def test_a_hit_follows_the_chain(Tables):
    t = Tables(8, 4)
    a = prompt(9)
    t.allocate("a", 9)
    t.cache_full("a", a, 9)
    b = [1, 2, 3, 4] + a[4:]                 # a's 2nd block, another 1st
    got = t.hits(b)
    assert got == [], (
        f"{b} shares a's second block of tokens but not its first: a "
        f"block's K/V depends on every token before it, so nothing is a "
        f"hit (lookup each block after the one found before); you said "
        f"{got}")


def test_a_hit_is_shared_not_copied(Tables):
    t = Tables(8, 4)
    tokens = prompt(9)
    t.allocate("a", 9)
    t.cache_full("a", tokens, 9)
    hits = t.hits(tokens + [50])
    got = t.allocate("b", 10, hits)
    assert t.tables["b"] == [0, 1, 3] and got == [3], (
        f"b hits blocks [0, 1] and needs 3 blocks for 10 positions: its "
        f"table is the hits then one new block, [0, 1, 3], and allocate "
        f"returns the new one; you made {t.tables['b']}, returned {got}")
    assert t.pool.ref_counts[:2] == [2, 2], (
        f"a and b both name blocks 0 and 1: each has ref count 2, you have "
        f"{t.pool.ref_counts[:2]} (a hit is shared, pool.share)")
    ok(t)
    t.free("a")
    ok(t)
    assert t.pool.ref_counts[:2] == [1, 1] and t.pool.num_free == 5, \
        "after a is freed, b still holds blocks 0 and 1"


def test_a_free_cached_hit_costs_a_free_block(Tables):
    t = Tables(4, 4)
    tokens = prompt(9)
    t.allocate("a", 9)
    t.cache_full("a", tokens, 9)
    t.free("a")                         # blocks 0, 1: free, still cached
    t.allocate("c", 8)                  # takes 2 and 3 (nothing cached in them)
    ok(t)
    hits = t.hits(tokens)
    assert hits == [0, 1], f"a's cached blocks are still hits, not {hits}"
    assert not t.can_allocate("b", 9, hits), (
        "b hits blocks 0 and 1, which are free (nobody names them, their "
        "content is still cached), and needs 1 new block: taking the hits "
        "off the free list uses 2 of the 2 free blocks, so b does not fit")
    assert t.can_allocate("b", 8, hits[:1]), \
        "b with 1 hit and 1 new block uses the 2 free blocks: it fits"


def test_free_drops_the_last_block_first(Tables):
    t = Tables(8, 4)
    tokens = prompt(13)
    t.allocate("a", 13)
    t.cache_full("a", tokens, 13)
    t.free("a")
    got = t.pool.cached_free_blocks()
    assert got == [2, 1, 0], (
        f"a's cached blocks 0, 1, 2 are free now in eviction order {got}: "
        "free drops a table's last block first, so its tail is evicted "
        "before its head (a block before its parent): [2, 1, 0]")
    ok(t)


def test_the_same_as_minicb_on_random_calls(Tables):
    seen = {"shared": False, "full": False}
    for seed in range(20):
        rng = random.Random(seed)
        yours, ref = Tables(10, 4), _reference.BlockTables(10, 4)
        prompts, log = {}, []
        for _ in range(60):
            seen["shared"] |= any(c > 1 for c in ref.pool.ref_counts)
            rid = f"r{rng.randrange(6)}"
            if rid in ref.tables and rng.random() < 0.5:
                call = ("free", rid)
            elif rid in ref.tables:
                call = ("grow", rid, len(prompts[rid]) + rng.randint(0, 6))
            else:                   # two token values: prefixes repeat
                toks = [rng.choice((7, 8)) for _ in range(rng.randint(1, 14))]
                call = ("admit", rid, toks)
            log.append(call)
            results = []
            for t in (ref, yours):
                if call[0] == "free":
                    results.append(t.free(rid))
                elif call[0] == "grow":
                    fits = t.can_allocate(rid, call[2])
                    results.append((fits, fits and t.allocate(rid, call[2])))
                else:
                    hits = t.hits(toks)
                    fits = t.can_allocate(rid, len(toks), hits)
                    new = fits and t.allocate(rid, len(toks), hits)
                    cached = fits and t.cache_full(rid, toks, len(toks))
                    results.append((hits, fits, new, cached))
            if call[0] == "admit":
                prompts[rid] = toks
            fits = {"grow": 0, "admit": 1}.get(call[0])
            seen["full"] |= fits is not None and results[0][fits] is False
            ok(yours)
            state = [(dict(t.tables), t.pool.ref_counts, t.pool.num_free,
                      t.pool.cached_free_blocks()) for t in (ref, yours)]
            if results[0] != results[1] or state[0] != state[1]:
                pytest.fail(
                    f"random calls {seed}, after {log[-3:]}: minicb "
                    f"returned {results[0]} and has (tables, ref counts, "
                    f"free, cached free) {state[0]}; you returned "
                    f"{results[1]} and have {state[1]}")
    assert seen["shared"] and seen["full"], \
        "the calls must share blocks and fill the pool (the checker is wrong)"
