//! RMSNorm: `y = x · rstd · γ` with `rstd = 1/sqrt(mean(x²) + eps)` per row, and its backward
//! `dx = rstd · (dŷ − x̂ · mean(dŷ · x̂))`, `dŷ = dy · γ`, `x̂ = x · rstd`, `dγ = Σ_rows dy · x̂`.
//!
//! The forward saves one fp32 `rstd` per row; the backward recomputes `x̂` from `x` and that
//! `rstd`. dγ goes through an explicit fp32 workspace of [`workspace_len`] elements (one partial
//! row per group of consecutive rows, summed in a fixed order), so it is bitwise reproducible on
//! any grid and any GPU. No device memory is allocated and nothing synchronizes inside a call.

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};
use normkern_gpu::rms_norm::{BackwardParams, ForwardParams};
use normkern_gpu::variant::{Dtype as KernelDtype, Variant};

use crate::context::{Context, Gpu};
use crate::emulator::Emulator;
use crate::error::{Error, Result};
use crate::launch::{
    Executor, Kernel, ROW_KERNEL_SHARED_BYTES, Shape, check_eps, group_layout, launch_column_sum,
    packs_fit, row_tile,
};
use crate::tensor::{Buffer, Dtype, Rows, RowsMut, RowsRef, expect_len};

/// f32 elements of workspace the backward needs for `rows × d`.
pub fn workspace_len(rows: usize, d: usize) -> usize {
    group_layout(rows).1 * d
}

/// Allocates a workspace of [`workspace_len`] f32 on `stream` (outside any launch: do it once and
/// reuse it for every backward of that shape or smaller).
pub fn alloc_workspace(
    stream: &std::sync::Arc<CudaStream>,
    rows: usize,
    d: usize,
) -> Result<CudaSlice<f32>> {
    stream
        .alloc_zeros::<f32>(workspace_len(rows, d).max(1))
        .map_err(Error::driver("cuMemAlloc"))
}

/// RMSNorm forward on `stream`: writes `y` and, when given, `rstd` (one f32 per row, for the
/// backward). `gamma` has `d` elements; `x` and `y` have the same shape and their own strides.
pub fn forward<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    x: &RowsRef<'_, T>,
    gamma: &CudaView<'_, T>,
    eps: f32,
    y: &mut RowsMut<'_, T>,
    rstd: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    validate_forward(x, gamma.len(), eps, y, rstd.as_ref().map(|r| r.len()))?;
    ctx.check_context("stream", stream)?;
    ctx.check_context("x", x.data.stream())?;
    ctx.check_context("gamma", gamma.stream())?;
    ctx.check_context("y", y.data.stream())?;
    if let Some(r) = &rstd {
        ctx.check_context("rstd", r.stream())?;
    }
    let (x_ptr, _x) = x.data.device_ptr(stream);
    let (gamma_ptr, _gamma) = gamma.device_ptr(stream);
    let (y_ptr, _y) = y.data.device_ptr_mut(stream);
    let (rstd_ptr, _rstd) = match rstd {
        Some(r) => {
            let (p, guard) = r.device_ptr_mut(stream);
            (p, Some(guard))
        }
        None => (0, None),
    };
    run_forward(
        &Gpu { ctx, stream },
        T::KERNEL,
        (x.rows, x.d),
        [(x_ptr, x.stride), (y_ptr, y.stride)],
        gamma_ptr,
        rstd_ptr,
        eps,
    )
}

