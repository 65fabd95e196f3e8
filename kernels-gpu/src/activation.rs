//! Activations, forward and backward, plain and gated, and a backward with a fused dbias.
//!
//! The functions and their derivatives are public `#[inline]` device functions, so other Rust GPU
//! kernels (a matmul-backward epilogue, say) can fuse them: the backward recomputes `f'(preact)`
//! from the saved pre-activation, so the derivative never round-trips through memory (seed 000).
//! No libm: everything is built on `ex2.approx`, `rcp.approx` and FMA polynomials (one `erfc` fit);
//! the accuracy against f64 is measured by `cargo test` (emulator) and on the GPU, see
//! `docs/activation-accuracy.md`. SiLU and GELU are a few dozen instructions per element, so the
//! kernels stay memory-bound only with these fast forms (IEEE division made them arithmetic-bound).
//!
//! Kernels walk `rows × d` elements in 16-byte packs (or single elements for unaligned views),
//! with every operand on its own row stride; fp32 math, one rounding at the store.
//!
//! Special values: NaN in gives NaN out (forward and derivative). ±∞ give the limits:
//! `silu(−∞) = gelu(−∞) = 0`, `f(+∞) = +∞`, `f'(−∞) = 0`, `f'(+∞) = 1`.

use core::f32::consts::{FRAC_1_SQRT_2, LOG2_E};

use crate::arch;
use crate::element::{Access, Element, Pack, row_addr, store_f32s};
use crate::variant::{act, export_activation_family};

/// `1/sqrt(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
/// `sqrt(2/π)`, the scale of the tanh form of GELU.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh form of GELU.
const GELU_TANH_CUBIC: f32 = 0.044_715;

/// `e^x` through `ex2.approx.f32`: relative error a few 1e-7 near 0, growing to about 1e-5 for
/// |x| near 80 (the f32 rounding of `x·log2 e`); overflows to +∞ above 88.7, flushes to 0 below −103.
#[inline]
pub fn exp(x: f32) -> f32 {
    arch::exp2(x * LOG2_E)
}

/// [`exp`] with subnormal results flushed to zero: for sums with 1, where they change nothing.
#[inline]
fn exp_ftz(x: f32) -> f32 {
    arch::exp2_ftz(x * LOG2_E)
}

/// `x · t` where `t` vanishes faster than `x` grows (a tail of exp): `0` when `t == 0`, so the
/// limits at ±∞ are 0 rather than `∞ · 0 = NaN`; NaN still propagates through `t`.
#[inline]
fn times_vanishing(x: f32, t: f32) -> f32 {
    if t == 0.0 { 0.0 } else { x * t }
}

/// `c + x · t` with `t` as in [`times_vanishing`], one rounding (FMA) when `t ≠ 0`.
#[inline]
fn plus_times_vanishing(c: f32, x: f32, t: f32) -> f32 {
    if t == 0.0 { c } else { arch::fma(x, t, c) }
}

/// The logistic function `1 / (1 + e^−x)`, with a 1-ulp reciprocal (`rcp.approx`): an IEEE
/// division's range check and slow path would make SiLU arithmetic-bound. Results below 2⁻¹²⁶
/// (x < −87.3) flush to 0.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    arch::rcp_approx(1.0 + exp_ftz(-x))
}

/// Numerical Recipes' `erfcc` Chebyshev fit: `erfc(a) = t·exp(−a² + Σ c_k t^k)`, `t = 1/(1 + a/2)`,
/// fractional error below 1.2e-7 for every `a ≥ 0` (so the tail keeps its relative accuracy and
/// `gelu` of large negative inputs does not cancel). `c_0` first.
const ERFCC: [f32; 10] = [
    -1.265_512_2,
    1.000_023_7,
    0.374_091_96,
    0.096_784_18,
    -0.186_288_06,
    0.278_868_07,
    -1.135_204,
    1.488_515_9,
    -0.822_152_23,
    0.170_872_77,
];

