"""P(a session returns soon), from the survival function of the idle gaps between turns.

    p_reuse(idle, h) = P(gap <= idle + h | gap > idle) = (S(idle) - S(idle + h)) / S(idle)

S(x) = P(gap > x) counts sessions that never return as gaps of infinite length. Gaps are learned
online per reuse key (tenant, app class, how the turn before the gap ended, the tool it called)
in a histogram with log-spaced bins from `min_gap_s` to `max_age_s` (a 1 s gap and a 1 h gap
both matter; a fixed number of bins keeps memory bounded). A client's hints (close, expected
return) replace the learned distribution for that session (`cdf_table`).
A session idle longer than `max_age_s` is counted once as "never returned", which estimates
P(no return); consistently, p_reuse is 0 beyond that age.

Gaps still running count too (`censor`, called with every decision): an idle session younger than
the cut-off has been idle at least its age, and the sessions that will never come back are
among them. Learning from finished gaps alone is biased towards short ones (a run shorter than
the cut-off never sees a "no return" at all, so every idle session looks due back), which
made the predictions overconfident: on the `multiclass` preset, predicted 0.45 -> observed
0.03. A key's distribution is the actuarial life table over both (`kernels.life_table`).

Before data arrives a prior stands in, blended by pseudo-counts down a hierarchy of keys: a
key's bin masses are its counts plus `weight` pseudo-sessions spread like the same key across
every tenant (app class, end kind and tool: `_AcrossTenants`); that one's are its counts plus
`weight` pseudo-sessions spread like the pooled histogram of all keys; and the pooled
histogram's are its counts plus `weight` pseudo-sessions spread like the prior (a hierarchical
Dirichlet smoothing, each level backing off to the nearest more general one). So a new tenant's
agents start from what the server has seen of agents that ended a turn the same way, and the
server from the prior. Backing off to the pooled histogram alone made a key with few gaps look
like the traffic's majority: on agent traffic, where most gaps are tool calls that return in
seconds, the gaps after an agent's answer (minutes, or never) were predicted back within 10 s
one time in seven, against one in a hundred in the workload.

The prior is an assumption, anchored on published traces:
- Wang et al., "KVCache Cache in the Wild: Characterizing and Optimizing KVCache Cache at a
  Large Cloud Provider", USENIX ATC'25 (arXiv:2506.02634): in Alibaba's consumer chat trace 80%
  of KV reuses happen within 10 minutes (within 10 s in the API trace), and within a request
  category the reuse time is predictable (close to exponential).
- Gao et al., "Cost-Efficient Large Language Model Serving for Multi-turn Conversations with
  CachedAttention", USENIX ATC'24: 73% of ShareGPT conversations have more than one turn.
- Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving",
  FAST'25: Kimi's serving system, whose published request trace (arrival times and block
  hashes) is the kind of data the histogram is fitted from.
**A session's own rhythm.** The last `session_gaps` gaps of each session are kept too (at
most `max_sessions` sessions, least recently updated evicted). A session's distribution can
be its key's blended with its own gaps, the key's worth `w` pseudo-gaps: an agent loop that came
back after 3 s, 3 s and 4 s is expected back in seconds even if its tenant's chats take
minutes. Whether that helps depends on the traffic (where gaps are drawn independently, a
session's past says nothing and the blend only adds noise), so it is learned per key, online:
every return and every abandonment is scored, before it is learned from, by the log likelihood
each candidate `w` in `SESSION_WEIGHTS` (inf: ignore the session) gave it, and a key uses the
candidate with the best total so far, once it leads the key alone by a likelihood ratio of 20
(a prequential choice: Dawid, "Present position and potential developments: the prequential
approach", JRSS A, 1984).

Parameters: P(no return) = 0.27 (the single-turn share of ShareGPT, read per gap); returns
lognormal with median 60 s (a person reads the reply and types; our assumption) and sigma
ln(10) / z_0.8 = 2.74, which puts 80% of returns within 600 s. Prior mass beyond `max_age_s`
counts as no return.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from kvtier.policy.kernels import (
    cumulative_masses,
    grid_chances,
    life_table,
    own_cumulative,
    row_chances,
    score_return,
)
from kvtier.policy.key_codes import Key, KeyGroups, group_keys
from kvtier.policy.tracker import Abandoned, Returned, SessionEvent
from kvtier.policy.view import SessionView

# where times fall in the bins: each one's bin, its share of the way through it, past the end
Located = tuple[np.ndarray, np.ndarray, np.ndarray]
_REUSE_KEY = attrgetter("reuse_key")
_SESSION_ID = attrgetter("session_id")
# pseudo-gaps the key's distribution is worth against a session's own gaps; inf: the key alone
SESSION_WEIGHTS = (math.inf, 8.0, 2.0, 0.5)
RHYTHM_SD = math.log(2.0) / 2  # a session's next gap: within a factor 2 of its last, 2 sd
# a likelihood ratio of 20 ("strong evidence": Kass and Raftery, "Bayes factors", JASA 1995)
# before a key trusts its sessions' rhythm, so a handful of outcomes cannot flip it
EVIDENCE_NATS = math.log(20.0)

Z_80 = 0.8416212335729143  # standard normal quantile at 0.8
# a client's expected return time is taken as the median of a lognormal of this sigma: within a
# factor of 2 either way two times in three (a tool's run time varies from run to run)
HINT_SIGMA = math.log(2.0)


@dataclass(frozen=True)
class GapPrior:
    """The gap distribution assumed before data: see the module docstring for the sources."""

    median_s: float = 60.0
    sigma: float = math.log(10) / Z_80
    no_return: float = 0.27
    weight: float = 10.0  # pseudo-sessions it is worth against observed ones

    def masses(self, edges: np.ndarray) -> tuple[np.ndarray, float]:
        """Probability of each bin [edges[i], edges[i+1]) and of no return (which takes the
        lognormal's mass beyond the last edge)."""
        z = (np.log(np.maximum(edges, 1e-300)) - math.log(self.median_s)) / self.sigma
        cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in z])
        cdf[0] = 0.0  # the first edge is 0 s
        returns = 1 - self.no_return
        return returns * np.diff(cdf), self.no_return + returns * (1 - cdf[-1])


