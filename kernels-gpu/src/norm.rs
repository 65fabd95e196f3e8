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
//! Residual fusion (the `_res` families): the forward reads `x` and `residual`, writes
//! `h = x + residual` (fp32 sum, one rounding) to `residual_out` and normalizes h *as stored*, so a
//! backward that takes `residual_out` as its x sees exactly the row the forward normalized. The
//! backward adds the gradient arriving on `residual_out` into dx before its one rounding. Residual
//! rows are in the activations' dtype or f32 (a runtime flag, like the parameters'), so one family
//! covers both without another set of instances. The plain families contain none of it: where
//! the row comes from is a type parameter of the bodies (`RowSource`), so their instances do the
//! same work as before.
//!
//! One block works on one row at a time. Register tiles (`VPT` = 1, 2, 4 accesses per thread)
//! load the whole row once and keep it on chip: 16-byte packs give every thread `VPT·16` bytes in
//! flight per operand. Rows too wide for one block's registers are split over a cluster of blocks
//! (sm_90; the `CLUSTER` instances, [`Team`]): each block holds its share of the row and
//! [`RowReducer`] adds the blocks' partial sums through distributed shared memory; their backward
//! has its rows copied into a ring in shared memory by the copy engine ([`StagedRows`]). Rows wider
//! still, or any too wide for a block before sm_90, use the streaming instance (`VPT` = 0), which
//! reads the row more than once (the later reads mostly hit L2), over a cluster where there is one.

use crate::arch;
use crate::element::{Access, Element, MixedRows, Pack, Wide, load_f32s, row_addr, store_f32s};
use crate::reduce::{PendingSums, ROW_REDUCER_SHARED_WORDS, RowReducer, Team};
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
    /// Residual families only: `h = x + residual` is written to `residual_out` and normalized.
    pub residual: u64,
    pub residual_out: u64,
    pub residual_stride: u64,
    pub residual_out_stride: u64,
    /// 1: stored as f32; 0: in the activations' dtype (each of the two on its own).
    pub residual_f32: u32,
    pub residual_out_f32: u32,
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
    /// Residual families only: 1 when x (the forward's `residual_out`) and `dresidual` are stored
    /// as f32 rather than in dy's dtype.
    pub x_f32: u32,
    /// Residual families only: the gradient arriving on the forward's `residual_out`, added into
    /// dx; 0 for none.
    pub dresidual: u64,
    pub dresidual_stride: u64,
}

/// The row a body normalizes (forward) or differentiates through (backward), one access
/// (`Access::<T, VEC>::LEN` elements) at a time. `load` only issues loads; `hold` does the
/// arithmetic on them, so a prefetched row costs registers but no wait until it is used.
trait RowSource<T: Element, const VEC: bool>: Copy {
    /// Row addresses, computed once per row.
    type Row: Copy;
    /// One access as loaded.
    type Raw: Copy + Default;
    /// One access ready for use.
    type Held: Copy + Default;
    /// Backward: one access of what is added into dx (dresidual), as loaded.
    type Extra: Copy + Default;
    /// Raw accesses hold more than one pack of `T`: too many registers to prefetch the widest tile.
    const WIDE: bool;
    fn row(&self, row: usize) -> Self::Row;
    /// # Safety
    /// The access lies inside the rows, aligned as `VEC` requires.
    unsafe fn load(&self, row: &Self::Row, elem: usize) -> Self::Raw;
    fn hold(&self, raw: &Self::Raw) -> Self::Held;
    /// Element `i` of the row, in f32.
    fn get(held: &Self::Held, i: usize) -> f32;
    /// Forward: writes what is kept besides y (the residual sum).
    ///
    /// # Safety
    /// As for [`Self::load`], writable.
    #[inline(always)]
    unsafe fn emit(&self, _row: &Self::Row, _elem: usize, _held: &Self::Held) {}
    /// Backward: loads one access of what is added into dx.
    ///
    /// # Safety
    /// As for [`Self::load`].
    #[inline(always)]
    unsafe fn load_extra(&self, _row: &Self::Row, _elem: usize) -> Self::Extra {
        Self::Extra::default()
    }
    /// Backward: element `i` of dx with the gradient arriving from elsewhere (dresidual) added.
    #[inline(always)]
    fn dx(&self, _extra: &Self::Extra, _i: usize, dx: f32) -> f32 {
        dx
    }
}

/// x itself, in the activations' dtype: the plain families. Held as loaded (packed `T`), which is
/// what lets a bf16 row fit in half the registers of its f32 image.
#[derive(Clone, Copy)]
struct Plain {
    x: u64,
    stride: u64,
}

impl<T: Element, const VEC: bool> RowSource<T, VEC> for Plain {
    type Row = u64;
    type Raw = Pack;
    type Held = Pack;
    type Extra = ();
    const WIDE: bool = false;
    #[inline(always)]
    fn row(&self, row: usize) -> u64 {
        row_addr::<T>(self.x, row, self.stride)
    }
    #[inline(always)]
    unsafe fn load(&self, row: &u64, elem: usize) -> Pack {
        unsafe { Access::<T, VEC>::load(*row, elem) }
    }
    #[inline(always)]
    fn hold(&self, raw: &Pack) -> Pack {
        *raw
    }
    #[inline(always)]
    fn get(held: &Pack, i: usize) -> f32 {
        T::get(held, i)
    }
}

/// The forward of the residual families: `h = x + residual`, rounded as `residual_out` stores it
/// and written there.
#[derive(Clone, Copy)]
struct AddResidual {
    x: Plain,
    residual: MixedRows,
    out: MixedRows,
}