/// The same polynomial in `h = t/2 = 1/(2 + a)` and in base 2, highest power first (Horner):
/// coefficient `c_k · 2^k · log2 e`. Evaluating `erfc/2 = h · 2^(Σ … − a²·log2 e)` this way saves
/// the multiplications by ½ and by log2 e per element (the scaling by 2^k is exact).
const HALF_ERFC_POLY: [f32; 10] = {
    let mut out = [0.0; 10];
    let (mut k, mut scale) = (0, LOG2_E);
    while k < 10 {
        out[9 - k] = ERFCC[k] * scale;
        k += 1;
        scale *= 2.0;
    }
    out
};

/// A shorter fit of the same function of `h` (degree 5, base 2, highest power first; least squares
/// with Lawson reweighting on Chebyshev-spaced h, coefficients rounded to f32): relative error of
/// `erfc` below 5.8e-5 for every `a ≥ 0`, evaluated in f32. The kernels use it when the result is
/// stored as f16 or bf16, whose rounding (up to 2⁻¹¹ and 2⁻⁸ relative) is 8 and 70 times larger;
/// four fewer FMAs per element keep GELU-erf memory-bound.
const HALF_ERFC_POLY_SHORT: [f32; 6] = [
    8.298_8,
    -13.195_384,
    3.827_871_3,
    1.856_153_8,
    2.897_199_6,
    -1.825_821,
];

/// `erfc(a)/2` for `a ≥ 0` through the fit `poly` (NaN propagates, `+∞` gives 0). Results below
/// about 2e-39 (a > 9.2), already subnormal, flush to 0.
#[inline(always)]
fn half_erfc_nonneg<const N: usize>(a: f32, poly: &[f32; N]) -> f32 {
    let h = arch::rcp_approx(a + 2.0);
    let mut sum = poly[0];
    for &c in &poly[1..] {
        sum = arch::fma(sum, h, c);
    }
    h * arch::exp2_ftz(arch::fma(a * -LOG2_E, a, sum))
}

/// Complementary error function, on Numerical Recipes' `erfcc` fit (fractional error below 1.2e-7
/// in exact arithmetic; see [`ERFCC`]) with `ex2.approx` and `rcp.approx`.
#[inline]
pub fn erfc(z: f32) -> f32 {
    let r = 2.0 * half_erfc_nonneg(z.abs(), &HALF_ERFC_POLY);
    if z >= 0.0 { r } else { 2.0 - r }
}

/// The standard normal CDF `Φ(x) = erfc(−x/√2)/2`, computed without cancellation for x < 0.
#[inline(always)]
fn normal_cdf<const N: usize>(x: f32, poly: &[f32; N]) -> f32 {
    let q = half_erfc_nonneg(x.abs() * FRAC_1_SQRT_2, poly);
    if x > 0.0 { 1.0 - q } else { q }
}

/// ReLU: `max(x, 0)`, NaN propagating.
#[inline]
pub fn relu(x: f32) -> f32 {
    if x > 0.0 || x.is_nan() { x } else { 0.0 }
}

/// ReLU': 1 for `x > 0`, else 0; NaN for NaN.
#[inline]
pub fn relu_grad(x: f32) -> f32 {
    if x.is_nan() {
        x
    } else if x > 0.0 {
        1.0
    } else {
        0.0
    }
}

/// SiLU (swish): `x · σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    times_vanishing(x, sigmoid(x))
}

/// SiLU': `σ(x) · (1 + x · (1 − σ(x)))`, evaluated as `σ + x·σ·(1 − σ)`.
#[inline]
pub fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    plus_times_vanishing(s, x, s * (1.0 - s))
}

/// GELU, exact form: `x · Φ(x) = ½ · x · erfc(−x/√2)`. Results below about 1e-38 in magnitude
/// (x < −13.2) flush to 0.
#[inline]
pub fn gelu_erf(x: f32) -> f32 {
    gelu_erf_with(x, &HALF_ERFC_POLY)
}

#[inline(always)]
fn gelu_erf_with<const N: usize>(x: f32, poly: &[f32; N]) -> f32 {
    // Clamping x keeps `−∞ · Φ(−∞) = −∞ · 0` at 0 in one instruction (NaN still propagates
    // through Φ).
    x.max(-f32::MAX) * normal_cdf(x, poly)
}

/// GELU' (exact form): `Φ(x) + x · φ(x)`.
#[inline]
pub fn gelu_erf_grad(x: f32) -> f32 {
    gelu_erf_grad_with(x, &HALF_ERFC_POLY)
}

