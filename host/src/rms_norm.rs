//! RMSNorm: `y = x · rstd · γ` with `rstd = 1/sqrt(mean(x²) + eps)` per row, and its backward
//! `dx = rstd · (dŷ − x̂ · mean(dŷ · x̂))`, `dŷ = dy · γ`, `x̂ = x · rstd`, `dγ = Σ_rows dy · x̂`.
//!
//! The forward saves one fp32 `rstd` per row; the backward recomputes `x̂` from `x` and that
//! `rstd` (or recomputes rstd too). dγ goes through an explicit fp32 workspace of
//! [`workspace_len`] elements (one partial row per group of consecutive rows, summed in a fixed
//! order), so it is bitwise reproducible on any grid and any GPU. A residual add can be fused in
//! ([`NormForward::residual`], [`NormBackward::dresidual`]).
//!
//! ```no_run
//! use half::bf16;
//! use normkern::{Context, NormBackward, NormForward, Rows, rms_norm};
//!
//! # fn main() -> normkern::Result<()> {
//! let ctx = Context::new(0)?;
//! let stream = ctx.cuda().new_stream().unwrap();
//! let gpu = ctx.on(&stream)?;
//! let (rows, d) = (4096, 4096);
//! let x = stream.clone_htod(&vec![bf16::from_f32(0.5); rows * d]).unwrap();
//! let dy = stream.clone_htod(&vec![bf16::from_f32(0.1); rows * d]).unwrap();
//! let weight = stream.clone_htod(&vec![bf16::ONE; d]).unwrap();
//! let mut y = stream.alloc_zeros::<bf16>(rows * d).unwrap();
//! let mut rstd = stream.alloc_zeros::<f32>(rows).unwrap();
//! rms_norm::forward(
//!     &gpu,
//!     NormForward::new(Rows::new(x.as_view(), rows, d)?, weight.as_view(), Rows::new(y.as_view_mut(), rows, d)?)
//!         .eps(1e-6)
//!         .rstd(rstd.as_view_mut()),
//! )?;
//!
//! let mut dx = stream.alloc_zeros::<bf16>(rows * d).unwrap();
//! let mut dweight = stream.alloc_zeros::<bf16>(d).unwrap();
//! let mut workspace = stream.alloc_zeros::<f32>(rms_norm::workspace_len(rows, d)?).unwrap();
//! rms_norm::backward(
//!     &gpu,
//!     NormBackward::new(
//!         Rows::new(dy.as_view(), rows, d)?,
//!         Rows::new(x.as_view(), rows, d)?,
//!         weight.as_view(),
//!         Rows::new(dx.as_view_mut(), rows, d)?,
//!         dweight.as_view_mut(),
//!         workspace.as_view_mut(),
//!     )
//!     .eps(1e-6)
//!     .rstd(rstd.as_view()),
//! )?;
//! # Ok(()) }
//! ```
//!
//! # Special values
//!
//! NaN and ±∞ go through the formulas above in IEEE arithmetic, as in PyTorch: nothing is checked
//! or clamped. Rows stay independent: a special value in x or dy changes no other row's
//! y, rstd or dx (they keep their bits), and reaches dγ only through its own row's terms `dy·x̂`.
//!
//! - In a row of x (with the residual fused in, of h = x + residual as stored): that row's rstd is
//!   NaN for a NaN and 0 for ±∞ (`1/sqrt(∞)`), so its y is NaN throughout for a NaN, and NaN at
//!   the ±∞ and ±0 elsewhere for ±∞. Its dx is non-finite throughout; dγ is NaN in the columns
//!   where its x̂ is NaN (every column for a NaN, the ±∞'s column for ±∞).
//! - In a row of dy, column j: that row's dx is non-finite throughout; dγ_j is NaN or ±∞ as
//!   `Σ dy·x̂` gives it.
//! - In γ_j: column j of y is `x̂·γ_j` in every row (NaN for a NaN; ±∞, or NaN where x̂ = 0, for
//!   ±∞); every row's dx is non-finite throughout; dγ is unchanged.
//! - Which of NaN, +∞ and −∞ a non-finite dx element is, is not specified (PyTorch's own backward
//!   formulas differ on it); y, rstd and dγ are what the formulas give.
//! - f16 and bf16 outputs are rounded to nearest: a value past the dtype's range is ±∞, never
//!   clamped, as PyTorch's cast gives (h included: a sum past the range makes its row one holding
//!   ±∞).