/// RMSNorm backward on `stream`: writes `dx` and `dgamma` from `dy`, `x`, `gamma` and the forward's
/// `rstd`, using `workspace` (at least [`workspace_len`] f32) for the dγ partials.
/// With `rows == 0`, `dgamma` is set to zero.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    dy: &RowsRef<'_, T>,
    x: &RowsRef<'_, T>,
    gamma: &CudaView<'_, T>,
    rstd: &CudaView<'_, f32>,
    dx: &mut RowsMut<'_, T>,
    dgamma: &mut CudaViewMut<'_, T>,
    workspace: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    validate_backward(
        dy,
        x,
        gamma.len(),
        rstd.len(),
        dx,
        dgamma.len(),
        workspace.len(),
    )?;
    ctx.check_context("stream", stream)?;
    for (what, s) in [
        ("dy", dy.data.stream()),
        ("x", x.data.stream()),
        ("gamma", gamma.stream()),
        ("rstd", rstd.stream()),
        ("dx", dx.data.stream()),
        ("dgamma", dgamma.stream()),
        ("workspace", workspace.stream()),
    ] {
        ctx.check_context(what, s)?;
    }
    let (dy_ptr, _dy) = dy.data.device_ptr(stream);
    let (x_ptr, _x) = x.data.device_ptr(stream);
    let (gamma_ptr, _gamma) = gamma.device_ptr(stream);
    let (rstd_ptr, _rstd) = rstd.device_ptr(stream);
    let (dx_ptr, _dx) = dx.data.device_ptr_mut(stream);
    let (dgamma_ptr, _dgamma) = dgamma.device_ptr_mut(stream);
    let (ws_ptr, _ws) = workspace.device_ptr_mut(stream);
    run_backward(
        &Gpu { ctx, stream },
        T::KERNEL,
        (x.rows, x.d),
        [(dy_ptr, dy.stride), (x_ptr, x.stride), (dx_ptr, dx.stride)],
        [gamma_ptr, rstd_ptr, dgamma_ptr, ws_ptr],
    )
}

impl Emulator {
    /// [`forward`] on host memory, run by the CPU emulator.
    pub fn rms_norm_forward<T: Dtype>(
        &self,
        x: &Rows<&[T]>,
        gamma: &[T],
        eps: f32,
        y: &mut Rows<&mut [T]>,
        rstd: Option<&mut [f32]>,
    ) -> Result<()> {
        validate_forward(x, gamma.len(), eps, y, rstd.as_ref().map(|r| r.len()))?;
        run_forward(
            self,
            T::KERNEL,
            (x.rows, x.d),
            [
                (x.data.as_ptr() as u64, x.stride),
                (y.data.as_mut_ptr() as u64, y.stride),
            ],
            gamma.as_ptr() as u64,
            rstd.map_or(0, |r| r.as_mut_ptr() as u64),
            eps,
        )
    }

    /// [`backward`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_backward<T: Dtype>(
        &self,
        dy: &Rows<&[T]>,
        x: &Rows<&[T]>,
        gamma: &[T],
        rstd: &[f32],
        dx: &mut Rows<&mut [T]>,
        dgamma: &mut [T],
        workspace: &mut [f32],
    ) -> Result<()> {
        validate_backward(
            dy,
            x,
            gamma.len(),
            rstd.len(),
            dx,
            dgamma.len(),
            workspace.len(),
        )?;
        run_backward(
            self,
            T::KERNEL,
            (x.rows, x.d),
            [
                (dy.data.as_ptr() as u64, dy.stride),
                (x.data.as_ptr() as u64, x.stride),
                (dx.data.as_mut_ptr() as u64, dx.stride),
            ],
            [
                gamma.as_ptr() as u64,
                rstd.as_ptr() as u64,
                dgamma.as_mut_ptr() as u64,
                workspace.as_mut_ptr() as u64,
            ],
        )
    }
}

fn validate_forward<X: Buffer, Y: Buffer>(
    x: &Rows<X>,
    gamma_len: usize,
    eps: f32,
    y: &Rows<Y>,
    rstd_len: Option<usize>,
) -> Result<()> {
    y.expect_shape("y", x.rows, x.d)?;
    expect_len("gamma", gamma_len, x.d)?;
    if let Some(n) = rstd_len {
        expect_len("rstd", n, x.rows)?;
    }
    check_eps(eps)
}

