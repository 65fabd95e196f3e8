//! RMSNorm and LayerNorm, forward and backward: one set of bodies, `CENTERED` selects LayerNorm.
//!
//! Forward, per row: LayerNorm `μ = mean(x)`, `rstd = 1/sqrt(mean((x−μ)²) + eps)`,
//! `y = (x−μ)·rstd·γ + β` (β optional), saving fp32 μ and rstd; RMSNorm the same with μ = 0 and
//! no β, saving rstd. The row is on chip, so the variance is the exact two-pass one.
//! `γ + offset` (offset in fp32, Gemma's `1 + γ`) stands for γ everywhere; dγ does not see it.
//! Backward, per row: `x̂ = (x−μ)·rstd` (recomputed from x and the saved statistics, never stored;
//! with nothing saved the statistics themselves are recomputed from the row, one more reduction),
//! `dŷ = dy·γ`, `dx = rstd·(dŷ − mean(dŷ) − x̂·mean(dŷ·x̂))` (RMSNorm drops `mean(dŷ)`).
//! dγ = Σ_rows dy·x̂ and dβ = Σ_rows dy: each group of `rows_per_group` consecutive rows accumulates
//! its partials in fp32 registers and writes one row of each `[groups, d]` fp32 workspace;
//! [`crate::reduce::column_sum`] then adds the groups in a fixed order. The group count is a
//! function of the shape only, so dγ and dβ are the same bits on any grid and any GPU.
//!
//! One block works on one row at a time. Register tiles (`VPT` = 1, 2, 4 accesses per thread)
//! load the whole row once and keep it on chip: 16-byte packs give every thread `VPT·16` bytes in
//! flight per operand. Rows too wide for registers use the streaming instance (`VPT` = 0), which
//! reads the row more than once — the later reads mostly hit L2.

use crate::arch;
use crate::element::{Access, Element, Pack, load_f32s, row_addr, store_f32s};
use crate::reduce::BlockReducer;
use crate::variant::export_family;

/// Launch parameters of the forward. Row strides are in elements; a statistic pointer of 0 skips
/// saving it, a `beta` of 0 means no bias (LayerNorm only; RMSNorm ignores `beta` and `mean`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardParams {
    pub x: u64,
    pub y: u64,
    pub gamma: u64,
    pub beta: u64,
    pub mean: u64,
    pub rstd: u64,
    pub x_stride: u64,
    pub y_stride: u64,
    pub rows: u32,
    pub d: u32,
    pub eps: f32,
    /// `1/d`, rounded once on the host.
    pub inv_d: f32,
    /// Added to γ in fp32 (`y = x̂·(γ + offset)`, Gemma's `1 + γ`); 0 for plain γ.
    pub gamma_offset: f32,
    /// 1: γ and β are stored as f32 (whatever the activations' dtype); 0: in the activations' dtype.
    pub params_f32: u32,
}

/// Launch parameters of the backward (dx and the dγ, dβ partials).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BackwardParams {
    pub x: u64,
    pub dy: u64,
    pub gamma: u64,
    /// Saved μ per row (LayerNorm only).
    pub mean: u64,
    /// Saved rstd per row, or 0: recompute μ and rstd from x (nothing saved by the forward).
    pub rstd: u64,
    pub dx: u64,
    /// `[groups, d]` fp32 dγ partials.
    pub partials: u64,
    /// `[groups, d]` fp32 dβ partials, or 0 for none (LayerNorm only).
    pub dbeta_partials: u64,
    pub x_stride: u64,
    pub dy_stride: u64,
    pub dx_stride: u64,
    pub rows: u32,
    pub d: u32,
    pub rows_per_group: u32,
    pub groups: u32,
    pub inv_d: f32,
    /// As in the forward: dŷ = dy·(γ + offset); dγ does not see it.
    pub gamma_offset: f32,
    /// For recomputing the statistics when `rstd == 0`.
    pub eps: f32,
    /// 1: γ is stored as f32; 0: in the activations' dtype.
    pub params_f32: u32,
}

