//! The staged backward (`super::policy::staged`: the plain packed cluster tiles and narrower block
//! tiles): rows copied into a ring in shared memory by the copy engine, several rows ahead,
//! instead of one prefetched row in registers.

use super::Normalization;
use super::backward::{DxRow, RowPair, load_stats};
use super::params::BackwardParams;
use super::policy::gamma_end;
use super::rows::{Plain, RowSource};
use super::tile::BackwardTile;
use crate::arch;
use crate::element::{Access, Element, Pack, row_addr};
use crate::reduce::{RowReducer, Team};

/// A team's rows in order, one at a time: the rows of its groups `first, first + stride, …` of
/// `per_group` rows each (but the last of all, which ends at `rows`). Groups may be shorter than
/// the ring is deep (small batches have groups of one row): the ring's filler walks the team's
/// rows with one of these, as many rows ahead of the rows being worked on as the ring has stages
/// (one fewer where pass 2 reads its row again, [`staged_rows`]). Additions only, no division:
/// the widest tiles have no registers to spare.
#[derive(Clone, Copy)]
pub(super) struct TeamRows {
    row: usize,
    end: usize,
    /// The first row of the current group.
    start: usize,
    per_group: usize,
    /// Rows from one of the team's groups to its next.
    stride_rows: usize,
    rows: usize,
}

impl TeamRows {
    #[inline(always)]
    pub(super) fn new(first_group: usize, per_group: usize, stride: usize, rows: usize) -> Self {
        let start = first_group * per_group;
        TeamRows {
            row: start,
            end: (start + per_group).min(rows),
            start,
            per_group,
            stride_rows: stride * per_group,
            rows,
        }
    }

    /// The current row, if the team has one.
    #[inline(always)]
    pub(super) fn get(&self) -> Option<usize> {
        (self.row < self.end).then_some(self.row)
    }

    /// Moves to the team's next row.
    #[inline(always)]
    pub(super) fn advance(&mut self) {
        self.row += 1;
        if self.row >= self.end {
            self.start += self.stride_rows;
            self.row = self.start;
            self.end = (self.start + self.per_group).min(self.rows);
        }
    }
}

/// The end of a [`StagedRows`] ring of `stages` rows that follows `start` words: the stages,
/// 128-byte aligned (x and dy, `vpt` accesses of 16 bytes per thread each), then one mbarrier per
/// stage.
pub(super) const fn staged_words_end(
    start: usize,
    stages: usize,
    vpt: usize,
    threads: usize,
) -> usize {
    start.next_multiple_of(32) + stages * 2 * vpt * threads * 4 + 2 * stages
}

/// A ring of `STAGES` rows in shared memory (`super::policy::staged_stages`), filled by the copy
/// engine ([`arch::SharedF32::bulk_copy_from`]) and drained into registers by every thread. One
/// thread fills; each stage's mbarrier counts the bytes of its row, and its phase says which row.
///
/// A block's accesses `k` cover `block · LEN` consecutive elements of the row (the team's threads
/// are the blocks' in rank order), so each is one bulk copy per operand, and thread t's pack sits
/// at 16·t bytes into it: a warp's shared loads take consecutive 16 bytes, no bank conflicts.
pub(super) struct StagedRows<T: Element, const VPT: usize, const STAGES: usize> {
    /// Word of stage 0, x's first access.
    base: usize,
    /// Word of stage 0's mbarrier.
    barriers: usize,
    /// Words of one access of one operand: `block · 4`.
    access_words: usize,
    /// This block's first element of access 0, and the team's elements per access.
    first: usize,
    team_elems: usize,
    d: usize,
    element: core::marker::PhantomData<T>,
}

