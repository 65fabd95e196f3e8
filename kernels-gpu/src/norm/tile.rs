//! The backward's register tile: a thread's accesses of a row held in registers, its γ (in
//! registers or shared memory), and the two passes over a row.

use super::Normalization;
use super::backward::{DxRow, RowSums, load_stats};
use super::params::BackwardParams;
use super::policy::{backward_prefetches, gamma_in_shared};
use super::rows::{RowSource, param, row_stats_regs};
use crate::arch;
use crate::column_sum::{GROUP_SUMS_LOCKED, store_group_partials};
use crate::element::{Access, Element, Pack, row_addr};
use crate::reduce::{PendingSums, ROW_REDUCER_SHARED_WORDS, RowReducer, Team};

/// This thread's γ in shared memory ([`gamma_in_shared`]): 8 words per access, as two 16-byte
/// words, each half laid out thread by thread so a warp's loads touch consecutive 16 bytes (no bank
/// conflicts). Only the thread that stored its words reads them back, so they need no barrier.
#[derive(Clone, Copy)]
pub(super) struct SharedGamma {
    first: usize,
    block: usize,
}

impl SharedGamma {
    /// After the reducer's words, 16-byte aligned.
    pub(super) const BASE: usize = ROW_REDUCER_SHARED_WORDS.next_multiple_of(4);

    #[inline(always)]
    pub(super) fn new() -> Self {
        SharedGamma {
            first: Self::BASE + arch::thread_idx() * 4,
            block: arch::block_dim(),
        }
    }

    #[inline(always)]
    pub(super) fn word(&self, k: usize, half: usize) -> usize {
        self.first + (2 * k + half) * self.block * 4
    }

    /// # Safety
    /// The launch provides [`backward_shared_bytes`].
    #[inline(always)]
    pub(super) unsafe fn store(&self, k: usize, g: &[f32; 8], len: usize) {
        let shared = arch::shared_f32();
        unsafe { shared.store4(self.word(k, 0), [g[0], g[1], g[2], g[3]]) };
        if len > 4 {
            unsafe { shared.store4(self.word(k, 1), [g[4], g[5], g[6], g[7]]) };
        }
    }

    /// # Safety
    /// As for [`Self::store`], which stored access `k` before.
    #[inline(always)]
    pub(super) unsafe fn load(&self, k: usize, len: usize) -> [f32; 8] {
        let shared = arch::shared_f32();
        let [a, b, c, d] = unsafe { shared.load4(self.word(k, 0)) };
        let [e, f, g, h] = if len > 4 {
            unsafe { shared.load4(self.word(k, 1)) }
        } else {
            [0.0; 4]
        };
        [a, b, c, d, e, f, g, h]
    }
}

/// One row of a backward register tile as loaded: x, dy, what is added into dx (dresidual, when
/// prefetched) and the saved statistics.
pub(super) type LoadedRow<R, E, const VPT: usize> = ([R; VPT], [Pack; VPT], [E; VPT], (f32, f32));

/// A row after pass 1: x as used, its statistics `(μ, rstd)`, and its sums on their way.
pub(super) type Pass1<H, const VPT: usize> = ([H; VPT], (f32, f32), PendingSums);

/// What the rows of a backward register tile share: this thread's accesses and its γ.
pub(super) struct BackwardTile<
    'a,
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    S,
> {
    p: &'a BackwardParams,
    src: S,
    team: Team,
    d: usize,
    /// γ in registers, unless [`gamma_in_shared`].
    gamma: [[f32; 8]; VPT],
    shared_gamma: SharedGamma,
    /// Loads of row r+1 are issued before row r's reduction and stores, so a block always has a
    /// row in flight: with only a couple of blocks per SM that is what hides memory latency.
    /// Without that (or where the source says so, [`RowSource::PREFETCH_EXTRA`]), what only the
    /// stores need (dresidual) is loaded one access at a time next to its store, to keep it out
    /// of the registers of the reductions.
    pub(super) prefetch: bool,
    element: core::marker::PhantomData<(T, N)>,
}