#[inline(always)]
fn gelu_erf_grad_with<const N: usize>(x: f32, poly: &[f32; N]) -> f32 {
    // φ(x) = e^(−x²/2)/√(2π); below 2⁻¹²⁶ (|x| > 13.2) it flushes to 0.
    let phi = FRAC_1_SQRT_2PI * arch::exp2_ftz(x * x * (-0.5 * LOG2_E));
    plus_times_vanishing(normal_cdf(x, poly), x, phi)
}

/// GELU, tanh approximation: `½x(1 + tanh(u))`, `u = √(2/π)(x + 0.044715x³)`, evaluated as
/// `x · σ(2u)` (the same function without the cancellation of `1 + tanh` for negative x).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    times_vanishing(x, sigmoid(gelu_tanh_2u(x)))
}

/// `2u = 2·√(2/π)·x·(1 + 0.044715·x²)` of the tanh form of GELU.
#[inline]
fn gelu_tanh_2u(x: f32) -> f32 {
    const TWO_S: f32 = 2.0 * SQRT_2_OVER_PI;
    x * arch::fma(TWO_S * GELU_TANH_CUBIC, x * x, TWO_S)
}

/// Derivative of [`gelu_tanh`]: `σ(2u) + x · 2σ(2u)(1 − σ(2u)) · u'`.
#[inline]
pub fn gelu_tanh_grad(x: f32) -> f32 {
    // d(2u)/dx = 2·√(2/π)·(1 + 3·0.044715·x²); σ(2u)' = σ(1 − σ)·d(2u)/dx.
    const TWO_S: f32 = 2.0 * SQRT_2_OVER_PI;
    let d2u = arch::fma(3.0 * TWO_S * GELU_TANH_CUBIC, x * x, TWO_S);
    let s = sigmoid(gelu_tanh_2u(x));
    plus_times_vanishing(s, x, times_vanishing(d2u, s * (1.0 - s)))
}

/// `f(x)` for the activation `ACT` (one of [`act`]); resolved at compile time.
#[inline(always)]
pub fn apply<const ACT: u32>(x: f32) -> f32 {
    match ACT {
        act::RELU => relu(x),
        act::SILU => silu(x),
        act::GELU_ERF => gelu_erf(x),
        _ => gelu_tanh(x),
    }
}

/// `f'(x)` for the activation `ACT`; resolved at compile time.
#[inline(always)]
pub fn grad<const ACT: u32>(x: f32) -> f32 {
    match ACT {
        act::RELU => relu_grad(x),
        act::SILU => silu_grad(x),
        act::GELU_ERF => gelu_erf_grad(x),
        _ => gelu_tanh_grad(x),
    }
}

/// [`apply`] as the kernels evaluate it for storage dtype `T`: GELU-erf with the shorter erfc fit
/// ([`HALF_ERFC_POLY_SHORT`]) when the result is rounded to f16 or bf16 anyway.
#[inline(always)]
fn apply_stored<T: Element, const ACT: u32>(x: f32) -> f32 {
    if ACT == act::GELU_ERF && T::BYTES < 4 {
        gelu_erf_with(x, &HALF_ERFC_POLY_SHORT)
    } else {
        apply::<ACT>(x)
    }
}

/// [`grad`] as the kernels evaluate it for storage dtype `T` (see [`apply_stored`]).
#[inline(always)]
fn grad_stored<T: Element, const ACT: u32>(x: f32) -> f32 {
    if ACT == act::GELU_ERF && T::BYTES < 4 {
        gelu_erf_grad_with(x, &HALF_ERFC_POLY_SHORT)
    } else {
        grad::<ACT>(x)
    }
}

/// Launch parameters of every activation kernel: up to three row inputs and two row outputs, each
/// with its own stride (elements), and the dbias group layout. Unused pointers are 0.
///
/// | family | in0 | in1 | in2 | out0 | out1 |
/// |---|---|---|---|---|---|
/// | `act_fwd` | x | | | y | |
/// | `act_bwd`, `act_bwd_dbias` | dy | preact | | dx (may be dy) | |
/// | `glu_fwd` | a | b | | h | |
/// | `glu_bwd` | dh | a | b | da | db |
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Params {
    pub inputs: [u64; 3],
    pub outputs: [u64; 2],
    pub input_strides: [u64; 3],
    pub output_strides: [u64; 2],
    /// `[groups, d]` fp32 dbias partials (`act_bwd_dbias` only).
    pub partials: u64,
    pub rows: u32,
    pub d: u32,
    pub rows_per_group: u32,
    pub groups: u32,
}

