//! The backward: dx and one dγ (and dβ) partial row per group of rows, from a register tile
//! (`super::tile`), rows staged through shared memory (`super::staged`) or a streamed row.

use super::Normalization;
use super::params::BackwardParams;
use super::policy::{
    STREAM, block_stages_rows, gamma_end, instance_backward_words, pairs_rows,
    plain_adds_dresidual, staged, staged_stages,
};
use super::rows::{Plain, ResidualBackward, RowSource, group_rows, param, row_stats_stream};
use super::segments::{SEGMENT_THREADS, backward_segments, combine_words};
use super::staged::backward_staged;
use super::tile::BackwardTile;
use crate::arch;
use crate::column_sum::{GROUP_SUMS_ATOMIC, finish_group_sums, store_group_partials};
use crate::element::{Access, Element, load_f32s, row_addr};
use crate::reduce::{PendingSums, RowReducer, Team};

/// The backward: dx, and one dγ (and dβ) partial row per group; launch any grid (blocks walk
/// groups by grid stride; with `LANES`, [`super::segments`]), then [`crate::column_sum`] over the partials, or have this launch sum
/// them or add them atomically (`p.sums`, [`crate::column_sum::GroupSums`]).
///
/// # Safety
/// As for `forward`; each partials buffer holds `groups · d` f32, 16-byte aligned.
#[inline(always)]
pub unsafe fn backward<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    const RESIDUAL: bool,
    const CLUSTER: bool,
    const LANES: usize,
    const RING: bool,
>(
    p: &BackwardParams,
) {
    // The column sum after this launch may take the SMs its blocks leave (it waits for the
    // partial rows itself): no idle gap between the two.
    arch::launch_dependents();
    let team = Team::new(CLUSTER, LANES);
    let threads = if LANES != 0 {
        SEGMENT_THREADS
    } else {
        arch::block_dim()
    };
    let slots =
        instance_backward_words::<T, N, VEC, VPT, RESIDUAL, CLUSTER, LANES, RING>(threads).0;
    let plain = Plain::backward(p, plain_adds_dresidual(VPT, LANES), slots);
    let area = combine_words(
        gamma_end(N::CENTERED, VPT, LANES, SEGMENT_THREADS),
        VPT,
        LANES,
    )
    .0;
    unsafe {
        match (VPT == STREAM, RESIDUAL) {
            (false, false) if LANES != 0 => {
                backward_segments::<T, VEC, VPT, N, _>(p, plain, team, area)
            }
            (false, true) if LANES != 0 => {
                backward_segments::<T, VEC, VPT, N, _>(p, ResidualBackward::new(p), team, area)
            }
            (true, false) => backward_stream::<T, VEC, N, _>(p, plain, team),
            (true, true) => backward_stream::<T, VEC, N, _>(p, ResidualBackward::new(p), team),
            // A ring instance stages in any block where the host asks (`p.stage_rows`) and
            // keeps the register prefetch for the others, as RMSNorm's block instance does: with
            // both compiled ptxas gives it 96 registers at 16 bits instead of 80, with which the
            // ring path ran 6 % shorter (`bench-results/h200.md`, twenty-ninth session, round 16).
            (false, false)
                if (RING || staged(N::CENTERED, VEC, CLUSTER, RESIDUAL, VPT, LANES))
                    && (CLUSTER
                        || block_stages_rows(arch::block_dim())
                        || (RING && p.stage_rows != 0)) =>
            {
                // The ring's depth is a constant of the instance (`i % STAGES` a mask at 4).
                if staged_stages(N::CENTERED, T::BYTES, VPT, CLUSTER) == 3 {
                    backward_staged::<T, VEC, VPT, N, 3, false>(p, plain, team)
                } else if pairs_rows(T::BYTES, VPT, RING) {
                    backward_staged::<T, VEC, VPT, N, 4, true>(p, plain, team)
                } else {
                    backward_staged::<T, VEC, VPT, N, 4, false>(p, plain, team)
                }
            }
            (false, false) => backward_regs::<T, VEC, VPT, N, _>(p, plain, team),
            (false, true) => backward_regs::<T, VEC, VPT, N, _>(p, ResidualBackward::new(p), team),
        }
    }
    team.finish();
    let partials = (p.partials, p.dbeta_partials);
    unsafe { finish_group_sums::<T>(&p.sums, partials, p.groups as usize, p.d as usize) };
}

