//! What RMSNorm and LayerNorm share on the host: validation, launch planning and the two-pass
//! dγ/dβ, over the shared kernel bodies of `normkern_gpu::norm`. The public functions live in
//! [`crate::rms_norm`] and [`crate::layer_norm`].

use normkern_gpu::norm::{BackwardParams, ForwardParams, Norm};
use normkern_gpu::variant::{Dtype as KernelDtype, Variant};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::launch::{
    Executor, Kernel, Shape, check_eps, group_layout, launch_column_sum, packs_fit, row_tile,
};
use crate::tensor::{Buffer, Dtype, Rows, RowsMut, RowsRef, expect_len};

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
    /// Residual fusion: h = x + residual is written to `residual_out` and normalized instead of x.
    pub residual: Option<ResidualRows>,
}

/// The residual operands of a forward: `(address, stride)` of each and whether it is stored as
/// f32 (otherwise in the activations' dtype).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ResidualRows {
    pub input: (u64, usize),
    pub output: (u64, usize),
    pub input_f32: bool,
    pub output_f32: bool,
}

/// A forward's residual operands in host memory (the emulator): `residual`, `residual_out`.
pub(crate) type HostResidual<'a, 'r, 'h, R, H> = (&'a Rows<&'r [R]>, &'a mut Rows<&'h mut [H]>);

impl ResidualRows {
    /// The residual operands of an emulated forward (host slices), with the dtypes validation found.
    pub(crate) fn host<R: Dtype, H: Dtype>(
        residual: &Rows<&[R]>,
        residual_out: &mut Rows<&mut [H]>,
        (input_f32, output_f32): (bool, bool),
    ) -> Self {
        ResidualRows {
            input: (residual.data.as_ptr() as u64, residual.stride),
            output: (residual_out.data.as_mut_ptr() as u64, residual_out.stride),
            input_f32,
            output_f32,
        }
    }

    /// The residual operands of a forward on the device, with the dtypes validation found: checks
    /// their context, then takes their addresses and the guards that order them on `stream`
    /// (keep them until the launch is enqueued).
    pub(crate) fn device<'a, R: Dtype, H: Dtype>(
        ctx: &Context,
        stream: &'a CudaStream,
        residual: &'a RowsRef<'_, R>,
        residual_out: &'a mut RowsMut<'_, H>,
        (input_f32, output_f32): (bool, bool),
    ) -> Result<(Self, [SyncOnDrop<'a>; 2])> {
        ctx.check_context("residual", residual.data.stream())?;
        ctx.check_context("residual_out", residual_out.data.stream())?;
        let out_stride = residual_out.stride;
        let (input, input_guard) = residual.data.device_ptr(stream);
        let (output, output_guard) = residual_out.data.device_ptr_mut(stream);
        Ok((
            ResidualRows {
                input: (input, residual.stride),
                output: (output, out_stride),
                input_f32,
                output_f32,
            },
            [input_guard, output_guard],
        ))
    }
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
    /// x (and `dresidual`) stored as f32 rather than in `dtype`.
    pub x_f32: bool,
    /// The gradient arriving on the forward's `residual_out`, added into dx; address 0 for none.
    pub dresidual: (u64, usize),
}

/// A row stride in elements of the activations' dtype (`elem_bytes`), as [`packs_fit`] counts
/// them: an f32 row's stride scaled by `4 / elem_bytes`, so the test "a multiple of the pack"
/// becomes "a multiple of 16 bytes" for it too.
fn stride_in_elems(stride: usize, f32: bool, elem_bytes: usize) -> usize {
    if f32 { stride * 4 / elem_bytes } else { stride }
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
        let res = self.residual;
        // Absent operands are 0, which fits packs.
        let (r_in, r_out) = res.map_or(((0, 0), (0, 0)), |r| {
            let elems = |(addr, stride), f32| (addr, stride_in_elems(stride, f32, dtype.bytes()));
            (elems(r.input, r.input_f32), elems(r.output, r.output_f32))
        });
        let vec = packs_fit(
            dtype.bytes(),
            d,
            &[self.x.0, self.y.0, self.gamma, self.beta, r_in.0, r_out.0],
            &[self.x.1, self.y.1, r_in.1, r_out.1],
        );
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
            residual: res.map_or(0, |r| r.input.0),
            residual_out: res.map_or(0, |r| r.output.0),
            residual_stride: res.map_or(0, |r| r.input.1 as u64),
            residual_out_stride: res.map_or(0, |r| r.output.1 as u64),
            residual_f32: res.is_some_and(|r| r.input_f32) as u32,
            residual_out_f32: res.is_some_and(|r| r.output_f32) as u32,
        };
        // Forward rows are independent: with a row per SM or more, a block per row streaming
        // from L2 outruns a cluster per row (1024×65536 bf16 on the H200: RMSNorm 61.5 %,
        // LayerNorm 46.8 % of copy, against 52 and 21 % for 4 packs × 256 threads × 8).
        let clusters = if rows < exec.sm_count() {
            exec.max_cluster()
        } else {
            1
        };
        launch_rows(
            exec,
            dtype,
            vec,
            res.is_some(),
            clusters,
            d,
            rows,
            |variant| Kernel::NormForward(self.norm, variant, params),
        )
    }
}

