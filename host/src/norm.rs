//! What RMSNorm and LayerNorm share on the host: validation, launch planning and the two-pass
//! dγ/dβ, over the shared kernel bodies of `normkern_gpu::norm`. The public functions live in
//! [`crate::rms_norm`] and [`crate::layer_norm`].

use normkern_gpu::norm::{BackwardParams, ForwardParams, Norm};
use normkern_gpu::variant::{Dtype as KernelDtype, Variant};

use crate::error::{Error, Result};
use crate::launch::{
    Executor, Kernel, ROW_KERNEL_SHARED_BYTES, Shape, check_eps, group_layout, launch_column_sum,
    packs_fit, row_tile,
};
use crate::tensor::{Buffer, Dtype, Rows, expect_len};

/// Device address of an optional buffer (0 when absent) and the guard ordering it on `stream`.
macro_rules! opt_ptr {
    ($v:expr, $stream:expr, $method:ident) => {
        match $v {
            Some(v) => {
                let (p, guard) = v.$method($stream);
                (p, Some(guard))
            }
            None => (0, None),
        }
    };
}
pub(crate) use opt_ptr;

/// Settings of an RMSNorm or LayerNorm call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormConfig {
    /// Added to the variance (mean square for RMSNorm) before the square root: finite, > 0.
    pub eps: f32,
    /// Added to γ in fp32 before use: `y = x̂·(γ + offset)` (Gemma stores γ − 1 and uses 1).
    /// dγ is unaffected. Finite; default 0.
    pub gamma_offset: f32,
}

impl NormConfig {
    /// `eps` with no γ offset.
    pub fn new(eps: f32) -> Self {
        NormConfig {
            eps,
            gamma_offset: 0.0,
        }
    }