impl AddResidual {
    fn new(p: &ForwardParams) -> Self {
        AddResidual {
            x: Plain {
                x: p.x,
                stride: p.x_stride,
            },
            residual: MixedRows {
                base: p.residual,
                stride: p.residual_stride,
                is_f32: p.residual_f32 != 0,
            },
            out: MixedRows {
                base: p.residual_out,
                stride: p.residual_out_stride,
                is_f32: p.residual_out_f32 != 0,
            },
        }
    }
}

impl<T: Element, const VEC: bool> RowSource<T, VEC> for AddResidual {
    /// x, residual, residual_out.
    type Row = (u64, u64, u64);
    type Raw = (Pack, Wide);
    type Held = [f32; 8];
    type Extra = ();
    const WIDE: bool = true;
    #[inline(always)]
    fn row(&self, row: usize) -> (u64, u64, u64) {
        (
            RowSource::<T, VEC>::row(&self.x, row),
            self.residual.row::<T>(row),
            self.out.row::<T>(row),
        )
    }
    #[inline(always)]
    unsafe fn load(&self, row: &(u64, u64, u64), elem: usize) -> (Pack, Wide) {
        unsafe {
            (
                Access::<T, VEC>::load(row.0, elem),
                self.residual.load::<T, VEC>(row.1, elem),
            )
        }
    }
    #[inline(always)]
    fn hold(&self, (x, r): &(Pack, Wide)) -> [f32; 8] {
        let mut h = [0.0f32; 8];
        for i in 0..Access::<T, VEC>::LEN {
            h[i] = self
                .out
                .round::<T>(T::get(x, i) + self.residual.get::<T>(r, i));
        }
        h
    }
    #[inline(always)]
    fn get(held: &[f32; 8], i: usize) -> f32 {
        held[i]
    }
    #[inline(always)]
    unsafe fn emit(&self, row: &(u64, u64, u64), elem: usize, h: &[f32; 8]) {
        unsafe { self.out.store::<T, VEC>(row.2, elem, h) }
    }
}

/// The backward of the residual families: x (the forward's `residual_out`) in the activations'
/// dtype or f32, and the gradient arriving on it (`dresidual`, same dtype, optional).
#[derive(Clone, Copy)]
struct ResidualBackward {
    x: MixedRows,
    dresidual: MixedRows,
}

impl ResidualBackward {
    fn new(p: &BackwardParams) -> Self {
        let is_f32 = p.x_f32 != 0;
        ResidualBackward {
            x: MixedRows {
                base: p.x,
                stride: p.x_stride,
                is_f32,
            },
            dresidual: MixedRows {
                base: p.dresidual,
                stride: p.dresidual_stride,
                is_f32,
            },
        }
    }
}

impl<T: Element, const VEC: bool> RowSource<T, VEC> for ResidualBackward {
    /// x, dresidual.
    type Row = (u64, u64);
    type Raw = Wide;
    type Held = [f32; 8];
    type Extra = Wide;
    const WIDE: bool = true;
    #[inline(always)]
    fn row(&self, row: usize) -> (u64, u64) {
        (self.x.row::<T>(row), self.dresidual.row::<T>(row))
    }
    #[inline(always)]
    unsafe fn load(&self, row: &(u64, u64), elem: usize) -> Wide {
        unsafe { self.x.load::<T, VEC>(row.0, elem) }
    }
    #[inline(always)]
    fn hold(&self, x: &Wide) -> [f32; 8] {
        let mut held = [0.0f32; 8];
        for i in 0..Access::<T, VEC>::LEN {
            held[i] = self.x.get::<T>(x, i);
        }
        held
    }
    #[inline(always)]
    fn get(held: &[f32; 8], i: usize) -> f32 {
        held[i]
    }
    #[inline(always)]
    unsafe fn load_extra(&self, row: &(u64, u64), elem: usize) -> Wide {
        if self.dresidual.base != 0 {
            unsafe { self.dresidual.load::<T, VEC>(row.1, elem) }
        } else {
            Wide::default()
        }
    }
    #[inline(always)]
    fn dx(&self, dresidual: &Wide, i: usize, dx: f32) -> f32 {
        dx + self.dresidual.get::<T>(dresidual, i)
    }
}