/// Pass 1 of the backward over some elements of a row: `Σ dŷ` and `Σ dŷ·(x−μ)`, the second to be
/// scaled by rstd once per row ([`RowSums::start`]) rather than once per element.
#[derive(Clone, Copy, Default)]
pub(super) struct RowSums {
    dy_hat: f32,
    dot: f32,
}

impl RowSums {
    /// Adds one element: `dy_hat = dy·γ`, `centered = x − μ`.
    #[inline(always)]
    pub(super) fn add(&mut self, dy_hat: f32, centered: f32) {
        self.dy_hat += dy_hat;
        self.dot = arch::fma(dy_hat, centered, self.dot);
    }

    /// Starts the reduction of the row's sums (RMSNorm needs only the second);
    /// `Σ dŷ·x̂ = rstd·Σ dŷ·(x−μ)`.
    ///
    /// # Safety
    /// As for [`RowReducer::start`].
    #[inline(always)]
    pub(super) unsafe fn start<N: Normalization>(
        self,
        reducer: &mut RowReducer,
        rstd: f32,
    ) -> PendingSums {
        let dot = self.dot * rstd;
        if N::CENTERED {
            unsafe { reducer.start([self.dy_hat, dot]) }
        } else {
            unsafe { reducer.start([dot]) }
        }
    }

    /// `(mean(dŷ), mean(dŷ·x̂))` of a row from the sums [`Self::start`] started.
    ///
    /// # Safety
    /// As for [`RowReducer::finish`].
    #[inline(always)]
    pub(super) unsafe fn means<N: Normalization>(
        reducer: &mut RowReducer,
        sums: PendingSums,
        inv_d: f32,
    ) -> (f32, f32) {
        if N::CENTERED {
            let [a, b] = unsafe { reducer.finish(sums) };
            (a * inv_d, b * inv_d)
        } else {
            (0.0, unsafe { reducer.finish::<1>(sums) }[0] * inv_d)
        }
    }
}

/// The pass-1 sums of two rows reduced at once: one block exchange and one barrier for both
/// where each row alone takes one. Each row's totals have the bits of its own reduction (the
/// butterfly and the warps' combination add each value apart, in the same order).
pub(super) struct RowPair;

impl RowPair {
    /// Rows a's and b's `(mean(dŷ), mean(dŷ·x̂))` (RMSNorm: the first 0), as [`RowSums::means`]
    /// gives each; `Σ dŷ·x̂ = rstd·Σ dŷ·(x−μ)`.
    ///
    /// # Safety
    /// As for [`RowReducer::block_sums`].
    #[inline(always)]
    pub(super) unsafe fn means<N: Normalization>(
        reducer: &mut RowReducer,
        (a, b): (RowSums, RowSums),
        (rstd_a, rstd_b): (f32, f32),
        inv_d: f32,
    ) -> [(f32, f32); 2] {
        let (dot_a, dot_b) = (a.dot * rstd_a, b.dot * rstd_b);
        if N::CENTERED {
            let [dy_a, dot_a, dy_b, dot_b] =
                unsafe { reducer.block_sums([a.dy_hat, dot_a, b.dy_hat, dot_b]) };
            [(dy_a * inv_d, dot_a * inv_d), (dy_b * inv_d, dot_b * inv_d)]
        } else {
            let [dot_a, dot_b] = unsafe { reducer.block_sums([dot_a, dot_b]) };
            [(0.0, dot_a * inv_d), (0.0, dot_b * inv_d)]
        }
    }
}