/// Writes the row's statistics (thread 0 only).
#[inline(always)]
fn save_stats<const CENTERED: bool>(p: &ForwardParams, row: usize, mean: f32, rstd: f32) {
    if arch::thread_idx() == 0 {
        if p.rstd != 0 {
            unsafe { (p.rstd as *mut f32).add(row).write(rstd) };
        }
        if CENTERED && p.mean != 0 {
            unsafe { (p.mean as *mut f32).add(row).write(mean) };
        }
    }
}

/// `(μ, rstd)` of a row held in registers (μ = 0 for RMSNorm): exact two-pass variance, since the
/// row is on chip. Accesses past `d` hold zeros and are kept out of the sums.
///
/// # Safety
/// Every thread of the block calls it (block reductions).
#[inline(always)]
unsafe fn row_stats_regs<T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool>(
    reducer: &mut BlockReducer,
    x: &[Pack; VPT],
    d: usize,
    inv_d: f32,
    eps: f32,
) -> (f32, f32) {
    let len = Access::<T, VEC>::LEN;
    let (tid, threads) = (arch::thread_idx(), arch::block_dim());
    let mean = if CENTERED {
        let mut sum = 0.0f32;
        for xk in x {
            for i in 0..len {
                sum += T::get(xk, i);
            }
        }
        let total = unsafe { reducer.sum(sum) };
        total * inv_d
    } else {
        0.0
    };
    let mut sum_sq = 0.0f32;
    for k in 0..VPT {
        if (tid + k * threads) * len < d {
            for i in 0..len {
                let c = T::get(&x[k], i) - mean;
                sum_sq += c * c;
            }
        }
    }
    (
        mean,
        arch::rsqrt(unsafe { reducer.sum(sum_sq) } * inv_d + eps),
    )
}

/// `(μ, rstd)` of a row streamed from memory (μ = 0 for RMSNorm), one pass per statistic.
///
/// # Safety
/// As for [`stream_sum`].
#[inline(always)]
unsafe fn row_stats_stream<T: Element, const VEC: bool, const CENTERED: bool>(
    reducer: &mut BlockReducer,
    row: u64,
    d: usize,
    inv_d: f32,
    eps: f32,
) -> (f32, f32) {
    let mean = if CENTERED {
        let sum = unsafe { stream_sum::<T, VEC>(reducer, row, d, |v| v) };
        sum * inv_d
    } else {
        0.0
    };
    let sum_sq = unsafe { stream_sum::<T, VEC>(reducer, row, d, |v| (v - mean) * (v - mean)) };
    (mean, arch::rsqrt(sum_sq * inv_d + eps))
}

/// One access worth of a per-feature parameter (γ or β) starting at element `elem`, in f32:
/// stored as f32 (`params_f32 != 0`, mixed precision) or in the activations' dtype `T`; `offset`
/// is added in f32 (γ's offset; 0 for β). Elements past the access's length are 0.
///
/// # Safety
/// The access lies inside the parameter vector, aligned as `VEC` requires for its storage.
#[inline(always)]
unsafe fn param<T: Element, const VEC: bool>(
    base: u64,
    elem: usize,
    params_f32: u32,
    offset: f32,
) -> [f32; 8] {
    let len = Access::<T, VEC>::LEN;
    let mut v = if params_f32 != 0 {
        unsafe { load_f32s::<VEC>(base, elem, len) }
    } else {
        let pack = unsafe { Access::<T, VEC>::load(base, elem) };
        let mut v = [0.0f32; 8];
        for i in 0..len {
            v[i] = T::get(&pack, i);
        }
        v
    };
    for x in v.iter_mut().take(len) {
        *x += offset;
    }
    v
}

/// `y` of one element: `(x−μ)·rstd·γ (+ β)`.
#[inline(always)]
fn normalize<const CENTERED: bool>(x: f32, mean: f32, rstd: f32, gamma: f32, beta: f32) -> f32 {
    if CENTERED {
        (x - mean) * rstd * gamma + beta
    } else {
        x * rstd * gamma
    }
}

