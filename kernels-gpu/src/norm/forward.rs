//! The forward: y and the row statistics, from a register tile or a streamed row.

use super::Normalization;
use super::params::ForwardParams;
use super::policy::{
    STREAM, STREAM_DEPTH, forward_params_in_shared, forward_prefetches, forward_segments_one_shot,
    forward_words,
};
use super::rows::{
    AddResidual, Plain, RowSource, param, row_stats_regs, row_stats_stream, stream_accesses,
};
use crate::arch;
use crate::element::{Access, Element, Pack, row_addr};
use crate::reduce::{RowReducer, Team};

/// Writes the row's statistics (thread 0 of the team only).
#[inline(always)]
pub(super) fn save_stats<N: Normalization>(
    p: &ForwardParams,
    team: Team,
    row: usize,
    mean: f32,
    rstd: f32,
) {
    if team.tid == 0 {
        if p.rstd != 0 {
            unsafe { (p.rstd as *mut f32).add(row).write(rstd) };
        }
        if N::CENTERED && p.mean != 0 {
            unsafe { (p.mean as *mut f32).add(row).write(mean) };
        }
    }
}

/// `y` of one element: `(x−μ)·rstd·γ (+ β)`.
#[inline(always)]
pub(super) fn normalize<N: Normalization>(
    x: f32,
    mean: f32,
    rstd: f32,
    gamma: f32,
    beta: f32,
) -> f32 {
    if N::CENTERED {
        arch::fma((x - mean) * rstd, gamma, beta)
    } else {
        x * rstd * gamma
    }
}

/// The forward; launch any grid (teams walk rows by grid stride): one block per row, or with
/// `LANES` a segment team of that many lanes per row (`super::segments`).
///
/// # Safety
/// The params describe valid, non-overlapping buffers laid out as the kernel's [`super::NormKey`]
/// requires; the block is a multiple of 32 threads with enough of them (or the team enough lanes)
/// to cover the row in `VPT`.
#[inline(always)]
pub unsafe fn forward<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    const RESIDUAL: bool,
    const CLUSTER: bool,
    const LANES: usize,
    // The backward's ring block tiles (`NormKey::ring`); no forward has one.
    const RING: bool,
>(
    p: &ForwardParams,
) {
    let team = Team::new(CLUSTER, LANES);
    let plain = Plain::rows(p.x, p.x_stride);
    unsafe {
        match (VPT == STREAM, RESIDUAL) {
            (true, false) => forward_stream::<T, VEC, N, _>(p, plain, team),
            (true, true) => forward_stream::<T, VEC, N, _>(p, AddResidual::new(p), team),
            (false, false) => forward_regs::<T, VEC, VPT, N, _>(p, plain, team),
            (false, true) => forward_regs::<T, VEC, VPT, N, _>(p, AddResidual::new(p), team),
        }
    }
    team.finish();
}

#[inline(always)]
pub(super) unsafe fn forward_regs<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    S: RowSource<T, VEC>,
>(
    p: &ForwardParams,
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
    let elem = |k: usize| (tid + k * threads) * len;
    // γ and β are re-read for every row (from L1: every block of the SM reads the same few KB)
    // rather than held: as f32 they would take 16 registers per pack each, a resident block.
    // Where `forward_params_in_shared`, from this thread's own shared slots instead, written once
    // here (no barrier: no other thread reads them).
    let in_shared = forward_params_in_shared(N::CENTERED, S::WIDE, VEC, VPT, team.lanes);
    let has_beta = N::CENTERED && p.beta != 0;
    let slots = ParamSlots::<VPT>::new(
        forward_words(
            N::CENTERED,
            S::WIDE,
            VEC,
            VPT,
            team.lanes,
            arch::block_dim(),
        )
        .0,
        len,
    );
    if in_shared {
        for k in 0..VPT {
            if elem(k) < d {
                let at = elem(k);
                unsafe {
                    let gamma = param::<T, VEC>(p.gamma, at, p.params_f32, p.gamma_offset);
                    slots.keep(0, k, &gamma);
                    if has_beta {
                        slots.keep(1, k, &param::<T, VEC>(p.beta, at, p.params_f32, 0.0));
                    }
                }
            }
        }
    }
    // As in the backward, the next row's loads can be issued before this row's reduction and stores.
    let load_row = |row: usize| {
        let src_row = src.row(row);
        let mut x = [S::Raw::default(); VPT];
        for (k, xk) in x.iter_mut().enumerate() {
            if elem(k) < d {
                *xk = unsafe { src.load(&src_row, elem(k)) };
            }
        }
        x
    };
    let rows = p.rows as usize;
    let mut row = first;
    // A segment team's accesses are few: it has the registers for the next row, but on the
    // one-shot grid it has one row and nothing to prefetch.
    let one_shot = team.lanes != 0 && forward_segments_one_shot(N::CENTERED, S::WIDE, VPT);
    let prefetch = !one_shot
        && (forward_prefetches(N::CENTERED, S::WIDE, team.cluster, T::BYTES, VPT)
            || (team.lanes != 0 && !S::WIDE));
    let mut next = if prefetch && row < rows {
        load_row(row)
    } else {
        [S::Raw::default(); VPT]
    };
    while row < rows {
        let raw = if prefetch { next } else { load_row(row) };
        if prefetch && row + stride < rows {
            next = load_row(row + stride);
        }
        let mut x = [S::Held::default(); VPT];
        for k in 0..VPT {
            x[k] = src.hold(&raw[k]);
        }
        let (mean, rstd) = unsafe {
            // Segment teams shorten their sums' chain (on the one-shot grid it is a team's life).
            let lane_sums = team.lanes != 0;
            row_stats_regs::<T, VEC, VPT, N, S>(
                &mut reducer,
                team,
                &x,
                d,
                p.inv_d,
                p.eps,
                lane_sums,
            )
        };
        save_stats::<N>(p, team, row, mean, rstd);
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        let src_row = src.row(row);
        for k in 0..VPT {
            if elem(k) < d {
                unsafe { src.emit(&src_row, elem(k), &x[k]) };
                let (gamma, beta) = if in_shared {
                    let beta = if has_beta {
                        unsafe { slots.kept(1, k) }
                    } else {
                        [0.0; 8]
                    };
                    (unsafe { slots.kept(0, k) }, beta)
                } else {
                    // A block tile's γ/β offsets through `arch::opaque`: else LLVM hoists their
                    // addresses (every access, both storage forms, 64 bits each) out of the row
                    // loop and holds them across the reductions.
                    let at = if team.lanes == 0 {
                        arch::opaque(elem(k))
                    } else {
                        elem(k)
                    };
                    let gamma =
                        unsafe { param::<T, VEC>(p.gamma, at, p.params_f32, p.gamma_offset) };
                    let beta = if has_beta {
                        unsafe { param::<T, VEC>(p.beta, at, p.params_f32, 0.0) }
                    } else {
                        [0.0; 8]
                    };
                    (gamma, beta)
                };
                let mut y = [0.0f32; 8];
                for i in 0..len {
                    y[i] = normalize::<N>(S::get(&x[k], i), mean, rstd, gamma[i], beta[i]);
                }
                let y = T::pack(&y, len);
                // RMSNorm's segment teams store y evict-first (measured faster at d ≤ 1024;
                // LayerNorm's slower, block tiles too).
                if team.lanes != 0 && !N::CENTERED {
                    unsafe { Access::<T, VEC>::store_streaming(y_row, elem(k), &y) };
                } else {
                    unsafe { Access::<T, VEC>::store(y_row, elem(k), &y) };
                }
            }
        }
        row += stride;
    }
}

