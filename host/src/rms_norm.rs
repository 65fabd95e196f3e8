//! RMSNorm: `y = x · rstd · γ` with `rstd = 1/sqrt(mean(x²) + eps)` per row, and its backward
//! `dx = rstd · (dŷ − x̂ · mean(dŷ · x̂))`, `dŷ = dy · γ`, `x̂ = x · rstd`, `dγ = Σ_rows dy · x̂`.
//!
//! The forward saves one fp32 `rstd` per row; the backward recomputes `x̂` from `x` and that
//! `rstd`. dγ goes through an explicit fp32 workspace of [`workspace_len`] elements (one partial
//! row per group of consecutive rows, summed in a fixed order), so it is bitwise reproducible on
//! any grid and any GPU. No device memory is allocated and nothing synchronizes inside a call.
//!
//! [`forward_residual`] and [`backward_residual`] fuse the residual add of a pre-norm block; see
//! their docs.

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

/// f32 elements of workspace the backward needs for `rows × d`.
pub fn workspace_len(rows: usize, d: usize) -> usize {
    group_layout(rows, d).1 * d
}

/// Allocates a workspace of [`workspace_len`] f32 on `stream` (outside any launch: do it once and
/// reuse it for every backward of that shape or smaller).
pub fn alloc_workspace(stream: &Arc<CudaStream>, rows: usize, d: usize) -> Result<CudaSlice<f32>> {
    stream
        .alloc_zeros::<f32>(workspace_len(rows, d).max(1))
        .map_err(Error::driver("cuMemAlloc"))
}

/// RMSNorm forward on `stream`: writes `y` and, when given, `rstd` (one f32 per row, for the
/// backward). `gamma` has `d` elements; `x` and `y` have the same shape and their own strides.
pub fn forward<T: Dtype, P: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    x: &RowsRef<'_, T>,
    gamma: &CudaView<'_, P>,
    y: &mut RowsMut<'_, T>,
    rstd: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    forward_impl::<T, T, T, P>(ctx, stream, cfg, x, None, gamma, y, rstd)
}

/// RMSNorm forward with the residual add of a pre-norm block fused in: `h = x + residual` (an
/// fp32 sum, rounded once) is written to `residual_out`, and `y` and `rstd` are those of
/// [`forward`] on h *as stored* in `residual_out`'s dtype, so a [`backward_residual`] given
/// `residual_out` as its x differentiates exactly the row that was normalized. `residual` and
/// `residual_out` have x's shape and their own strides, and each is in x's dtype or f32 (an fp32
/// residual stream next to bf16 activations); other dtypes are an [`Error::UnsupportedDtypes`].
/// Neither may overlap another operand (for an in-place residual stream, alternate two buffers).
#[allow(clippy::too_many_arguments)]
pub fn forward_residual<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    x: &RowsRef<'_, T>,
    residual: &RowsRef<'_, R>,
    gamma: &CudaView<'_, P>,
    y: &mut RowsMut<'_, T>,
    residual_out: &mut RowsMut<'_, H>,
    rstd: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    let residual = Some((residual, residual_out));
    forward_impl(ctx, stream, cfg, x, residual, gamma, y, rstd)
}

#[allow(clippy::too_many_arguments)]
fn forward_impl<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    x: &RowsRef<'_, T>,
    residual: Option<(&RowsRef<'_, R>, &mut RowsMut<'_, H>)>,
    gamma: &CudaView<'_, P>,
    y: &mut RowsMut<'_, T>,
    rstd: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    validate_forward(
        x,
        gamma.len(),
        None,
        cfg,
        y,
        &[("rstd", rstd.as_ref().map(|r| r.len()))],
    )?;
    let residual_f32 = match &residual {
        Some((r, o)) => Some(validate_residual::<T, _, _>(x, r, o)?),
        None => None,
    };
    let params_f32 = params_f32::<T, P>()?;
    ctx.check_context("stream", stream)?;
    ctx.check_context("x", x.data.stream())?;
    ctx.check_context("gamma", gamma.stream())?;
    ctx.check_context("y", y.data.stream())?;
    if let Some(r) = &rstd {
        ctx.check_context("rstd", r.stream())?;
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
    let (y_ptr, _y) = y.data.device_ptr_mut(stream);
    let (rstd_ptr, _rstd) = opt_ptr!(rstd, stream, device_ptr_mut);
    Forward {
        norm: Norm::Rms,
        dtype: T::KERNEL,
        rows: x.rows,
        d: x.d,
        x: (x_ptr, x.stride),
        y: (y_ptr, y.stride),
        gamma: gamma_ptr,
        beta: 0,
        mean: 0,
        rstd: rstd_ptr,
        cfg: *cfg,
        params_f32,
        residual,
    }
    .run(&Gpu { ctx, stream })
}