/// The forward; launch one block per row, any grid (blocks walk rows by grid stride).
///
/// # Safety
/// The params describe valid, non-overlapping buffers laid out as the [`crate::variant::Variant`]
/// requires; the block is a multiple of 32 threads with enough of them to cover the row in `VPT`.
#[inline(always)]
pub unsafe fn forward<T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool>(
    p: &ForwardParams,
) {
    unsafe {
        if VPT == 0 {
            forward_stream::<T, VEC, CENTERED>(p)
        } else {
            forward_regs::<T, VEC, VPT, CENTERED>(p)
        }
    }
}

#[inline(always)]
unsafe fn forward_regs<T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool>(
    p: &ForwardParams,
) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let elem = |k: usize| (tid + k * threads) * len;
    // γ and β are the same for every row: load them once per block.
    let mut gamma = [[0.0f32; 8]; VPT];
    let mut beta = [[0.0f32; 8]; VPT];
    for k in 0..VPT {
        if elem(k) < d {
            gamma[k] = unsafe { param::<T, VEC>(p.gamma, elem(k), p.params_f32, p.gamma_offset) };
            if CENTERED && p.beta != 0 {
                beta[k] = unsafe { param::<T, VEC>(p.beta, elem(k), p.params_f32, 0.0) };
            }
        }
    }
    // As in the backward, the next row's loads can be issued before this row's reduction and stores.
    let load_row = |row: usize| {
        let x_row = row_addr::<T>(p.x, row, p.x_stride);
        let mut x: [Pack; VPT] = [[0; 4]; VPT];
        for (k, xk) in x.iter_mut().enumerate() {
            if elem(k) < d {
                *xk = unsafe { Access::<T, VEC>::load(x_row, elem(k)) };
            }
        }
        x
    };
    let rows = p.rows as usize;
    let mut row = arch::block_idx();
    // Only the widest tile prefetches: for narrower ones the extra registers cost a resident block
    // per SM, which hid more latency than the prefetch (H200, 16384×4096 bf16: 82.6 % of copy
    // without, 78–79 % with; 4096×16384 with the 4-pack tile: 64.5 % without, 84.5 % with).
    let prefetch = VPT >= 4;
    let mut next = if prefetch && row < rows {
        load_row(row)
    } else {
        [[0; 4]; VPT]
    };
    while row < rows {
        let x = if prefetch { next } else { load_row(row) };
        if prefetch && row + arch::grid_dim() < rows {
            next = load_row(row + arch::grid_dim());
        }
        let (mean, rstd) =
            unsafe { row_stats_regs::<T, VEC, VPT, CENTERED>(&mut reducer, &x, d, p.inv_d, p.eps) };
        save_stats::<CENTERED>(p, row, mean, rstd);
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        for k in 0..VPT {
            if elem(k) < d {
                let mut y: Pack = [0; 4];
                for i in 0..len {
                    let v = normalize::<CENTERED>(
                        T::get(&x[k], i),
                        mean,
                        rstd,
                        gamma[k][i],
                        beta[k][i],
                    );
                    T::set(&mut y, i, v);
                }
                unsafe { Access::<T, VEC>::store(y_row, elem(k), &y) };
            }
        }
        row += arch::grid_dim();
    }
}

#[inline(always)]
unsafe fn forward_stream<T: Element, const VEC: bool, const CENTERED: bool>(p: &ForwardParams) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let accesses = d.div_ceil(len);
    let mut row = arch::block_idx();
    while row < p.rows as usize {
        let x_row = row_addr::<T>(p.x, row, p.x_stride);
        let (mean, rstd) =
            unsafe { row_stats_stream::<T, VEC, CENTERED>(&mut reducer, x_row, d, p.inv_d, p.eps) };
        save_stats::<CENTERED>(p, row, mean, rstd);
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        let mut a = tid;
        while a < accesses {
            let x = unsafe { Access::<T, VEC>::load(x_row, a * len) };
            let g = unsafe { param::<T, VEC>(p.gamma, a * len, p.params_f32, p.gamma_offset) };
            let b = if CENTERED && p.beta != 0 {
                unsafe { param::<T, VEC>(p.beta, a * len, p.params_f32, 0.0) }
            } else {
                [0.0; 8]
            };
            let mut y: Pack = [0; 4];
            for i in 0..len {
                T::set(
                    &mut y,
                    i,
                    normalize::<CENTERED>(T::get(&x, i), mean, rstd, g[i], b[i]),
                );
            }
            unsafe { Access::<T, VEC>::store(y_row, a * len, &y) };
            a += threads;
        }
        row += arch::grid_dim();
    }
}