#[inline(always)]
pub(super) unsafe fn forward_stream<
    T: Element,
    const VEC: bool,
    N: Normalization,
    S: RowSource<T, VEC>,
>(
    p: &ForwardParams,
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
    let mut row = first;
    while row < p.rows as usize {
        // Every pass re-reads the inputs (from L2) rather than the residual sum it wrote: the
        // sum is only written once, in the last pass.
        let (mean, rstd) = unsafe {
            row_stats_stream::<T, VEC, N, S>(&mut reducer, team, &src, row, d, p.inv_d, p.eps)
        };
        save_stats::<N>(p, team, row, mean, rstd);
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        let src_row = src.row(row);
        let load = |a: usize| unsafe { src.load(&src_row, a * len) };
        let write = |a: usize, raw: &S::Raw| {
            let x = src.hold(raw);
            unsafe { src.emit(&src_row, a * len, &x) };
            let g = unsafe { param::<T, VEC>(p.gamma, a * len, p.params_f32, p.gamma_offset) };
            let b = if N::CENTERED && p.beta != 0 {
                unsafe { param::<T, VEC>(p.beta, a * len, p.params_f32, 0.0) }
            } else {
                [0.0; 8]
            };
            let mut y: Pack = [0; 4];
            for i in 0..len {
                T::set(
                    &mut y,
                    i,
                    normalize::<N>(S::get(&x, i), mean, rstd, g[i], b[i]),
                );
            }
            // y evict-first: the rows in flight stay in L2 for this pass to read.
            unsafe { Access::<T, VEC>::store_streaming(y_row, a * len, &y) };
        };
        // SAFETY (the loads): every access below `accesses` lies inside the row.
        if S::WIDE {
            stream_accesses::<_, 1>(tid, threads, accesses, load, write);
        } else {
            stream_accesses::<_, STREAM_DEPTH>(tid, threads, accesses, load, write);
        }
        row += stride;
    }
}

/// A thread's shared-memory slots for γ and β ([`forward_params_in_shared`]): per access, 8 f32
/// in two 16-byte halves, each half of a block's threads consecutive (no bank conflicts); γ's
/// slots (`which` 0), then β's (1).
#[derive(Clone, Copy)]
struct ParamSlots<const VPT: usize> {
    base: usize,
    halves: usize,
}

impl<const VPT: usize> ParamSlots<VPT> {
    #[inline(always)]
    fn new(base: usize, len: usize) -> Self {
        ParamSlots {
            base,
            halves: len.div_ceil(4),
        }
    }

    #[inline(always)]
    fn word(&self, which: usize, k: usize, half: usize) -> usize {
        let block = arch::block_dim();
        self.base + 4 * (((which * VPT + k) * 2 + half) * block + arch::thread_idx())
    }

    /// Stores this thread's `v` of access `k`.
    ///
    /// # Safety
    /// The launch provides the slots (`forward_words`).
    #[inline(always)]
    unsafe fn keep(&self, which: usize, k: usize, v: &[f32; 8]) {
        for half in 0..self.halves {
            let quad = [
                v[4 * half],
                v[4 * half + 1],
                v[4 * half + 2],
                v[4 * half + 3],
            ];
            unsafe { arch::shared_f32().store4(self.word(which, k, half), quad) };
        }
    }

    /// What [`Self::keep`] stored.
    ///
    /// # Safety
    /// As for [`Self::keep`].
    #[inline(always)]
    unsafe fn kept(&self, which: usize, k: usize) -> [f32; 8] {
        let mut v = [0.0f32; 8];
        for half in 0..self.halves {
            let quad = unsafe { arch::shared_f32().load4(self.word(which, k, half)) };
            v[4 * half..4 * half + 4].copy_from_slice(&quad);
        }
        v
    }
}
