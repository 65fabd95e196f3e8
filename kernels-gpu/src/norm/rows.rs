//! The row a kernel works on: where it comes from ([`RowSource`]: x itself, x + residual, or a
//! residual backward's x and dresidual), the per-feature parameters γ and β, and the row
//! statistics (μ, rstd) from registers or streamed from memory.

use super::Normalization;
use crate::arch;
use crate::element::{Access, Element, MixedRows, Pack, Wide, load_f32s, row_addr};
use crate::reduce::{RowReducer, Team};

use super::params::{BackwardParams, ForwardParams};
use super::policy::STREAM_DEPTH;

/// The row a body normalizes (forward) or differentiates through (backward), one access
/// (`Access::<T, VEC>::LEN` elements) at a time. `load` only issues loads; `hold` does the
/// arithmetic on them, so a prefetched row costs registers but no wait until it is used.
pub(super) trait RowSource<T: Element, const VEC: bool>: Copy {
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
    /// Backward: whether a tile that prefetches the next row prefetches its [`Self::Extra`] too
    /// (else it is loaded next to dx's store).
    const PREFETCH_EXTRA: bool = true;
    fn row(&self, row: usize) -> Self::Row;
    /// # Safety
    /// The access lies inside the rows, aligned as `VEC` requires.
    unsafe fn load(&self, row: &Self::Row, elem: usize) -> Self::Raw;
    /// [`Self::load`] in a streaming pass after which the block reads the row again (from L2).
    ///
    /// # Safety
    /// As for [`Self::load`].
    #[inline(always)]
    unsafe fn load_kept(&self, row: &Self::Row, elem: usize) -> Self::Raw {
        unsafe { self.load(row, elem) }
    }
    fn hold(&self, raw: &Self::Raw) -> Self::Held;
    /// Element `i` of the row, in f32.
    fn get(held: &Self::Held, i: usize) -> f32;
    /// Forward: writes what is kept besides y (the residual sum).
    ///
    /// # Safety
    /// As for [`Self::load`], writable.
    #[inline(always)]
    unsafe fn emit(&self, _row: &Self::Row, _elem: usize, _held: &Self::Held) {}
    /// Backward: starts fetching access `k` (at `elem`) of what is added into dx, for
    /// [`Self::load_extra`], where the source stages it on chip.
    ///
    /// # Safety
    /// As for [`Self::load`]; every access a thread starts, it loads before starting the next row.
    #[inline(always)]
    unsafe fn start_extra(&self, _row: &Self::Row, _elem: usize, _k: usize) {}
    /// Backward: loads access `k` (at `elem`) of what is added into dx.
    ///
    /// # Safety
    /// As for [`Self::load`].
    #[inline(always)]
    unsafe fn load_extra(&self, _row: &Self::Row, _elem: usize, _k: usize) -> Self::Extra {
        Self::Extra::default()
    }
    /// Backward: whether this call adds anything into dx ([`Self::dx`]); without it the backward
    /// skips [`Self::load_extra`] and [`Self::dx`].
    #[inline(always)]
    fn has_extra(&self) -> bool {
        true
    }
    /// Backward: element `i` of dx with the gradient arriving from elsewhere (dresidual) added.
    #[inline(always)]
    fn dx(&self, _extra: &Self::Extra, _i: usize, dx: f32) -> f32 {
        dx
    }
}

/// x itself, in the activations' dtype: the plain families. Held as loaded (packed `T`), which is
/// what lets a bf16 row fit in half the registers of its f32 image. In the backward of the
/// instances that take one ([`super::policy::plain_adds_dresidual`]), a dresidual in the same
/// dtype (a residual stream stored like the activations) is added into dx: packed accesses copy
/// it into shared memory while the row is reduced and read it back next to dx's store, so it
/// takes no registers across the reductions (single elements load it there).
#[derive(Clone, Copy)]
pub(super) struct Plain {
    pub(super) x: u64,
    pub(super) stride: u64,
    /// Whether the instance adds a dresidual: a constant of each instance, so those that do not
    /// compile none of it.
    adds: bool,
    /// 0 for none.
    dresidual: u64,
    dresidual_stride: u64,
    /// The shared word of the block's dresidual slots (16-byte accesses): access `k` of thread
    /// `t` at `slots + 4·(k·block + t)`.
    slots: usize,
}