/// `Σ f(x)` over one row of `d` elements, read from memory (L2, after the first pass) by the
/// whole block; every thread gets the sum.
///
/// # Safety
/// The row is readable as the access requires; every thread of the block calls it.
#[inline(always)]
unsafe fn stream_sum<T: Element, const VEC: bool>(
    reducer: &mut BlockReducer,
    row: u64,
    d: usize,
    f: impl Fn(f32) -> f32,
) -> f32 {
    let len = Access::<T, VEC>::LEN;
    let mut sum = 0.0f32;
    let mut a = arch::thread_idx();
    while a < d.div_ceil(len) {
        let x = unsafe { Access::<T, VEC>::load(row, a * len) };
        for i in 0..len {
            sum += f(T::get(&x, i));
        }
        a += arch::block_dim();
    }
    unsafe { reducer.sum(sum) }
}

/// The backward: dx, and one dγ (and dβ) partial row per group; launch any grid (blocks walk
/// groups by grid stride), then [`crate::reduce::column_sum`] over the partials.
///
/// # Safety
/// As for [`forward`]; each partials buffer holds `groups · d` f32, 16-byte aligned.
#[inline(always)]
pub unsafe fn backward<T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool>(
    p: &BackwardParams,
) {
    unsafe {
        if VPT == 0 {
            backward_stream::<T, VEC, CENTERED>(p)
        } else {
            backward_regs::<T, VEC, VPT, CENTERED>(p)
        }
    }
}

/// `(mean(dŷ), mean(dŷ·x̂))` of a row from its block-wide sums (RMSNorm needs only the second).
#[inline(always)]
unsafe fn row_means<const CENTERED: bool>(
    reducer: &mut BlockReducer,
    sum_dy_hat: f32,
    dot: f32,
    inv_d: f32,
) -> (f32, f32) {
    if CENTERED {
        let [a, b] = unsafe { reducer.sums([sum_dy_hat, dot]) };
        (a * inv_d, b * inv_d)
    } else {
        (0.0, unsafe { reducer.sum(dot) } * inv_d)
    }
}

/// The saved statistics of a row: `(μ, rstd)` (μ = 0 for RMSNorm); zeros when they are to be
/// recomputed (`rstd == 0`).
#[inline(always)]
fn load_stats<const CENTERED: bool>(p: &BackwardParams, row: usize) -> (f32, f32) {
    if p.rstd == 0 {
        return (0.0, 0.0);
    }
    let mean = if CENTERED {
        unsafe { (p.mean as *const f32).add(row).read() }
    } else {
        0.0
    };
    (mean, unsafe { (p.rstd as *const f32).add(row).read() })
}