use normkern_gpu::norm::Norm;

use crate::error::Result;
use crate::executor::Executor;
use crate::norm::{NormBackward, NormForward, norm_calls};
use crate::tensor::Dtype;

norm_calls!(
    Norm::Rms,
    forward: {
        /// RMSNorm forward: writes `y` and, when asked, `rstd`. `bias` and `mean` must be `None`.
        ///
        /// ```
        /// use normkern::{Emulator, NormForward, Rows, rms_norm};
        ///
        /// let (rows, d) = (2, 4);
        /// let x = [1.0f32, -1.0, 1.0, -1.0, 2.0, 2.0, -2.0, -2.0];
        /// let weight = [1.0f32, 2.0, 3.0, 4.0];
        /// let (mut y, mut rstd) = ([0.0f32; 8], [0.0f32; 2]);
        /// let args = NormForward::new(Rows::new(&x[..], rows, d)?, &weight[..], Rows::new(&mut y[..], rows, d)?)
        ///     .eps(1e-6)
        ///     .rstd(&mut rstd[..]);
        /// rms_norm::forward(&Emulator::new(), args)?;
        /// // Row 1: mean(x²) = 4, so rstd = 1/2 and y = x/2 · γ.
        /// let expected = [1.0, 2.0, -3.0, -4.0];
        /// assert!((rstd[1] - 0.5).abs() < 1e-6);
        /// assert!(y[4..].iter().zip(expected).all(|(y, e)| (y - e).abs() < 1e-5));
        /// # Ok::<(), normkern::Error>(())
        /// ```
    },
    backward: {
        /// RMSNorm backward: writes `dx` and `dweight`. `mean` and `dbias` must be `None`. With no
        /// rows, `dweight` is set to zero.
        ///
        /// ```
        /// use normkern::{Emulator, NormBackward, Rows, rms_norm};
        ///
        /// let (rows, d) = (2, 4);
        /// let x = [1.0f32, -1.0, 1.0, -1.0, 2.0, 2.0, -2.0, -2.0];
        /// let dy = [1.0f32; 8];
        /// let weight = [1.0f32; 4];
        /// let (mut dx, mut dweight) = ([0.0f32; 8], [0.0f32; 4]);
        /// let mut workspace = vec![0.0f32; rms_norm::workspace_len(rows, d)?];
        /// let args = NormBackward::new(
        ///     Rows::new(&dy[..], rows, d)?,
        ///     Rows::new(&x[..], rows, d)?,
        ///     &weight[..],
        ///     Rows::new(&mut dx[..], rows, d)?,
        ///     &mut dweight[..],
        ///     &mut workspace[..],
        /// )
        /// .eps(1e-6); // no saved rstd: recomputed from x
        /// rms_norm::backward(&Emulator::new(), args)?;
        /// // dγ_j = Σ_rows dy · x̂: x̂ is ±1 in both rows here.
        /// assert!((dweight[0] - 2.0).abs() < 1e-5 && (dweight[3] + 2.0).abs() < 1e-5);
        /// # Ok::<(), normkern::Error>(())
        /// ```
    },
    workspace: {
        /// f32 elements of workspace the backward needs for `rows × d`: the single launch's
        /// barrier words (4), then one fp32 partial row per group of rows, the groups fixed by
        /// the shape. Allocate it zeroed ([`crate::ParamGradients`]).
        ///
        /// ```
        /// let len = normkern::rms_norm::workspace_len(16384, 4096)?;
        /// assert!(len > 4096 && (len - 4) % 4096 == 0);
        /// # Ok::<(), normkern::Error>(())
        /// ```
    }
);