impl Plain {
    /// x alone (the forward).
    pub(super) fn rows(x: u64, stride: u64) -> Self {
        Plain {
            x,
            stride,
            adds: false,
            dresidual: 0,
            dresidual_stride: 0,
            slots: 0,
        }
    }

    /// The backward's x, and its dresidual if the instance `adds` one, staged in the shared
    /// words from `slots` on.
    pub(super) fn backward(p: &BackwardParams, adds: bool, slots: usize) -> Self {
        if !adds {
            return Self::rows(p.x, p.x_stride);
        }
        Plain {
            adds,
            dresidual: p.dresidual,
            dresidual_stride: p.dresidual_stride,
            slots,
            ..Self::rows(p.x, p.x_stride)
        }
    }

    /// The shared word of this thread's slot for access `k`.
    #[inline(always)]
    fn slot(&self, k: usize) -> usize {
        self.slots + 4 * (k * arch::block_dim() + arch::thread_idx())
    }
}

impl<T: Element, const VEC: bool> RowSource<T, VEC> for Plain {
    /// x, dresidual (0 for none).
    type Row = (u64, u64);
    type Raw = Pack;
    type Held = Pack;
    type Extra = Pack;
    const WIDE: bool = false;
    const PREFETCH_EXTRA: bool = false;
    #[inline(always)]
    fn row(&self, row: usize) -> (u64, u64) {
        let dresidual = if self.dresidual != 0 {
            row_addr::<T>(self.dresidual, row, self.dresidual_stride)
        } else {
            0
        };
        (row_addr::<T>(self.x, row, self.stride), dresidual)
    }
    #[inline(always)]
    unsafe fn load(&self, row: &(u64, u64), elem: usize) -> Pack {
        unsafe { Access::<T, VEC>::load(row.0, elem) }
    }
    /// x evict-last in L2: a streaming statistics pass (the forward's, the backward's recompute)
    /// reads it from DRAM and the block's next pass reads it again.
    #[inline(always)]
    unsafe fn load_kept(&self, row: &(u64, u64), elem: usize) -> Pack {
        unsafe { Access::<T, VEC>::load_kept(row.0, elem) }
    }
    #[inline(always)]
    fn hold(&self, raw: &Pack) -> Pack {
        *raw
    }
    #[inline(always)]
    fn get(held: &Pack, i: usize) -> f32 {
        T::get(held, i)
    }
    /// Packed accesses copy dresidual into the thread's slot while the row is reduced: its
    /// latency is hidden without registers held across the reductions.
    #[inline(always)]
    unsafe fn start_extra(&self, row: &(u64, u64), elem: usize, k: usize) {
        if VEC && self.dresidual != 0 {
            let src = row.1 + (elem * T::BYTES) as u64;
            unsafe { arch::shared_f32().copy16_async_from(self.slot(k), src) };
        }
    }
    #[inline(always)]
    unsafe fn load_extra(&self, row: &(u64, u64), elem: usize, k: usize) -> Pack {
        if VEC && self.dresidual != 0 {
            arch::wait_async_copies();
            unsafe { arch::shared_f32().load4(self.slot(k)) }.map(f32::to_bits)
        } else {
            unsafe { Access::<T, VEC>::load(row.1, elem) }
        }
    }
    #[inline(always)]
    fn has_extra(&self) -> bool {
        self.adds && self.dresidual != 0
    }
    #[inline(always)]
    fn dx(&self, dresidual: &Pack, i: usize, dx: f32) -> f32 {
        dx + T::get(dresidual, i)
    }
}

/// The forward of the residual families: `h = x + residual`, rounded as `residual_out` stores it
/// and written there.
#[derive(Clone, Copy)]
pub(super) struct AddResidual {
    x: Plain,
    residual: MixedRows,
    out: MixedRows,
}