#[inline(always)]
unsafe fn backward_regs<T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool>(
    p: &BackwardParams,
) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let elem = |k: usize| (tid + k * threads) * len;
    let with_dbeta = CENTERED && p.dbeta_partials != 0;
    let mut gamma = [[0.0f32; 8]; VPT];
    for (k, g) in gamma.iter_mut().enumerate() {
        if elem(k) < d {
            *g = unsafe { param::<T, VEC>(p.gamma, elem(k), p.params_f32, p.gamma_offset) };
        }
    }
    let rows = p.rows as usize;
    let mut group = arch::block_idx();
    while group < p.groups as usize {
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        let mut dgamma = [[0.0f32; 8]; VPT];
        let mut dbeta = [[0.0f32; 8]; VPT];
        // Loads of row r+1 are issued before row r's reduction and stores, so a block always has
        // a row in flight: with only a couple of blocks per SM that is what hides memory latency.
        let load_row = |row: usize| {
            let x_row = row_addr::<T>(p.x, row, p.x_stride);
            let dy_row = row_addr::<T>(p.dy, row, p.dy_stride);
            let mut x: [Pack; VPT] = [[0; 4]; VPT];
            let mut dy: [Pack; VPT] = [[0; 4]; VPT];
            for k in 0..VPT {
                if elem(k) < d {
                    x[k] = unsafe { Access::<T, VEC>::load(x_row, elem(k)) };
                    dy[k] = unsafe { Access::<T, VEC>::load(dy_row, elem(k)) };
                }
            }
            (x, dy, load_stats::<CENTERED>(p, row))
        };
        // The widest LayerNorm tile has no registers left for a second row (it would spill).
        let prefetch = !(CENTERED && VPT >= 4);
        let empty = ([[0; 4]; VPT], [[0; 4]; VPT], (0.0, 0.0));
        let mut next = if prefetch && first < end {
            load_row(first)
        } else {
            empty
        };
        for row in first..end {
            let (x, dy, saved) = if prefetch { next } else { load_row(row) };
            if prefetch && row + 1 < end {
                next = load_row(row + 1);
            }
            // Nothing saved: recompute the statistics from the row already in registers.
            let (mean, rstd) = if p.rstd == 0 {
                unsafe {
                    row_stats_regs::<T, VEC, VPT, CENTERED>(&mut reducer, &x, d, p.inv_d, p.eps)
                }
            } else {
                saved
            };
            let (mut sum_dy_hat, mut dot) = (0.0f32, 0.0f32);
            for k in 0..VPT {
                for i in 0..len {
                    let dy_hat = T::get(&dy[k], i) * gamma[k][i];
                    sum_dy_hat += dy_hat;
                    // Accesses past d hold dy = 0, so they add nothing to either sum.
                    dot += dy_hat * ((T::get(&x[k], i) - mean) * rstd);
                }
            }
            let (mean_dy_hat, mean_dot) =
                unsafe { row_means::<CENTERED>(&mut reducer, sum_dy_hat, dot, p.inv_d) };
            let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
            for k in 0..VPT {
                if elem(k) < d {
                    let mut dx: Pack = [0; 4];
                    for i in 0..len {
                        let x_hat = (T::get(&x[k], i) - mean) * rstd;
                        let dy_i = T::get(&dy[k], i);
                        let dy_hat = dy_i * gamma[k][i];
                        T::set(&mut dx, i, rstd * (dy_hat - mean_dy_hat - x_hat * mean_dot));
                        dgamma[k][i] += dy_i * x_hat;
                        if with_dbeta {
                            dbeta[k][i] += dy_i;
                        }
                    }
                    unsafe { Access::<T, VEC>::store(dx_row, elem(k), &dx) };
                }
            }
        }
        let offset = (group * d * 4) as u64;
        for k in 0..VPT {
            if elem(k) < d {
                unsafe { store_f32s::<VEC>(p.partials + offset, elem(k), &dgamma[k], len) };
                if with_dbeta {
                    unsafe {
                        store_f32s::<VEC>(p.dbeta_partials + offset, elem(k), &dbeta[k], len)
                    };
                }
            }
        }
        group += arch::grid_dim();
    }
}

