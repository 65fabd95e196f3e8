//! Activations, forward and backward, plain and gated, and a backward with a fused dbias.
//!
//! The functions and their derivatives are public `#[inline]` device functions, so other Rust GPU
//! kernels (a matmul-backward epilogue, say) can fuse them: the backward recomputes `f'(preact)`
//! from the saved pre-activation, so the derivative never round-trips through memory (seed 000).
//! No libm: everything is built on [`exp`] (PTX `ex2.approx.f32`) and one `erfc` approximation;
//! the accuracy against f64 is measured by `cargo test` (emulator) and on the GPU, see the docs.
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

/// `x · t` where `t` vanishes faster than `x` grows (a tail of exp): `0` when `t == 0`, so the
/// limits at ±∞ are 0 rather than `∞ · 0 = NaN`; NaN still propagates through `t`.
#[inline]
fn times_vanishing(x: f32, t: f32) -> f32 {
    if t == 0.0 { 0.0 } else { x * t }
}

/// The logistic function `1 / (1 + e^−x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Complementary error function, Chebyshev fit of Numerical Recipes' `erfcc` (fractional error
/// below 1.2e-7 in exact arithmetic) on top of [`exp`]. Relative accuracy holds in the tail too, so
/// `gelu` of large negative inputs does not cancel.
#[inline]
pub fn erfc(z: f32) -> f32 {
    let a = z.abs();
    let t = 1.0 / (1.0 + 0.5 * a);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * exp(-a * a + poly);
    if z >= 0.0 { r } else { 2.0 - r }
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
    s + times_vanishing(x, s * (1.0 - s))
}

/// GELU, exact form: `x · Φ(x) = ½ · x · erfc(−x/√2)`.
#[inline]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * times_vanishing(x, erfc(-x * FRAC_1_SQRT_2))
}

/// GELU' (exact form): `Φ(x) + x · φ(x)`.
#[inline]
pub fn gelu_erf_grad(x: f32) -> f32 {
    0.5 * erfc(-x * FRAC_1_SQRT_2) + times_vanishing(x, FRAC_1_SQRT_2PI * exp(-0.5 * x * x))
}

/// GELU, tanh approximation: `½x(1 + tanh(u))`, `u = √(2/π)(x + 0.044715x³)`, evaluated as
/// `x · σ(2u)` (the same function without the cancellation of `1 + tanh` for negative x).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
    times_vanishing(x, sigmoid(2.0 * u))
}

/// Derivative of [`gelu_tanh`]: `σ(2u) + x · 2σ(2u)(1 − σ(2u)) · u'`.
#[inline]
pub fn gelu_tanh_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_TANH_CUBIC * x * x * x);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * x * x);
    let s = sigmoid(2.0 * u);
    s + times_vanishing(x, times_vanishing(du, 2.0 * s * (1.0 - s)))
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
        row_addr::<T>(self.inputs[k], row, self.input_strides[k])
    }
    /// Address of row `row` of output `k`.
    #[inline(always)]
    fn output_row<T: Element>(&self, k: usize, row: usize) -> u64 {
        row_addr::<T>(self.outputs[k], row, self.output_strides[k])
    }
}

/// Calls `f(row, first_element)` for every access of the `rows × d` grid, spread over all threads
/// of the grid. Indices are u32: the host rejects more than 2³² − 1 accesses.
#[inline(always)]
fn for_each_access<T: Element, const VEC: bool>(p: &Params, mut f: impl FnMut(usize, usize)) {
    let len = Access::<T, VEC>::LEN as u32;
    let per_row = p.d / len;
    let total = p.rows * per_row;
    let step = (arch::grid_dim() * arch::block_dim()) as u32;
    let mut i = (arch::block_idx() * arch::block_dim() + arch::thread_idx()) as u32;
    while i < total {
        let row = i / per_row;
        f(row as usize, ((i - row * per_row) * len) as usize);
        i = i.wrapping_add(step);
        if i < step {
            break; // wrapped past 2³²
        }
    }
}

/// `y = f(x)`. Launch any grid of any block size (a multiple of 32).
///
/// # Safety
/// The params describe valid buffers laid out as the variant requires.
pub unsafe fn forward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    let len = Access::<T, VEC>::LEN;
    for_each_access::<T, VEC>(p, |row, col| {
        let x = unsafe { Access::<T, VEC>::load(p.input_row::<T>(0, row), col) };
        let mut y: Pack = [0; 4];
        for i in 0..len {
            T::set(&mut y, i, apply::<ACT>(T::get(&x, i)));
        }
        unsafe { Access::<T, VEC>::store(p.output_row::<T>(0, row), col, &y) };
    });
}

