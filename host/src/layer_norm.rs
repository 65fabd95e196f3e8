//! LayerNorm: `y = (x − μ) · rstd · γ + β` with `μ = mean(x)`, `rstd = 1/sqrt(mean((x − μ)²) + eps)`
//! per row (β optional), and its backward `dx = rstd · (dŷ − mean(dŷ) − x̂ · mean(dŷ · x̂))`,
//! `dŷ = dy · γ`, `x̂ = (x − μ) · rstd`, `dγ = Σ_rows dy · x̂`, `dβ = Σ_rows dy`.
//!
//! The same kernel bodies, arguments and guarantees as [`crate::rms_norm`], plus the bias: the
//! forward takes β ([`NormForward::bias`]) and saves μ ([`NormForward::mean`]) next to rstd; the
//! backward takes both statistics ([`NormBackward::mean_rstd`]) and writes dβ
//! ([`NormBackward::dbias`]) from the same pass, through the same deterministic group partials.
//!
//! # Special values
//!
//! As for [`crate::rms_norm#special-values`]: IEEE arithmetic through the formulas, as in
//! PyTorch; rows independent (a special value in x or dy changes no other row's y, μ, rstd or
//! dx; dγ and dβ see only its row's terms `dy·x̂` and `dy`); the dx of a row it reaches is
//! non-finite throughout, which of NaN, +∞ and −∞ not specified; f16 and bf16 outputs past the
//! dtype's range are ±∞. With LayerNorm's statistics:
//!
//! - NaN or ±∞ in a row of x (or of h = x + residual as stored): that row's μ is NaN or ±∞ and
//!   its rstd NaN, so its y is NaN throughout, and dγ is NaN in every column; dβ is unchanged.
//! - In a row of dy, column j: dγ_j and dβ_j are NaN or ±∞ as `Σ dy·x̂` and `Σ dy` give them.
//! - In γ_j: column j of y is `x̂·γ_j + β_j` in every row (NaN for a NaN; ±∞, or NaN where x̂ = 0,
//!   for ±∞); every row's dx is non-finite; dγ and dβ are unchanged.
//! - In β_j: column j of y is β_j (NaN or that ±∞) in every row; the backward does not read β.

use normkern_gpu::norm::Norm;

use crate::error::Result;
use crate::executor::Executor;
use crate::norm::{NormBackward, NormForward, norm_calls};
use crate::tensor::Dtype;

norm_calls!(
    Norm::Layer,
    forward: "LayerNorm forward: writes `y` and, when asked, `mean` and `rstd`.",
    backward: "LayerNorm backward: writes `dx`, `dweight` and, when asked, `dbias`. With no rows, the parameter gradients are set to zero.",
    workspace: "f32 elements of workspace the backward needs for `rows × d` (room for dγ and dβ partials)."
);