#[inline(always)]
unsafe fn backward_stream<T: Element, const VEC: bool, const CENTERED: bool>(p: &BackwardParams) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let accesses = d.div_ceil(len);
    let with_dbeta = CENTERED && p.dbeta_partials != 0;
    let rows = p.rows as usize;
    let mut group = arch::block_idx();
    while group < p.groups as usize {
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        // Too wide for registers: the group's partials accumulate in its own workspace rows,
        // which only this block touches (each thread re-reads exactly what it wrote).
        let offset = (group * d * 4) as u64;
        for row in first..end {
            let x_row = row_addr::<T>(p.x, row, p.x_stride);
            let dy_row = row_addr::<T>(p.dy, row, p.dy_stride);
            let (mean, rstd) = if p.rstd == 0 {
                unsafe {
                    row_stats_stream::<T, VEC, CENTERED>(&mut reducer, x_row, d, p.inv_d, p.eps)
                }
            } else {
                load_stats::<CENTERED>(p, row)
            };
            let (mut sum_dy_hat, mut dot) = (0.0f32, 0.0f32);
            let mut a = tid;
            while a < accesses {
                let x = unsafe { Access::<T, VEC>::load(x_row, a * len) };
                let dy = unsafe { Access::<T, VEC>::load(dy_row, a * len) };
                let g = unsafe { param::<T, VEC>(p.gamma, a * len, p.params_f32, p.gamma_offset) };
                for i in 0..len {
                    let dy_hat = T::get(&dy, i) * g[i];
                    sum_dy_hat += dy_hat;
                    dot += dy_hat * ((T::get(&x, i) - mean) * rstd);
                }
                a += threads;
            }
            let (mean_dy_hat, mean_dot) =
                unsafe { row_means::<CENTERED>(&mut reducer, sum_dy_hat, dot, p.inv_d) };
            let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
            let mut a = tid;
            while a < accesses {
                let x = unsafe { Access::<T, VEC>::load(x_row, a * len) };
                let dy = unsafe { Access::<T, VEC>::load(dy_row, a * len) };
                let g = unsafe { param::<T, VEC>(p.gamma, a * len, p.params_f32, p.gamma_offset) };
                let (mut dgamma, mut dbeta) = if row == first {
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
                let mut dx: Pack = [0; 4];
                for i in 0..len {
                    let x_hat = (T::get(&x, i) - mean) * rstd;
                    let dy_i = T::get(&dy, i);
                    T::set(
                        &mut dx,
                        i,
                        rstd * (dy_i * g[i] - mean_dy_hat - x_hat * mean_dot),
                    );
                    dgamma[i] += dy_i * x_hat;
                    dbeta[i] += dy_i;
                }
                unsafe { Access::<T, VEC>::store(dx_row, a * len, &dx) };
                unsafe { store_f32s::<VEC>(p.partials + offset, a * len, &dgamma, len) };
                if with_dbeta {
                    unsafe { store_f32s::<VEC>(p.dbeta_partials + offset, a * len, &dbeta, len) };
                }
                a += threads;
            }
        }
        group += arch::grid_dim();
    }
}

/// RMSNorm and LayerNorm instances of the shared bodies, as the export and select macros want them.
macro_rules! norm_instances {
    ($($name:ident => $body:ident::<$centered:literal>($params:ty);)*) => {$(
        #[inline(always)]
        unsafe fn $name<T: Element, const VEC: bool, const VPT: usize>(p: &$params) {
            unsafe { $body::<T, VEC, VPT, $centered>(p) }
        }
    )*};
}
norm_instances! {
    rms_forward => forward::<false>(ForwardParams);
    rms_backward => backward::<false>(BackwardParams);
    layer_forward => forward::<true>(ForwardParams);
    layer_backward => backward::<true>(BackwardParams);
}

export_family!("rms_norm_fwd", ForwardParams, rms_forward);
export_family!("rms_norm_bwd", BackwardParams, rms_backward);
export_family!("layer_norm_fwd", ForwardParams, layer_forward);
export_family!("layer_norm_bwd", BackwardParams, layer_backward);

/// Which norm: the `CENTERED` parameter of the shared bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Norm {
    Rms,
    Layer,
}

impl Norm {
    /// PTX entry prefixes of the forward and backward families.
    pub const fn families(self) -> (&'static str, &'static str) {
        match self {
            Norm::Rms => ("rms_norm_fwd", "rms_norm_bwd"),
            Norm::Layer => ("layer_norm_fwd", "layer_norm_bwd"),
        }
    }
}

/// The forward body a variant names, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn forward_body(norm: Norm, v: crate::variant::Variant) -> unsafe fn(&ForwardParams) {
    match norm {
        Norm::Rms => crate::variant::select_family!(v, ForwardParams, rms_forward),
        Norm::Layer => crate::variant::select_family!(v, ForwardParams, layer_forward),
    }
}

/// The backward body a variant names, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn backward_body(norm: Norm, v: crate::variant::Variant) -> unsafe fn(&BackwardParams) {
    match norm {
        Norm::Rms => crate::variant::select_family!(v, BackwardParams, rms_backward),
        Norm::Layer => crate::variant::select_family!(v, BackwardParams, layer_backward),
    }
}
