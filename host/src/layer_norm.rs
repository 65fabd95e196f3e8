//! LayerNorm: `y = (x − μ) · rstd · γ + β` with `μ = mean(x)`, `rstd = 1/sqrt(mean((x − μ)²) + eps)`
//! per row (β optional), and its backward `dx = rstd · (dŷ − mean(dŷ) − x̂ · mean(dŷ · x̂))`,
//! `dŷ = dy · γ`, `x̂ = (x − μ) · rstd`, `dγ = Σ_rows dy · x̂`, `dβ = Σ_rows dy`.
//!
//! The same kernel bodies, arguments and guarantees as [`crate::rms_norm`], plus the bias: the
//! forward takes β ([`NormForward::bias`]) and saves μ ([`NormForward::mean`]) next to rstd; the
//! backward takes both statistics ([`NormBackward::mean_rstd`]) and writes dβ
//! ([`NormBackward::dbias`]) from the same pass, through the same deterministic group partials.

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