impl Params {
    /// Address of row `row` of input `k`.
    #[inline(always)]
    fn input_row<T: Element>(&self, k: usize, row: usize) -> u64 {
        let (base, stride) = pick(k, &self.inputs, &self.input_strides);
        row_addr::<T>(base, row, stride)
    }
    /// Address of row `row` of output `k`.
    #[inline(always)]
    fn output_row<T: Element>(&self, k: usize, row: usize) -> u64 {
        let (base, stride) = pick(k, &self.outputs, &self.output_strides);
        row_addr::<T>(base, row, stride)
    }
}

/// `(bases[k], strides[k])` by selects, never by a dynamic index: if LLVM leaves a loop over
/// operands rolled, indexing the kernel-parameter arrays would copy them to local memory.
#[inline(always)]
fn pick<const N: usize>(k: usize, bases: &[u64; N], strides: &[u64; N]) -> (u64, u64) {
    let mut picked = (bases[0], strides[0]);
    for j in 1..N {
        if k == j {
            picked = (bases[j], strides[j]);
        }
    }
    picked
}

/// The elementwise kernels' engine: for every element of the `rows × d` grid, `outputs = f(inputs)`
/// with `IN` row inputs and `OUT` row outputs, each on its own stride. Accesses are spread over all
/// blocks in tiles of `block_dim · UNROLL` consecutive accesses (thread `t` takes accesses `t`,
/// `t + block_dim`, …: coalesced), tiles by grid stride. The host launches one block per tile:
/// a persistent grid loses its last, partly filled trip (about 10 % at 64Mi elements, measured).
/// All loads of a tile are issued before any result is computed, so a thread keeps
/// `UNROLL · IN · 16` bytes in flight; [`Family::unroll`] keeps that near 64 to 128 bytes, in
/// registers.
/// An output may alias an input (in-place backward): every element is read before it is written,
/// by the same thread.
#[inline(always)]
fn elementwise<
    T: Element,
    const VEC: bool,
    const IN: usize,
    const OUT: usize,
    const UNROLL: usize,
>(
    p: &Params,
    f: impl Fn([f32; IN]) -> [f32; OUT],
) {
    let len = Access::<T, VEC>::LEN;
    let rows = p.rows as usize;
    let per_row = (p.d as usize) / len;
    let (threads, tile) = (arch::block_dim(), arch::block_dim() * UNROLL);
    let total = rows * per_row;
    let mut tile_start = arch::block_idx() * tile;
    if rows == 1 {
        // One row (the host hands contiguous operands over as one): positions are plain indices,
        // no cursor arithmetic and no row addresses.
        while tile_start < total {
            let first = (0, tile_start + arch::thread_idx());
            let advance = |(row, access): (usize, usize)| (row, access + threads);
            elementwise_tile::<T, VEC, IN, OUT, UNROLL>(p, &f, first, advance, |(_, a)| a < total);
            tile_start += arch::grid_dim() * tile;
        }
        return;
    }
    // Within a tile the cursor moves by whole rows and leftover accesses: no division per access.
    let (step_rows, step_accesses) = (threads / per_row, threads % per_row);
    let advance = |(row, access): (usize, usize)| {
        let (row, access) = (row + step_rows, access + step_accesses);
        if access >= per_row {
            (row + 1, access - per_row)
        } else {
            (row, access)
        }
    };
    while tile_start < total {
        // The host rejects more than 2³² − 1 accesses, so u32 division is exact here.
        let (first, per_row32) = ((tile_start + arch::thread_idx()) as u32, per_row as u32);
        let first = ((first / per_row32) as usize, (first % per_row32) as usize);
        elementwise_tile::<T, VEC, IN, OUT, UNROLL>(p, &f, first, advance, |(r, _)| r < rows);
        tile_start += arch::grid_dim() * tile;
    }
}