/// Writes the row's statistics (thread 0 of the team only).
#[inline(always)]
fn save_stats<const CENTERED: bool>(
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
unsafe fn row_stats_regs<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    const CENTERED: bool,
    S: RowSource<T, VEC>,
>(
    reducer: &mut RowReducer,
    team: Team,
    x: &[S::Held; VPT],
    d: usize,
    inv_d: f32,
    eps: f32,
) -> (f32, f32) {
    let len = Access::<T, VEC>::LEN;
    let Team { tid, threads, .. } = team;
    let mean = if CENTERED {
        let mut sum = 0.0f32;
        for xk in x {
            for i in 0..len {
                sum += S::get(xk, i);
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
                let c = S::get(&x[k], i) - mean;
                sum_sq = arch::fma(c, c, sum_sq);
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
unsafe fn row_stats_stream<
    T: Element,
    const VEC: bool,
    const CENTERED: bool,
    S: RowSource<T, VEC>,
>(
    reducer: &mut RowReducer,
    team: Team,
    src: &S,
    row: usize,
    d: usize,
    inv_d: f32,
    eps: f32,
) -> (f32, f32) {
    let mean = if CENTERED {
        let sum = unsafe { stream_sum::<T, VEC, S>(reducer, team, src, row, d, |v| v) };
        sum * inv_d
    } else {
        0.0
    };
    let sum_sq =
        unsafe { stream_sum::<T, VEC, S>(reducer, team, src, row, d, |v| (v - mean) * (v - mean)) };
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
    // No `+ 0.0` for β: it is not an identity (−0 + 0 = +0), so every element would issue it.
    // (γ's offset is a runtime value: its adds are predicated, issued whether 0 or not.)
    if offset != 0.0 {
        for x in v.iter_mut().take(len) {
            *x += offset;
        }
    }
    v
}

/// `y` of one element: `(x−μ)·rstd·γ (+ β)`.
#[inline(always)]
fn normalize<const CENTERED: bool>(x: f32, mean: f32, rstd: f32, gamma: f32, beta: f32) -> f32 {
    if CENTERED {
        arch::fma((x - mean) * rstd, gamma, beta)
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
pub unsafe fn forward<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    const CENTERED: bool,
    const RESIDUAL: bool,
    const CLUSTER: bool,
>(
    p: &ForwardParams,
) {
    let team = Team::new(CLUSTER);
    let plain = Plain {
        x: p.x,
        stride: p.x_stride,
    };
    unsafe {
        match (VPT == 0, RESIDUAL) {
            (true, false) => forward_stream::<T, VEC, CENTERED, _>(p, plain, team),
            (true, true) => forward_stream::<T, VEC, CENTERED, _>(p, AddResidual::new(p), team),
            (false, false) => forward_regs::<T, VEC, VPT, CENTERED, _>(p, plain, team),
            (false, true) => forward_regs::<T, VEC, VPT, CENTERED, _>(p, AddResidual::new(p), team),
        }
    }
    team.finish();
}

#[inline(always)]
unsafe fn forward_regs<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    const CENTERED: bool,
    S: RowSource<T, VEC>,
>(
    p: &ForwardParams,
    src: S,
    team: Team,
) {
    let mut reducer = unsafe { RowReducer::new(team.cluster) };
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
    let prefetch = forward_prefetches(CENTERED, S::WIDE, VPT);
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
            row_stats_regs::<T, VEC, VPT, CENTERED, S>(&mut reducer, team, &x, d, p.inv_d, p.eps)
        };
        save_stats::<CENTERED>(p, team, row, mean, rstd);
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        let src_row = src.row(row);
        for k in 0..VPT {
            if elem(k) < d {
                unsafe { src.emit(&src_row, elem(k), &x[k]) };
                let gamma =
                    unsafe { param::<T, VEC>(p.gamma, elem(k), p.params_f32, p.gamma_offset) };
                let beta = if CENTERED && p.beta != 0 {
                    unsafe { param::<T, VEC>(p.beta, elem(k), p.params_f32, 0.0) }
                } else {
                    [0.0; 8]
                };
                let mut y = [0.0f32; 8];
                for i in 0..len {
                    y[i] = normalize::<CENTERED>(S::get(&x[k], i), mean, rstd, gamma[i], beta[i]);
                }
                unsafe { Access::<T, VEC>::store(y_row, elem(k), &T::pack(&y, len)) };
            }
        }
        row += stride;
    }
}

#[inline(always)]
unsafe fn forward_stream<
    T: Element,
    const VEC: bool,
    const CENTERED: bool,
    S: RowSource<T, VEC>,
>(
    p: &ForwardParams,
    src: S,
    team: Team,
) {
    let mut reducer = unsafe { RowReducer::new(team.cluster) };
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
            row_stats_stream::<T, VEC, CENTERED, S>(
                &mut reducer,
                team,
                &src,
                row,
                d,
                p.inv_d,
                p.eps,
            )
        };
        save_stats::<CENTERED>(p, team, row, mean, rstd);
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        let src_row = src.row(row);
        let mut a = tid;
        while a < accesses {
            let x = src.hold(&unsafe { src.load(&src_row, a * len) });
            unsafe { src.emit(&src_row, a * len, &x) };
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
                    normalize::<CENTERED>(S::get(&x, i), mean, rstd, g[i], b[i]),
                );
            }
            unsafe { Access::<T, VEC>::store(y_row, a * len, &y) };
            a += threads;
        }
        row += stride;
    }
}

/// `Σ f(x)` over one row of `d` elements, read from memory (L2, after the first pass) by the
/// whole block; every thread gets the sum.
///
/// # Safety
/// The row is readable as the access requires; every thread of the block calls it.
#[inline(always)]
unsafe fn stream_sum<T: Element, const VEC: bool, S: RowSource<T, VEC>>(
    reducer: &mut RowReducer,
    team: Team,
    src: &S,
    row: usize,
    d: usize,
    f: impl Fn(f32) -> f32,
) -> f32 {
    let len = Access::<T, VEC>::LEN;
    let mut sum = 0.0f32;
    let row = src.row(row);
    let mut a = team.tid;
    while a < d.div_ceil(len) {
        let x = src.hold(&unsafe { src.load(&row, a * len) });
        for i in 0..len {
            sum += f(S::get(&x, i));
        }
        a += team.threads;
    }
    unsafe { reducer.sum(sum) }
}

/// The backward: dx, and one dγ (and dβ) partial row per group; launch any grid (blocks walk
/// groups by grid stride), then [`crate::reduce::column_sum`] over the partials.
///
/// # Safety
/// As for [`forward`]; each partials buffer holds `groups · d` f32, 16-byte aligned.
#[inline(always)]
pub unsafe fn backward<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    const CENTERED: bool,
    const RESIDUAL: bool,
    const CLUSTER: bool,
>(
    p: &BackwardParams,
) {
    let team = Team::new(CLUSTER);
    let plain = Plain {
        x: p.x,
        stride: p.x_stride,
    };
    unsafe {
        match (VPT == 0, RESIDUAL) {
            (true, false) => backward_stream::<T, VEC, CENTERED, _>(p, plain, team),
            (true, true) => {
                backward_stream::<T, VEC, CENTERED, _>(p, ResidualBackward::new(p), team)
            }
            (false, false) if staged(CLUSTER, RESIDUAL, VPT) => {
                backward_staged::<T, VEC, VPT, CENTERED>(p, plain, team)
            }
            (false, false) => backward_regs::<T, VEC, VPT, CENTERED, _>(p, plain, team),
            (false, true) => {
                backward_regs::<T, VEC, VPT, CENTERED, _>(p, ResidualBackward::new(p), team)
            }
        }
    }
    team.finish();
}

/// Pass 1 of the backward over some elements of a row: `Σ dŷ` and `Σ dŷ·(x−μ)`, the second to be
/// scaled by rstd once per row ([`RowSums::start`]) rather than once per element.
#[derive(Clone, Copy, Default)]
struct RowSums {
    dy_hat: f32,
    dot: f32,
}

impl RowSums {
    /// Adds one element: `dy_hat = dy·γ`, `centered = x − μ`.
    #[inline(always)]
    fn add(&mut self, dy_hat: f32, centered: f32) {
        self.dy_hat += dy_hat;
        self.dot = arch::fma(dy_hat, centered, self.dot);
    }

    /// Starts the reduction of the row's sums (RMSNorm needs only the second);
    /// `Σ dŷ·x̂ = rstd·Σ dŷ·(x−μ)`.
    ///
    /// # Safety
    /// As for [`RowReducer::start`].
    #[inline(always)]
    unsafe fn start<const CENTERED: bool>(
        self,
        reducer: &mut RowReducer,
        rstd: f32,
    ) -> PendingSums {
        let dot = self.dot * rstd;
        if CENTERED {
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
    unsafe fn means<const CENTERED: bool>(
        reducer: &mut RowReducer,
        sums: PendingSums,
        inv_d: f32,
    ) -> (f32, f32) {
        if CENTERED {
            let [a, b] = unsafe { reducer.finish(sums) };
            (a * inv_d, b * inv_d)
        } else {
            (0.0, unsafe { reducer.finish::<1>(sums) }[0] * inv_d)
        }
    }
}

/// dx of a row in two FMAs per element: `rstd·(dŷ − mean(dŷ) − x̂·mean(dŷ·x̂))` is
/// `rstd·dŷ + (x−μ)·c + b` with `c = −rstd²·mean(dŷ·x̂)` and `b = −rstd·mean(dŷ)`.
#[derive(Clone, Copy)]
struct DxRow {
    mean: f32,
    rstd: f32,
    c: f32,
    b: f32,
}

impl DxRow {
    #[inline(always)]
    fn new((mean, rstd): (f32, f32), (mean_dy_hat, mean_dot): (f32, f32)) -> Self {
        DxRow {
            mean,
            rstd,
            c: -(rstd * rstd * mean_dot),
            b: -(rstd * mean_dy_hat),
        }
    }

    /// `(dx, x̂)` of one element.
    #[inline(always)]
    fn dx(&self, x: f32, dy_hat: f32) -> (f32, f32) {
        let centered = x - self.mean;
        let dx = arch::fma(self.rstd, dy_hat, arch::fma(centered, self.c, self.b));
        (dx, centered * self.rstd)
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

/// Whether a forward register tile (`vpt` ≥ 1) loads the next row before reducing this one.
/// RMSNorm does in the widest tile only: for narrower ones the extra registers cost a resident
/// block per SM, which hid more latency than the prefetch (H200, 16384×4096 bf16: 82.6 % of copy
/// without, 78–79 % with; 4096×16384 with the 4-pack tile: 64.5 % without, 84.5 % with).
/// LayerNorm waits for two reductions per row, so it prefetches from 2 packs on. The residual
/// families hold f32 rows: no room.
pub const fn forward_prefetches(centered: bool, residual: bool, vpt: usize) -> bool {
    !residual && (vpt >= 4 || (centered && vpt >= 2))
}

/// Whether a backward register tile holds γ in shared memory rather than in registers:
/// LayerNorm's tiles of two or more accesses per thread. Their rows, dγ and dβ fill the
/// registers: the widest plain tile needs the room for the next row (it waits on two reductions per
/// row, so it needs one in flight), the two-access tile to keep two blocks per SM (128 registers)
/// without spilling, the widest residual tile to stay within 255.
pub const fn gamma_in_shared(centered: bool, vpt: usize) -> bool {
    centered && vpt >= 2
}

/// Whether a backward instance stages its rows through shared memory ([`StagedRows`]): the
/// plain register tiles of a cluster. Their blocks wait on each other every row, so each row waits
/// for the slowest block's loads; the copy engine keeps three rows in flight where registers held
/// one. H200, bf16, A/B in one call: RMSNorm 4096×16384 68.9 → 74.7 %, 1024×65536 62.2 → 64.2 %
/// of copy; LayerNorm 58.2 → 59.8 % and 52.4 → 50.0 % (the one loss, within run-to-run spread).
pub const fn staged(cluster: bool, residual: bool, vpt: usize) -> bool {
    cluster && !residual && vpt != crate::variant::STREAM
}

/// The first word past the reducer's and γ's ([`gamma_in_shared`]) of a backward block of
/// `threads` threads with `vpt` accesses each.
const fn gamma_end(centered: bool, vpt: usize, threads: usize) -> usize {
    if gamma_in_shared(centered, vpt) {
        SharedGamma::BASE + vpt * threads * 8
    } else {
        ROW_REDUCER_SHARED_WORDS
    }
}

/// Dynamic shared memory of a backward block of `threads` threads with `vpt` accesses each:
/// the reducer's words, γ where [`gamma_in_shared`], and the rows in flight where [`staged`].
pub const fn backward_shared_bytes(norm: Norm, vpt: usize, threads: usize, staged: bool) -> usize {
    let centered = matches!(norm, Norm::Layer);
    let words = if staged {
        staged_words_end(gamma_end(centered, vpt, threads), vpt, threads)
    } else {
        gamma_end(centered, vpt, threads)
    };
    words * 4
}

/// This thread's γ in shared memory ([`gamma_in_shared`]): 8 words per access, as two 16-byte
/// words, each half laid out thread by thread so a warp's loads touch consecutive 16 bytes (no bank
/// conflicts). Only the thread that stored its words reads them back, so they need no barrier.
#[derive(Clone, Copy)]
struct SharedGamma {
    first: usize,
    block: usize,
}

impl SharedGamma {
    /// After the reducer's words, 16-byte aligned.
    const BASE: usize = ROW_REDUCER_SHARED_WORDS.next_multiple_of(4);

    #[inline(always)]
    fn new() -> Self {
        SharedGamma {
            first: Self::BASE + arch::thread_idx() * 4,
            block: arch::block_dim(),
        }
    }

    #[inline(always)]
    fn word(&self, k: usize, half: usize) -> usize {
        self.first + (2 * k + half) * self.block * 4
    }

    /// # Safety
    /// The launch provides [`backward_shared_bytes`].
    #[inline(always)]
    unsafe fn store(&self, k: usize, g: &[f32; 8], len: usize) {
        let shared = arch::shared_f32();
        unsafe { shared.store4(self.word(k, 0), [g[0], g[1], g[2], g[3]]) };
        if len > 4 {
            unsafe { shared.store4(self.word(k, 1), [g[4], g[5], g[6], g[7]]) };
        }
    }

    /// # Safety
    /// As for [`Self::store`], which stored access `k` before.
    #[inline(always)]
    unsafe fn load(&self, k: usize, len: usize) -> [f32; 8] {
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
type LoadedRow<R, E, const VPT: usize> = ([R; VPT], [Pack; VPT], [E; VPT], (f32, f32));

/// A row after pass 1: x as used, its statistics `(μ, rstd)`, and its sums on their way.
type Pass1<H, const VPT: usize> = ([H; VPT], (f32, f32), PendingSums);

/// What the rows of a backward register tile share: this thread's accesses and its γ.
struct BackwardTile<'a, T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool, S> {
    p: &'a BackwardParams,
    src: S,
    team: Team,
    d: usize,
    /// γ in registers, unless [`gamma_in_shared`].
    gamma: [[f32; 8]; VPT],
    shared_gamma: SharedGamma,
    /// Loads of row r+1 are issued before row r's reduction and stores, so a block always has a
    /// row in flight: with only a couple of blocks per SM that is what hides memory latency.
    /// Without that, what only the stores need (dresidual) is loaded one access at a time next to
    /// its store, to keep it out of the registers of the reductions.
    prefetch: bool,
    element: core::marker::PhantomData<T>,
}

impl<T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool, S: RowSource<T, VEC>>
    BackwardTile<'_, T, VEC, VPT, CENTERED, S>
{
    const LEN: usize = Access::<T, VEC>::LEN;
    const GAMMA_IN_SHARED: bool = gamma_in_shared(CENTERED, VPT);

    /// # Safety
    /// As for [`backward`]; every thread of the block calls it.
    #[inline(always)]
    unsafe fn new(
        p: &BackwardParams,
        src: S,
        team: Team,
    ) -> BackwardTile<'_, T, VEC, VPT, CENTERED, S> {
        let mut tile = BackwardTile {
            p,
            src,
            team,
            d: p.d as usize,
            gamma: [[0.0f32; 8]; VPT],
            shared_gamma: SharedGamma::new(),
            // The widest tile of a wide source has no registers left for a second row (it would
            // spill); LayerNorm's widest plain tile makes room by holding γ in shared memory.
            prefetch: !(S::WIDE && VPT >= 4),
            element: core::marker::PhantomData,
        };
        for k in 0..VPT {
            // Past d: γ = 0 (and dy = 0), so those accesses add nothing to the row sums.
            let mut g = [0.0f32; 8];
            if tile.elem(k) < tile.d {
                g = unsafe { param::<T, VEC>(p.gamma, tile.elem(k), p.params_f32, p.gamma_offset) };
            }
            if Self::GAMMA_IN_SHARED {
                unsafe { tile.shared_gamma.store(k, &g, Self::LEN) };
            } else {
                tile.gamma[k] = g;
            }
        }
        tile
    }

    /// LayerNorm with a dβ to compute.
    #[inline(always)]
    fn with_dbeta(&self) -> bool {
        CENTERED && self.p.dbeta_partials != 0
    }

    /// The first element of this thread's access `k`.
    #[inline(always)]
    fn elem(&self, k: usize) -> usize {
        (self.team.tid + k * self.team.threads) * Self::LEN
    }

    #[inline(always)]
    fn gamma(&self, k: usize) -> [f32; 8] {
        if Self::GAMMA_IN_SHARED {
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
    unsafe fn load(&self, row: usize) -> LoadedRow<S::Raw, S::Extra, VPT> {
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
            if self.prefetch && self.elem(k) < self.d {
                extra[k] = unsafe { self.src.load_extra(&src_row, self.elem(k)) };
            }
        }
        (x, dy, extra, load_stats::<CENTERED>(p, row))
    }

    /// A row with nothing loaded (past the last).
    #[inline(always)]
    fn empty() -> LoadedRow<S::Raw, S::Extra, VPT> {
        (
            [S::Raw::default(); VPT],
            [[0; 4]; VPT],
            [S::Extra::default(); VPT],
            (0.0, 0.0),
        )
    }

    /// Pass 1 of a row: x as used, its statistics, and the sums of `dŷ` and `dŷ·x̂` started.
    ///
    /// # Safety
    /// Every thread of the team calls it (it reduces).
    #[inline(always)]
    unsafe fn pass1(
        &self,
        reducer: &mut RowReducer,
        row: &LoadedRow<S::Raw, S::Extra, VPT>,
    ) -> Pass1<S::Held, VPT> {
        let p = self.p;
        let (raw, dy, _, saved) = row;
        let mut x = [S::Held::default(); VPT];
        for k in 0..VPT {
            x[k] = self.src.hold(&raw[k]);
        }
        // Nothing saved: recompute the statistics from the row already in registers.
        let (mean, rstd) = if p.rstd == 0 {
            unsafe {
                row_stats_regs::<T, VEC, VPT, CENTERED, S>(
                    reducer, self.team, &x, self.d, p.inv_d, p.eps,
                )
            }
        } else {
            *saved
        };
        let mut sums = RowSums::default();
        for k in 0..VPT {
            let gamma = self.gamma(k);
            for i in 0..Self::LEN {
                // Accesses past d hold dy = 0, so they add nothing to either sum.
                sums.add(T::get(&dy[k], i) * gamma[i], S::get(&x[k], i) - mean);
            }
        }
        let sums = unsafe { sums.start::<CENTERED>(reducer, rstd) };
        (x, (mean, rstd), sums)
    }

    /// Pass 2 of a row: finishes its sums, writes dx and adds the row into `dgamma` and `dbeta`.
    ///
    /// # Safety
    /// Every thread of the team calls it (it reduces); `pass1` is this row's, and its sums are
    /// the oldest unfinished.
    #[inline(always)]
    unsafe fn pass2(
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
        let (_, dy, extra, _) = loaded;
        let dx_of = DxRow::new(stats, unsafe {
            RowSums::means::<CENTERED>(reducer, sums, p.inv_d)
        });
        let with_dbeta = self.with_dbeta();
        let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
        let src_row = self.src.row(row);
        for k in 0..VPT {
            if self.elem(k) < self.d {
                let extra = if self.prefetch {
                    extra[k]
                } else {
                    unsafe { self.src.load_extra(&src_row, self.elem(k)) }
                };
                let gamma = self.gamma(k);
                let mut dx = [0.0f32; 8];
                for i in 0..Self::LEN {
                    let dy_i = T::get(&dy[k], i);
                    let (v, x_hat) = dx_of.dx(S::get(&x[k], i), dy_i * gamma[i]);
                    dx[i] = self.src.dx(&extra, i, v);
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

    /// Writes a group's dγ (and dβ) partials: row `group` of each workspace.
    ///
    /// # Safety
    /// `group` is below the launch's `groups`.
    #[inline(always)]
    unsafe fn store_partials(
        &self,
        group: usize,
        dgamma: &[[f32; 8]; VPT],
        dbeta: &[[f32; 8]; VPT],
    ) {
        let p = self.p;
        let offset = (group * self.d * 4) as u64;
        for k in 0..VPT {
            if self.elem(k) < self.d {
                let elem = self.elem(k);
                unsafe { store_f32s::<VEC>(p.partials + offset, elem, &dgamma[k], Self::LEN) };
                if self.with_dbeta() {
                    unsafe {
                        store_f32s::<VEC>(p.dbeta_partials + offset, elem, &dbeta[k], Self::LEN)
                    };
                }
            }
        }
    }
}

/// The team's row `n` places after `row` of its group ending at `end`: within the group, or
/// (for `n` at most a group's rows) within the team's next group, `next_first..next_end`.
#[inline(always)]
fn row_ahead(
    row: usize,
    n: usize,
    end: usize,
    (next_first, next_end): (usize, usize),
) -> Option<usize> {
    if row + n < end {
        Some(row + n)
    } else {
        let next = next_first + (row + n - end);
        (next < next_end).then_some(next)
    }
}

/// Rows in flight per block of a [`staged`] backward. Each holds the block's share of x and dy
/// (at 4 packs × 256 threads, 32 KiB); four keep three rows loading while one is worked on. Groups
/// of dγ rows must have at least this many rows (but the last of all), as the ring looks this far
/// ahead into a team's next group only.
pub const STAGES: usize = 4;

/// The end of a [`StagedRows`] ring that follows `start` words: the stages, 128-byte aligned
/// (x and dy, `vpt` accesses of 16 bytes per thread each), then one mbarrier per stage.
const fn staged_words_end(start: usize, vpt: usize, threads: usize) -> usize {
    start.next_multiple_of(32) + STAGES * 2 * vpt * threads * 4 + 2 * STAGES
}

/// A ring of [`STAGES`] rows in shared memory, filled by the copy engine
/// ([`arch::SharedF32::bulk_copy_from`]) and drained into registers by every thread. One thread
/// fills; each stage's mbarrier counts the bytes of its row, and its phase says which row.
///
/// A block's accesses `k` cover `block · LEN` consecutive elements of the row (the team's threads
/// are the blocks' in rank order), so each is one bulk copy per operand, and thread t's pack sits
/// at 16·t bytes into it: a warp's shared loads take consecutive 16 bytes, no bank conflicts.
struct StagedRows<T: Element, const VPT: usize> {
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

impl<T: Element, const VPT: usize> StagedRows<T, VPT> {
    /// A ring after the block's first `start` words; thread 0 makes its mbarriers.
    ///
    /// # Safety
    /// Every thread of the block calls it, before [`RowReducer::new`] (whose cluster barrier
    /// publishes the mbarriers); the launch provides [`staged_words_end`] words.
    #[inline(always)]
    unsafe fn new(start: usize, team: Team, d: usize) -> Self {
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
        }
        ring
    }

    /// The first word of access `k` of `operand` (0: x, 1: dy) in `stage`.
    #[inline(always)]
    fn word(&self, stage: usize, operand: usize, k: usize) -> usize {
        self.base + ((stage * 2 + operand) * VPT + k) * self.access_words
    }

    /// Starts copying the team's `i`-th row, `row`, into its stage. Called by thread 0 only,
    /// once every thread has read the stage's previous row.
    ///
    /// # Safety
    /// `row` is below `rows`; the rows are 16-byte aligned with `d` a multiple of the pack.
    #[inline(always)]
    unsafe fn fill(&self, p: &BackwardParams, i: usize, row: usize) {
        let shared = arch::shared_f32();
        let stage = i % STAGES;
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
    unsafe fn take(&self, i: usize, elem: impl Fn(usize) -> usize) -> ([Pack; VPT], [Pack; VPT]) {
        let shared = arch::shared_f32();
        let stage = i % STAGES;
        unsafe { shared.mbarrier_wait(self.barriers + 2 * stage, (i / STAGES % 2) as u32) };
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
/// instead of one prefetched row in registers.
#[inline(always)]
unsafe fn backward_staged<T: Element, const VEC: bool, const VPT: usize, const CENTERED: bool>(
    p: &BackwardParams,
    src: Plain,
    team: Team,
) {
    let d = p.d as usize;
    let ring =
        unsafe { StagedRows::<T, VPT>::new(gamma_end(CENTERED, VPT, arch::block_dim()), team, d) };
    let mut reducer = unsafe { RowReducer::new(team.cluster) };
    let tile = unsafe { BackwardTile::<T, VEC, VPT, CENTERED, Plain>::new(p, src, team) };
    let (per_group, rows) = (p.rows_per_group as usize, p.rows as usize);
    let group_rows = |group: usize| {
        let first = group * per_group;
        (first, (first + per_group).min(rows))
    };
    let filler = arch::thread_idx() == 0;
    let mut group = team.first;
    let (first, end) = group_rows(group);
    // A group has at least `STAGES` rows unless it is the last of all (the host's group layout),
    // so the first `STAGES` rows of a team lie in its first group.
    if filler {
        for (i, row) in (first..end.max(first)).take(STAGES).enumerate() {
            unsafe { ring.fill(p, i, row) };
        }
    }
    let mut next_stats = (0.0, 0.0);
    if first < end {
        next_stats = load_stats::<CENTERED>(p, first);
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
            if let Some(next) = row_ahead(row, 1, end, next_group) {
                next_stats = load_stats::<CENTERED>(p, next);
            }
            let (x, dy) = unsafe { ring.take(i, |k| tile.elem(k)) };
            let this = (x, dy, [(); VPT], stats);
            unsafe {
                let pass1 = tile.pass1(&mut reducer, &this);
                // Pass 1 ended in a block barrier (its reduction), after every thread had read
                // this row's stage: the stage can take the row `STAGES` ahead.
                if filler && let Some(next) = row_ahead(row, STAGES, end, next_group) {
                    ring.fill(p, i + STAGES, next);
                }
                tile.pass2(&mut reducer, row, &this, pass1, &mut dgamma, &mut dbeta);
            }
            i += 1;
        }
        unsafe { tile.store_partials(group, &dgamma, &dbeta) };
        group += team.stride;
    }
}

#[inline(always)]
unsafe fn backward_regs<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    const CENTERED: bool,
    S: RowSource<T, VEC>,
>(
    p: &BackwardParams,
    src: S,
    team: Team,
) {
    let mut reducer = unsafe { RowReducer::new(team.cluster) };
    let tile = unsafe { BackwardTile::<T, VEC, VPT, CENTERED, S>::new(p, src, team) };
    let rows = p.rows as usize;
    let prefetch = tile.prefetch;
    let mut group = team.first;
    while group < p.groups as usize {
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        let mut dgamma = [[0.0f32; 8]; VPT];
        let mut dbeta = [[0.0f32; 8]; VPT];
        let mut next = BackwardTile::<T, VEC, VPT, CENTERED, S>::empty();
        if prefetch && first < end {
            next = unsafe { tile.load(first) };
        }
        for row in first..end {
            let this = if prefetch {
                next
            } else {
                unsafe { tile.load(row) }
            };
            if prefetch && row + 1 < end {
                next = unsafe { tile.load(row + 1) };
            }
            unsafe {
                let pass1 = tile.pass1(&mut reducer, &this);
                tile.pass2(&mut reducer, row, &this, pass1, &mut dgamma, &mut dbeta);
            }
        }
        unsafe { tile.store_partials(group, &dgamma, &dbeta) };
        group += team.stride;
    }
}

#[inline(always)]
unsafe fn backward_stream<
    T: Element,
    const VEC: bool,
    const CENTERED: bool,
    S: RowSource<T, VEC>,
>(
    p: &BackwardParams,
    src: S,
    team: Team,
) {
    let mut reducer = unsafe { RowReducer::new(team.cluster) };
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
    let with_dbeta = CENTERED && p.dbeta_partials != 0;
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
                    row_stats_stream::<T, VEC, CENTERED, S>(
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
                load_stats::<CENTERED>(p, row)
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
                let sums = sums.start::<CENTERED>(&mut reducer, rstd);
                RowSums::means::<CENTERED>(&mut reducer, sums, p.inv_d)
            });
            let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
            let mut a = tid;
            while a < accesses {
                let x = src.hold(&unsafe { src.load(&src_row, a * len) });
                let extra = unsafe { src.load_extra(&src_row, a * len) };
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
                let mut dx = [0.0f32; 8];
                for i in 0..len {
                    let dy_i = T::get(&dy, i);
                    let (v, x_hat) = dx_of.dx(S::get(&x, i), dy_i * g[i]);
                    dx[i] = src.dx(&extra, i, v);
                    dgamma[i] = arch::fma(dy_i, x_hat, dgamma[i]);
                    dbeta[i] += dy_i;
                }
                unsafe { Access::<T, VEC>::store(dx_row, a * len, &T::pack(&dx, len)) };
                unsafe { store_f32s::<VEC>(p.partials + offset, a * len, &dgamma, len) };
                if with_dbeta {
                    unsafe { store_f32s::<VEC>(p.dbeta_partials + offset, a * len, &dbeta, len) };
                }
                a += threads;
            }
        }
        group += stride;
    }
}

/// The kernel families: for each, the block instance and the cluster instance of a shared body
/// (as the export and select macros want them), exported under the family's prefix. With
/// `scalar_streams`, single-element access gets only the streaming block instance; the cluster
/// instances are for packed access and exist in the sm_90 build only.
macro_rules! norm_families {
    ($($family:literal: $name:ident, $cluster:ident
        => $body:ident::<$centered:literal, $residual:literal>($params:ty) $(, $mode:ident)?;)*) => {$(
        #[cfg(target_arch = "nvptx64")]
        #[inline(always)]
        unsafe fn $name<T: Element, const VEC: bool, const VPT: usize>(p: &$params) {
            unsafe { $body::<T, VEC, VPT, $centered, $residual, false>(p) }
        }
        // The sm_80 build compiles it for nothing: only the sm_90 build exports it.
        #[cfg(target_arch = "nvptx64")]
        #[cfg_attr(not(target_feature = "sm_90"), allow(dead_code))]
        #[inline(always)]
        unsafe fn $cluster<T: Element, const VEC: bool, const VPT: usize>(p: &$params) {
            unsafe { $body::<T, VEC, VPT, $centered, $residual, true>(p) }
        }
        export_family!($family, $params, $name $(, $mode)?);
        export_family!($family, $params, $cluster, cluster);
    )*};
}
norm_families! {
    "rms_norm_fwd": rms_forward, rms_forward_cluster => forward::<false, false>(ForwardParams);
    "rms_norm_bwd": rms_backward, rms_backward_cluster => backward::<false, false>(BackwardParams);
    "layer_norm_fwd": layer_forward, layer_forward_cluster => forward::<true, false>(ForwardParams);
    "layer_norm_bwd": layer_backward, layer_backward_cluster
        => backward::<true, false>(BackwardParams);
    "rms_norm_fwd_res": rms_forward_res, rms_forward_res_cluster
        => forward::<false, true>(ForwardParams), scalar_streams;
    "rms_norm_bwd_res": rms_backward_res, rms_backward_res_cluster
        => backward::<false, true>(BackwardParams), scalar_streams;
    "layer_norm_fwd_res": layer_forward_res, layer_forward_res_cluster
        => forward::<true, true>(ForwardParams), scalar_streams;
    "layer_norm_bwd_res": layer_backward_res, layer_backward_res_cluster
        => backward::<true, true>(BackwardParams), scalar_streams;
}

/// Which norm: the `CENTERED` parameter of the shared bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Norm {
    Rms,
    Layer,
}

impl Norm {
    pub const ALL: [Norm; 2] = [Norm::Rms, Norm::Layer];

    /// Whether the families (plain or with residual fusion) are exported with `scalar_streams`:
    /// the residual ones are. Single-element access only serves views that are not 16-byte
    /// aligned; register tiles for it would add a third to the residual families' PTX (and to
    /// the driver's load time) for a path that is slow anyway.
    pub const fn scalar_streams(residual: bool) -> bool {
        residual
    }

    /// PTX entry prefixes of the forward and backward families, plain or with residual fusion.
    pub const fn families(self, residual: bool) -> (&'static str, &'static str) {
        match (self, residual) {
            (Norm::Rms, false) => ("rms_norm_fwd", "rms_norm_bwd"),
            (Norm::Layer, false) => ("layer_norm_fwd", "layer_norm_bwd"),
            (Norm::Rms, true) => ("rms_norm_fwd_res", "rms_norm_bwd_res"),
            (Norm::Layer, true) => ("layer_norm_fwd_res", "layer_norm_bwd_res"),
        }
    }
}

impl ForwardParams {
    /// Whether these parameters need a residual family (they name a residual).
    pub const fn residual_family(&self) -> bool {
        self.residual != 0
    }
}

impl BackwardParams {
    /// Whether these parameters need a residual family (dresidual, or x stored as f32).
    pub const fn residual_family(&self) -> bool {
        self.dresidual != 0 || self.x_f32 != 0
    }
}

/// The instance of `$body` (`forward` or `backward`) for a variant's norm, residual fusion and
/// cluster, then dtype and tile: the emulator's twin of the exported entry points.
#[cfg(not(target_arch = "nvptx64"))]
macro_rules! select_norm_body {
    ($body:ident, $params:ty, $norm:expr, $residual:expr, $v:expr) => {
        select_norm_body!(@arms $body, $params, $v, ($norm, $residual, $v.cluster);
            (Rms, false, false, false), (Layer, true, false, false),
            (Rms, false, true, false), (Layer, true, true, false),
            (Rms, false, false, true), (Layer, true, false, true),
            (Rms, false, true, true), (Layer, true, true, true))
    };
    (@arms $body:ident, $params:ty, $v:expr, $key:expr;
        $(($norm:ident, $centered:literal, $residual:literal, $cluster:literal)),*) => {
        match $key {
            $((Norm::$norm, $residual, $cluster) => {
                unsafe fn body<T: Element, const VEC: bool, const VPT: usize>(p: &$params) {
                    unsafe { $body::<T, VEC, VPT, $centered, $residual, $cluster>(p) }
                }
                crate::variant::select_family!($v, $params, body)
            })*
        }
    };
}

/// The forward body a variant names, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn forward_body(
    norm: Norm,
    residual: bool,
    v: crate::variant::Variant,
) -> unsafe fn(&ForwardParams) {
    select_norm_body!(forward, ForwardParams, norm, residual, v)
}

/// The backward body a variant names, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn backward_body(
    norm: Norm,
    residual: bool,
    v: crate::variant::Variant,
) -> unsafe fn(&BackwardParams) {
    select_norm_body!(backward, BackwardParams, norm, residual, v)
}