/// RMSNorm backward on `stream`: writes `dx` and `dgamma` from `dy`, `x`, `gamma` and the forward's
/// `rstd` — or, with `rstd = None`, rstd recomputed from `x` (nothing saved by the forward; one more
/// reduction per row) — using `workspace` (at least [`workspace_len`] f32) for the dγ partials.
/// With `rows == 0`, `dgamma` is set to zero.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Dtype, P: Dtype, G: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    dy: &RowsRef<'_, T>,
    x: &RowsRef<'_, T>,
    gamma: &CudaView<'_, P>,
    rstd: Option<&CudaView<'_, f32>>,
    dx: &mut RowsMut<'_, T>,
    dgamma: &mut CudaViewMut<'_, G>,
    workspace: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    backward_residual(
        ctx, stream, cfg, dy, x, gamma, rstd, None, dx, dgamma, workspace,
    )
}

/// The backward of [`forward_residual`]: [`backward`] with `x` the forward's `residual_out` (in
/// dy's dtype or f32) and, when given, `dresidual` — the gradient arriving on `residual_out` from
/// the rest of the network, same dtype and shape, own stride — added into dx in the same pass
/// (`dx = ∂y/∂h·dy + dresidual`, one rounding). That dx is the gradient of both x and residual.
#[allow(clippy::too_many_arguments)]
pub fn backward_residual<T: Dtype, H: Dtype, P: Dtype, G: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    cfg: &NormConfig,
    dy: &RowsRef<'_, T>,
    x: &RowsRef<'_, H>,
    gamma: &CudaView<'_, P>,
    rstd: Option<&CudaView<'_, f32>>,
    dresidual: Option<&RowsRef<'_, H>>,
    dx: &mut RowsMut<'_, T>,
    dgamma: &mut CudaViewMut<'_, G>,
    workspace: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    validate_backward(
        cfg,
        dy,
        x,
        dx,
        &[("gamma", Some(gamma.len())), ("dgamma", Some(dgamma.len()))],
        &[("rstd", rstd.map(|r| r.len()))],
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
    if let Some(r) = rstd {
        ctx.check_context("rstd", r.stream())?;
    }
    if let Some(r) = dresidual {
        ctx.check_context("dresidual", r.data.stream())?;
    }
    let (dy_ptr, _dy) = dy.data.device_ptr(stream);
    let (x_ptr, _x) = x.data.device_ptr(stream);
    let (gamma_ptr, _gamma) = gamma.device_ptr(stream);
    let (rstd_ptr, _rstd) = opt_ptr!(rstd, stream, device_ptr);
    let (dres_ptr, _dres) = opt_ptr!(dresidual.map(|r| &r.data), stream, device_ptr);
    let (dx_ptr, _dx) = dx.data.device_ptr_mut(stream);
    let (dgamma_ptr, _dgamma) = dgamma.device_ptr_mut(stream);
    let (ws_ptr, _ws) = workspace.device_ptr_mut(stream);
    Backward {
        norm: Norm::Rms,
        dtype: T::KERNEL,
        rows: x.rows,
        d: x.d,
        dy: (dy_ptr, dy.stride),
        x: (x_ptr, x.stride),
        dx: (dx_ptr, dx.stride),
        gamma: gamma_ptr,
        mean: 0,
        rstd: rstd_ptr,
        dgamma: dgamma_ptr,
        dbeta: 0,
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
    pub fn rms_norm_forward<T: Dtype, P: Dtype>(
        &self,
        cfg: &NormConfig,
        x: &Rows<&[T]>,
        gamma: &[P],
        y: &mut Rows<&mut [T]>,
        rstd: Option<&mut [f32]>,
    ) -> Result<()> {
        self.rms_norm_forward_impl::<T, T, T, P>(cfg, x, None, gamma, y, rstd)
    }

    /// [`forward_residual`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_forward_residual<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
        &self,
        cfg: &NormConfig,
        x: &Rows<&[T]>,
        residual: &Rows<&[R]>,
        gamma: &[P],
        y: &mut Rows<&mut [T]>,
        residual_out: &mut Rows<&mut [H]>,
        rstd: Option<&mut [f32]>,
    ) -> Result<()> {
        self.rms_norm_forward_impl(cfg, x, Some((residual, residual_out)), gamma, y, rstd)
    }

    fn rms_norm_forward_impl<T: Dtype, R: Dtype, H: Dtype, P: Dtype>(
        &self,
        cfg: &NormConfig,
        x: &Rows<&[T]>,
        residual: Option<HostResidual<'_, '_, '_, R, H>>,
        gamma: &[P],
        y: &mut Rows<&mut [T]>,
        rstd: Option<&mut [f32]>,
    ) -> Result<()> {
        validate_forward(
            x,
            gamma.len(),
            None,
            cfg,
            y,
            &[("rstd", rstd.as_ref().map(|r| r.len()))],
        )?;
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
            norm: Norm::Rms,
            dtype: T::KERNEL,
            rows: x.rows,
            d: x.d,
            x: (x.data.as_ptr() as u64, x.stride),
            y: (y.data.as_mut_ptr() as u64, y.stride),
            gamma: gamma.as_ptr() as u64,
            beta: 0,
            mean: 0,
            rstd: rstd.map_or(0, |r| r.as_mut_ptr() as u64),
            cfg: *cfg,
            params_f32,
            residual,
        }
        .run(self)
    }

    /// [`backward`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_backward<T: Dtype, P: Dtype, G: Dtype>(
        &self,
        cfg: &NormConfig,
        dy: &Rows<&[T]>,
        x: &Rows<&[T]>,
        gamma: &[P],
        rstd: Option<&[f32]>,
        dx: &mut Rows<&mut [T]>,
        dgamma: &mut [G],
        workspace: &mut [f32],
    ) -> Result<()> {
        self.rms_norm_backward_residual(cfg, dy, x, gamma, rstd, None, dx, dgamma, workspace)
    }

    /// [`backward_residual`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_backward_residual<T: Dtype, H: Dtype, P: Dtype, G: Dtype>(
        &self,
        cfg: &NormConfig,
        dy: &Rows<&[T]>,
        x: &Rows<&[H]>,
        gamma: &[P],
        rstd: Option<&[f32]>,
        dresidual: Option<&Rows<&[H]>>,
        dx: &mut Rows<&mut [T]>,
        dgamma: &mut [G],
        workspace: &mut [f32],
    ) -> Result<()> {
        validate_backward(
            cfg,
            dy,
            x,
            dx,
            &[("gamma", Some(gamma.len())), ("dgamma", Some(dgamma.len()))],
            &[("rstd", rstd.map(|r| r.len()))],
            workspace.len(),
            workspace_len(x.rows, x.d),
        )?;
        let x_f32 = validate_residual_backward::<T, _>(x, dresidual)?;
        let params_f32 = params_f32::<T, P>()?;
        check_grad_dtype::<T, P, G>()?;
        Backward {
            norm: Norm::Rms,
            dtype: T::KERNEL,
            rows: x.rows,
            d: x.d,
            dy: (dy.data.as_ptr() as u64, dy.stride),
            x: (x.data.as_ptr() as u64, x.stride),
            dx: (dx.data.as_mut_ptr() as u64, dx.stride),
            gamma: gamma.as_ptr() as u64,
            mean: 0,
            rstd: rstd.map_or(0, |r| r.as_ptr() as u64),
            dgamma: dgamma.as_mut_ptr() as u64,
            dbeta: 0,
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
