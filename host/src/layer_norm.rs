//! LayerNorm: `y = (x − μ) · rstd · γ + β` with `μ = mean(x)`, `rstd = 1/sqrt(mean((x − μ)²) + eps)`
//! per row (β optional), and its backward `dx = rstd · (dŷ − mean(dŷ) − x̂ · mean(dŷ · x̂))`,
//! `dŷ = dy · γ`, `x̂ = (x − μ) · rstd`, `dγ = Σ_rows dy · x̂`, `dβ = Σ_rows dy`.
//!
//! The forward saves fp32 μ and rstd per row; the backward recomputes `x̂` from `x` and them. dγ
//! and dβ come from the same pass over x and dy, through the same deterministic group partials and
//! fixed-order column sum as RMSNorm (the kernels are the same bodies), in an explicit fp32
//! workspace of [`workspace_len`] elements. No device memory is allocated and nothing synchronizes
//! inside a call.
//!
//! [`forward_residual`] and [`backward_residual`] fuse the residual add of a pre-norm block, as
//! RMSNorm's do.

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};
use normkern_gpu::norm::Norm;

use crate::context::{Context, Gpu};
use crate::emulator::Emulator;
use crate::error::{Error, Result};
use crate::launch::group_layout;
use crate::norm::{
    Backward, Forward, HostResidual, NormConfig, ResidualRows, check_grad_dtype, opt_ptr,
    params_f32, validate_backward, validate_forward, validate_residual, validate_residual_backward,
};
use crate::tensor::{Dtype, Rows, RowsMut, RowsRef};

/// f32 elements of workspace the backward needs for `rows × d` (room for dγ and dβ partials).
pub fn workspace_len(rows: usize, d: usize) -> usize {
    2 * group_layout(rows, d).1 * d
}

/// Allocates a workspace of [`workspace_len`] f32 on `stream` (outside any launch: do it once and
/// reuse it for every backward of that shape or smaller).
pub fn alloc_workspace(stream: &Arc<CudaStream>, rows: usize, d: usize) -> Result<CudaSlice<f32>> {
    stream
        .alloc_zeros::<f32>(workspace_len(rows, d).max(1))
        .map_err(Error::driver("cuMemAlloc"))
}

/// LayerNorm forward on `stream`: writes `y` and, when given, `mean` and `rstd` (one f32 per row
/// each, for the backward). `gamma` and `beta` (optional) have `d` elements.
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Dtype, P: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    x: &RowsRef<'_, T>,
    gamma: &CudaView<'_, P>,
    beta: Option<&CudaView<'_, P>>,
    y: &mut RowsMut<'_, T>,
    mean: Option<&mut CudaViewMut<'_, f32>>,
    rstd: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    forward_impl::<T, T, T, P>(ctx, stream, cfg, x, None, gamma, beta, y, mean, rstd)
}

/// LayerNorm forward with the residual add fused in: `h = x + residual` is written to
/// `residual_out` and normalized as stored, exactly as [`crate::rms_norm::forward_residual`]
/// describes (same dtypes, strides and rules).
#[allow(clippy::too_many_arguments)]
pub fn forward_residual<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    x: &RowsRef<'_, T>,
    residual: &RowsRef<'_, R>,
    gamma: &CudaView<'_, P>,
    beta: Option<&CudaView<'_, P>>,
    y: &mut RowsMut<'_, T>,
    residual_out: &mut RowsMut<'_, H>,
    mean: Option<&mut CudaViewMut<'_, f32>>,
    rstd: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    let residual = Some((residual, residual_out));
    forward_impl(ctx, stream, cfg, x, residual, gamma, beta, y, mean, rstd)
}