@dataclass(frozen=True)
class _AcrossTenants:
    """A reuse key without its tenant: every tenant's sessions of one app class whose turn
    ended the same way (a distribution of its own, between a key and the pooled one)."""

    rest: tuple[str | None, ...]

    @classmethod
    def of(cls, key: Key) -> _AcrossTenants:
        return cls(key[1:])


# a distribution the predictor keeps: a reuse key's, the same key's across tenants, or the
# pooled one (None)
Level = Key | _AcrossTenants | None


class _Histogram:
    """Gap counts per bin and the number of sessions that never came back; for a key, also
    the running log score of each candidate session weight."""

    def __init__(self, bins: int) -> None:
        self.counts = np.zeros(bins)
        self.no_return = 0.0
        self.scores = np.zeros(len(SESSION_WEIGHTS))

    @property
    def session_weight(self) -> float:
        """The best-scoring candidate, once it beats the key alone by strong evidence."""
        best = int(np.argmax(self.scores))
        if self.scores[best] - self.scores[0] < EVIDENCE_NATS:
            return math.inf
        return SESSION_WEIGHTS[best]

    @property
    def total(self) -> float:
        return float(self.counts.sum()) + self.no_return


class ReusePredictor:
    """Online survival model of inter-turn gaps; see the module docstring."""

    def __init__(
        self,
        *,
        max_age_s: float = 3600.0,
        min_gap_s: float = 1.0,
        bins: int = 64,
        prior: GapPrior | None = None,
        max_keys: int = 1024,
        session_gaps: int = 8,
        max_sessions: int = 65_536,
    ) -> None:
        if not 0 < min_gap_s < max_age_s or bins < 2 or max_keys < 1:
            raise ValueError("need 0 < min_gap_s < max_age_s, bins >= 2 and max_keys >= 1")
        self.max_age_s = max_age_s
        self.prior = prior or GapPrior()
        # bin 0 is [0, min_gap); the rest are log-spaced up to max_age
        self.edges = np.concatenate([[0.0], np.geomspace(min_gap_s, max_age_s, bins)])
        self._edge_list = self.edges.tolist()
        # each bin's log width, log(hi / lo), which `_cdf_many` divides by: taken once per
        # bin here rather than per element (np.log gives the same bits on the same inputs)
        lows = np.maximum(self.edges[:-1], 1e-300)
        self._log_width = np.log(self.edges[1:] / lows)
        self._prior_masses, self._prior_no_return = self.prior.masses(self.edges)
        self._pooled = _Histogram(bins)
        self._keys: OrderedDict[Key, _Histogram] = OrderedDict()
        self._across: OrderedDict[_AcrossTenants, _Histogram] = OrderedDict()
        # the first tenant each across-tenants level has seen, until it sees a second: a level
        # of one tenant holds that key's own gaps again, which would count them twice
        self._only_tenant: dict[_AcrossTenants, str] = {}
        self._max_keys = max_keys
        self._cache: dict[Level, tuple[np.ndarray, float]] = {}
        # gaps still running: per key (None: pooled), how many idle sessions are in each bin
        self._censored: dict[Level, np.ndarray] = {}
        self._session_gaps = session_gaps
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, deque[int]] = OrderedDict()  # bins of recent gaps
        self._own: dict[str, np.ndarray] = {}  # `_mine` of sessions, until they change
        # a session's gaps are smoothed by a normal kernel in log(gap), sd `RHYTHM_SD`
        width = math.log(max_age_s / min_gap_s) / (bins - 1)
        half = max(1, math.ceil(3 * RHYTHM_SD / width))
        kernel = np.exp(-0.5 * (np.arange(-half, half + 1) * width / RHYTHM_SD) ** 2)
        self._kernel, self._kernel_half = kernel / kernel.sum(), half
        self._weights = np.array(SESSION_WEIGHTS)

    def record_gap(self, key: Key, gap_s: float, session_id: str | None = None) -> None:
        """A session of `key` came back `gap_s` seconds after its previous turn ended."""
        if session_id is not None:
            self._score(key, session_id, gap_s)
            if gap_s < self.max_age_s:
                self._remember(session_id, self._bin(gap_s))
        # `record_gaps` for one gap, without building arrays (one call per returning turn)
        gap = max(gap_s, 0.0)
        late = gap >= self.max_age_s
        b = 0 if late else self._bin(gap)
        for histogram in self._levels(key):
            if late:
                histogram.no_return += 1
            else:
                histogram.counts[b] += 1
        self._cache.clear()

    def record_gaps(self, key: Key, gaps_s: Iterable[float]) -> None:
        """Many gaps at once, e.g. to warm-start from a trace; gaps past the cut-off age count
        as sessions that never returned."""
        gaps = np.maximum(np.asarray(list(gaps_s), dtype=float), 0.0)
        late = gaps >= self.max_age_s
        bins = np.searchsorted(self.edges, gaps[~late], side="right") - 1
        for histogram in self._levels(key):
            np.add.at(histogram.counts, bins, 1)
            histogram.no_return += int(late.sum())
        self._cache.clear()

    def record_no_return(self, key: Key, session_id: str | None = None) -> None:
        """A session of `key` stayed idle past `max_age_s`."""
        if session_id is not None:
            self._score(key, session_id, math.inf)
            self._sessions.pop(session_id, None)
            self._own.pop(session_id, None)
        for histogram in self._levels(key):
            histogram.no_return += 1
        self._cache.clear()

    def censor(self, running: Mapping[Key, np.ndarray]) -> None:
        """The gaps still running (`running`: the idle ages of each key's idle sessions, as
        `running_gaps.RunningGaps` keeps them): every idle session younger than the cut-off has
        been idle at least this long, and how many of them never come back is not yet known.
        Counting only finished gaps would take the short ones for the whole story
        (right-censoring: a session's last turn is counted as "no return" an hour later, if the
        run lasts that long), so a key's distribution is the life-table estimate over both
        (`kernels.life_table`)."""
        bins = len(self.edges) - 1
        censored: dict[Level, np.ndarray] = {}
        across: dict[_AcrossTenants, np.ndarray] = {}
        for key, ages in running.items():
            ages = ages[ages < self.max_age_s]
            if len(ages):
                at = np.searchsorted(self.edges, ages, side="right") - 1
                counts = censored[key] = np.bincount(at, minlength=bins).astype(float)
                up = _AcrossTenants.of(key)
                across[up] = across[up] + counts if up in across else counts
        if censored:
            censored[None] = np.sum(list(censored.values()), axis=0)
            censored |= across
        if not _same_counts(censored, self._censored):
            self._censored = censored
            self._cache.clear()

    def observe(self, events: Iterable[SessionEvent]) -> None:
        for event in events:
            if isinstance(event, Returned):
                self.record_gap(event.key, event.gap_s, event.session_id)
            elif isinstance(event, Abandoned):
                self.record_no_return(event.key, event.session_id)

    def personal(self, session: SessionView) -> bool:
        """True when this session's prediction uses its own gaps (its key learned that they
        help, and it has some)."""
        histogram = self._keys.get(session.reuse_key)
        return (
            histogram is not None
            and histogram.session_weight != math.inf
            and session.session_id in self._sessions
        )

    def p_reuse(self, session: SessionView | Key, idle_s: float, horizon_s: float) -> float:
        """P(the session returns within `horizon_s` | it has been idle `idle_s`)."""
        if idle_s >= self.max_age_s or horizon_s <= 0:
            return 0.0
        key = session.reuse_key if isinstance(session, SessionView) else session
        cdf, _ = self._distribution(key)
        alive = 1 - self._cdf(cdf, idle_s)
        if alive <= 0:
            return 0.0
        returned = self._cdf(cdf, min(idle_s + horizon_s, self.max_age_s)) - self._cdf(cdf, idle_s)
        return min(1.0, max(0.0, returned / alive))

    def p_reuse_many(
        self, session: SessionView | Key, idle_s: np.ndarray, horizon_s: np.ndarray
    ) -> np.ndarray:
        """`p_reuse` elementwise over arrays of idle times and horizons (one key, or one
        session: its own gaps count where `personal`): what a policy pricing many intervals at
        once asks, without a Python call per interval."""
        if isinstance(session, SessionView):
            cdf = self.cdf_rows([session])[0]
        else:
            cdf, _ = self._distribution(session)
        return self._p_reuse_cdf(cdf, np.asarray(idle_s, float), np.asarray(horizon_s, float))

    def p_reuse_sessions(
        self, sessions: Sequence[SessionView], idle_s: np.ndarray, horizon_s: np.ndarray
    ) -> np.ndarray:
        """`p_reuse_many` for many sessions at once: row s of `idle_s` and `horizon_s` is
        session s's."""
        return self.p_reuse_cdf(self.cdf_rows(sessions), idle_s, horizon_s)

    def p_reuse_cdf(self, cdf: np.ndarray, idle_s: np.ndarray, horizon_s: np.ndarray) -> np.ndarray:
        """`p_reuse` elementwise, row r of `idle_s` and `horizon_s` under distribution
        `cdf[r]` (rows of `cdf_table`)."""
        return self._p_reuse_cdf(cdf, np.asarray(idle_s, float), np.asarray(horizon_s, float))

    def p_reuse_rows(
        self, table: np.ndarray, rows: np.ndarray, idle_s: np.ndarray, horizon_s: np.ndarray
    ) -> np.ndarray:
        """`p_reuse_cdf` of one idle time and horizon per session, session s under
        distribution `table[rows[s]]`, reading only the entries it needs (a decision asks
        this of every candidate: gathering their whole rows cost more than the answer). The
        logarithms are numpy's (`_locate`), the rest compiled (`kernels.row_chances`): the
        same operations, so the same bits."""
        idle, horizon = np.asarray(idle_s, float), np.asarray(horizon_s, float)
        first, last = self.locate_grid(idle, horizon)
        out = np.empty(len(idle))
        row_chances(
            np.ascontiguousarray(table, dtype=float),
            np.ascontiguousarray(rows, dtype=np.int64),
            *_contiguous(first),
            *_contiguous(last),
            np.ascontiguousarray(idle),
            np.ascontiguousarray(horizon),
            float(self.max_age_s),
            out,
        )
        return out

    def cdf_rows(self, sessions: Sequence[SessionView]) -> np.ndarray:
        """Each session's cumulative gap masses at the bin edges: its key's, blended with its
        own gaps where `personal`."""
        table, rows = self.cdf_table(sessions)
        return table[rows]

    def cdf_table(
        self,
        sessions: Sequence[SessionView],
        keys: KeyGroups | None = None,
        ids: Sequence[str] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(distributions, which one each session has): the distinct cumulative gap masses
        at the bin edges, one row per key the sessions have and one per session blended with
        its own gaps (`personal`), and each session's row. Sessions sharing a row share every
        prediction made from it, so a caller can compute those once. `keys` and `ids`, when
        given, are the sessions' `reuse_key`s, grouped, and ids (a caller that keeps them
        saves reading them from every view)."""
        # the keys' rows gathered at once, then the sessions with their own gaps blended in
        # at once: per session only C-level lookups (a decision asks for thousands of rows),
        # and a Python step only for the sessions of keys that use their own gaps
        if not sessions:
            return np.empty((0, len(self.edges))), np.zeros(0, dtype=np.int64)
        if keys is None:
            keys = group_keys(list(map(_REUSE_KEY, sessions)))
        cdfs = [self._distribution(key)[0] for key in keys.distinct]
        weights: list[float] = []
        for key in keys.distinct:
            histogram = self._keys.get(key)
            weights.append(math.inf if histogram is None else histogram.session_weight)
        at = keys.at.copy()  # sessions with their own gaps get rows of their own below
        own_at = np.zeros(0, dtype=np.int64)
        gaps = self._sessions
        if any(weight != math.inf for weight in weights):
            # which sessions blend their own gaps in: C-level maps over all of them, Python
            # only for those that do
            if ids is None:
                ids = list(map(_SESSION_ID, sessions))
            # a session's gaps are never an empty deque: it is forgotten instead
            has_gaps = np.fromiter(map(gaps.__contains__, ids), bool, len(ids))
            own_at = np.flatnonzero(has_gaps & (np.array(weights) != math.inf)[at])
        table = np.stack(cdfs)
        if len(own_at):
            own_ids = list(map(ids.__getitem__, own_at.tolist()))
            own_counts = list(map(len, map(gaps.__getitem__, own_ids)))
            key_rows = at[own_at]
            weight = np.array(weights)[key_rows][:, None]
            for session_id in set(own_ids).difference(self._own):  # a return since
                self._mine(session_id)
            mine = np.array(list(map(self._own.__getitem__, own_ids)))  # C-level, not np.stack
            count = np.array(own_counts, dtype=float)[:, None]
            at[own_at] = len(table) + np.arange(len(own_at))
            blended = (mine + weight * table[key_rows]) / (count + weight)
            table = np.concatenate([table, blended])
        return self._hinted(sessions, table, at)

    def _hinted(
        self, sessions: Sequence[SessionView], table: np.ndarray, at: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """`cdf_table` with the client's word taken over what was learned: a session its
        client closed never returns (a row of zeros), and one whose client expects it back
        after `expect_return_s` returns around then (lognormal, median that time, sigma
        `HINT_SIGMA`). One row per distinct hint."""
        rows: dict[tuple[bool, float | None], int] = {}
        for index, session in enumerate(sessions):
            hints = session.hints
            if not (hints.close or hints.expect_return_s is not None):
                continue
            key = (hints.close, None if hints.close else hints.expect_return_s)
            row = rows.get(key)
            if row is None:
                row = rows[key] = len(table) + len(rows)
            at[index] = row
        if not rows:
            return table, at
        extra = np.zeros((len(rows), len(self.edges)))
        for (close, expected), row in rows.items():
            if not close:
                extra[row - len(table)] = self._expected_cdf(float(expected))
        return np.concatenate([table, extra]), at

    def _expected_cdf(self, expected_s: float) -> np.ndarray:
        """Cumulative return mass at the edges of a return around `expected_s` (median)."""
        if expected_s <= 0:
            return np.ones(len(self.edges))
        z = (np.log(np.maximum(self.edges, 1e-300)) - math.log(expected_s)) / HINT_SIGMA
        cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2)))
        cdf[0] = 0.0
        return cdf

    def locate_grid(self, idle_s: np.ndarray, horizon_s: np.ndarray) -> tuple[Located, Located]:
        """Where the starts `idle_s` and ends (`idle_s + horizon_s`, at most the cut-off) of
        intervals fall in the bins: `p_reuse_grid`'s first step, which a caller asking about
        the same times again can keep."""
        idle, horizon = np.asarray(idle_s, float), np.asarray(horizon_s, float)
        return self._locate(idle), self._locate(np.minimum(idle + horizon, self.max_age_s))

    def p_reuse_grid(
        self,
        table: np.ndarray,
        rows: np.ndarray,
        at: np.ndarray,
        idle_s: np.ndarray,
        horizon_s: np.ndarray,
        located: tuple[Located, Located] | None = None,
    ) -> np.ndarray:
        """`p_reuse_cdf` of row `at[s]` of `idle_s` and `horizon_s` under distribution
        `table[rows[s]]`, per s: sessions whose schedules start on one age bin's edge share a
        row of times, so where those times fall in the bins (a logarithm each) is found once
        per row of times, not once per session; the rest is compiled (`kernels.grid_chances`),
        the same operations on the same numbers. `located`: `locate_grid` of these times,
        where the caller has it."""
        idle, horizon = np.asarray(idle_s, float), np.asarray(horizon_s, float)
        first, last = self.locate_grid(idle, horizon) if located is None else located
        q = np.empty((len(rows), idle.shape[1]))
        grid_chances(
            np.ascontiguousarray(table, dtype=float),
            np.ascontiguousarray(rows, dtype=np.int64),
            np.ascontiguousarray(at, dtype=np.int64),
            np.ascontiguousarray(idle),
            np.ascontiguousarray(horizon),
            *_contiguous(first),
            *_contiguous(last),
            float(self.max_age_s),
            q,
        )
        return q

    def _p_reuse_cdf(
        self,
        cdf: np.ndarray,
        idle: np.ndarray,
        horizon: np.ndarray,
        rows: np.ndarray | None = None,
    ) -> np.ndarray:
        start = self._cdf_many(cdf, idle, rows)
        end = self._cdf_many(cdf, np.minimum(idle + horizon, self.max_age_s), rows)
        return self._p_reuse(start, end, idle, horizon)

    def _p_reuse(
        self, start: np.ndarray, end: np.ndarray, idle: np.ndarray, horizon: np.ndarray
    ) -> np.ndarray:
        """P(return within `horizon` | idle `idle`) from the cumulative masses at both ends."""
        alive = 1 - start
        returned = end - start
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.clip(returned / alive, 0.0, 1.0)
        return np.where((idle >= self.max_age_s) | (horizon <= 0) | (alive <= 0), 0.0, p)

    def _mine(self, session_id: str) -> np.ndarray:
        """The session's own gaps as cumulative counts at the bin edges, kept until it records
        another gap."""
        found = self._own.get(session_id)
        if found is None:
            found = self._own[session_id] = np.empty(len(self.edges))
            own_cumulative(self._smoothed(self._sessions[session_id]), self._kernel_half, found)
        return found

    def _smoothed(self, gaps: deque[int]) -> np.ndarray:
        """A few gaps say "about this long", not "in exactly this bin": each is spread over its
        neighbours in log(gap), the full convolution of the counts with the kernel (the mass
        falling off either end is put back on the ends by `kernels.own_cumulative`). numpy's
        convolution, as its dot products sum in BLAS's order."""
        counts = np.bincount(np.fromiter(gaps, int), minlength=len(self.edges) - 1)
        return np.convolve(counts.astype(float), self._kernel)

    def _bin(self, gap_s: float) -> int:
        # `searchsorted(edges, gap, side="right")` on a list: one call per returning turn
        return bisect.bisect_right(self._edge_list, max(gap_s, 0.0)) - 1

    def _remember(self, session_id: str, bin_index: int) -> None:
        gaps = self._sessions.get(session_id)
        if gaps is None:
            gaps = self._sessions[session_id] = deque(maxlen=self._session_gaps)
            if len(self._sessions) > self._max_sessions:
                gone, _ = self._sessions.popitem(last=False)
                self._own.pop(gone, None)
        self._sessions.move_to_end(session_id)
        gaps.append(bin_index)
        self._own.pop(session_id, None)

    def _score(self, key: Key, session_id: str, gap_s: float) -> None:
        """Add to each candidate weight's total the log likelihood it gave this outcome (a
        return in the gap's bin, or none), before learning from it: under the key's
        distribution, which the return before changed (through the pooled histogram too), so
        there is nothing to cache, blended with the session's own gaps at each weight, at the
        edges the outcome touches. One compiled call (`kernels.score_return`)."""
        own = self._sessions.get(session_id)
        if not own:
            return  # every candidate predicts the same for a session without gaps
        late = gap_s >= self.max_age_s
        # a key not seen yet is scored against what it backs off to (`_distribution`)
        cdf = self._distribution(key)[0]
        histogram = self._histogram(key)
        score_return(
            cdf,
            self._smoothed(own),
            self._kernel_half,
            len(own),
            0 if late else self._bin(gap_s),
            late,
            self._weights,
            histogram.scores,
        )

    def _cdf_many(
        self, cdf: np.ndarray, x: np.ndarray, rows: np.ndarray | None = None
    ) -> np.ndarray:
        """`_cdf` elementwise; `cdf` one distribution, or one per row of `x`, or with `rows`
        a table of them: element s of `x` (1-D) under `cdf[rows[s]]`."""
        i, share, beyond = self._locate(x)
        if rows is not None:  # the same arithmetic on the entries `take_along_axis` would take
            at, above = cdf[rows, i], cdf[rows, i + 1]
            return np.where(beyond, cdf[rows, -1], at + (above - at) * share)
        if cdf.ndim == 2:  # one row per session, one row of x each
            at, above = np.take_along_axis(cdf, i, 1), np.take_along_axis(cdf, i + 1, 1)
            return np.where(beyond, cdf[:, -1:], at + (above - at) * share)
        out = cdf[i] + (cdf[i + 1] - cdf[i]) * share
        return np.where(beyond, cdf[-1], out)

    def _locate(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where each time of `x` falls: its bin, its share of the way through it (in
        log(gap); linearly in bin 0) and whether it is past the last edge."""
        edges = self.edges
        clipped = np.clip(x, 0.0, edges[-1])
        i = np.clip(np.searchsorted(edges, clipped, side="right") - 1, 0, len(edges) - 2)
        lo, hi = edges[i], edges[i + 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            log_share = (
                np.log(np.maximum(clipped, 1e-300) / np.maximum(lo, 1e-300)) / self._log_width[i]
            )
        share = np.where(i == 0, clipped / hi, log_share)
        return i, share, x >= edges[-1]

    def age_floor(self, idle_s: np.ndarray) -> np.ndarray:
        """Each idle age rounded down to the bin edge at or below it (ages past the cut-off
        to the cut-off). Within a bin the histogram knows no more than its log-uniform spread,
        so a schedule conditioned on the bin's lower edge moves in steps the model resolves:
        a policy can reuse what it priced until a session's age crosses an edge."""
        return self.edges[self.age_edge(idle_s)]

    def age_edge(self, idle_s: np.ndarray) -> np.ndarray:
        """The index in `edges` of each idle age's `age_floor`."""
        edges = self.edges
        at = np.searchsorted(edges, np.asarray(idle_s, float), side="right") - 1
        return np.clip(at, 0, len(edges) - 1)

    def p_no_return(self, session: SessionView | Key) -> float:
        key = session.reuse_key if isinstance(session, SessionView) else session
        return self._distribution(key)[1]

    def _histogram(self, key: Key) -> _Histogram:
        return self._bounded(self._keys, key)

    def _levels(self, key: Key) -> tuple[_Histogram, _Histogram, _Histogram]:
        """The histograms a gap of `key` is counted in: pooled, across tenants, the key's."""
        up = _AcrossTenants.of(key)
        fresh = up not in self._across
        across = self._bounded(self._across, up)
        if fresh:
            self._only_tenant[up] = key[0]
        elif self._only_tenant.get(up, key[0]) != key[0]:
            # a second tenant: the level is shared from now on (every caller then clears the
            # distributions cached from before)
            del self._only_tenant[up]
        return self._pooled, across, self._histogram(key)

    def _bounded(self, table: OrderedDict, key: Key | _AcrossTenants) -> _Histogram:
        histogram = table.get(key)
        if histogram is None:
            histogram = table[key] = _Histogram(len(self._prior_masses))
            if len(table) > self._max_keys:
                # the least recently updated key goes; its data stays in the levels above it
                gone, _ = table.popitem(last=False)
                self._only_tenant.pop(gone, None)
        table.move_to_end(key)
        return histogram

    def _known(self, key: Level) -> Level:
        """The most specific level with data at or above `key`: a key without data is exactly
        the distribution it backs off to, so only known levels take cache space."""
        if isinstance(key, tuple) and key not in self._keys:
            key = _AcrossTenants.of(key)
        if isinstance(key, _AcrossTenants) and key not in self._across:
            key = None
        return key

    def _above(self, key: Key | _AcrossTenants) -> Level:
        """The level `key` backs off to: its key across tenants once two tenants share it,
        else (and above that) the pooled one."""
        if isinstance(key, _AcrossTenants):
            return None
        up = _AcrossTenants.of(key)
        return up if up in self._across and up not in self._only_tenant else None

    def _distribution(self, key: Level) -> tuple[np.ndarray, float]:
        """(cumulative mass at each edge, P(no return)) for `key` (a reuse key, the same
        across tenants, or None: pooled), blended with the level above it."""
        key = self._known(key)
        if key not in self._cache:
            if key is None:
                histogram, base, base_none = self._pooled, self._prior_masses, self._prior_no_return
            else:
                up_cdf, base_none = self._distribution(self._above(key))
                table = self._across if isinstance(key, _AcrossTenants) else self._keys
                histogram, base = table[key], np.diff(up_cdf)
            # the prior is `weight` pseudo-sessions, every gap of theirs finished
            weight = self.prior.weight
            censored = self._censored.get(key)
            total = histogram.total + weight
            cdf = np.empty(len(base) + 1)
            if censored is None:  # `censor` keeps only keys with a gap running
                # the running sum, after a 0, of (counts + weight * base) / total, compiled:
                # rebuilt after every return
                cumulative_masses(histogram.counts, base, float(weight), total, cdf)
                no_return = (histogram.no_return + weight * base_none) / total
            else:
                # the life table over finished and running gaps, compiled as well
                no_return = life_table(histogram.counts, base, float(weight), total, censored, cdf)
            self._cache[key] = (cdf, no_return)
        return self._cache[key]

    def _cdf(self, cdf: np.ndarray, x: float) -> float:
        """P(gap <= x), spreading each bin's mass uniformly in log(gap) (linearly in bin 0)."""
        edges = self.edges
        if x >= edges[-1]:
            return float(cdf[-1])
        i = int(np.searchsorted(edges, x, side="right")) - 1
        lo, hi = edges[i], edges[i + 1]
        share = x / hi if i == 0 else math.log(x / lo) / math.log(hi / lo)
        return float(cdf[i] + (cdf[i + 1] - cdf[i]) * share)


def _contiguous(found: Located) -> Located:
    """`_locate`'s (bin, share, past the end) as the compiled kernels take them."""
    i, share, beyond = found
    return (
        np.ascontiguousarray(i, dtype=np.int64),
        np.ascontiguousarray(share, dtype=float),
        np.ascontiguousarray(beyond, dtype=bool),
    )


def _same_counts(a: dict[Level, np.ndarray], b: dict[Level, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