/// dx of a row in two FMAs per element: `rstd·(dŷ − mean(dŷ) − x̂·mean(dŷ·x̂))` is
/// `rstd·dŷ + (x−μ)·c + b` with `c = −rstd²·mean(dŷ·x̂)` and `b = −rstd·mean(dŷ)`.
#[derive(Clone, Copy)]
pub(super) struct DxRow {
    mean: f32,
    rstd: f32,
    c: f32,
    b: f32,
}

impl DxRow {
    #[inline(always)]
    pub(super) fn new((mean, rstd): (f32, f32), (mean_dy_hat, mean_dot): (f32, f32)) -> Self {
        DxRow {
            mean,
            rstd,
            c: -(rstd * rstd * mean_dot),
            b: -(rstd * mean_dy_hat),
        }
    }

    /// `(dx, x̂)` of one element.
    #[inline(always)]
    pub(super) fn dx(&self, x: f32, dy_hat: f32) -> (f32, f32) {
        let centered = x - self.mean;
        let dx = arch::fma(self.rstd, dy_hat, arch::fma(centered, self.c, self.b));
        (dx, centered * self.rstd)
    }
}

/// The saved statistics of a row: `(μ, rstd)` (μ = 0 for RMSNorm); zeros when they are to be
/// recomputed (`rstd == 0`).
#[inline(always)]
pub(super) fn load_stats<N: Normalization>(p: &BackwardParams, row: usize) -> (f32, f32) {
    if p.rstd == 0 {
        return (0.0, 0.0);
    }
    let mean = if N::CENTERED {
        unsafe { (p.mean as *const f32).add(row).read() }
    } else {
        0.0
    };
    (mean, unsafe { (p.rstd as *const f32).add(row).read() })
}

#[inline(always)]
pub(super) unsafe fn backward_regs<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    S: RowSource<T, VEC>,
>(
    p: &BackwardParams,
    src: S,
    team: Team,
) {
    let mut reducer = unsafe { RowReducer::new(team) };
    let tile = unsafe { BackwardTile::<T, VEC, VPT, N, S>::new(p, src, team) };
    let rows = p.rows as usize;
    let prefetch = tile.prefetch;
    let mut group = team.first;
    while group < p.groups as usize {
        // LayerNorm's one-access tile keeps its rows stepped: it fits either way and measured 6
        // points faster so.
        let (first, end) = group_rows(
            group,
            p.rows_per_group as usize,
            rows,
            !(N::CENTERED && VPT == 1),
        );
        let mut dgamma = [[0.0f32; 8]; VPT];
        let mut dbeta = [[0.0f32; 8]; VPT];
        let mut next = BackwardTile::<T, VEC, VPT, N, S>::empty();
        if prefetch && first < end {
            next = unsafe { tile.load(first) };
        }
        for row in first..end {
            let this = if prefetch {
                next
            } else {
                unsafe { tile.load(arch::recomputed_on_sm80(row)) }
            };
            if prefetch && row + 1 < end {
                next = unsafe { tile.load(arch::recomputed_on_sm80(row + 1)) };
            }
            unsafe {
                let row = arch::recomputed_on_sm80(row);
                let pass1 = tile.pass1(&mut reducer, row, &this);
                tile.pass2(&mut reducer, row, &this, pass1, &mut dgamma, &mut dbeta);
            }
        }
        unsafe { tile.store_group(group, &dgamma, &dbeta) };
        group += team.stride;
    }
}

#[inline(always)]
pub(super) unsafe fn backward_stream<
    T: Element,
    const VEC: bool,
    N: Normalization,
    S: RowSource<T, VEC>,