impl<T: Element, const VPT: usize, const STAGES: usize> StagedRows<T, VPT, STAGES> {
    /// A ring after the block's first `start` words; thread 0 makes its mbarriers.
    ///
    /// # Safety
    /// Every thread of the block calls it (a block team: it has a barrier), a cluster's before
    /// [`RowReducer::new`] (whose cluster barrier publishes the mbarriers); the launch provides
    /// [`staged_words_end`] words.
    #[inline(always)]
    pub(super) unsafe fn new(start: usize, team: Team, d: usize) -> Self {
        let block = arch::block_dim();
        let len = Access::<T, true>::LEN;
        let base = start.next_multiple_of(32);
        let ring = StagedRows {
            base,
            barriers: base + STAGES * 2 * VPT * block * 4,
            access_words: block * 4,
            first: (team.tid - arch::thread_idx()) * len,
            team_elems: team.threads * len,
            d,
            element: core::marker::PhantomData,
        };
        if arch::thread_idx() == 0 {
            for stage in 0..STAGES {
                unsafe { arch::shared_f32().mbarrier_init(ring.barriers + 2 * stage, 1) };
            }
            if !team.cluster {
                arch::fence_mbarrier_init();
            }
        }
        if !team.cluster {
            // A block team has no cluster barrier to publish the mbarriers (`RowReducer::new`'s):
            // without this one another thread may wait on a stage's mbarrier before thread 0
            // made it (racecheck found it on the H200, and it faulted there).
            arch::sync_threads();
        }
        ring
    }

    /// The stage of the team's `i`-th row. A ring of three divides in 32 bits: 64-bit division by a
    /// constant cost its tile 7 registers, past the 64 its 1024-thread blocks allow.
    #[inline(always)]
    pub(super) fn stage(i: usize) -> usize {
        if STAGES.is_power_of_two() {
            i % STAGES
        } else {
            (i as u32 % STAGES as u32) as usize
        }
    }

    /// The mbarrier phase of the team's `i`-th row: its stage's round, modulo 2.
    #[inline(always)]
    fn phase(i: usize) -> u32 {
        if STAGES.is_power_of_two() {
            (i / STAGES % 2) as u32
        } else {
            i as u32 / STAGES as u32 % 2
        }
    }

    /// The first word of access `k` of `operand` (0: x, 1: dy) in `stage`.
    #[inline(always)]
    pub(super) fn word(&self, stage: usize, operand: usize, k: usize) -> usize {
        self.base + ((stage * 2 + operand) * VPT + k) * self.access_words
    }

    /// Starts copying the team's `i`-th row, `row`, into its stage. Called by thread 0 only,
    /// once every thread has read the stage's previous row.
    ///
    /// # Safety
    /// `row` is below `rows`; the rows are 16-byte aligned with `d` a multiple of the pack.
    #[inline(always)]
    pub(super) unsafe fn fill(&self, p: &BackwardParams, i: usize, row: usize) {
        let shared = arch::shared_f32();
        let stage = Self::stage(i);
        let barrier = self.barriers + 2 * stage;
        let x_row = row_addr::<T>(p.x, row, p.x_stride);
        let dy_row = row_addr::<T>(p.dy, row, p.dy_stride);
        // Each access's span, cut at d (a multiple of the pack, so of 16 bytes).
        let span = |k: usize| {
            let elem = self.first + k * self.team_elems;
            let elems = (self.d.saturating_sub(elem)).min(self.access_words * 4 / T::BYTES);
            (elem, (elems * T::BYTES) as u32)
        };
        let mut bytes = 0;
        for k in 0..VPT {
            bytes += span(k).1;
        }
        unsafe { shared.mbarrier_arrive_expect_tx(barrier, 2 * bytes) };
        for k in 0..VPT {
            let (elem, n) = span(k);
            if n > 0 {
                let offset = (elem * T::BYTES) as u64;
                unsafe {
                    shared.bulk_copy_from(self.word(stage, 0, k), x_row + offset, n, barrier);
                    shared.bulk_copy_from(self.word(stage, 1, k), dy_row + offset, n, barrier);
                }
            }
        }
    }