/// One thread's share of one tile of [`elementwise`]: the `UNROLL` positions `first`,
/// `advance(first)`, … (row, access in the row), those that are `inside` the grid.
#[inline(always)]
fn elementwise_tile<
    T: Element,
    const VEC: bool,
    const IN: usize,
    const OUT: usize,
    const UNROLL: usize,
>(
    p: &Params,
    f: &impl Fn([f32; IN]) -> [f32; OUT],
    first: (usize, usize),
    advance: impl Fn((usize, usize)) -> (usize, usize),
    inside: impl Fn((usize, usize)) -> bool,
) {
    let len = Access::<T, VEC>::LEN;
    let mut ins = [[[0u32; 4]; IN]; UNROLL];
    let mut at = first;
    for packs in ins.iter_mut() {
        if inside(at) {
            for (j, pack) in packs.iter_mut().enumerate() {
                let row = p.input_row::<T>(j, at.0);
                *pack = unsafe { Access::<T, VEC>::load(row, at.1 * len) };
            }
        }
        at = advance(at);
    }
    // Walk the same positions again (cheaper than keeping them in registers). Always use slot 0
    // and shift the others down: should LLVM leave this loop rolled (big bodies), a dynamic
    // `ins[k]` would put the packs in local memory.
    let mut at = first;
    for _ in 0..UNROLL {
        let ((row, access), packs) = (at, ins[0]);
        for k in 1..UNROLL {
            ins[k - 1] = ins[k];
        }
        if inside(at) {
            let mut outs = [[0.0f32; 8]; OUT];
            for i in 0..len {
                let mut args = [0.0f32; IN];
                for (j, arg) in args.iter_mut().enumerate() {
                    *arg = T::get(&packs[j], i);
                }
                let results = f(args);
                // Indexed, not `zip`/`into_iter`: LLVM leaves array iterators rolled, and a
                // rolled loop over `outs` means local memory.
                #[allow(clippy::needless_range_loop)]
                for o in 0..OUT {
                    outs[o][i] = results[o];
                }
            }
            for (o, vals) in outs.iter().enumerate() {
                let out = p.output_row::<T>(o, row);
                unsafe { Access::<T, VEC>::store(out, access * len, &T::pack(vals, len)) };
            }
        }
        at = advance(at);
    }
}

/// `y = f(x)`. Launch any grid of any block size (a multiple of 32).
///
/// # Safety
/// The params describe valid buffers laid out as the variant requires.
pub unsafe fn forward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 1, 1, { Family::Forward.unroll() }>(p, |[x]| [apply_stored::<T, ACT>(x)]);
}

/// `dx = dy · f'(preact)`; `dx` may be `dy` itself.
///
/// # Safety
/// As for [`forward`].
pub unsafe fn backward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 2, 1, { Family::Backward.unroll() }>(p, |[dy, pre]| {
        [dy * grad_stored::<T, ACT>(pre)]
    });
}

/// Rows of a group [`backward_dbias`] loads before using any: bytes in flight per thread.
const DBIAS_ROWS_IN_FLIGHT: usize = 4;