    /// The same settings with γ used as `γ + offset`.
    pub fn with_gamma_offset(self, offset: f32) -> Self {
        NormConfig {
            gamma_offset: offset,
            ..self
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        check_eps(self.eps)?;
        if !self.gamma_offset.is_finite() {
            return Err(Error::GammaOffset(self.gamma_offset));
        }
        Ok(())
    }
}

impl Default for NormConfig {
    /// eps = 1e-5 (PyTorch's LayerNorm default), no offset.
    fn default() -> Self {
        NormConfig::new(1e-5)
    }
}

/// A validated forward: addresses (host or device) and row strides of every operand; 0 for an
/// operand that is absent (β, saved statistics).
pub(crate) struct Forward {
    pub norm: Norm,
    pub dtype: KernelDtype,
    pub rows: usize,
    pub d: usize,
    pub x: (u64, usize),
    pub y: (u64, usize),
    pub gamma: u64,
    pub beta: u64,
    pub mean: u64,
    pub rstd: u64,
    pub cfg: NormConfig,
    /// γ and β stored as f32 rather than in `dtype`.
    pub params_f32: bool,
}

/// A validated backward. `rstd == 0`: recompute the statistics from x. `dbeta == 0`: no dβ. The workspace holds the dγ partials, then (with
/// dβ) the dβ partials.
pub(crate) struct Backward {
    pub norm: Norm,
    pub dtype: KernelDtype,
    pub rows: usize,
    pub d: usize,
    pub dy: (u64, usize),
    pub x: (u64, usize),
    pub dx: (u64, usize),
    pub gamma: u64,
    pub mean: u64,
    pub rstd: u64,
    pub dgamma: u64,
    pub dbeta: u64,
    pub workspace: u64,
    pub cfg: NormConfig,
    /// γ stored as f32 rather than in `dtype`.
    pub params_f32: bool,
    /// Storage of dγ and dβ.
    pub grad_dtype: KernelDtype,
}

fn inv(d: usize) -> f32 {
    (1.0f64 / d as f64) as f32
}

impl Forward {
    pub(crate) fn run(self, exec: &dyn Executor) -> Result<()> {
        let (rows, d, dtype) = (self.rows, self.d, self.dtype);
        if rows == 0 {
            return Ok(());
        }
        let mut addrs = vec![self.x.0, self.y.0, self.gamma];
        addrs.extend((self.beta != 0).then_some(self.beta));
        let vec = packs_fit(dtype.bytes(), d, &addrs, &[self.x.1, self.y.1]);
        let params = ForwardParams {
            x: self.x.0,
            y: self.y.0,
            gamma: self.gamma,
            beta: self.beta,
            mean: self.mean,
            rstd: self.rstd,
            x_stride: self.x.1 as u64,
            y_stride: self.y.1 as u64,
            rows: rows as u32,
            d: d as u32,
            eps: self.cfg.eps,
            inv_d: inv(d),
            gamma_offset: self.cfg.gamma_offset,
            params_f32: self.params_f32 as u32,
        };
        launch_rows(exec, dtype, vec, d, rows, |variant| {
            Kernel::NormForward(self.norm, variant, params)
        })
    }
}

impl Backward {
    /// The dx + partials kernel, then one fixed-order column sum per parameter gradient.
    pub(crate) fn run(self, exec: &dyn Executor) -> Result<()> {
        let (rows, d, dtype) = (self.rows, self.d, self.dtype);
        let (rows_per_group, groups) = group_layout(rows);
        let dbeta_partials = if self.dbeta != 0 {
            self.workspace + (groups * d * 4) as u64
        } else {
            0
        };
        if rows > 0 {
            // The workspace takes 16-byte stores on the packed path: it must be aligned like the rest.
            let mut addrs = vec![self.dy.0, self.x.0, self.dx.0, self.gamma, self.workspace];
            addrs.extend((dbeta_partials != 0).then_some(dbeta_partials));
            let vec = packs_fit(dtype.bytes(), d, &addrs, &[self.dy.1, self.x.1, self.dx.1]);
            let params = BackwardParams {
                x: self.x.0,
                dy: self.dy.0,
                gamma: self.gamma,
                mean: self.mean,
                rstd: self.rstd,
                dx: self.dx.0,
                partials: self.workspace,
                dbeta_partials,
                x_stride: self.x.1 as u64,
                dy_stride: self.dy.1 as u64,
                dx_stride: self.dx.1 as u64,
                rows: rows as u32,
                d: d as u32,
                rows_per_group: rows_per_group as u32,
                groups: groups as u32,
                inv_d: inv(d),
                gamma_offset: self.cfg.gamma_offset,
                eps: self.cfg.eps,
                params_f32: self.params_f32 as u32,
            };
            launch_rows(exec, dtype, vec, d, groups, |variant| {
                Kernel::NormBackward(self.norm, variant, params)
            })?;
        }
        launch_column_sum(
            exec,
            self.grad_dtype,
            self.workspace,
            self.dgamma,
            groups,
            d,
        )?;
        if self.dbeta != 0 {
            launch_column_sum(exec, self.grad_dtype, dbeta_partials, self.dbeta, groups, d)?;
        }
        Ok(())
    }
}

/// Picks the row tile for a row kernel (its register limit included) and launches a persistent
/// grid over `work` items (rows, or groups of rows).
fn launch_rows(
    exec: &dyn Executor,
    dtype: KernelDtype,
    vec: bool,
    d: usize,
    work: usize,
    kernel: impl Fn(Variant) -> Kernel,
) -> Result<()> {
    let variant = |vpt| Variant { dtype, vec, vpt };
    let len = if vec { 16 / dtype.bytes() } else { 1 };
    let tile = row_tile(d, len, |vpt| exec.max_threads(&kernel(variant(vpt))))?;
    let k = kernel(variant(tile.vpt));
    let grid = exec.persistent_grid(&k, work, tile.threads, ROW_KERNEL_SHARED_BYTES)?;
    exec.launch(
        &k,
        Shape {
            grid,
            block: tile.threads,
            shared_bytes: ROW_KERNEL_SHARED_BYTES,
        },
    )
}

/// Whether parameters stored as `P` next to activations stored as `T` are f32 parameters (mixed
/// precision). Supported: `P == T`, or `P == f32`.
pub(crate) fn params_f32<T: Dtype, P: Dtype>() -> Result<bool> {
    if P::KERNEL == T::KERNEL {
        Ok(false)
    } else if P::KERNEL == KernelDtype::F32 {
        Ok(true)
    } else {
        Err(Error::UnsupportedDtypes {
            what: "gamma/beta",
            dtype: P::KERNEL.name(),
            activations: T::KERNEL.name(),
            supported: "parameters must be in the activations' dtype or f32",
        })
    }
}

/// Checks that gradients stored as `G` fit parameters stored as `P`: `G == P`, or `G == f32`.
pub(crate) fn check_grad_dtype<T: Dtype, P: Dtype, G: Dtype>() -> Result<()> {
    if G::KERNEL == P::KERNEL || G::KERNEL == KernelDtype::F32 {
        return Ok(());
    }
    Err(Error::UnsupportedDtypes {
        what: "dgamma/dbeta",
        dtype: G::KERNEL.name(),
        activations: T::KERNEL.name(),
        supported: "parameter gradients must be in the parameters' dtype or f32",
    })
}

/// Shapes and lengths of a forward: `y` like `x`, `gamma` (and `beta`) of `d`, statistics of `rows`.
pub(crate) fn validate_forward<X: Buffer, Y: Buffer>(
    x: &Rows<X>,
    gamma_len: usize,
    beta_len: Option<usize>,
    cfg: &NormConfig,
    y: &Rows<Y>,
    stats: &[(&'static str, Option<usize>)],
) -> Result<()> {
    y.expect_shape("y", x.rows, x.d)?;
    expect_len("gamma", gamma_len, x.d)?;
    if let Some(n) = beta_len {
        expect_len("beta", n, x.d)?;
    }
    for &(what, len) in stats {
        if let Some(n) = len {
            expect_len(what, n, x.rows)?;
        }
    }
    cfg.validate()
}

/// Shapes and lengths of a backward: `dy`, `dx` like `x`; `gamma`, `dgamma` (and `dbeta`) of `d`;
/// statistics of `rows`; a workspace of at least `workspace_needed`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn validate_backward<DY: Buffer, X: Buffer, DX: Buffer>(
    cfg: &NormConfig,
    dy: &Rows<DY>,
    x: &Rows<X>,
    dx: &Rows<DX>,
    params: &[(&'static str, Option<usize>)],
    stats: &[(&'static str, Option<usize>)],
    workspace_len: usize,
    workspace_needed: usize,
) -> Result<()> {
    cfg.validate()?;
    dy.expect_shape("dy", x.rows, x.d)?;
    dx.expect_shape("dx", x.rows, x.d)?;
    for &(what, len) in params {
        if let Some(n) = len {
            expect_len(what, n, x.d)?;
        }
    }
    for &(what, len) in stats {
        if let Some(n) = len {
            expect_len(what, n, x.rows)?;
        }
    }
    if workspace_len < workspace_needed {
        return Err(Error::WorkspaceTooSmall {
            needed: workspace_needed,
            actual: workspace_len,
        });
    }
    Ok(())
}
