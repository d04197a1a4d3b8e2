"""The cost policy's hot loops, compiled: the backward induction and the allocation's last pass
over every candidate chunk, the predictor's rebuild of a distribution after each return, and
the small passes of every decision.

`CostPolicy._induction` prices every candidate chunk at (almost) every decision: about a dozen
stages of the recursion of `cost_policy`'s module docstring over each chunk and tier. In numpy
each stage is several passes over [tiers, chunks] arrays, with every session's schedule first
repeated out to its chunks; this kernel (numba: LLVM, no C compiler) takes one chunk at a time,
its tiers' values in scalars, and does per element the same IEEE operations in the same order
(no fast-math, so no reassociation or fused multiply-add): the values are bit for bit those of
the numpy passes (tests/policy/test_kernels.py checks it on a decision's inputs).

The allocation's last pass (`upgrade`) walks the chunks one by one, each taking the best tier
that still has room for it: sequential by nature, it was a Python loop over every chunk that
had a better tier than where the auction put it. Here it is the same comparisons and the same
sums of whole byte counts (exact in float64), so the same placement.

`cumulative_masses` is `ReusePredictor._distribution`'s blend of a histogram with its prior
and the running sum after it: the predictor rebuilds a distribution after every return it
learns from (each changes the pooled histogram every key blends with), several numpy calls
on 64 bins each time. The same divisions and the same left-to-right running sum as
`np.cumsum`, so the same bits. `life_table` is the same blend when gaps are still running
(`ReusePredictor.censor`): the actuarial life table over finished and running gaps, rebuilt
as often, in the same operations and order as the numpy passes it replaced (running sums and
products left to right, as `np.cumsum` and `np.cumprod` take them).

The rest are small per-decision passes that were a dozen numpy calls each over a few hundred
sessions, where the calls cost more than the arithmetic: `grid_chances` and `row_chances` read
each session's return chances off its distribution once numpy has located the times in the
bins (the logarithms stay numpy's: numba's `log` differs from it in the last bit on a few
inputs in a million), `stale_rows` is `SessionTable.stale`'s comparisons, `merge_units`
the merging of a session's chunks into pricing units (sums of whole numbers), and
`score_return` the scoring of each return the predictor learns from (`ReusePredictor._score`),
one call where there were a dozen: the session's own gaps folded and summed (`own_cumulative`,
which `_mine` shares; numpy's `sum` is `pairwise_sum`), blended with the key's distribution, and
a logarithm per candidate weight. Their
convolution stays numpy's, whose dot products sum in BLAS's order. Each does the same
operations on the same numbers as the numpy passes it replaced, which the tests keep beside
them.

They are compiled when this module is first imported, from numba's on-disk cache after the first
time in an environment (next to this file, or numba's per-user directory when that is not
writable), so no decision waits for the compiler.
"""

from __future__ import annotations

import math

import numpy as np

from kvtier.jit import compiled

MAX_TIERS = 4  # device, host, disk, remote: the kernel keeps each tier's values in registers


@compiled("float64(float64, float64)", inline="always")
def _at_least(value, floor):  # pragma: no cover - compiled
    """numpy's `maximum(value, floor)`: NaN wins, and of equals the first (so -0.0 stays)."""
    return value if (value >= floor or value != value) else floor