fn validate_backward<DY: Buffer, X: Buffer, DX: Buffer>(
    dy: &Rows<DY>,
    x: &Rows<X>,
    gamma_len: usize,
    rstd_len: usize,
    dx: &Rows<DX>,
    dgamma_len: usize,
    workspace_len_given: usize,
) -> Result<()> {
    dy.expect_shape("dy", x.rows, x.d)?;
    dx.expect_shape("dx", x.rows, x.d)?;
    expect_len("gamma", gamma_len, x.d)?;
    expect_len("rstd", rstd_len, x.rows)?;
    expect_len("dgamma", dgamma_len, x.d)?;
    let needed = workspace_len(x.rows, x.d);
    if workspace_len_given < needed {
        return Err(Error::WorkspaceTooSmall {
            needed,
            actual: workspace_len_given,
        });
    }
    Ok(())
}

/// Plans and launches a validated forward. `rows_at` = `[(x, stride), (y, stride)]`.
fn run_forward(
    exec: &dyn Executor,
    dtype: KernelDtype,
    (rows, d): (usize, usize),
    [(x, x_stride), (y, y_stride)]: [(u64, usize); 2],
    gamma: u64,
    rstd: u64,
    eps: f32,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let vec = packs_fit(dtype.bytes(), d, &[x, y, gamma], &[x_stride, y_stride]);
    let params = ForwardParams {
        x,
        y,
        gamma,
        rstd,
        x_stride: x_stride as u64,
        y_stride: y_stride as u64,
        rows: rows as u32,
        d: d as u32,
        eps,
        inv_d: (1.0f64 / d as f64) as f32,
    };
    let kernel = |vpt| Kernel::RmsNormForward(Variant { dtype, vec, vpt }, params);
    let len = if vec { 16 / dtype.bytes() } else { 1 };
    let tile = row_tile(d, len, |vpt| exec.max_threads(&kernel(vpt)))?;
    let k = kernel(tile.vpt);
    let grid = exec.persistent_grid(&k, rows, tile.threads, ROW_KERNEL_SHARED_BYTES)?;
    exec.launch(
        &k,
        Shape {
            grid,
            block: tile.threads,
            shared_bytes: ROW_KERNEL_SHARED_BYTES,
        },
    )
}

/// Plans and launches a validated backward: the dx + partials kernel, then the column sum.
/// `rows_at` = `[(dy, stride), (x, stride), (dx, stride)]`, `vectors` = `[gamma, rstd, dgamma, workspace]`.
fn run_backward(
    exec: &dyn Executor,
    dtype: KernelDtype,
    (rows, d): (usize, usize),
    [(dy, dy_stride), (x, x_stride), (dx, dx_stride)]: [(u64, usize); 3],
    [gamma, rstd, dgamma, workspace]: [u64; 4],
) -> Result<()> {
    let (rows_per_group, groups) = group_layout(rows);
    if rows > 0 {
        // The workspace takes 16-byte stores on the packed path: it must be aligned like the rest.
        let vec = packs_fit(
            dtype.bytes(),
            d,
            &[dy, x, dx, gamma, workspace],
            &[dy_stride, x_stride, dx_stride],
        );
        let params = BackwardParams {
            x,
            dy,
            gamma,
            rstd,
            dx,
            partials: workspace,
            x_stride: x_stride as u64,
            dy_stride: dy_stride as u64,
            dx_stride: dx_stride as u64,
            rows: rows as u32,
            d: d as u32,
            rows_per_group: rows_per_group as u32,
            groups: groups as u32,
            inv_d: (1.0f64 / d as f64) as f32,
            _pad: 0,
        };
        let kernel = |vpt| Kernel::RmsNormBackward(Variant { dtype, vec, vpt }, params);
        let len = if vec { 16 / dtype.bytes() } else { 1 };
        let tile = row_tile(d, len, |vpt| exec.max_threads(&kernel(vpt)))?;
        let k = kernel(tile.vpt);
        let grid = exec.persistent_grid(&k, groups, tile.threads, ROW_KERNEL_SHARED_BYTES)?;
        exec.launch(
            &k,
            Shape {
                grid,
                block: tile.threads,
                shared_bytes: ROW_KERNEL_SHARED_BYTES,
            },
        )?;
    }
    launch_column_sum(exec, dtype, workspace, dgamma, groups, d)
}