#[allow(clippy::too_many_arguments)]
fn forward_impl<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    x: &RowsRef<'_, T>,
    residual: Option<(&RowsRef<'_, R>, &mut RowsMut<'_, H>)>,
    gamma: &CudaView<'_, P>,
    beta: Option<&CudaView<'_, P>>,
    y: &mut RowsMut<'_, T>,
    mean: Option<&mut CudaViewMut<'_, f32>>,
    rstd: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    let stats = [
        ("mean", mean.as_ref().map(|m| m.len())),
        ("rstd", rstd.as_ref().map(|r| r.len())),
    ];
    validate_forward(x, gamma.len(), beta.map(|b| b.len()), cfg, y, &stats)?;
    let residual_f32 = match &residual {
        Some((r, o)) => Some(validate_residual::<T, _, _>(x, r, o)?),
        None => None,
    };
    let params_f32 = params_f32::<T, P>()?;
    ctx.check_context("stream", stream)?;
    ctx.check_context("x", x.data.stream())?;
    ctx.check_context("gamma", gamma.stream())?;
    ctx.check_context("y", y.data.stream())?;
    for (what, s) in [
        ("beta", beta.map(|b| b.stream())),
        ("mean", mean.as_ref().map(|m| m.stream())),
        ("rstd", rstd.as_ref().map(|r| r.stream())),
    ] {
        if let Some(s) = s {
            ctx.check_context(what, s)?;
        }
    }
    let (residual, _residual) = match residual.zip(residual_f32) {
        Some(((r, o), f32s)) => {
            let (rows, guards) = ResidualRows::device(ctx, stream, r, o, f32s)?;
            (Some(rows), Some(guards))
        }
        None => (None, None),
    };
    let (x_ptr, _x) = x.data.device_ptr(stream);
    let (gamma_ptr, _gamma) = gamma.device_ptr(stream);
    let (beta_ptr, _beta) = opt_ptr!(beta, stream, device_ptr);
    let (y_ptr, _y) = y.data.device_ptr_mut(stream);
    let (mean_ptr, _mean) = opt_ptr!(mean, stream, device_ptr_mut);
    let (rstd_ptr, _rstd) = opt_ptr!(rstd, stream, device_ptr_mut);
    Forward {
        norm: Norm::Layer,
        dtype: T::KERNEL,
        rows: x.rows,
        d: x.d,
        x: (x_ptr, x.stride),
        y: (y_ptr, y.stride),
        gamma: gamma_ptr,
        beta: beta_ptr,
        mean: mean_ptr,
        rstd: rstd_ptr,
        cfg: *cfg,
        params_f32,
        residual,
    }
    .run(&Gpu { ctx, stream })
}

/// LayerNorm backward on `stream`: writes `dx`, `dgamma` and, when given, `dbeta` from `dy`, `x`,
/// `gamma` and the forward's `(mean, rstd)` — or, with `stats = None`, statistics recomputed from
/// `x` (nothing saved by the forward; one more reduction per row) — using `workspace` (at least
/// [`workspace_len`] f32).
/// With `rows == 0`, `dgamma` and `dbeta` are set to zero.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Dtype, P: Dtype, G: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    dy: &RowsRef<'_, T>,
    x: &RowsRef<'_, T>,
    gamma: &CudaView<'_, P>,
    stats: Option<(&CudaView<'_, f32>, &CudaView<'_, f32>)>,
    dx: &mut RowsMut<'_, T>,
    dgamma: &mut CudaViewMut<'_, G>,
    dbeta: Option<&mut CudaViewMut<'_, G>>,
    workspace: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    backward_residual(
        ctx, stream, cfg, dy, x, gamma, stats, None, dx, dgamma, dbeta, workspace,
    )
}