@compiled(
    "void(float64[:,::1], float64[::1], float64[::1], float64[:,::1], float64[:,::1],"
    " int64[::1], int64[::1], int64[::1], int64[::1], float64[:,::1], float64[:,::1])"
)
def induction(  # pragma: no cover - compiled
    gain, size, prices, q, d, row_session, rank, tier_rank, at, values, saves
):
    """values[at[c], j]: chunk c's value held in tier column j (-inf where j is faster than
    the chunk's tier `rank[c]`; `tier_rank[j]` is column j's rank); saves[at[c], j] =
    gain[j, c]. gain [tiers, chunks]: what a return saves; rent per second is prices[j] *
    size[c]; chunk c's schedule is row `row_session[c]` of q, d [sessions, stages] (zero
    past its grid). At most `MAX_TIERS` tiers.

        V_K = 0,  V_k(j) = max(0, max over j' >= j of
                               q_k gain[j'] - rent[j'] d_k + (1 - q_k) V_k+1(j'))
        out[j] = q_0 gain[j] - rent[j] d_0 + (1 - q_0) V_1(j)

    Each max is numpy's `maximum`; the max over j' >= j is taken from the slowest tier up,
    each tier's stage against the running max of those below it. One chunk at a time, its
    tiers in scalars: a chunk's stages depend on each other, chunks do not, so the CPU
    overlaps neighbouring chunks. Tiers past `count` are padded with a stage of exactly 0,
    which leaves every max as it is (the stages it meets are already at least 0)."""
    count = gain.shape[0]
    n = gain.shape[1]
    stages = q.shape[1]
    price = np.zeros(MAX_TIERS)
    price[:count] = prices
    g = np.zeros(MAX_TIERS)
    later = np.zeros(MAX_TIERS)
    for c in range(n):
        s = row_session[c]
        b = size[c]
        for j in range(count):
            g[j] = gain[j, c]
        g0, g1, g2, g3 = g[0], g[1], g[2], g[3]
        r0, r1, r2, r3 = price[0] * b, price[1] * b, price[2] * b, price[3] * b
        l0 = l1 = l2 = l3 = 0.0
        for k in range(stages - 1, 0, -1):
            qk = q[s, k]
            dk = d[s, k]
            stay = 1 - qk
            a0 = _at_least(qk * g0 - r0 * dk + stay * l0, 0.0)
            a1 = _at_least(qk * g1 - r1 * dk + stay * l1, 0.0)
            a2 = _at_least(qk * g2 - r2 * dk + stay * l2, 0.0)
            l3 = _at_least(qk * g3 - r3 * dk + stay * l3, 0.0)
            l2 = _at_least(a2, l3)
            l1 = _at_least(a1, l2)
            l0 = _at_least(a0, l1)
        later[0], later[1], later[2], later[3] = l0, l1, l2, l3
        q0 = q[s, 0]
        d0 = d[s, 0]
        stay = 1 - q0
        row = at[c]
        for j in range(count):
            saves[row, j] = g[j]
            if tier_rank[j] < rank[c]:
                values[row, j] = -np.inf  # no promotions
            else:
                values[row, j] = q0 * g[j] - price[j] * b * d0 + stay * later[j]


@compiled("void(float64[:,::1], float64[::1], float64[::1], int64[::1])")
def upgrade(values, size, room, placed):  # pragma: no cover - compiled
    """Move chunks up into space still free where that is worth more, in row order: row r
    (values[r] per tier column, `size[r]` bytes, in column placed[r], -1 dropped: worth 0)
    tries its tiers best first (ties: the first column) while they are worth more than where
    it is, and takes the first with `room` for it, freeing its old place. `room` and
    `placed` are updated in place."""
    n, count = values.shape
    order = np.empty(count, np.int64)
    for r in range(n):
        at = placed[r]
        now = values[r, at] if at >= 0 else 0.0
        hopeful = False
        for j in range(count):
            if values[r, j] > now:
                hopeful = True
        if not hopeful:
            continue
        for j in range(count):  # a stable insertion sort, highest value first
            i = j
            while i > 0 and values[r, order[i - 1]] < values[r, j]:
                order[i] = order[i - 1]
                i -= 1
            order[i] = j
        for i in range(count):
            j = order[i]
            if values[r, j] <= now:
                break
            if size[r] <= room[j]:
                room[j] -= size[r]
                if at >= 0:
                    room[at] += size[r]
                placed[r] = j
                break


@compiled("void(float64[::1], float64[::1], float64, float64, float64[::1])")
def cumulative_masses(counts, base, weight, total, out):  # pragma: no cover - compiled
    """out = [0, cumsum((counts + weight * base) / total)], the sum taken left to right as
    numpy's `cumsum` does."""
    out[0] = 0.0
    running = 0.0
    for i in range(len(counts)):
        mass = (counts[i] + weight * base[i]) / total
        running = mass if i == 0 else running + mass
        out[i + 1] = running


@compiled("float64(float64[::1], float64[::1], float64, float64, float64[::1], float64[::1])")
def life_table(counts, base, weight, total, censored, out):  # pragma: no cover - compiled
    """The distribution of gaps from finished ones (`counts` per bin blended with `weight`
    pseudo-sessions spread like `base`, `total` of them with the returns that never came,
    pseudo-sessions included) and running ones (`censored` per bin of their age): out = [0,
    running sum of each bin's probability]; returns P(no return). The hazard of bin b is its
    returns over the sessions at risk when it starts, less half of those censored inside it;
    a bin nobody is at risk in has none."""
    still_idle = 0.0
    for i in range(len(counts)):
        still_idle += censored[i]  # whole counts: exact in any order
    seen = total + still_idle
    out[0] = 0.0
    left = 0.0  # gaps that ended (or were censored) in the bins before this one
    survival = 1.0
    # 0.0 + x is x, so the running sums start as numpy's cumsum does, with the first term
    for i in range(len(counts)):
        finished = counts[i] + weight * base[i]
        at_risk = seen - left - censored[i] / 2
        hazard = min(finished / at_risk, 1.0) if at_risk > 0 else 0.0
        out[i + 1] = out[i] + survival * hazard
        survival = survival * (1.0 - hazard)
        left += finished + censored[i]
    return survival