    /// Waits for the team's `i`-th row and reads this thread's accesses of it into registers.
    ///
    /// # Safety
    /// [`Self::fill`] started row `i`; rows before it were taken in order.
    #[inline(always)]
    pub(super) unsafe fn take(
        &self,
        i: usize,
        elem: impl Fn(usize) -> usize,
    ) -> ([Pack; VPT], [Pack; VPT]) {
        let shared = arch::shared_f32();
        let stage = Self::stage(i);
        unsafe { shared.mbarrier_wait(self.barriers + 2 * stage, Self::phase(i)) };
        let own = arch::thread_idx() * 4;
        let mut x: [Pack; VPT] = [[0; 4]; VPT];
        let mut dy: [Pack; VPT] = [[0; 4]; VPT];
        for k in 0..VPT {
            if elem(k) < self.d {
                x[k] = unsafe { shared.load4(self.word(stage, 0, k) + own) }.map(f32::to_bits);
                dy[k] = unsafe { shared.load4(self.word(stage, 1, k) + own) }.map(f32::to_bits);
            }
        }
        (x, dy)
    }

    /// Reads this thread's accesses of the row in `stage` again, without waiting. (The same loads
    /// as [`Self::take`]'s, written out there too: sharing them changed ptxas's register choice
    /// for tiles that never read twice, RMSNorm's 2-access cluster tile from 117 to 168.)
    ///
    /// # Safety
    /// The stage's row was [`Self::take`]n and the stage not filled since.
    #[inline(always)]
    pub(super) unsafe fn read(
        &self,
        stage: usize,
        elem: impl Fn(usize) -> usize,
    ) -> ([Pack; VPT], [Pack; VPT]) {
        let shared = arch::shared_f32();
        let own = arch::thread_idx() * 4;
        let mut x: [Pack; VPT] = [[0; 4]; VPT];
        let mut dy: [Pack; VPT] = [[0; 4]; VPT];
        for k in 0..VPT {
            if elem(k) < self.d {
                x[k] = unsafe { shared.load4(self.word(stage, 0, k) + own) }.map(f32::to_bits);
                dy[k] = unsafe { shared.load4(self.word(stage, 1, k) + own) }.map(f32::to_bits);
            }
        }
        (x, dy)
    }
}

/// The [`staged`] backward: as [`backward_regs`], with the rows arriving through [`StagedRows`]
/// of `STAGES` rows instead of one prefetched row in registers.
#[inline(always)]
pub(super) unsafe fn backward_staged<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    const STAGES: usize,
    const PAIRS: bool,
>(
    p: &BackwardParams,
    src: Plain,
    team: Team,
) {
    let d = p.d as usize;
    let ring = unsafe {
        StagedRows::<T, VPT, STAGES>::new(
            gamma_end(N::CENTERED, VPT, 0, arch::block_dim()),
            team,
            d,
        )
    };
    let mut reducer = unsafe { RowReducer::new(team) };
    let tile = unsafe { BackwardTile::<T, VEC, VPT, N, Plain>::new(p, src, team) };
    // Two copies of the row loop: a call that adds a dresidual (a launch constant) takes the
    // one that reads each row twice. Where `pairs_rows` (a constant: `PAIRS`), a call with saved
    // statistics takes its rows in pairs.
    unsafe {
        if PAIRS && !<Plain as RowSource<T, VEC>>::has_extra(&src) && p.rstd != 0 {
            staged_row_pairs::<T, VEC, VPT, N, STAGES>(p, &ring, &mut reducer, &tile, team)
        } else if <Plain as RowSource<T, VEC>>::has_extra(&src) {
            staged_rows::<T, VEC, VPT, N, STAGES, true>(p, &ring, &mut reducer, &tile, team)
        } else {
            staged_rows::<T, VEC, VPT, N, STAGES, false>(p, &ring, &mut reducer, &tile, team)
        }
    }
}

/// The rows of a [`backward_staged`] team. With `REREAD` (a dresidual to add), pass 2 reads its row
/// from the stage again rather than holding x and dy across the reductions, where the dresidual
/// slots and their sums need the registers (the widest tiles spilled). The stage then lives until
/// pass 2 is done: the next pass 1's block barrier frees it, one row later than without.
///
/// # Safety
/// As for [`backward_staged`], which made `ring`, `reducer` and `tile`.
#[inline(always)]
unsafe fn staged_rows<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    const STAGES: usize,
    const REREAD: bool,