impl AddResidual {
    pub(super) fn new(p: &ForwardParams) -> Self {
        AddResidual {
            x: Plain::rows(p.x, p.x_stride),
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
            RowSource::<T, VEC>::row(&self.x, row).0,
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
pub(super) struct ResidualBackward {
    x: MixedRows,
    dresidual: MixedRows,
}

impl ResidualBackward {
    pub(super) fn new(p: &BackwardParams) -> Self {
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
    unsafe fn load_extra(&self, row: &(u64, u64), elem: usize, _k: usize) -> Wide {
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

/// `(μ, rstd)` of a row held in registers (μ = 0 for RMSNorm): exact two-pass variance, since the
/// row is on chip (LayerNorm's cluster teams: both in one exchange,
/// [`RowReducer::mean_and_deviations`]). Accesses past `d` hold zeros and are kept out of the
/// sums. `lane_sums`: each thread adds its elements as [`lane_sum`] does (the forward's segment
/// teams: on the one-shot grid a team lives for one row); otherwise in element order (the block
/// tiles and the backward, which measured no gain from it, the backward a loss:
/// `bench-results/h200.md`, thirty-second session).
/// The element-order branch is written out as it was before lane sums: folding both into one
/// helper reordered instructions in 194 sm_90 kernels (the backwards among them), unmeasured.
///
/// # Safety
/// Every thread of the block calls it (block reductions).
#[inline(always)]
pub(super) unsafe fn row_stats_regs<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    S: RowSource<T, VEC>,
>(
    reducer: &mut RowReducer,
    team: Team,
    x: &[S::Held; VPT],
    d: usize,
    inv_d: f32,
    eps: f32,
    lane_sums: bool,
) -> (f32, f32) {
    let len = Access::<T, VEC>::LEN;
    let Team { tid, threads, .. } = team;
    // The team's mean and squared deviations (about the mean; RMSNorm's about 0).
    let (mean, m2) = if lane_sums {
        let active = |k: usize| (tid + k * threads) * len < d;
        let mean = if N::CENTERED {
            // Elements past d are held as 0: every access adds.
            let sum = lane_sum::<VPT>(len, |_| true, |k, i, acc| acc + S::get(&x[k], i));
            let total = unsafe { reducer.sum(sum) };
            total * inv_d
        } else {
            0.0
        };
        let sum_sq = lane_sum::<VPT>(len, active, |k, i, acc| {
            let c = S::get(&x[k], i) - mean;
            arch::fma(c, c, acc)
        });
        (mean, unsafe { reducer.sum(sum_sq) })
    } else if N::CENTERED && team.cluster {
        let active = |k: usize| (tid + k * threads) * len < d;
        let mut sum = 0.0f32;
        let mut count = 0usize;
        for (k, xk) in x.iter().enumerate() {
            // Elements past d are held as 0: every access adds to the sum.
            for i in 0..len {
                sum += S::get(xk, i);
            }
            if active(k) {
                count += len;
            }
        }
        let deviations = |c: f32| {
            let mut m2 = 0.0f32;
            for (k, xk) in x.iter().enumerate() {
                if active(k) {
                    for i in 0..len {
                        let dev = S::get(xk, i) - c;
                        m2 = arch::fma(dev, dev, m2);
                    }
                }
            }
            m2
        };
        unsafe { reducer.mean_and_deviations(count as f32, sum, deviations) }
    } else {
        // RMSNorm, and LayerNorm's block teams: their two barriers cost less than the merge's
        // shuffles (LayerNorm's forward 1.2 points lower at 16384×4096 in one exchange, H100).
        let mean = if N::CENTERED {
            let mut sum = 0.0f32;
            for xk in x {
                for i in 0..len {
                    sum += S::get(xk, i);
                }
            }
            unsafe { reducer.sum(sum) * inv_d }
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
        (mean, unsafe { reducer.sum(sum_sq) })
    };
    (mean, arch::rsqrt(m2 * inv_d + eps))
}

/// `Σ step` over this thread's accesses `k` (those `active`) and their `len` elements (a power of
/// two, at most 8) as `len` sums over the accesses, then a fixed pairwise tree over them: the
/// row's reduction waits on `VPT + log2(len)` dependent adds rather than `VPT · len` (a one-shot
/// forward team lives for one row, so that chain is its lifetime).
#[inline(always)]
fn lane_sum<const VPT: usize>(
    len: usize,
    active: impl Fn(usize) -> bool,
    step: impl Fn(usize, usize, f32) -> f32,
) -> f32 {
    let mut acc = [0.0f32; 8];
    for k in 0..VPT {
        if active(k) {
            #[allow(clippy::needless_range_loop)]
            for i in 0..8 {
                if i < len {
                    acc[i] = step(k, i, acc[i]);
                }
            }
        }
    }
    // Written out: a loop over halving widths leaves `acc` in local memory.
    let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
    match len {
        8 => ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)),
        4 => (a0 + a2) + (a1 + a3),
        2 => a0 + a1,
        _ => a0,
    }
}

/// `(μ, rstd)` of a row streamed from memory (μ = 0 for RMSNorm): one pass over the row, which
/// reads it from DRAM; LayerNorm's variance from the moments of each thread's elements
/// ([`centered_moments`]) rather than from a second pass.
///
/// # Safety
/// As for [`stream_sum`].
#[inline(always)]
pub(super) unsafe fn row_stats_stream<
    T: Element,
    const VEC: bool,
    N: Normalization,
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
    if N::CENTERED {
        let moments = unsafe {
            if S::WIDE {
                centered_moments::<T, VEC, S, 1>(team, src, row, d)
            } else {
                centered_moments::<T, VEC, S, STREAM_DEPTH>(team, src, row, d)
            }
        };
        // Chan et al.'s combination, in one exchange: each thread's M2 about a mean c is its own
        // plus n·(its mean − c)².
        let count = moments.accesses * Access::<T, VEC>::LEN as f32;
        let (mean, m2) = unsafe {
            reducer.mean_and_deviations(count, moments.sum, |c| moments.m2_about::<T, VEC>(c))
        };
        return (mean, arch::rsqrt(m2 * inv_d + eps));
    }
    let sum_sq = unsafe {
        if S::WIDE {
            stream_sum::<T, VEC, S, 1>(reducer, team, src, row, d, |v| v * v)
        } else {
            stream_sum::<T, VEC, S, STREAM_DEPTH>(reducer, team, src, row, d, |v| v * v)
        }
    };
    (0.0, arch::rsqrt(sum_sq * inv_d + eps))
}

/// One thread's elements of a row, summarized: their `sum` (for μ), and, over the `accesses` it
/// has added, their `mean` and squared deviations about it, `m2`. Each access is summarized
/// exactly in registers (its own mean and deviations) and merged into the running ones (Chan et
/// al.): no sum of squares, so nothing cancels when the mean is large against the spread.
#[derive(Clone, Copy, Default)]
pub(super) struct Moments {
    accesses: f32,
    sum: f32,
    mean: f32,
    m2: f32,
}

impl Moments {
    /// Adds one access of `len` elements.
    #[inline(always)]
    fn add<T: Element, const VEC: bool, S: RowSource<T, VEC>>(&mut self, x: &S::Held) {
        let len = Access::<T, VEC>::LEN;
        let mut sum = 0.0f32;
        for i in 0..len {
            sum += S::get(x, i);
        }
        self.sum += sum;
        let mean = sum * (1.0 / len as f32);
        let mut m2 = 0.0f32;
        for i in 0..len {
            let c = S::get(x, i) - mean;
            m2 = arch::fma(c, c, m2);
        }
        // Merging n = k·len elements with len more: the mean moves by δ·len/(n + len) = δ/(k+1),
        // and the deviations gain δ²·n·len/(n + len) = δ²·len·k/(k+1).
        self.accesses += 1.0;
        let w = arch::rcp_approx(self.accesses);
        let delta = mean - self.mean;
        self.mean = arch::fma(delta, w, self.mean);
        self.m2 += arch::fma(delta * delta * len as f32, 1.0 - w, m2);
    }

    /// The squared deviations of the elements about `mean`: `m2 + n·(mean_t − mean)²`.
    #[inline(always)]
    fn m2_about<T: Element, const VEC: bool>(&self, mean: f32) -> f32 {
        if self.accesses == 0.0 {
            return 0.0;
        }
        let n = self.accesses * Access::<T, VEC>::LEN as f32;
        let off = self.mean - mean;
        arch::fma(n * off, off, self.m2)
    }
}

/// [`Moments`] of this thread's accesses of a streamed row, `DEPTH` loads in flight
/// ([`stream_accesses`]).
///
/// # Safety
/// As for [`stream_sum`].
#[inline(always)]
unsafe fn centered_moments<
    T: Element,
    const VEC: bool,
    S: RowSource<T, VEC>,
    const DEPTH: usize,
>(
    team: Team,
    src: &S,
    row: usize,
    d: usize,
) -> Moments {
    let len = Access::<T, VEC>::LEN;
    let row = src.row(row);
    let mut m = Moments::default();
    stream_accesses::<_, DEPTH>(
        team.tid,
        team.threads,
        d.div_ceil(len),
        // SAFETY: the access lies inside the row (the caller's contract).
        |a| unsafe { src.load_kept(&row, a * len) },
        |_, raw| m.add::<T, VEC, S>(&src.hold(raw)),
    );
    m
}

/// One access worth of a per-feature parameter (γ or β) starting at element `elem`, in f32:
/// stored as f32 (`params_f32 != 0`, mixed precision) or in the activations' dtype `T`; `offset`
/// is added in f32 (γ's offset; 0 for β). Elements past the access's length are 0.
///
/// # Safety
/// The access lies inside the parameter vector, aligned as `VEC` requires for its storage.
#[inline(always)]
pub(super) unsafe fn param<T: Element, const VEC: bool>(
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

/// Rows `first..end` of dγ group `group` of `rows` rows in groups of `per_group` (the last group
/// has the rest). `fresh`: the first row goes through `arch::opaque`, so the group's row addresses
/// are computed afresh rather than stepped from the last group's — stepped, they held registers
/// across the row loop that ptxas spilled.
#[inline(always)]
pub(super) fn group_rows(
    group: usize,
    per_group: usize,
    rows: usize,
    fresh: bool,
) -> (usize, usize) {
    let first = if fresh { arch::opaque(group) } else { group } * per_group;
    (first, (first + per_group).min(rows))
}

/// Calls `f(a, raw)` for the accesses `a = first, first + step, …` below `accesses` of one
/// streaming pass, in that order, with each access as loaded by `load`; the loads of `DEPTH`
/// consecutive accesses (`policy::STREAM_DEPTH`, or one for two-operand sources) are issued
/// before the first of them is used.
#[inline(always)]
pub(super) fn stream_accesses<R: Copy + Default, const DEPTH: usize>(
    first: usize,
    step: usize,
    accesses: usize,
    load: impl Fn(usize) -> R,
    mut f: impl FnMut(usize, &R),
) {
    let mut a = first;
    if DEPTH > 1 {
        while a + (DEPTH - 1) * step < accesses {
            let mut raws = [R::default(); DEPTH];
            for (k, raw) in raws.iter_mut().enumerate() {
                *raw = load(a + k * step);
            }
            for (k, raw) in raws.iter().enumerate() {
                f(a + k * step, raw);
            }
            a += DEPTH * step;
        }
    }
    while a < accesses {
        f(a, &load(a));
        a += step;
    }
}

/// `Σ f(x)` over one row of `d` elements, read from memory (L2, after the first pass) by the
/// whole block; every thread gets the sum. Each thread adds its accesses in order.
///
/// # Safety
/// The row is readable as the access requires; every thread of the block calls it.
#[inline(always)]
pub(super) unsafe fn stream_sum<
    T: Element,
    const VEC: bool,
    S: RowSource<T, VEC>,
    const DEPTH: usize,
>(
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
    stream_accesses::<_, DEPTH>(
        team.tid,
        team.threads,
        d.div_ceil(len),
        // SAFETY: the access lies inside the row (the caller's contract).
        |a| unsafe { src.load_kept(&row, a * len) },
        |_, raw| {
            let x = src.hold(raw);
            for i in 0..len {
                sum += f(S::get(&x, i));
            }
        },
    );
    unsafe { reducer.sum(sum) }
}