impl<T: Element, const VEC: bool, const VPT: usize, N: Normalization, S: RowSource<T, VEC>>
    BackwardTile<'_, T, VEC, VPT, N, S>
{
    pub(super) const LEN: usize = Access::<T, VEC>::LEN;

    /// # Safety
    /// As for [`backward`]; every thread of the block calls it.
    #[inline(always)]
    pub(super) unsafe fn new(
        p: &BackwardParams,
        src: S,
        team: Team,
    ) -> BackwardTile<'_, T, VEC, VPT, N, S> {
        let mut tile = BackwardTile {
            p,
            src,
            team,
            d: p.d as usize,
            gamma: [[0.0f32; 8]; VPT],
            shared_gamma: SharedGamma::new(),
            prefetch: backward_prefetches(S::WIDE, VPT),
            element: core::marker::PhantomData,
        };
        for k in 0..VPT {
            // Past d: γ = 0 (and dy = 0), so those accesses add nothing to the row sums.
            let mut g = [0.0f32; 8];
            if tile.elem(k) < tile.d {
                g = unsafe { param::<T, VEC>(p.gamma, tile.elem(k), p.params_f32, p.gamma_offset) };
            }
            if tile.gamma_in_shared() {
                unsafe { tile.shared_gamma.store(k, &g, Self::LEN) };
            } else {
                tile.gamma[k] = g;
            }
        }
        tile
    }

    /// [`gamma_in_shared`] for this tile (a constant: the team's lanes are the instance's).
    #[inline(always)]
    fn gamma_in_shared(&self) -> bool {
        gamma_in_shared(N::CENTERED, VPT, self.team.lanes)
    }

    /// Whether [`Self::load`] loads the row's extra (dresidual) with it.
    #[inline(always)]
    fn prefetch_extra(&self) -> bool {
        self.prefetch && S::PREFETCH_EXTRA
    }

    /// LayerNorm with a dβ to compute.
    #[inline(always)]
    pub(super) fn with_dbeta(&self) -> bool {
        N::CENTERED && self.p.dbeta_partials != 0
    }

    /// The first element of this thread's access `k`.
    #[inline(always)]
    pub(super) fn elem(&self, k: usize) -> usize {
        (self.team.tid + k * self.team.threads) * Self::LEN
    }

    #[inline(always)]
    pub(super) fn gamma(&self, k: usize) -> [f32; 8] {
        if self.gamma_in_shared() {
            unsafe { self.shared_gamma.load(k, Self::LEN) }
        } else {
            self.gamma[k]
        }
    }

    /// Issues the loads of a row.
    ///
    /// # Safety
    /// `row` is below `rows`.
    #[inline(always)]
    pub(super) unsafe fn load(&self, row: usize) -> LoadedRow<S::Raw, S::Extra, VPT> {
        let p = self.p;
        let src_row = self.src.row(row);
        let dy_row = row_addr::<T>(p.dy, row, p.dy_stride);
        let mut x = [S::Raw::default(); VPT];
        let mut dy: [Pack; VPT] = [[0; 4]; VPT];
        for k in 0..VPT {
            if self.elem(k) < self.d {
                x[k] = unsafe { self.src.load(&src_row, self.elem(k)) };
                dy[k] = unsafe { Access::<T, VEC>::load(dy_row, self.elem(k)) };
            }
        }
        let mut extra = [S::Extra::default(); VPT];
        for k in 0..VPT {
            if self.prefetch_extra() && self.elem(k) < self.d {
                extra[k] = unsafe { self.src.load_extra(&src_row, self.elem(k), k) };
            }
        }
        (x, dy, extra, load_stats::<N>(p, row))
    }

    /// A row with nothing loaded (past the last).
    #[inline(always)]
    pub(super) fn empty() -> LoadedRow<S::Raw, S::Extra, VPT> {
        (
            [S::Raw::default(); VPT],
            [[0; 4]; VPT],
            [S::Extra::default(); VPT],
            (0.0, 0.0),
        )
    }

    /// Pass 1 of row `row`: x as used, its statistics, and the sums of `dŷ` and `dŷ·x̂` started.
    ///
    /// # Safety
    /// Every thread of the team calls it (it reduces).
    #[inline(always)]
    pub(super) unsafe fn pass1(
        &self,
        reducer: &mut RowReducer,
        row: usize,
        loaded: &LoadedRow<S::Raw, S::Extra, VPT>,
    ) -> Pass1<S::Held, VPT> {
        let p = self.p;
        let (raw, dy, _, saved) = loaded;
        if !self.prefetch_extra() {
            // What pass 2 adds into dx, fetched while this row is reduced (where the source
            // stages it).
            let src_row = self.src.row(row);
            for k in 0..VPT {
                if self.elem(k) < self.d {
                    unsafe { self.src.start_extra(&src_row, self.elem(k), k) };
                }
            }
        }
        let x = self.hold(raw);
        // Nothing saved: recompute the statistics from the row already in registers.
        let (mean, rstd) = if p.rstd == 0 {
            unsafe {
                row_stats_regs::<T, VEC, VPT, N, S>(
                    reducer, self.team, &x, self.d, p.inv_d, p.eps, false,
                )
            }
        } else {
            *saved
        };
        let sums = unsafe { self.row_sums(&x, dy, mean).start::<N>(reducer, rstd) };
        (x, (mean, rstd), sums)
    }

    /// This thread's part of a row's pass-1 sums, about the row's mean.
    #[inline(always)]
    pub(super) fn row_sums(&self, x: &[S::Held; VPT], dy: &[Pack; VPT], mean: f32) -> RowSums {
        let mut sums = RowSums::default();
        for k in 0..VPT {
            let gamma = self.gamma(k);
            for i in 0..Self::LEN {
                // Accesses past d hold dy = 0, so they add nothing to either sum.
                sums.add(T::get(&dy[k], i) * gamma[i], S::get(&x[k], i) - mean);
            }
        }
        sums
    }

    /// x of a loaded row as the passes use it.
    #[inline(always)]
    pub(super) fn hold(&self, raw: &[S::Raw; VPT]) -> [S::Held; VPT] {
        let mut x = [S::Held::default(); VPT];
        for k in 0..VPT {
            x[k] = self.src.hold(&raw[k]);
        }
        x
    }

    /// Pass 2 of a row: finishes its sums, writes dx and adds the row into `dgamma` and `dbeta`.
    ///
    /// # Safety
    /// Every thread of the team calls it (it reduces); `pass1` is this row's, and its sums are
    /// the oldest unfinished.
    #[inline(always)]
    pub(super) unsafe fn pass2(
        &self,
        reducer: &mut RowReducer,
        row: usize,
        loaded: &LoadedRow<S::Raw, S::Extra, VPT>,
        pass1: Pass1<S::Held, VPT>,
        dgamma: &mut [[f32; 8]; VPT],
        dbeta: &mut [[f32; 8]; VPT],
    ) {
        let p = self.p;
        let (x, stats, sums) = pass1;
        let means = unsafe { RowSums::means::<N>(reducer, sums, p.inv_d) };
        unsafe { self.pass2_of(row, loaded, &x, DxRow::new(stats, means), dgamma, dbeta) }
    }

    /// The end of [`Self::pass2`], from the row's reduced means (`dx_of`).
    ///
    /// # Safety
    /// As for [`Self::pass2`], less the reduction.
    #[inline(always)]
    pub(super) unsafe fn pass2_of(
        &self,
        row: usize,
        loaded: &LoadedRow<S::Raw, S::Extra, VPT>,
        x: &[S::Held; VPT],
        dx_of: DxRow,
        dgamma: &mut [[f32; 8]; VPT],
        dbeta: &mut [[f32; 8]; VPT],
    ) {
        // Two copies of the loop where the source may add something into dx, so a call without
        // it runs none of the adds.
        if self.src.has_extra() {
            unsafe { self.write_dx::<true>(row, loaded, x, dx_of, dgamma, dbeta) }
        } else {
            unsafe { self.write_dx::<false>(row, loaded, x, dx_of, dgamma, dbeta) }
        }
    }

    /// The end of [`Self::pass2`]: dx of each access (plus the source's extra if `EXTRA`), and the
    /// row added into `dgamma` and `dbeta`.
    ///
    /// # Safety
    /// As for [`Self::pass2`].
    #[inline(always)]
    unsafe fn write_dx<const EXTRA: bool>(
        &self,
        row: usize,
        loaded: &LoadedRow<S::Raw, S::Extra, VPT>,
        x: &[S::Held; VPT],
        dx_of: DxRow,
        dgamma: &mut [[f32; 8]; VPT],
        dbeta: &mut [[f32; 8]; VPT],
    ) {
        let p = self.p;
        let (_, dy, extra, _) = loaded;
        let with_dbeta = self.with_dbeta();
        let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
        let src_row = self.src.row(row);
        for k in 0..VPT {
            if self.elem(k) < self.d {
                let extra = if !EXTRA {
                    S::Extra::default()
                } else if self.prefetch_extra() {
                    extra[k]
                } else {
                    unsafe { self.src.load_extra(&src_row, self.elem(k), k) }
                };
                let gamma = self.gamma(k);
                let mut dx = [0.0f32; 8];
                for i in 0..Self::LEN {
                    let dy_i = T::get(&dy[k], i);
                    let (v, x_hat) = dx_of.dx(S::get(&x[k], i), dy_i * gamma[i]);
                    dx[i] = if EXTRA { self.src.dx(&extra, i, v) } else { v };
                    dgamma[k][i] = arch::fma(dy_i, x_hat, dgamma[k][i]);
                    if with_dbeta {
                        dbeta[k][i] += dy_i;
                    }
                }
                let dx = T::pack(&dx, Self::LEN);
                unsafe { Access::<T, VEC>::store(dx_row, self.elem(k), &dx) };
            }
        }
    }

    /// Writes the group's partial rows ([`Self::store_partials`]), or for the locked-buffers
    /// baseline (block tiles only: the launch plan refuses it to clusters and segment teams) adds
    /// them into buffer `group % buffers` under its lock.
    ///
    /// # Safety
    /// As for [`Self::store_partials`]; every thread of the block calls it (the lock is the
    /// block's).
    #[inline(always)]
    pub(super) unsafe fn store_group(
        &self,
        group: usize,
        dgamma: &[[f32; 8]; VPT],
        dbeta: &[[f32; 8]; VPT],
    ) {
        let sums = &self.p.sums;
        if sums.mode == GROUP_SUMS_LOCKED {
            let slot = group % sums.buffers as usize;
            let lock = sums.sync + (slot * 4) as u64;
            unsafe {
                arch::block_lock(lock);
                self.store_partials(slot, dgamma, dbeta);
                arch::block_unlock(lock);
            }
        } else {
            unsafe { self.store_partials(group, dgamma, dbeta) };
        }
    }

    /// Writes a group's dγ (and dβ) partials: row `group` of each workspace (or adds them into
    /// the f32 gradients, with atomic sums).
    ///
    /// # Safety
    /// `group` is below the launch's `groups`.
    #[inline(always)]
    pub(super) unsafe fn store_partials(
        &self,
        group: usize,
        dgamma: &[[f32; 8]; VPT],
        dbeta: &[[f32; 8]; VPT],
    ) {
        let p = self.p;
        let at = (group, self.d);
        for k in 0..VPT {
            if self.elem(k) < self.d {
                let elem = self.elem(k);
                let (sums, len) = (&p.sums, Self::LEN);
                unsafe { store_group_partials::<VEC>(sums, p.partials, at, elem, &dgamma[k], len) };
                if self.with_dbeta() {
                    let dbeta = &dbeta[k];
                    unsafe {
                        store_group_partials::<VEC>(sums, p.dbeta_partials, at, elem, dbeta, len)
                    };
                }
            }
        }
    }
}