/// The backward of [`forward_residual`]: [`backward`] with `x` the forward's `residual_out` (in
/// dy's dtype or f32) and, when given, `dresidual` (the gradient arriving on `residual_out`, same
/// dtype and shape, own stride) added into dx in the same pass, as
/// [`crate::rms_norm::backward_residual`] describes.
#[allow(clippy::too_many_arguments)]
pub fn backward_residual<T: Dtype, H: Dtype, P: Dtype, G: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    dy: &RowsRef<'_, T>,
    x: &RowsRef<'_, H>,
    gamma: &CudaView<'_, P>,
    stats: Option<(&CudaView<'_, f32>, &CudaView<'_, f32>)>,
    dresidual: Option<&RowsRef<'_, H>>,
    dx: &mut RowsMut<'_, T>,
    dgamma: &mut CudaViewMut<'_, G>,
    dbeta: Option<&mut CudaViewMut<'_, G>>,
    workspace: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    validate_backward(
        cfg,
        dy,
        x,
        dx,
        &[
            ("gamma", Some(gamma.len())),
            ("dgamma", Some(dgamma.len())),
            ("dbeta", dbeta.as_ref().map(|b| b.len())),
        ],
        &[
            ("mean", stats.map(|s| s.0.len())),
            ("rstd", stats.map(|s| s.1.len())),
        ],
        workspace.len(),
        workspace_len(x.rows, x.d),
    )?;
    let x_f32 = validate_residual_backward::<T, _>(x, dresidual)?;
    let params_f32 = params_f32::<T, P>()?;
    check_grad_dtype::<T, P, G>()?;
    ctx.check_context("stream", stream)?;
    for (what, s) in [
        ("dy", dy.data.stream()),
        ("x", x.data.stream()),
        ("gamma", gamma.stream()),
        ("dx", dx.data.stream()),
        ("dgamma", dgamma.stream()),
        ("workspace", workspace.stream()),
    ] {
        ctx.check_context(what, s)?;
    }
    if let Some(b) = &dbeta {
        ctx.check_context("dbeta", b.stream())?;
    }
    if let Some((mean, rstd)) = stats {
        ctx.check_context("mean", mean.stream())?;
        ctx.check_context("rstd", rstd.stream())?;
    }
    if let Some(r) = dresidual {
        ctx.check_context("dresidual", r.data.stream())?;
    }
    let (dy_ptr, _dy) = dy.data.device_ptr(stream);
    let (x_ptr, _x) = x.data.device_ptr(stream);
    let (gamma_ptr, _gamma) = gamma.device_ptr(stream);
    let (mean_ptr, _mean) = opt_ptr!(stats.map(|s| s.0), stream, device_ptr);
    let (rstd_ptr, _rstd) = opt_ptr!(stats.map(|s| s.1), stream, device_ptr);
    let (dres_ptr, _dres) = opt_ptr!(dresidual.map(|r| &r.data), stream, device_ptr);
    let (dx_ptr, _dx) = dx.data.device_ptr_mut(stream);
    let (dgamma_ptr, _dgamma) = dgamma.device_ptr_mut(stream);
    let (dbeta_ptr, _dbeta) = opt_ptr!(dbeta, stream, device_ptr_mut);
    let (ws_ptr, _ws) = workspace.device_ptr_mut(stream);
    Backward {
        norm: Norm::Layer,
        dtype: T::KERNEL,
        rows: x.rows,
        d: x.d,
        dy: (dy_ptr, dy.stride),
        x: (x_ptr, x.stride),
        dx: (dx_ptr, dx.stride),
        gamma: gamma_ptr,
        mean: mean_ptr,
        rstd: rstd_ptr,
        dgamma: dgamma_ptr,
        dbeta: dbeta_ptr,
        workspace: ws_ptr,
        cfg: *cfg,
        params_f32,
        grad_dtype: G::KERNEL,
        x_f32,
        dresidual: (dres_ptr, dresidual.map_or(0, |r| r.stride)),
    }
    .run(&Gpu { ctx, stream })
}