@compiled(
    "float64(float64[:,::1], int64, int64, float64, boolean, int64, float64, boolean, float64,"
    " float64, float64)",
    inline="always",
)
def _chance(  # pragma: no cover - compiled
    table, row, i0, share0, beyond0, i1, share1, beyond1, idle, horizon, max_age
):
    """`ReusePredictor._p_reuse` of one interval under distribution `table[row]`: the
    cumulative masses at its start and end (bins `i0`, `i1`, shares of the way through them,
    and whether past the last edge, as `ReusePredictor._locate` finds them) interpolated as
    `_cdf_many` does, then P(return in it | idle at its start), numpy's clip and where."""
    last = table.shape[1] - 1
    start = (
        table[row, last]
        if beyond0
        else table[row, i0] + (table[row, i0 + 1] - table[row, i0]) * share0
    )
    end = (
        table[row, last]
        if beyond1
        else table[row, i1] + (table[row, i1 + 1] - table[row, i1]) * share1
    )
    alive = 1 - start
    if idle >= max_age or horizon <= 0 or alive <= 0:
        return 0.0
    p = (end - start) / alive
    return min(max(p, 0.0), 1.0)


@compiled(
    "void(float64[:,::1], int64[::1], int64[::1], float64[:,::1], float64[:,::1],"
    " int64[:,::1], float64[:,::1], boolean[:,::1], int64[:,::1], float64[:,::1],"
    " boolean[:,::1], float64, float64[:,::1])"
)
def grid_chances(  # pragma: no cover - compiled
    table, rows, edge, starts, lengths, i0, share0, beyond0, i1, share1, beyond1, max_age, q
):
    """q[s, k]: P(return in interval k | idle until it starts) for session s, under
    distribution `table[rows[s]]`, on the time grid of its age bin's edge `edge[s]` (row e of
    `starts` and `lengths`, with where each interval's start and end fall in the bins: rows e
    of the located arrays); 0 where the interval is empty (`_chance`).
    `CostPolicy._schedule_rows`' numpy passes did the same operations per element, so the
    same bits."""
    for s in range(len(rows)):
        r = rows[s]
        e = edge[s]
        for k in range(starts.shape[1]):
            q[s, k] = _chance(
                table,
                r,
                i0[e, k],
                share0[e, k],
                beyond0[e, k],
                i1[e, k],
                share1[e, k],
                beyond1[e, k],
                starts[e, k],
                lengths[e, k],
                max_age,
            )


@compiled(
    "void(float64[:,::1], int64[::1], int64[::1], float64[::1], boolean[::1], int64[::1],"
    " float64[::1], boolean[::1], float64[::1], float64[::1], float64, float64[::1])"
)
def row_chances(  # pragma: no cover - compiled
    table, rows, i0, share0, beyond0, i1, share1, beyond1, idle, horizon, max_age, out
):
    """out[s]: P(return within `horizon[s]` | idle `idle[s]`) under distribution
    `table[rows[s]]`, the interval's ends located in the bins as `grid_chances` takes them:
    `ReusePredictor.p_reuse_rows`' arithmetic after its logarithms."""
    for s in range(len(rows)):
        out[s] = _chance(
            table,
            rows[s],
            i0[s],
            share0[s],
            beyond0[s],
            i1[s],
            share1[s],
            beyond1[s],
            idle[s],
            horizon[s],
            max_age,
        )


@compiled("int64(float64[:,::1], int64[::1], int64, float64[:,::1], int64[::1])")
def merge_units(rows, counts, unit, merged, units):  # pragma: no cover - compiled
    """`session_table.chunk_columns_many`'s rows of single chunks (`counts[s]` of session s
    in turn: index, tokens, first token, bytes, tier rank, 1) merged into pricing units: a
    unit is a run of at most `unit` chunks of one session with consecutive indices in one
    tier; its tokens, bytes and chunk count are the sums (whole numbers: exact in any
    order), the rest its first chunk's. Writes `merged` (at least as many rows as `rows`) and
    `units[s]`, session s's unit count; returns how many units there are."""
    out = -1
    r = 0
    for s in range(len(counts)):
        units[s] = 0
        run = 0  # chunks in the current unit
        for _ in range(counts[s]):
            joins = (
                run > 0
                and run < unit
                and rows[r, 0] == rows[r - 1, 0] + 1
                and rows[r, 4] == rows[r - 1, 4]
            )
            if joins:
                merged[out, 1] += rows[r, 1]
                merged[out, 3] += rows[r, 3]
                merged[out, 5] += 1.0
                run += 1
            else:
                out += 1
                for c in range(rows.shape[1]):
                    merged[out, c] = rows[r, c]
                units[s] += 1
                run = 1
            r += 1
    return out + 1