/// [`backward`] plus `dbias = Σ_rows dx` through the deterministic group partials: each group of
/// `rows_per_group` consecutive rows writes one fp32 row of `partials`, summed afterwards by
/// [`crate::reduce::column_sum`]. A work item is one group × `block_dim` columns (one access per
/// thread); blocks take items by grid stride, so the host can launch one block per item. Which
/// block takes an item never changes the order of any sum.
///
/// # Safety
/// As for [`forward`]; `partials` holds `groups · d` f32, 16-byte aligned.
pub unsafe fn backward_dbias<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    let len = Access::<T, VEC>::LEN;
    let (d, rows) = (p.d as usize, p.rows as usize);
    let per_row = d / len;
    let chunks = per_row.div_ceil(arch::block_dim());
    let mut item = arch::block_idx();
    while item < p.groups as usize * chunks {
        let (group, chunk) = (item / chunks, item % chunks);
        item += arch::grid_dim();
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        let a = chunk * arch::block_dim() + arch::thread_idx();
        if a < per_row {
            let col = a * len;
            let mut dbias = [0.0f32; 8];
            let mut row = first;
            while row < end {
                // Load a few rows, then use them in row order: the sum order stays fixed.
                let mut dy: [Pack; DBIAS_ROWS_IN_FLIGHT] = [[0; 4]; DBIAS_ROWS_IN_FLIGHT];
                let mut pre: [Pack; DBIAS_ROWS_IN_FLIGHT] = [[0; 4]; DBIAS_ROWS_IN_FLIGHT];
                for r in 0..DBIAS_ROWS_IN_FLIGHT {
                    if row + r < end {
                        dy[r] =
                            unsafe { Access::<T, VEC>::load(p.input_row::<T>(0, row + r), col) };
                        pre[r] =
                            unsafe { Access::<T, VEC>::load(p.input_row::<T>(1, row + r), col) };
                    }
                }
                for r in 0..DBIAS_ROWS_IN_FLIGHT {
                    if row + r < end {
                        let mut dx = [0.0f32; 8];
                        for i in 0..len {
                            dx[i] = T::get(&dy[r], i) * grad_stored::<T, ACT>(T::get(&pre[r], i));
                            dbias[i] += dx[i];
                        }
                        let out = p.output_row::<T>(0, row + r);
                        unsafe { Access::<T, VEC>::store(out, col, &T::pack(&dx, len)) };
                    }
                }
                row += DBIAS_ROWS_IN_FLIGHT;
            }
            unsafe { store_f32s::<VEC>(p.partials + (group * d * 4) as u64, col, &dbias, len) };
        }
    }
}

/// Gated forward: `h = f(a) · b` (SwiGLU with SiLU, GeGLU with either GELU).
///
/// # Safety
/// As for [`forward`].
pub unsafe fn gated_forward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 2, 1, { Family::GatedForward.unroll() }>(p, |[a, b]| {
        [apply_stored::<T, ACT>(a) * b]
    });
}

/// Gated backward in one pass: `da = dh · b · f'(a)`, `db = dh · f(a)`.
///
/// # Safety
/// As for [`forward`].
pub unsafe fn gated_backward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 3, 2, { Family::GatedBackward.unroll() }>(p, |[dh, a, b]| {
        [
            dh * b * grad_stored::<T, ACT>(a),
            dh * apply_stored::<T, ACT>(a),
        ]
    });
}

export_activation_family!("act_fwd", Params, forward);
export_activation_family!("act_bwd", Params, backward);
export_activation_family!("act_bwd_dbias", Params, backward_dbias);
export_activation_family!("glu_fwd", Params, gated_forward);
export_activation_family!("glu_bwd", Params, gated_backward);

/// The body of an activation family (`"act_fwd"`, …) for a variant, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn body(family: Family, v: crate::variant::ActVariant) -> unsafe fn(&Params) {
    use crate::variant::select_activation_family;
    match family {
        Family::Forward => select_activation_family!(v, Params, forward),
        Family::Backward => select_activation_family!(v, Params, backward),
        Family::BackwardDbias => select_activation_family!(v, Params, backward_dbias),
        Family::GatedForward => select_activation_family!(v, Params, gated_forward),
        Family::GatedBackward => select_activation_family!(v, Params, gated_backward),
    }
}

/// The activation kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Forward,
    Backward,
    BackwardDbias,
    GatedForward,
    GatedBackward,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Forward,
        Family::Backward,
        Family::BackwardDbias,
        Family::GatedForward,
        Family::GatedBackward,
    ];

    /// Accesses (16-byte packs) per thread of the elementwise families: the tile of a block is
    /// `threads · unroll` accesses. (The dbias family walks groups of rows instead.)
    pub const fn unroll(self) -> usize {
        match self {
            Family::Forward | Family::Backward | Family::GatedForward => 4,
            Family::GatedBackward => 2,
            Family::BackwardDbias => 1,
        }
    }

    /// The PTX entry prefix.
    pub const fn prefix(self) -> &'static str {
        match self {
            Family::Forward => "act_fwd",
            Family::Backward => "act_bwd",
            Family::BackwardDbias => "act_bwd_dbias",
            Family::GatedForward => "glu_fwd",
            Family::GatedBackward => "glu_bwd",
        }
    }
}