impl Emulator {
    /// [`forward`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_forward<T: Dtype, P: Dtype>(
        &self,
        cfg: &NormConfig,
        x: &Rows<&[T]>,
        gamma: &[P],
        beta: Option<&[P]>,
        y: &mut Rows<&mut [T]>,
        mean: Option<&mut [f32]>,
        rstd: Option<&mut [f32]>,
    ) -> Result<()> {
        self.layer_norm_forward_impl::<T, T, T, P>(cfg, x, None, gamma, beta, y, mean, rstd)
    }

    /// [`forward_residual`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_forward_residual<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
        &self,
        cfg: &NormConfig,
        x: &Rows<&[T]>,
        residual: &Rows<&[R]>,
        gamma: &[P],
        beta: Option<&[P]>,
        y: &mut Rows<&mut [T]>,
        residual_out: &mut Rows<&mut [H]>,
        mean: Option<&mut [f32]>,
        rstd: Option<&mut [f32]>,
    ) -> Result<()> {
        let residual = Some((residual, residual_out));
        self.layer_norm_forward_impl(cfg, x, residual, gamma, beta, y, mean, rstd)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_norm_forward_impl<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
        &self,
        cfg: &NormConfig,
        x: &Rows<&[T]>,
        residual: Option<HostResidual<'_, '_, '_, R, H>>,
        gamma: &[P],
        beta: Option<&[P]>,
        y: &mut Rows<&mut [T]>,
        mean: Option<&mut [f32]>,
        rstd: Option<&mut [f32]>,
    ) -> Result<()> {
        let stats = [
            ("mean", mean.as_ref().map(|m| m.len())),
            ("rstd", rstd.as_ref().map(|r| r.len())),
        ];
        validate_forward(x, gamma.len(), beta.map(|b| b.len()), cfg, y, &stats)?;
        let residual = match residual {
            Some((r, o)) => Some(ResidualRows::host(
                r,
                o,
                validate_residual::<T, _, _>(x, r, o)?,
            )),
            None => None,
        };
        let params_f32 = params_f32::<T, P>()?;
        Forward {
            norm: Norm::Layer,
            dtype: T::KERNEL,
            rows: x.rows,
            d: x.d,
            x: (x.data.as_ptr() as u64, x.stride),
            y: (y.data.as_mut_ptr() as u64, y.stride),
            gamma: gamma.as_ptr() as u64,
            beta: beta.map_or(0, |b| b.as_ptr() as u64),
            mean: mean.map_or(0, |m| m.as_mut_ptr() as u64),
            rstd: rstd.map_or(0, |r| r.as_mut_ptr() as u64),
            cfg: *cfg,
            params_f32,
            residual,
        }
        .run(self)
    }

    /// [`backward`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward<T: Dtype, P: Dtype, G: Dtype>(
        &self,
        cfg: &NormConfig,
        dy: &Rows<&[T]>,
        x: &Rows<&[T]>,
        gamma: &[P],
        stats: Option<(&[f32], &[f32])>,
        dx: &mut Rows<&mut [T]>,
        dgamma: &mut [G],
        dbeta: Option<&mut [G]>,
        workspace: &mut [f32],
    ) -> Result<()> {
        self.layer_norm_backward_residual(
            cfg, dy, x, gamma, stats, None, dx, dgamma, dbeta, workspace,
        )
    }

    /// [`backward_residual`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward_residual<T: Dtype, H: Dtype, P: Dtype, G: Dtype>(
        &self,
        cfg: &NormConfig,
        dy: &Rows<&[T]>,
        x: &Rows<&[H]>,
        gamma: &[P],
        stats: Option<(&[f32], &[f32])>,
        dresidual: Option<&Rows<&[H]>>,
        dx: &mut Rows<&mut [T]>,
        dgamma: &mut [G],
        dbeta: Option<&mut [G]>,
        workspace: &mut [f32],
    ) -> Result<()> {
        validate_backward(
            cfg,
            dy,
            x,
            dx,
            &[
                ("gamma", Some(gamma.len())),
                ("dgamma", Some(dgamma.len())),
                ("dbeta", dbeta.as_ref().map(|b| b.len())),
            ],
            &[
                ("mean", stats.map(|s| s.0.len())),
                ("rstd", stats.map(|s| s.1.len())),
            ],
            workspace.len(),
            workspace_len(x.rows, x.d),
        )?;
        let x_f32 = validate_residual_backward::<T, _>(x, dresidual)?;
        let params_f32 = params_f32::<T, P>()?;
        check_grad_dtype::<T, P, G>()?;
        Backward {
            norm: Norm::Layer,
            dtype: T::KERNEL,
            rows: x.rows,
            d: x.d,
            dy: (dy.data.as_ptr() as u64, dy.stride),
            x: (x.data.as_ptr() as u64, x.stride),
            dx: (dx.data.as_mut_ptr() as u64, dx.stride),
            gamma: gamma.as_ptr() as u64,
            mean: stats.map_or(0, |s| s.0.as_ptr() as u64),
            rstd: stats.map_or(0, |s| s.1.as_ptr() as u64),
            dgamma: dgamma.as_mut_ptr() as u64,
            dbeta: dbeta.map_or(0, |b| b.as_mut_ptr() as u64),
            workspace: workspace.as_mut_ptr() as u64,
            cfg: *cfg,
            params_f32,
            grad_dtype: G::KERNEL,
            x_f32,
            dresidual: dresidual.map_or((0, 0), |r| (r.data.as_ptr() as u64, r.stride)),
        }
        .run(self)
    }
}