>(
    p: &BackwardParams,
    ring: &StagedRows<T, VPT, STAGES>,
    reducer: &mut RowReducer,
    tile: &BackwardTile<T, VEC, VPT, N, Plain>,
    team: Team,
) {
    let (per_group, rows) = (p.rows_per_group as usize, p.rows as usize);
    // `rows::group_rows(group, per_group, rows, true)`, spelled out: through that call these
    // kernels' PTX came out in another register order, which no GPU has run.
    let group_rows = |group: usize| {
        let first = arch::opaque(group) * per_group;
        (first, (first + per_group).min(rows))
    };
    let filler = arch::thread_idx() == 0;
    let mut group = team.first;
    let (first, end) = group_rows(group);
    // The team's first `STAGES` rows, however few groups they span; `fill` then stays `STAGES`
    // rows ahead of the row being worked on (`STAGES` − 1 with `REREAD`).
    let mut fill = TeamRows::new(group, per_group, team.stride, rows);
    for i in 0..STAGES {
        if filler && let Some(row) = fill.get() {
            unsafe { ring.fill(p, i, row) };
        }
        fill.advance();
    }
    let mut next_stats = (0.0, 0.0);
    if first < end {
        next_stats = load_stats::<N>(p, first);
    }
    let mut i = 0;
    while group < p.groups as usize {
        let (first, end) = group_rows(group);
        let next_group = group_rows(group + team.stride);
        let mut dgamma = [[0.0f32; 8]; VPT];
        let mut dbeta = [[0.0f32; 8]; VPT];
        for row in first..end {
            // The statistics are a row ahead in registers, as the rows are in the ring.
            let stats = next_stats;
            if row + 1 < end {
                next_stats = load_stats::<N>(p, row + 1);
            } else if next_group.0 < next_group.1 {
                next_stats = load_stats::<N>(p, next_group.0);
            }
            let (x, dy) = unsafe { ring.take(i, |k| tile.elem(k)) };
            let this = (x, dy, [[0; 4]; VPT], stats);
            unsafe {
                let pass1 = tile.pass1(reducer, row, &this);
                // Pass 1 ended in a block barrier (its reduction), after every thread had read
                // this row's stage and finished the previous row: with `REREAD` the previous
                // row's stage, otherwise this one, can take the row `STAGES` after it.
                if !REREAD || i > 0 {
                    if filler && let Some(next) = fill.get() {
                        ring.fill(p, i + STAGES - REREAD as usize, next);
                    }
                    fill.advance();
                }
                if REREAD {
                    let (x, dy) =
                        ring.read(StagedRows::<T, VPT, STAGES>::stage(i), |k| tile.elem(k));
                    let (_, stats, sums) = pass1;
                    let this = (x, dy, [[0; 4]; VPT], stats);
                    tile.pass2(
                        reducer,
                        row,
                        &this,
                        (x, stats, sums),
                        &mut dgamma,
                        &mut dbeta,
                    );
                } else {
                    tile.pass2(reducer, row, &this, pass1, &mut dgamma, &mut dbeta);
                }
            }
            i += 1;
        }
        if team.cluster {
            // The locked baseline is a block's (the launch plan refuses it to clusters).
            unsafe { tile.store_partials(group, &dgamma, &dbeta) };
        } else {
            unsafe { tile.store_group(group, &dgamma, &dbeta) };
        }
        group += team.stride;
    }
}