@compiled(
    "void(float64[:,::1], float64[:,::1], float64[::1], int64[::1], int64[::1], float64[:,::1],"
    " float64[:,::1], float64[:,::1], float64[::1], boolean[::1], float64, float64,"
    " boolean[::1])"
)
def stale_rows(  # pragma: no cover - compiled
    q, d, prices, ranks, slots, was_q, was_d, was_prices, top, priced, tolerance, floor, out
):
    """`SessionTable.stale`'s test per candidate s (stored in row `slots[s]` of the `was_`
    arrays, `top`, `priced`): never priced, an interval length changed, a probability moved
    by more than `tolerance` * what it was + `floor`, or the price of a tier at or below its
    fastest (`ranks[j] >= top`) by more than `tolerance` of what it was. The same
    comparisons of the same numbers as the numpy passes."""
    for s in range(q.shape[0]):
        slot = slots[s]
        stale = not priced[slot]
        for k in range(q.shape[1]):
            if stale:
                break
            was = was_q[slot, k]
            if abs(q[s, k] - was) > tolerance * was + floor or d[s, k] != was_d[slot, k]:
                stale = True
        for j in range(len(prices)):
            if stale:
                break
            was = was_prices[slot, j]
            if abs(prices[j] - was) > tolerance * abs(was) and ranks[j] >= top[slot]:
                stale = True
        out[s] = stale


@compiled("float64(float64[::1], int64, int64)")
def pairwise_sum(a, start, n):  # pragma: no cover - compiled
    """numpy's sum of `a[start:start + n]` (contiguous float64): its pairwise summation, in
    eight partial sums below 128 elements and halves above, so the same bits as `.sum()`."""
    if n < 8:
        res = 0.0
        for i in range(start, start + n):
            res += a[i]
        return res
    if n <= 128:
        r0, r1, r2, r3 = a[start], a[start + 1], a[start + 2], a[start + 3]
        r4, r5, r6, r7 = a[start + 4], a[start + 5], a[start + 6], a[start + 7]
        i = 8
        while i < n - (n % 8):
            at = start + i
            r0 += a[at]
            r1 += a[at + 1]
            r2 += a[at + 2]
            r3 += a[at + 3]
            r4 += a[at + 4]
            r5 += a[at + 5]
            r6 += a[at + 6]
            r7 += a[at + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[start + i]
            i += 1
        return res
    half = n // 2
    half -= half % 8
    return pairwise_sum(a, start, half) + pairwise_sum(a, start + half, n - half)


@compiled("void(float64[::1], int64, float64[::1])")
def own_cumulative(smoothed, half, out):  # pragma: no cover - compiled
    """`ReusePredictor._mine` after its convolution: the mass `smoothed` (the full
    convolution of a session's gap counts with the kernel of half-width `half`) puts past
    either end folded back onto the end bins, then the running sum after a leading 0, into
    `out`. The same sums as numpy's (`pairwise_sum`, then left to right as `np.cumsum`)."""
    bins = len(smoothed) - 2 * half
    total = 0.0
    out[0] = 0.0
    for i in range(bins):
        mass = smoothed[half + i]
        if i == 0:
            mass += pairwise_sum(smoothed, 0, half)
        if i == bins - 1:
            mass += pairwise_sum(smoothed, half + bins, half)
        total += mass
        out[i + 1] = total


@compiled(
    "void(float64[::1], float64[::1], int64, int64, int64, boolean, float64[::1], float64[::1])"
)
def score_return(key, smoothed, half, gaps, at, late, weights, scores):  # pragma: no cover
    """`ReusePredictor._score` of one outcome, in one call: add to each candidate session
    weight's score the log of the chance it gave the outcome, a return in bin `at` (or none,
    `late`), under the key's distribution (`key`, cumulative masses at the edges, as
    `ReusePredictor._distribution` gives them) blended with the session's own `gaps` gaps
    (`own_cumulative` of `smoothed` and `half`) at that weight (inf: the key's alone). The
    same operations in the same order as the Python it replaced, and the logarithm is the C
    library's, as Python's `math.log`."""
    n = len(key)
    mine = np.empty(n)
    own_cumulative(smoothed, half, mine)
    lo = n - 1 if late else at
    hi = n - 1 if late else at + 1
    for i in range(len(weights)):
        w = weights[i]
        if w == math.inf:
            k_lo, k_hi = key[lo], key[hi]
        else:
            k_lo = (mine[lo] + w * key[lo]) / (gaps + w)
            k_hi = (mine[hi] + w * key[hi]) / (gaps + w)
        p = 1.0 - k_lo if late else k_hi - k_lo
        floor = 1e-12
        scores[i] += math.log(floor if floor > p else p)