impl Backward {
    /// The dx + partials kernel, then one fixed-order column-sum launch for dγ (and dβ).
    pub(crate) fn run(self, exec: &dyn Executor) -> Result<()> {
        let (rows, d, dtype) = (self.rows, self.d, self.dtype);
        let (rows_per_group, groups) = group_layout(rows, d);
        let dbeta_partials = if self.dbeta != 0 {
            self.workspace + (groups * d * 4) as u64
        } else {
            0
        };
        if rows > 0 {
            // The workspace takes 16-byte stores on the packed path: it must be aligned like the
            // rest. Absent operands (dβ partials, dresidual) are 0, which fits packs.
            let elems = |stride| stride_in_elems(stride, self.x_f32, dtype.bytes());
            let vec = packs_fit(
                dtype.bytes(),
                d,
                &[
                    self.dy.0,
                    self.x.0,
                    self.dx.0,
                    self.gamma,
                    self.workspace,
                    dbeta_partials,
                    self.dresidual.0,
                ],
                &[
                    self.dy.1,
                    elems(self.x.1),
                    self.dx.1,
                    elems(self.dresidual.1),
                ],
            );
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
                x_f32: self.x_f32 as u32,
                dresidual: self.dresidual.0,
                dresidual_stride: self.dresidual.1 as u64,
            };
            let residual = params.residual_family();
            // The backward's parallelism is its dγ groups (at most 512, 64 at 1024 rows), and its
            // streaming instance re-reads the partial rows: clusters whenever a row needs them.
            let clusters = exec.max_cluster();
            launch_rows(exec, dtype, vec, residual, clusters, d, groups, |variant| {
                Kernel::NormBackward(self.norm, variant, params)
            })?;
        }
        let dbeta = (self.dbeta != 0).then_some((dbeta_partials, self.dbeta));
        let dgamma = (self.workspace, self.dgamma);
        launch_column_sum(exec, self.grad_dtype, dgamma, dbeta, groups, d)
    }
}

/// Picks the row tile for a row kernel (its register limit included; rows split over clusters
/// of up to `max_cluster` blocks) and launches a persistent grid over `work` items (rows, or
/// groups of rows).
#[allow(clippy::too_many_arguments)]
fn launch_rows(
    exec: &dyn Executor,
    dtype: KernelDtype,
    vec: bool,
    residual: bool,
    max_cluster: usize,
    d: usize,
    work: usize,
    kernel: impl Fn(Variant) -> Kernel,
) -> Result<()> {
    let variant = |vpt, cluster| Variant {
        dtype,
        vec,
        vpt,
        cluster,
    };
    let len = if vec { 16 / dtype.bytes() } else { 1 };
    let registers = vec || !Norm::scalar_streams(residual);
    // Cluster instances exist for packed access only.
    let max_cluster = if vec { max_cluster } else { 1 };
    let tile = row_tile(
        d,
        len,
        registers,
        max_cluster,
        |vpt, cluster| {
            let k = kernel(variant(vpt, cluster));
            Ok(exec
                .max_threads(&k)?
                .min(k.threads_within_shared(exec.shared_opt_in())))
        },
        |vpt| kernel(variant(vpt, false)).prefetches(),
    )?;
    let k = kernel(variant(tile.vpt, tile.cluster > 1));
    let shared_bytes = k.row_shared_bytes(tile.threads);
    let grid = exec.persistent_grid(&k, work, tile.threads, tile.cluster, shared_bytes)?;
    exec.launch(
        &k,
        Shape {
            grid,
            block: tile.threads,
            cluster: tile.cluster,
            shared_bytes,
        },
    )
}

/// Whether parameters stored as `P` next to activations stored as `T` are f32 parameters (mixed
/// precision). Supported: `P == T`, or `P == f32`.
pub(crate) fn params_f32<T: Dtype, P: Dtype>() -> Result<bool> {
    stored_f32::<T, P>(
        "gamma/beta",
        "parameters must be in the activations' dtype or f32",
    )
}

/// Whether an operand stored as `S` next to activations stored as `T` is stored as f32 rather
/// than in `T`; any other `S` is an [`Error::UnsupportedDtypes`].
fn stored_f32<T: Dtype, S: Dtype>(what: &'static str, supported: &'static str) -> Result<bool> {
    if S::KERNEL == T::KERNEL {
        Ok(false)
    } else if S::KERNEL == KernelDtype::F32 {
        Ok(true)
    } else {
        Err(Error::UnsupportedDtypes {
            what,
            dtype: S::KERNEL.name(),
            activations: T::KERNEL.name(),
            supported,
        })
    }
}

/// Shapes and dtypes of a forward's residual operands (both like `x`, each in `T` or f32):
/// whether `residual` and `residual_out` are stored as f32.
pub(crate) fn validate_residual<T: Dtype, R: Buffer, H: Buffer>(
    x: &Rows<impl Buffer>,
    residual: &Rows<R>,
    residual_out: &Rows<H>,
) -> Result<(bool, bool)> {
    residual.expect_shape("residual", x.rows, x.d)?;
    residual_out.expect_shape("residual_out", x.rows, x.d)?;
    let supported = "residual rows must be in the activations' dtype or f32";
    Ok((
        stored_f32::<T, R::Elem>("residual", supported)?,
        stored_f32::<T, H::Elem>("residual_out", supported)?,
    ))
}

/// Shape and dtype of a residual backward's `dresidual` (like `x`): whether x and dresidual, the
/// forward's `residual_out` and its gradient, are stored as f32 rather than in dy's dtype `T`.
pub(crate) fn validate_residual_backward<T: Dtype, X: Buffer>(
    x: &Rows<X>,
    dresidual: Option<&Rows<impl Buffer<Elem = X::Elem>>>,
) -> Result<bool> {
    if let Some(dr) = dresidual {
        dr.expect_shape("dresidual", x.rows, x.d)?;
    }
    stored_f32::<T, X::Elem>(
        "x (residual_out)",
        "the residual stream must be in the activations' dtype or f32",
    )
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