/// The rows of a [`backward_staged`] block team two at a time where they can be: saved statistics
/// and no dresidual. A block's rows are a chain — wait for the row, reduce it
/// (a block barrier), write dx — and a block runs one chain at a time; two rows per reduction
/// halve the barriers and reductions per row. dγ still takes the rows one by one, in order: the
/// same bits as one row at a time. A group's odd last row goes alone.
///
/// # Safety
/// As for [`staged_rows`]; the team is a block (the ring's stages are refilled after the
/// reduction's block barrier); `p.rstd` is set.
#[inline(always)]
unsafe fn staged_row_pairs<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    const STAGES: usize,
>(
    p: &BackwardParams,
    ring: &StagedRows<T, VPT, STAGES>,
    reducer: &mut RowReducer,
    tile: &BackwardTile<T, VEC, VPT, N, Plain>,
    team: Team,
) {
    let (per_group, rows) = (p.rows_per_group as usize, p.rows as usize);
    let group_rows = |group: usize| {
        let first = arch::opaque(group) * per_group;
        (first, (first + per_group).min(rows))
    };
    let filler = arch::thread_idx() == 0;
    // The team's first `STAGES` rows, as `staged_rows` fills them (written out in both: through
    // one shared method ptxas spilled RMSNorm's 16-bit block instance, which runs `staged_rows`,
    // at its budget of 80 registers).
    let mut fill = TeamRows::new(team.first, per_group, team.stride, rows);
    for i in 0..STAGES {
        if filler && let Some(row) = fill.get() {
            unsafe { ring.fill(p, i, row) };
        }
        fill.advance();
    }
    let mut refill = |i: usize| {
        if filler && let Some(next) = fill.get() {
            unsafe { ring.fill(p, i + STAGES, next) };
        }
        fill.advance();
    };
    // The statistics of the team's next two rows, loaded ahead of them as the ring loads rows.
    let mut stat_rows = TeamRows::new(team.first, per_group, team.stride, rows);
    let mut next_stats = || {
        let stats = stat_rows
            .get()
            .map_or((0.0, 0.0), |row| load_stats::<N>(p, row));
        stat_rows.advance();
        stats
    };
    let mut ahead = [next_stats(), next_stats()];
    let no_extra = [[0; 4]; VPT];
    let (mut group, mut i) = (team.first, 0);
    while group < p.groups as usize {
        let (first, end) = group_rows(group);
        let mut dgamma = [[0.0f32; 8]; VPT];
        let mut dbeta = [[0.0f32; 8]; VPT];
        let mut row = first;
        while row < end {
            if row + 1 < end {
                let stats = ahead;
                ahead = [next_stats(), next_stats()];
                let a = unsafe { ring.take(i, |k| tile.elem(k)) };
                let b = unsafe { ring.take(i + 1, |k| tile.elem(k)) };
                let (a, b) = (
                    (a.0, a.1, no_extra, stats[0]),
                    (b.0, b.1, no_extra, stats[1]),
                );
                let (xa, xb) = (tile.hold(&a.0), tile.hold(&b.0));
                let sums = (
                    tile.row_sums(&xa, &a.1, stats[0].0),
                    tile.row_sums(&xb, &b.1, stats[1].0),
                );
                unsafe {
                    let [ma, mb] =
                        RowPair::means::<N>(reducer, sums, (stats[0].1, stats[1].1), p.inv_d);
                    // Past the reduction's barrier every thread has read both stages.
                    refill(i);
                    refill(i + 1);
                    let (da, db) = (DxRow::new(stats[0], ma), DxRow::new(stats[1], mb));
                    tile.pass2_of(row, &a, &xa, da, &mut dgamma, &mut dbeta);
                    tile.pass2_of(row + 1, &b, &xb, db, &mut dgamma, &mut dbeta);
                }
                row += 2;
                i += 2;
            } else {
                let stats = ahead[0];
                ahead = [ahead[1], next_stats()];
                let (x, dy) = unsafe { ring.take(i, |k| tile.elem(k)) };
                let this = (x, dy, no_extra, stats);
                unsafe {
                    let pass1 = tile.pass1(reducer, row, &this);
                    refill(i);
                    tile.pass2(reducer, row, &this, pass1, &mut dgamma, &mut dbeta);
                }
                row += 1;
                i += 1;
            }
        }
        unsafe { tile.store_group(group, &dgamma, &dbeta) };
        group += team.stride;
    }
}