/// `dx = dy · f'(preact)`; `dx` may be `dy` itself (each element is read before it is written, by
/// the same thread).
///
/// # Safety
/// As for [`forward`].
pub unsafe fn backward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    let len = Access::<T, VEC>::LEN;
    for_each_access::<T, VEC>(p, |row, col| {
        let dy = unsafe { Access::<T, VEC>::load(p.input_row::<T>(0, row), col) };
        let pre = unsafe { Access::<T, VEC>::load(p.input_row::<T>(1, row), col) };
        let mut dx: Pack = [0; 4];
        for i in 0..len {
            T::set(&mut dx, i, T::get(&dy, i) * grad::<ACT>(T::get(&pre, i)));
        }
        unsafe { Access::<T, VEC>::store(p.output_row::<T>(0, row), col, &dx) };
    });
}

/// Rows of a group [`backward_dbias`] loads before using any: bytes in flight per thread.
const DBIAS_ROWS_IN_FLIGHT: usize = 4;

/// [`backward`] plus `dbias = Σ_rows dx` through the deterministic group partials: each group of
/// `rows_per_group` consecutive rows writes one fp32 row of `partials`, summed afterwards by
/// [`crate::reduce::column_sum`]. Blocks walk groups by grid stride; threads walk the columns.
///
/// # Safety
/// As for [`forward`]; `partials` holds `groups · d` f32, 16-byte aligned.
pub unsafe fn backward_dbias<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    let len = Access::<T, VEC>::LEN;
    let (d, rows) = (p.d as usize, p.rows as usize);
    let per_row = d / len;
    let mut group = arch::block_idx();
    while group < p.groups as usize {
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        let mut a = arch::thread_idx();
        while a < per_row {
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
                        let mut dx: Pack = [0; 4];
                        for i in 0..len {
                            let v = T::get(&dy[r], i) * grad::<ACT>(T::get(&pre[r], i));
                            T::set(&mut dx, i, v);
                            dbias[i] += v;
                        }
                        let out = p.output_row::<T>(0, row + r);
                        unsafe { Access::<T, VEC>::store(out, col, &dx) };
                    }
                }
                row += DBIAS_ROWS_IN_FLIGHT;
            }
            unsafe { store_f32s::<VEC>(p.partials + (group * d * 4) as u64, col, &dbias, len) };
            a += arch::block_dim();
        }
        group += arch::grid_dim();
    }
}

/// Gated forward: `h = f(a) · b` (SwiGLU with SiLU, GeGLU with either GELU).
///
/// # Safety
/// As for [`forward`].
pub unsafe fn gated_forward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    let len = Access::<T, VEC>::LEN;
    for_each_access::<T, VEC>(p, |row, col| {
        let a = unsafe { Access::<T, VEC>::load(p.input_row::<T>(0, row), col) };
        let b = unsafe { Access::<T, VEC>::load(p.input_row::<T>(1, row), col) };
        let mut h: Pack = [0; 4];
        for i in 0..len {
            T::set(&mut h, i, apply::<ACT>(T::get(&a, i)) * T::get(&b, i));
        }
        unsafe { Access::<T, VEC>::store(p.output_row::<T>(0, row), col, &h) };
    });
}

/// Gated backward in one pass: `da = dh · b · f'(a)`, `db = dh · f(a)`.
///
/// # Safety
/// As for [`forward`].
pub unsafe fn gated_backward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    let len = Access::<T, VEC>::LEN;
    for_each_access::<T, VEC>(p, |row, col| {
        let dh = unsafe { Access::<T, VEC>::load(p.input_row::<T>(0, row), col) };
        let a = unsafe { Access::<T, VEC>::load(p.input_row::<T>(1, row), col) };
        let b = unsafe { Access::<T, VEC>::load(p.input_row::<T>(2, row), col) };
        let (mut da, mut db): (Pack, Pack) = ([0; 4], [0; 4]);
        for i in 0..len {
            let (dh_i, a_i) = (T::get(&dh, i), T::get(&a, i));
            T::set(&mut da, i, dh_i * T::get(&b, i) * grad::<ACT>(a_i));
            T::set(&mut db, i, dh_i * apply::<ACT>(a_i));
        }
        unsafe { Access::<T, VEC>::store(p.output_row::<T>(0, row), col, &da) };
        unsafe { Access::<T, VEC>::store(p.output_row::<T>(1, row), col, &db) };
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
