//! The activation functions and their derivatives as public `#[inline]` device functions, so other
//! Rust GPU kernels (a matmul-backward epilogue, say) can fuse them. No libm: everything is built
//! on `ex2.approx`, `rcp.approx` and FMA polynomials (one `erfc` fit); the accuracy against f64 is
//! measured by `cargo test` (emulator) and on the GPU, see `docs/activation-accuracy.md`.
//!
//! Special values: NaN in gives NaN out (forward and derivative). ±∞ give the limits:
//! `silu(−∞) = gelu(−∞) = 0`, `f(+∞) = +∞`, `f'(−∞) = 0`, `f'(+∞) = 1`.

use core::f32::consts::{FRAC_1_SQRT_2, LOG2_E};

use super::act;
use crate::arch;
use crate::element::Element;

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
/// in exact arithmetic; see `ERFCC`) with `ex2.approx` and `rcp.approx`.
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
pub(super) fn apply_stored<T: Element, const ACT: u32>(x: f32) -> f32 {
    if ACT == act::GELU_ERF && T::BYTES < 4 {
        gelu_erf_with(x, &HALF_ERFC_POLY_SHORT)
    } else {
        apply::<ACT>(x)
    }
}

/// [`grad`] as the kernels evaluate it for storage dtype `T` (see [`apply_stored`]).
#[inline(always)]
pub(super) fn grad_stored<T: Element, const ACT: u32>(x: f32) -> f32 {
    if ACT == act::GELU_ERF && T::BYTES < 4 {
        gelu_erf_grad_with(x, &HALF_ERFC_POLY_SHORT)
    } else {
        grad::<ACT>(x)
    }
}
