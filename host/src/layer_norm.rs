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
    forward: {
        /// LayerNorm forward: writes `y` and, when asked, `mean` and `rstd`.
        ///
        /// ```
        /// use normkern::{Emulator, NormForward, Rows, layer_norm};
        ///
        /// let (rows, d) = (1, 4);
        /// let x = [1.0f32, 3.0, 1.0, 3.0];
        /// let (weight, bias) = ([2.0f32; 4], [0.5f32; 4]);
        /// let (mut y, mut mean) = ([0.0f32; 4], [0.0f32; 1]);
        /// let args = NormForward::new(Rows::new(&x[..], rows, d)?, &weight[..], Rows::new(&mut y[..], rows, d)?)
        ///     .eps(1e-6)
        ///     .bias(&bias[..])
        ///     .mean(&mut mean[..]);
        /// layer_norm::forward(&Emulator::new(), args)?;
        /// // mean 2, variance 1: x̂ = ±1, y = 2·x̂ + 0.5.
        /// assert!(mean[0] == 2.0 && (y[0] + 1.5).abs() < 1e-5 && (y[1] - 2.5).abs() < 1e-5);
        /// # Ok::<(), normkern::Error>(())
        /// ```
    },
    backward: {
        /// LayerNorm backward: writes `dx`, `dweight` and, when asked, `dbias`. With no rows, the
        /// parameter gradients are set to zero.
        ///
        /// ```
        /// use normkern::{Emulator, NormBackward, Rows, layer_norm};
        ///
        /// let (rows, d) = (2, 4);
        /// let x = [1.0f32, 3.0, 1.0, 3.0, 0.0, 4.0, 0.0, 4.0];
        /// let dy = [1.0f32, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
        /// let weight = [1.0f32; 4];
        /// let (mut dx, mut dweight, mut dbias) = ([0.0f32; 8], [0.0f32; 4], [0.0f32; 4]);
        /// let mut workspace = vec![0.0f32; layer_norm::workspace_len(rows, d)?];
        /// let args = NormBackward::new(
        ///     Rows::new(&dy[..], rows, d)?,
        ///     Rows::new(&x[..], rows, d)?,
        ///     &weight[..],
        ///     Rows::new(&mut dx[..], rows, d)?,
        ///     &mut dweight[..],
        ///     &mut workspace[..],
        /// )
        /// .eps(1e-6)
        /// .dbias(&mut dbias[..]);
        /// layer_norm::backward(&Emulator::new(), args)?;
        /// // dβ = Σ_rows dy; dγ_0 = Σ_rows dy·x̂ = −1 − 1; each row's dx sums to zero.
        /// assert_eq!(dbias, [2.0, 0.0, 0.0, 0.0]);
        /// assert!((dweight[0] + 2.0).abs() < 1e-5 && dx[..4].iter().sum::<f32>().abs() < 1e-5);
        /// # Ok::<(), normkern::Error>(())
        /// ```
    },
    workspace: {
        /// f32 elements of workspace the backward needs for `rows × d`: the single launch's
        /// barrier words (4), then room for dγ's and dβ's partial rows. Allocate it zeroed
        /// ([`crate::ParamGradients`]).
        ///
        /// ```
        /// use normkern::{layer_norm, rms_norm};
        /// let (ln, rms) = (layer_norm::workspace_len(1000, 512)?, rms_norm::workspace_len(1000, 512)?);
        /// assert_eq!(ln - 4, 2 * (rms - 4));
        /// # Ok::<(), normkern::Error>(())
        /// ```
    }
);