>(
    p: &BackwardParams,
    src: S,
    team: Team,
) {
    let mut reducer = unsafe { RowReducer::new(team) };
    let len = Access::<T, VEC>::LEN;
    let Team {
        tid,
        threads,
        first,
        stride,
        ..
    } = team;
    let d = p.d as usize;
    let accesses = d.div_ceil(len);
    let with_dbeta = N::CENTERED && p.dbeta_partials != 0;
    let atomic = p.sums.mode == GROUP_SUMS_ATOMIC;
    let rows = p.rows as usize;
    let mut group = first;
    while group < p.groups as usize {
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        // Too wide for registers: the group's partials accumulate in its own workspace rows,
        // which only this block touches (each thread re-reads exactly what it wrote).
        let offset = (group * d * 4) as u64;
        for row in first..end {
            let src_row = src.row(row);
            let dy_row = row_addr::<T>(p.dy, row, p.dy_stride);
            let (mean, rstd) = if p.rstd == 0 {
                unsafe {
                    row_stats_stream::<T, VEC, N, S>(
                        &mut reducer,
                        team,
                        &src,
                        row,
                        d,
                        p.inv_d,
                        p.eps,
                    )
                }
            } else {
                load_stats::<N>(p, row)
            };
            let mut sums = RowSums::default();
            let mut a = tid;
            while a < accesses {
                let x = src.hold(&unsafe { src.load(&src_row, a * len) });
                let dy = unsafe { Access::<T, VEC>::load(dy_row, a * len) };
                let g = unsafe { param::<T, VEC>(p.gamma, a * len, p.params_f32, p.gamma_offset) };
                for i in 0..len {
                    sums.add(T::get(&dy, i) * g[i], S::get(&x, i) - mean);
                }
                a += threads;
            }
            let dx_of = DxRow::new((mean, rstd), unsafe {
                let sums = sums.start::<N>(&mut reducer, rstd);
                RowSums::means::<N>(&mut reducer, sums, p.inv_d)
            });
            let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
            let has_extra = src.has_extra();
            let mut a = tid;
            while a < accesses {
                let x = src.hold(&unsafe { src.load(&src_row, a * len) });
                let extra = if has_extra {
                    unsafe { src.load_extra(&src_row, a * len, 0) }
                } else {
                    S::Extra::default()
                };
                let dy = unsafe { Access::<T, VEC>::load(dy_row, a * len) };
                let g = unsafe { param::<T, VEC>(p.gamma, a * len, p.params_f32, p.gamma_offset) };
                // Atomic sums add every row's contribution: there is no partial row to re-read.
                let (mut dgamma, mut dbeta) = if row == first || atomic {
                    ([0.0f32; 8], [0.0f32; 8])
                } else {
                    let dbeta = if with_dbeta {
                        unsafe { load_f32s::<VEC>(p.dbeta_partials + offset, a * len, len) }
                    } else {
                        [0.0; 8]
                    };
                    (
                        unsafe { load_f32s::<VEC>(p.partials + offset, a * len, len) },
                        dbeta,
                    )
                };
                let mut dx = [0.0f32; 8];
                for i in 0..len {
                    let dy_i = T::get(&dy, i);
                    let (v, x_hat) = dx_of.dx(S::get(&x, i), dy_i * g[i]);
                    dx[i] = if has_extra { src.dx(&extra, i, v) } else { v };
                    dgamma[i] = arch::fma(dy_i, x_hat, dgamma[i]);
                    dbeta[i] += dy_i;
                }
                unsafe { Access::<T, VEC>::store(dx_row, a * len, &T::pack(&dx, len)) };
                let (sums, at) = (&p.sums, (group, d));
                unsafe { store_group_partials::<VEC>(sums, p.partials, at, a * len, &dgamma, len) };
                if with_dbeta {
                    let dbeta = &dbeta;
                    unsafe {
                        store_group_partials::<VEC>(sums, p.dbeta_partials, at, a * len, dbeta, len)
                    };
                }
                a += threads;
            }
        }
        group += stride;
    }
}
