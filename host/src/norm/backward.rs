//! The norm backward: its arguments, validation and launch plan (the row kernel, then the column
//! sum of the dγ and dβ partials).

use normkern_gpu::kernel::Dtype as KernelDtype;
use normkern_gpu::norm::policy::{
    BACKWARD_WIDE_ROW_THREADS, backward_prefers_wide_blocks, block_takes_ring, has_ring_instance,
    plain_adds_dresidual,
};
use normkern_gpu::norm::{BACKWARD, BackwardParams, Norm, NormKey, STREAM};

use super::{RowLaunch, check_config, inv, params_f32, stored_f32, stride_in_elems};
use crate::distributed::{Across, launch_backward};
use crate::error::{Error, Result};
use crate::executor::{Device, Executor, Launch, optional_input, optional_output};
use crate::plan::{
    BlockSizes, CLUSTER_SIZES, GradientPlan, GradientsOf, PREFERRED_THREADS, ParamGradients,
    Partials, STREAM_THREADS, check_gradients, gradient_plan, gradient_workspace_len,
    max_block_threads, packs_fit, persistent_grid,
};
use crate::tensor::{Buffer, Dtype, Rows, expect_len};

/// The arguments of a norm backward ([`crate::rms_norm::backward`],
/// [`crate::layer_norm::backward`]): `dy` and `dx` in the activations' dtype `T`; `x` (and
/// `dresidual`) in `T` or f32 (`H`, an fp32 residual stream); `weight` in `T` or f32 (`W`);
/// `dweight` and `dbias` in `W` or f32 (`G`).
///
/// The statistics are the forward's saved ones (`rstd`, and LayerNorm's `mean` with it), or
/// recomputed from x when none are given (one more reduction per row).
#[must_use = "the arguments do nothing until passed to rms_norm::backward or layer_norm::backward"]
pub struct NormBackward<'a, E: Executor, T: Dtype, H: Dtype = T, W: Dtype = T, G: Dtype = W> {
    /// `rows × d`: the gradient arriving on y.
    pub dy: Rows<E::In<'a, T>>,
    /// `rows × d`: the forward's input (with a fused residual, the forward's `residual_out`).
    pub x: Rows<E::In<'a, H>>,
    /// `d` elements: γ.
    pub weight: E::In<'a, W>,
    /// The forward's saved means (LayerNorm only, given with `rstd`).
    pub mean: Option<E::In<'a, f32>>,
    /// The forward's saved rstd; `None` recomputes the statistics from x.
    pub rstd: Option<E::In<'a, f32>>,
    /// `rows × d`, x's dtype: the gradient arriving on the forward's `residual_out` from the rest
    /// of the network, added into dx in the same pass (`dx = ∂y/∂h·dy + dresidual`, one
    /// rounding); that dx is the gradient of both x and the residual.
    pub dresidual: Option<Rows<E::In<'a, H>>>,
    /// `rows × d` output: the gradient of x.
    pub dx: Rows<E::Out<'a, T>>,
    /// `d` elements: dγ, bitwise reproducible on any grid and GPU.
    pub dweight: E::Out<'a, G>,
    /// `d` elements: dβ (LayerNorm only).
    pub dbias: Option<E::Out<'a, G>>,
    /// At least `rms_norm::workspace_len` (`layer_norm::workspace_len`) f32 for the group
    /// partials of dγ (and dβ), **allocated zeroed** ([`ParamGradients`] says why).
    pub workspace: E::Out<'a, f32>,
    /// How dγ (and dβ) are summed over the rows; the default picks a deterministic way.
    pub param_gradients: ParamGradients,
    /// As in the forward: used when the statistics are recomputed.
    pub eps: f32,
    /// As in the forward: `dŷ = dy·(γ + offset)`; dγ does not see it.
    pub weight_offset: f32,
}

impl<'a, E: Executor, T: Dtype, H: Dtype, W: Dtype, G: Dtype> NormBackward<'a, E, T, H, W, G> {
    /// `dx` and `dweight` from `dy`, `x` and `weight`, statistics recomputed (until
    /// [`Self::rstd`] gives the saved ones), eps = [`super::DEFAULT_EPS`].
    pub fn new(
        dy: Rows<E::In<'a, T>>,
        x: Rows<E::In<'a, H>>,
        weight: E::In<'a, W>,
        dx: Rows<E::Out<'a, T>>,
        dweight: E::Out<'a, G>,
        workspace: E::Out<'a, f32>,
    ) -> Self {
        NormBackward {
            dy,
            x,
            weight,
            mean: None,
            rstd: None,
            dresidual: None,
            dx,
            dweight,
            dbias: None,
            workspace,
            eps: super::DEFAULT_EPS,
            weight_offset: 0.0,
            param_gradients: ParamGradients::Auto,
        }
    }

    /// Sums dγ (and dβ) over the rows as `strategy` says.
    pub fn param_gradients(self, strategy: ParamGradients) -> Self {
        NormBackward {
            param_gradients: strategy,
            ..self
        }
    }

    /// Sets eps.
    pub fn eps(self, eps: f32) -> Self {
        NormBackward { eps, ..self }
    }

    /// Uses γ as `γ + offset`.
    pub fn weight_offset(self, weight_offset: f32) -> Self {
        NormBackward {
            weight_offset,
            ..self
        }
    }

    /// The forward's saved rstd (RMSNorm).
    pub fn rstd(self, rstd: E::In<'a, f32>) -> Self {
        NormBackward {
            rstd: Some(rstd),
            ..self
        }
    }

    /// The forward's saved statistics (LayerNorm).
    pub fn mean_rstd(self, mean: E::In<'a, f32>, rstd: E::In<'a, f32>) -> Self {
        NormBackward {
            mean: Some(mean),
            rstd: Some(rstd),
            ..self
        }
    }

    /// Also writes dβ (LayerNorm).
    pub fn dbias(self, dbias: E::Out<'a, G>) -> Self {
        NormBackward {
            dbias: Some(dbias),
            ..self
        }
    }

    /// Adds the gradient arriving on the forward's `residual_out` into dx.
    pub fn dresidual(self, dresidual: Rows<E::In<'a, H>>) -> Self {
        NormBackward {
            dresidual: Some(dresidual),
            ..self
        }
    }
}

/// f32 elements of workspace a backward of `norm` over `rows × d` needs: the single launch's
/// counters, one partial row of dγ per group of rows, and for LayerNorm as many of dβ.
pub(crate) fn workspace_len(norm: Norm, rows: usize, d: usize) -> Result<usize> {
    gradient_workspace_len(
        GradientsOf::Norm,
        Partials::Own(ParamGradients::Auto),
        rows,
        d,
        sums(norm),
    )
}

/// The parameter gradients of `norm`'s backward: dγ, and LayerNorm's dβ.
pub(crate) fn sums(norm: Norm) -> usize {
    if norm == Norm::Layer { 2 } else { 1 }
}

/// A validated backward: addresses and strides; 0 for an absent operand.
pub(crate) struct Call {
    pub key: NormKey,
    pub rows: usize,
    pub d: usize,
    pub dy: (u64, usize),
    pub x: (u64, usize),
    pub dx: (u64, usize),
    pub dresidual: (u64, usize),
    pub weight: u64,
    pub mean: u64,
    pub rstd: u64,
    pub dweight: u64,
    pub dbias: u64,
    pub workspace: u64,
    pub eps: f32,
    pub weight_offset: f32,
    /// Weight stored as f32 rather than in the activations' dtype.
    pub params_f32: bool,
    /// x (and dresidual) stored as f32 rather than in the activations' dtype.
    pub x_f32: bool,
    /// Storage of dγ and dβ.
    pub grad_dtype: KernelDtype,
    /// Where dγ's and dβ's partials go (one device, or a rank's share).
    pub partials: Partials,
}

/// Runs the backward of `norm` on `exec`.
pub(crate) fn run<E: Executor, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
    norm: Norm,
    exec: &E,
    args: NormBackward<'_, E, T, H, W, G>,
) -> Result<()> {
    run_across(norm, exec, args, None)
}

/// Runs the backward of `norm` on `exec`, on one device (`across` = `None`) or as one rank of
/// several (dγ/dβ partials laid out and met as `across` says).
pub(crate) fn run_across<E: Executor, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
    norm: Norm,
    exec: &E,
    mut args: NormBackward<'_, E, T, H, W, G>,
    across: Option<Across<'_>>,
) -> Result<()> {
    let (rows, d) = (args.x.rows, args.x.d);
    check_config(args.eps, args.weight_offset)?;
    args.dy.expect_shape("dy", rows, d)?;
    args.dx.expect_shape("dx", rows, d)?;
    if let Some(dr) = &args.dresidual {
        dr.expect_shape("dresidual", rows, d)?;
    }
    expect_len("weight", args.weight.elements(), d)?;
    expect_len("dweight", args.dweight.elements(), d)?;
    if let Some(db) = &args.dbias {
        expect_len("dbias", db.elements(), d)?;
    }
    for (what, stat) in [("mean", &args.mean), ("rstd", &args.rstd)] {
        if let Some(s) = stat {
            expect_len(what, s.elements(), rows)?;
        }
    }
    match norm {
        Norm::Rms => {
            let no = "RMSNorm has none";
            if args.mean.is_some() {
                return Err(Error::Argument {
                    what: "mean",
                    problem: no,
                });
            }
            if args.dbias.is_some() {
                return Err(Error::Argument {
                    what: "dbias",
                    problem: no,
                });
            }
        }
        Norm::Layer => {
            if args.mean.is_some() != args.rstd.is_some() {
                return Err(Error::Argument {
                    what: "mean/rstd",
                    problem: "LayerNorm's saved statistics come together: both or neither",
                });
            }
        }
    }
    let strategy = args.param_gradients;
    let partials = match &across {
        None => Partials::Own(strategy),
        Some(_) if matches!(strategy, ParamGradients::Auto | ParamGradients::TwoPass) => across
            .as_ref()
            .map_or(Partials::Own(strategy), |a| a.partials),
        Some(_) => {
            return Err(Error::Argument {
                what: "param_gradients",
                problem: "a backward across ranks sums its gradients its own way: leave it Auto",
            });
        }
    };
    check_gradients(partials, G::KERNEL, T::KERNEL)?;
    let needed = gradient_workspace_len(GradientsOf::Norm, partials, rows, d, sums(norm))?;
    if args.workspace.elements() < needed {
        return Err(Error::WorkspaceTooSmall {
            needed,
            actual: args.workspace.elements(),
        });
    }
    let params_f32 = params_f32::<T, W>()?;
    if !(G::KERNEL == W::KERNEL || G::KERNEL == KernelDtype::F32) {
        return Err(Error::UnsupportedDtypes {
            what: "dweight/dbias",
            dtype: G::KERNEL.name(),
            activations: T::KERNEL.name(),
            supported: "parameter gradients must be in the parameters' dtype or f32",
        });
    }
    let x_f32 = stored_f32::<T, H>(
        "x (residual_out)",
        "the residual stream must be in the activations' dtype or f32",
    )?;
    exec.prepare()?;
    let (dy, _dy) = exec.input("dy", &args.dy.data)?;
    let (x, _x) = exec.input("x", &args.x.data)?;
    let (weight, _weight) = exec.input("weight", &args.weight)?;
    let (mean, _mean) = optional_input(exec, "mean", args.mean.as_ref())?;
    let (rstd, _rstd) = optional_input(exec, "rstd", args.rstd.as_ref())?;
    let dresidual_data = args.dresidual.as_ref().map(|r| &r.data);
    let (dresidual, _dresidual) = optional_input(exec, "dresidual", dresidual_data)?;
    let (dx, _dx) = exec.output("dx", &mut args.dx.data)?;
    let (dweight, _dweight) = exec.output("dweight", &mut args.dweight)?;
    let (dbias, _dbias) = optional_output(exec, "dbias", args.dbias.as_mut())?;
    let (workspace, _workspace) = exec.output("workspace", &mut args.workspace)?;
    let call = Call {
        // The `_res` kernels hold x as f32 for an f32 residual stream; some plain ones add a
        // dresidual in the activations' dtype themselves (`plan`).
        key: NormKey::call(norm, x_f32, T::KERNEL),
        rows,
        d,
        dy: (dy, args.dy.stride),
        x: (x, args.x.stride),
        dx: (dx, args.dx.stride),
        dresidual: (dresidual, args.dresidual.as_ref().map_or(0, |r| r.stride)),
        weight,
        mean,
        rstd,
        dweight,
        dbias,
        workspace,
        eps: args.eps,
        weight_offset: args.weight_offset,
        params_f32,
        x_f32,
        grad_dtype: G::KERNEL,
        partials,
    };
    let plan = plan(&call, exec.device())?;
    launch_backward(exec, plan.rows.as_ref(), &plan.gradients, across)
}

/// The cluster sizes a backward's row may be split over. RMSNorm's plain backward skips clusters
/// of four: at 2048×32768 (bf16) its 4-access tile over 4 blocks read 66 % of copy where the
/// 2-access tile over 8 blocks read 75 (and the 4-access over 8, 67); rows that take clusters of 2
/// or 8 measured best there (`bench-results/h200.md`, twenty-fourth session). LayerNorm's 2-access
/// cluster tile measured lower (48 against 53), and the calls that add a dresidual need the widest
/// tile (`plain_adds_dresidual`): both keep every size. LayerNorm's plain backward may also
/// split a row over 16 blocks (where the device keeps such a cluster resident): its f32 2-access
/// tile takes 80 registers, too many for the 1024-thread blocks that a row of 65536 needs over 8,
/// which streamed it instead (read twice, 49.8 % of copy on an H100, fifty-seventh session).
fn backward_cluster_sizes(norm: Norm, adds_residual: bool) -> &'static [usize] {
    match (norm, adds_residual) {
        (Norm::Rms, false) => &[2, 8],
        (Norm::Layer, false) => &[2, 4, 8, 16],
        (_, true) => CLUSTER_SIZES,
    }
}

/// Swaps a block tile's kernel for its ring instance where [`block_takes_ring`] says, on a device
/// that runs it (sm_90: the ring's bulk copies come with clusters) with the block it was planned
/// for; `work` items (dγ groups) for its persistent grid. A small batch is one whose groups all
/// have a resident block of the ring instance at once.
// Launch arithmetic on a planned launch.
#[allow(clippy::arithmetic_side_effects)]
fn take_ring(
    device: &dyn Device,
    launch: &mut Launch<NormKey, BackwardParams>,
    work: usize,
) -> Result<()> {
    let key = launch.kernel.key;
    if !has_ring_instance(key) || device.max_cluster() < 2 {
        return Ok(());
    }
    let Some(ring) = BACKWARD.find(&NormKey { ring: true, ..key }) else {
        return Ok(());
    };
    let shared_bytes = (ring.shared_bytes)(launch.block);
    if max_block_threads(device, ring)? < launch.block {
        return Ok(());
    }
    let resident = device.resident_blocks(ring.entry(), launch.block, shared_bytes)?;
    if !block_takes_ring(key, launch.block, work <= resident) {
        return Ok(());
    }
    let grid = persistent_grid(device, ring.entry(), work, launch.block, 1, shared_bytes)?;
    (launch.kernel, launch.shared_bytes, launch.grid) = (ring, shared_bytes, grid);
    launch.params.stage_rows = 1;
    Ok(())
}

/// The launches of a backward: the dx + partials kernel (none for no rows), then the
/// fixed-order column sums of dγ and dβ.
pub(crate) struct Plan {
    pub rows: Option<Launch<NormKey, BackwardParams>>,
    pub gradients: GradientPlan,
}

// Launch arithmetic on validated sizes (rows, d < 2³², at most 8192 groups).
#[allow(clippy::arithmetic_side_effects)]
pub(crate) fn plan(call: &Call, device: &dyn Device) -> Result<Plan> {
    let (rows, d, dtype) = (call.rows, call.d, call.key.dtype);
    let mut gradients = gradient_plan(
        device,
        GradientsOf::Norm,
        call.partials,
        (rows, d),
        call.workspace,
        [call.dweight, call.dbias],
        call.grad_dtype,
    )?;
    let [partials, dbias_partials] = gradients.partials;
    let mut rows_launch = None;
    if rows > 0 {
        let bytes = dtype.bytes();
        // The workspace takes 16-byte stores on the packed path: it must be aligned like the
        // rest. Absent operands (dβ partials, dresidual) are 0, which fits packs.
        let vec = packs_fit(
            bytes,
            d,
            &[
                call.dy.0,
                call.x.0,
                call.dx.0,
                call.weight,
                partials,
                dbias_partials,
                call.dresidual.0,
            ],
            &[
                call.dy.1,
                stride_in_elems(call.x.1, call.x_f32, bytes)?,
                call.dx.1,
                stride_in_elems(call.dresidual.1, call.x_f32, bytes)?,
            ],
        );
        let params = BackwardParams {
            x: call.x.0,
            dy: call.dy.0,
            gamma: call.weight,
            mean: call.mean,
            rstd: call.rstd,
            dx: call.dx.0,
            partials,
            dbeta_partials: dbias_partials,
            x_stride: call.x.1 as u64,
            dy_stride: call.dy.1 as u64,
            dx_stride: call.dx.1 as u64,
            rows: rows as u32,
            d: d as u32,
            rows_per_group: gradients.rows_per_group as u32,
            groups: gradients.groups as u32,
            inv_d: inv(d),
            gamma_offset: call.weight_offset,
            eps: call.eps,
            params_f32: call.params_f32 as u32,
            x_f32: call.x_f32 as u32,
            stage_rows: 0,
            dresidual: call.dresidual.0,
            dresidual_stride: call.dresidual.1 as u64,
            sums: gradients.group_sums,
        };
        let plain = |residual: bool| !residual && call.dresidual.0 == 0;
        let wide_blocks = |residual: bool| {
            backward_prefers_wide_blocks(plain(residual), vec, call.key.dtype.bytes(), d)
        };
        let row_launch = |residual: bool, cluster_sizes| {
            RowLaunch {
                table: &BACKWARD,
                key: NormKey {
                    vec,
                    residual,
                    ..call.key
                },
                d,
                // The backward's parallelism is its dγ groups (at most 8192, 64 at 1024 rows),
                // and its streaming instance re-reads the partial rows: clusters whenever a row
                // needs them.
                work: gradients.groups,
                cluster_sizes,
                fewest_accesses: 1,
                block_sizes: BlockSizes {
                    preferred: if wide_blocks(residual) {
                        BACKWARD_WIDE_ROW_THREADS
                    } else {
                        PREFERRED_THREADS
                    },
                    stream: STREAM_THREADS,
                },
                items_per_team: false,
                forward_row_bytes: None,
                params,
            }
            .plan(device, |_| false)
        };
        let sizes =
            backward_cluster_sizes(call.key.norm, call.key.residual || call.dresidual.0 != 0);
        let mut launch = row_launch(call.key.residual, sizes)?;
        let k = launch.kernel.key;
        if call.dresidual.0 != 0 && !k.residual && !plain_adds_dresidual(k.vpt, k.lanes) {
            // A dresidual in the activations' dtype where the plain tile would not add it: the
            // `_res` kernels' tile for the row.
            launch = row_launch(true, CLUSTER_SIZES)?;
        }
        let locked = launch.params.sums.mode == normkern_gpu::column_sum::GROUP_SUMS_LOCKED;
        let key = launch.kernel.key;
        if locked && (key.cluster || key.vpt == STREAM || key.lanes != 0) {
            // The lock is taken by the one block that holds the group's partial row.
            return Err(Error::Argument {
                what: "ParamGradients::LockedPartials",
                problem: "a benchmark baseline for rows one block holds in registers",
            });
        }
        take_ring(device, &mut launch, gradients.groups)?;
        launch.params.sums = gradients.fit(device, &mut launch, gradients.groups)?;
        rows_launch = Some(launch);
    }
    Ok(Plan {
        rows: rows_launch,
        gradients,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::plan::tests::FakeH200;
    use normkern_gpu::activation::kernels::dbias_group_layout;
    use normkern_gpu::column_sum::{
        COLUMN_SUM_THREADS, GROUP_SUMS_SHARED_WORDS, base_rows_per_group, group_layout,
    };
    use normkern_gpu::kernel::Kernel;
    use normkern_gpu::reduce::ROW_REDUCER_SHARED_WORDS;

    /// Registers per thread of the bf16 kernels, and of the f32 cluster backwards (ptxas, sm_90).
    pub(crate) fn registers(name: &str) -> usize {
        let tile = name.rsplit('_').next().unwrap_or("");
        let backward = name.contains("_bwd");
        match (backward, tile) {
            _ if name.starts_with("column_sum") => 32,
            // Two rows a reduction (`policy::pairs_rows`): four 128-thread blocks per SM.
            _ if name == "rms_norm_bwd_bf16_v1r" => 117,
            _ if name == "layer_norm_bwd_bf16_v1r" => 128,
            _ if name == "rms_norm_bwd_f32_v2c" => 64,
            _ if name == "layer_norm_bwd_f32_v2c" => 80,
            _ if name == "rms_norm_bwd_f32_v4c" => 172,
            _ if name == "layer_norm_bwd_f32_v4c" => 212,
            (true, "v1" | "v1c" | "s1") => 80,
            (true, "v2" | "s2") => 124,
            // RMSNorm's 2-pack cluster tile fits 512 threads, LayerNorm's does not.
            (true, "v2c") if name.starts_with("rms_norm") => 113,
            (true, "v2c") => 164,
            (true, "v4" | "s4") => 235,
            (true, "v4c") => 254,
            (true, _) => 79,
            (false, "v1" | "v1c" | "s1") => 43,
            (false, "v2" | "v2c" | "s2") => 64,
            // RMSNorm's plain 4-pack tiles keep no next row in flight.
            (false, "v4") if name.starts_with("rms_norm_fwd_bf16") => 64,
            (false, "v4c") if name.starts_with("rms_norm_fwd_bf16") => 70,
            (false, "v4" | "v4c" | "s4") => 128,
            (false, _) => 48,
        }
    }

    pub(crate) const H200: FakeH200 = FakeH200 {
        registers,
        grid_limit: None,
        max_cluster: 16,
        overlaps: true,
    };

    /// A backward of `norm` over dense, 16-byte aligned bf16 rows.
    fn call(norm: Norm, rows: usize, d: usize) -> Call {
        let buffer = 1 << 20;
        Call {
            key: NormKey::call(norm, false, KernelDtype::Bf16),
            rows,
            d,
            dy: (buffer, d),
            x: (2 * buffer, d),
            dx: (3 * buffer, d),
            dresidual: (0, 0),
            weight: 4 * buffer,
            mean: 5 * buffer,
            rstd: 6 * buffer,
            dweight: 7 * buffer,
            dbias: if norm == Norm::Layer { 8 * buffer } else { 0 },
            workspace: 9 * buffer,
            eps: 1e-5,
            weight_offset: 0.0,
            params_f32: false,
            x_f32: false,
            grad_dtype: KernelDtype::Bf16,
            partials: Partials::Own(ParamGradients::TwoPass),
        }
    }

    #[test]
    fn many_groups_take_the_chained_column_sum() {
        use normkern_gpu::column_sum::CHAIN_COLUMNS;
        // (rows, d, groups, chained): 4096 groups of 64 rows of 512, 1024 of 1024 rows of 128 —
        // more than one round of the sum's loads per slice — and 512 groups (one round) of 1024.
        for (rows, d, groups, chained) in [
            (262144, 512, 4096, true),
            (1 << 20, 128, 1024, true),
            (65536, 1024, 512, false),
        ] {
            let plan = plan(&call(Norm::Layer, rows, d), &H200).unwrap();
            let sums = plan.gradients.sums.unwrap();
            assert_eq!(sums.params.groups as usize, groups, "{rows}×{d}");
            assert_eq!(sums.params.chained != 0, chained, "{rows}×{d}");
            // dγ and dβ: slabs of 8 columns chained, else of 32.
            let slab = if chained { CHAIN_COLUMNS } else { 32 };
            assert_eq!(sums.grid, 2 * d / slab, "{rows}×{d}");
        }
    }

    #[test]
    fn ring_instances_serve_layer_norm_blocks_of_four_warps_and_small_batches() {
        // (kernel, block, stage_rows) of a bf16 backward, checking the shared memory it asks
        // for (the ring needs more than the default 48 KiB at 256 threads: the kernel opts in).
        let planned = |norm, rows, d, dresidual: bool| {
            let mut c = call(norm, rows, d);
            if dresidual {
                c.dresidual = (c.dx.0 + (1 << 30), d);
            }
            let rows = plan(&c, &H200).unwrap().rows.unwrap();
            assert_eq!(rows.cluster, 1);
            assert_eq!(rows.shared_bytes, (rows.kernel.shared_bytes)(rows.block));
            (rows.kernel.name, rows.block, rows.params.stage_rows)
        };
        use Norm::{Layer, Rms};
        let expected = [
            // LayerNorm's one-access tile of 128 and 256 threads stages its rows in its ring
            // instance.
            (Layer, 65536, 1024, false, "layer_norm_bwd_bf16_v1r", 128, 1),
            (Layer, 32768, 2048, false, "layer_norm_bwd_bf16_v1r", 256, 1),
            // So does either norm's in a small batch (every dγ group a resident block), in
            // blocks of any size.
            (Layer, 8192, 512, false, "layer_norm_bwd_bf16_v1r", 64, 1),
            (Rms, 8192, 512, false, "rms_norm_bwd_bf16_v1r", 64, 1),
            (Rms, 4096, 1024, false, "rms_norm_bwd_bf16_v1r", 128, 1),
            // The sweep's 65536×1024: 512 groups, four blocks of the pairs' 117 registers on
            // each of 132 SMs.
            (Rms, 65536, 1024, false, "rms_norm_bwd_bf16_v1r", 128, 1),
            // Large batches in 64-thread blocks (d = 512), the dresidual tiles and RMSNorm's
            // block instance where its groups outnumber its blocks keep the block instance.
            (Layer, 262144, 512, false, "layer_norm_bwd_bf16_v1", 64, 0),
            (Rms, 262144, 512, false, "rms_norm_bwd_bf16_v1", 64, 0),
            (Rms, 32768, 2048, false, "rms_norm_bwd_bf16_v1", 256, 0),
            (
                Layer,
                65536,
                1024,
                true,
                "layer_norm_bwd_res_bf16_v1",
                128,
                0,
            ),
        ];
        for (norm, rows, d, dresidual, kernel, block, stage_rows) in expected {
            let what = format!("{norm:?} {rows}×{d}, dresidual {dresidual}");
            let want = (kernel, block, stage_rows);
            assert_eq!(planned(norm, rows, d, dresidual), want, "{what}");
        }
    }

    #[test]
    fn narrow_rows_take_segment_teams_a_block_per_group() {
        for (d, name) in [
            (128, "layer_norm_bwd_bf16_v1l16"),
            (256, "layer_norm_bwd_bf16_v1l32"),
        ] {
            let plan = plan(&call(Norm::Layer, 1 << 20, d), &H200).unwrap();
            let rows = plan.rows.unwrap();
            assert_eq!((rows.kernel.name, rows.block), (name, 256));
            assert!(rows.grid <= 1024, "{d}: a block per group of 1024");
        }
        let wider = plan(&call(Norm::Layer, 1 << 20, 512), &H200).unwrap();
        assert_eq!(wider.rows.unwrap().kernel.key.lanes, 0);
        // Single elements (d not a multiple of the pack): four a lane, γ in registers for
        // LayerNorm too (in shared memory its 256 threads would need more than 48 KB).
        for (norm, name) in [
            (Norm::Rms, "rms_norm_bwd_bf16_s4l32"),
            (Norm::Layer, "layer_norm_bwd_bf16_s4l32"),
        ] {
            let rows = plan(&call(norm, 9000, 100), &H200).unwrap().rows.unwrap();
            assert_eq!((rows.kernel.name, rows.block), (name, 256));
            assert!(rows.shared_bytes <= 48 * 1024);
        }
    }

    #[test]
    fn a_row_that_fits_a_block_takes_the_preferred_block_and_even_rounds() {
        let plan = plan(&call(Norm::Rms, 16384, 4096), &H200).unwrap();
        let rows = plan.rows.unwrap();
        assert_eq!(rows.kernel.name, "rms_norm_bwd_bf16_v2");
        assert_eq!((rows.block, rows.cluster), (256, 1));
        assert_eq!(rows.shared_bytes, ROW_REDUCER_SHARED_WORDS * 4);
        // 256 groups of 64 rows (rows of 4096 take longer groups while 256 remain); two blocks
        // of 124 registers per SM: 264 resident, so one round of 256 blocks.
        assert_eq!((rows.params.groups, rows.params.rows_per_group), (256, 64));
        assert_eq!(rows.grid, 256);
        // dγ's column sum: 128 slabs of 32 columns, one column per thread at this width.
        assert_eq!(
            plan.gradients.sums.as_ref().unwrap().kernel.name,
            "column_sum_bf16"
        );
        assert_eq!(
            (
                plan.gradients.sums.as_ref().unwrap().block,
                plan.gradients.sums.as_ref().unwrap().grid
            ),
            (COLUMN_SUM_THREADS, 128)
        );
        assert_eq!(
            (
                plan.gradients.sums.as_ref().unwrap().params.columns,
                plan.gradients.sums.as_ref().unwrap().params.partials2
            ),
            (1, 0)
        );
    }

    #[test]
    fn the_single_launch_sums_in_the_row_kernel_on_a_resident_grid() {
        let mut c = call(Norm::Layer, 64, 4096);
        c.partials = Partials::Own(ParamGradients::Auto);
        let plan = plan(&c, &H200).unwrap();
        let rows = plan.rows.unwrap();
        assert!(plan.gradients.sums.is_none() && rows.cooperative);
        assert_eq!(
            rows.params.sums.mode,
            normkern_gpu::column_sum::GROUP_SUMS_IN_LAUNCH
        );
        // The barrier's words first, then dγ's and dβ's partial rows.
        assert_eq!(rows.params.sums.sync, c.workspace);
        assert_eq!(rows.params.partials, c.workspace + 16);
        assert_eq!(
            (rows.params.sums.out, rows.params.sums.out2),
            (c.dweight, c.dbias)
        );
        let two_pass = self::plan(&call(Norm::Layer, 64, 4096), &H200).unwrap();
        let (single, two) = (rows.shared_bytes, two_pass.rows.unwrap().shared_bytes);
        assert_eq!(single, two + GROUP_SUMS_SHARED_WORDS * 4);
        // 64 groups of one row, and 2 × 128 slabs of 32 columns to sum: 256 blocks, all
        // resident (two of 256 threads per SM).
        assert_eq!((rows.params.groups, rows.grid), (64, 256));
        // Atomics: the gradients themselves take the partial rows, no column sum, no barrier.
        c.partials = Partials::Own(ParamGradients::Atomic);
        let plan = self::plan(&c, &H200).unwrap();
        let rows = plan.rows.unwrap();
        assert!(plan.gradients.sums.is_none() && !rows.cooperative);
        assert_eq!(
            (rows.params.partials, rows.params.dbeta_partials),
            (c.dweight, c.dbias)
        );
    }

    /// `Auto` takes the single launch for calls of up to 2²² elements, and, where the column sum
    /// cannot overlap the row kernel (sm_80 builds), for large norm backwards where it was
    /// measured no slower, by the shape alone.
    #[test]
    fn auto_picks_the_single_launch_by_shape() {
        let sm80_build = FakeH200 {
            overlaps: false,
            ..H200
        };
        for (rows, d, single_sm90, single_sm80) in [
            (64, 4096, true, true),
            (1024, 4096, true, true),
            (1 << 20, 128, false, true),
            (1 << 18, 256, false, true),
            (1 << 18, 512, false, false),
            (65536, 1024, false, true),
            (16384, 4096, false, true),
            (8192, 8192, false, true),
            (4096, 16384, false, false),
            (1024, 65536, false, false),
        ] {
            for (device, single) in [(&H200, single_sm90), (&sm80_build, single_sm80)] {
                let mut c = call(Norm::Rms, rows, d);
                c.partials = Partials::Own(ParamGradients::Auto);
                let plan = plan(&c, device).unwrap();
                let cooperative = plan.rows.unwrap().cooperative;
                assert_eq!(cooperative, single, "{rows}×{d}");
                let sums = plan.gradients.sums.as_ref();
                assert_eq!(sums.is_none(), single, "{rows}×{d}");
                // The column sum overlaps the row kernel where the build's kernels wait for it.
                let overlaps = sums.is_some_and(|s| s.overlaps_previous);
                assert_eq!(overlaps, !single && device.overlaps, "{rows}×{d}");
            }
        }
    }

    #[test]
    fn wide_rows_are_split_over_clusters_and_staged() {
        let plan = plan(&call(Norm::Layer, 1024, 65536), &H200).unwrap();
        let rows = plan.rows.unwrap();
        assert_eq!(rows.kernel.name, "layer_norm_bwd_bf16_v4c");
        assert_eq!((rows.block, rows.cluster), (256, 8));
        // The staged ring needs more than the default 48 KiB: the kernel opts in.
        assert!(rows.kernel.large_shared && rows.shared_bytes > 48 * 1024);
        // 15 groups of 69 rows, one round over 15 clusters.
        assert_eq!((rows.params.groups, rows.grid), (15, 120));
        // dγ and dβ in one column-sum launch, four columns per thread.
        assert_ne!(plan.gradients.sums.as_ref().unwrap().params.partials2, 0);
        assert_eq!(plan.gradients.sums.as_ref().unwrap().params.columns, 4);
    }

    #[test]
    fn f32_rows_of_65536_stay_in_registers_where_the_ring_fits() {
        // (norm, device's largest cluster, kernel, block, cluster): RMSNorm's f32 2-access cluster
        // tile fits 1024 threads by its registers and, with a ring of three 64 KiB stages, by its
        // shared memory. LayerNorm's does not fit 1024 threads (80 registers): it takes a cluster
        // of 16 where the device has them, else streams the row over 8.
        for (norm, max_cluster, kernel, block, cluster) in [
            (Norm::Rms, 16, "rms_norm_bwd_f32_v2c", 1024, 8),
            (Norm::Layer, 16, "layer_norm_bwd_f32_v4c", 256, 16),
            (Norm::Layer, 8, "layer_norm_bwd_f32_vxc", 800, 8),
        ] {
            let mut c = call(norm, 1024, 65536);
            c.key = NormKey::call(norm, false, KernelDtype::F32);
            c.grad_dtype = KernelDtype::F32;
            let device = FakeH200 {
                max_cluster,
                ..H200
            };
            let rows = plan(&c, &device).unwrap().rows.unwrap();
            assert_eq!(
                (rows.kernel.name, rows.block, rows.cluster),
                (kernel, block, cluster),
                "{norm:?}"
            );
            assert!(rows.shared_bytes <= H200.shared_opt_in(), "{norm:?}");
            assert_eq!(rows.shared_bytes, (rows.kernel.shared_bytes)(rows.block));
        }
    }

    /// The emulated device the GPU-free tests split LayerNorm rows over 16 blocks on
    /// (`tests/tests/norm/kernels.rs`, `emulator_rows_split_over_clusters_match_reference`): f32
    /// rows of 8192 in blocks of 32 threads, with 16 blocks resident; with fewer there is no
    /// cluster of 16 to run, and the row streams over 8.
    #[test]
    fn the_emulator_takes_clusters_of_16_only_where_resident() {
        for (resident, kernel, cluster) in [
            (16, "layer_norm_bwd_f32_v4c", 16),
            (15, "layer_norm_bwd_f32_vxc", 8),
        ] {
            let emulator = crate::Emulator::new()
                .with_block_limit(32)
                .and_then(|e| e.with_clusters(16))
                .and_then(|e| e.with_resident_blocks(resident))
                .unwrap();
            let mut c = call(Norm::Layer, 5, 8192);
            c.key = NormKey::call(Norm::Layer, false, KernelDtype::F32);
            c.grad_dtype = KernelDtype::F32;
            let rows = plan(&c, &emulator).unwrap().rows.unwrap();
            assert_eq!(
                (rows.kernel.name, rows.block, rows.cluster),
                (kernel, 32, cluster)
            );
        }
    }

    #[test]
    fn rms_norm_skips_clusters_of_four_unless_it_adds_a_dresidual() {
        let tile = |norm, d, dresidual: bool| {
            let mut c = call(norm, 2048, d);
            if dresidual {
                c.dresidual = (10 << 20, d);
            }
            let rows = plan(&c, &H200).unwrap().rows.unwrap();
            (rows.kernel.name, rows.block, rows.cluster)
        };
        // 32768 bf16: 4 packs × 256 threads × 4 blocks, or for RMSNorm's plain backward one pack
        // × 512 threads over 8 blocks (`backward_prefers_wide_blocks`).
        assert_eq!(
            tile(Norm::Rms, 32768, false),
            ("rms_norm_bwd_bf16_v1c", 512, 8)
        );
        assert_eq!(
            tile(Norm::Layer, 32768, false),
            ("layer_norm_bwd_bf16_v4c", 256, 4)
        );
        assert_eq!(
            tile(Norm::Rms, 32768, true),
            ("rms_norm_bwd_bf16_v4c", 256, 4)
        );
        // Clusters of 2 and 8 are RMSNorm's as before, of 512-thread blocks (its 2-pack cluster
        // tile fits them) for the plain backward, of 256 with a dresidual.
        assert_eq!(
            tile(Norm::Rms, 16384, false),
            ("rms_norm_bwd_bf16_v2c", 512, 2)
        );
        assert_eq!(
            tile(Norm::Rms, 16384, true),
            ("rms_norm_bwd_bf16_v4c", 256, 2)
        );
        assert_eq!(
            tile(Norm::Rms, 65536, false),
            ("rms_norm_bwd_bf16_v2c", 512, 8)
        );
        // LayerNorm's 2-pack cluster tile (164 registers) does not: 256 threads of 4.
        assert_eq!(
            tile(Norm::Layer, 16384, false),
            ("layer_norm_bwd_bf16_v4c", 256, 2)
        );
    }

    /// 16-bit rows wider than 4096: the plain backward's blocks take 512 threads (16 warps of 2
    /// packs a thread, not 8 of 4 at 255 registers); with a dresidual, rows of 4096 and f32 rows,
    /// 256.
    #[test]
    fn plain_backwards_of_wide_rows_prefer_blocks_of_512() {
        let tile = |norm, d, dtype: KernelDtype, dresidual: bool| {
            let mut c = call(norm, 2048, d);
            c.key.dtype = dtype;
            if dresidual {
                c.dresidual = (10 << 20, d);
            }
            let rows = plan(&c, &H200).unwrap().rows.unwrap();
            (rows.kernel.name, rows.block, rows.cluster)
        };
        for (norm, name) in [(Norm::Rms, "rms_norm"), (Norm::Layer, "layer_norm")] {
            let v = |vpt| format!("{name}_bwd_bf16_v{vpt}");
            let t = tile(norm, 8192, KernelDtype::Bf16, false);
            assert_eq!((t.0, t.1, t.2), (&*v(2), 512, 1));
            let t = tile(norm, 8192, KernelDtype::Bf16, true);
            assert_eq!((t.0, t.1, t.2), (&*v(4), 256, 1));
            let t = tile(norm, 4096, KernelDtype::Bf16, false);
            assert_eq!((t.0, t.1, t.2), (&*v(2), 256, 1));
            let t = tile(norm, 8192, KernelDtype::F16, false);
            assert_eq!((t.0, t.1), (&*format!("{name}_bwd_f16_v2"), 512));
            // f32 rows of 4096 are 16 KiB, as 16-bit rows of 8192, but keep 256 threads.
            let t = tile(norm, 4096, KernelDtype::F32, false);
            assert_eq!((t.0, t.1), (&*format!("{name}_bwd_f32_v4"), 256));
        }
    }

    #[test]
    fn a_dresidual_in_the_activations_dtype_takes_plain_tiles_that_add_it() {
        for (d, name) in [
            (128, "rms_norm_bwd_bf16_v1l16"),
            (1024, "rms_norm_bwd_res_bf16_v1"),
            (8192, "rms_norm_bwd_bf16_v4"),
            (16384, "rms_norm_bwd_bf16_v4c"),
            (65536, "rms_norm_bwd_bf16_v4c"),
            (131072, "rms_norm_bwd_res_bf16_vxc"),
        ] {
            let mut c = call(Norm::Rms, 4096, d);
            c.dresidual = (10 << 20, d);
            let rows = plan(&c, &H200).unwrap().rows.unwrap();
            assert_eq!(rows.kernel.name, name, "d = {d}");
        }
    }

    #[test]
    fn unaligned_rows_take_single_element_access() {
        // d not a multiple of the pack: 4 elements × 256 threads cover a row of 1001.
        let rows = plan(&call(Norm::Rms, 100, 1001), &H200)
            .unwrap()
            .rows
            .unwrap();
        assert!(!rows.kernel.key.vec);
        assert_eq!(
            (rows.kernel.name, rows.block),
            ("rms_norm_bwd_bf16_s4", 256)
        );
        // x off 16-byte alignment at d = 4096: too wide for single-element register tiles, and
        // there are no single-element cluster kernels: one block streams the row.
        let mut c = call(Norm::Rms, 100, 4096);
        c.x.0 += 2;
        let rows = plan(&c, &H200).unwrap().rows.unwrap();
        assert_eq!(
            (rows.kernel.name, rows.block),
            ("rms_norm_bwd_bf16_sx", 800)
        );
        // The fp32 residual stream takes the residual kernels, which stream single elements.
        let mut c = call(Norm::Rms, 100, 4095);
        (c.key.residual, c.x_f32) = (true, true);
        let rows = plan(&c, &H200).unwrap().rows.unwrap();
        assert_eq!(rows.kernel.name, "rms_norm_bwd_res_bf16_sx");
    }

    #[test]
    fn no_rows_launch_only_the_column_sum_of_zero_groups() {
        let plan = plan(&call(Norm::Layer, 0, 4096), &H200).unwrap();
        assert!(plan.rows.is_none());
        assert_eq!(plan.gradients.sums.as_ref().unwrap().params.groups, 0);
    }

    #[test]
    fn grids_follow_the_grid_limit() {
        let limited = FakeH200 {
            grid_limit: Some(3),
            ..H200
        };
        let plan = plan(&call(Norm::Rms, 16384, 4096), &limited).unwrap();
        assert_eq!(plan.rows.unwrap().grid, 3);
        // A limit below one cluster still launches one whole cluster.
        let wide = super::plan(&call(Norm::Rms, 64, 65536), &limited).unwrap();
        assert_eq!(wide.rows.unwrap().grid, 8);
    }

    /// The staged cluster backward (4 rows of x and dy in flight, LayerNorm's γ and the dresidual
    /// slots besides) needs more than the default 48 KiB: it gets the device's opt-in limit, and
    /// a device with less gets fewer threads per block rather than a failed launch.
    #[test]
    fn staged_blocks_fit_the_opt_in_shared_memory() {
        use crate::plan::threads_within_shared;
        let key = |vpt, cluster, residual| NormKey {
            norm: Norm::Layer,
            residual,
            dtype: KernelDtype::Bf16,
            vec: true,
            vpt,
            cluster,
            lanes: 0,
            ring: false,
        };
        let staged = BACKWARD.find(&key(4, true, false)).unwrap();
        assert!(staged.large_shared);
        assert!((staged.shared_bytes)(256) > 48 * 1024);
        let within = |k: &Kernel<_, _>, opt_in| {
            threads_within_shared(k.large_shared, k.shared_bytes, opt_in)
        };
        assert_eq!(within(staged, 227 * 1024), 320);
        assert_eq!(within(staged, 99 * 1024), 128);
        // Residual and narrower block instances keep within 48 KiB whatever the device offers.
        for k in [
            key(2, false, false),
            key(4, false, true),
            key(4, true, true),
        ] {
            let kernel = BACKWARD.find(&k).unwrap();
            assert!(!kernel.large_shared);
            let threads = within(kernel, 227 * 1024);
            assert!((kernel.shared_bytes)(threads) <= 48 * 1024, "{k:?}");
        }
        // The widest block tile holds γ (LayerNorm) and the dresidual slots: a little more.
        let widest = BACKWARD.find(&key(4, false, false)).unwrap();
        assert!(widest.large_shared);
        assert_eq!(within(widest, 227 * 1024), 1024);
        assert_eq!(within(widest, 48 * 1024), 224);
    }

    /// The bounded search picks what a scan over every group size picks (the first cheapest),
    /// and sizes near the limits take no time (the base layout, before the longer groups).
    #[test]
    fn group_layouts_match_the_exhaustive_search() {
        fn scan(rows: usize, d: usize) -> (usize, usize) {
            // Rows of at most 256: up to 1024 groups; of at most 512: 2²¹ / d.
            let most = match d {
                ..=256 => 1024,
                257..=512 => (1 << 21) / d,
                _ => 512,
            };
            let fewest = rows.div_ceil(most);
            let default = fewest.max(16);
            let per_group = if d > 32768 {
                let busiest = |p: usize| rows.div_ceil(p).div_ceil(15) * (3 * p + 4);
                (fewest.max(4)..=(2 * default).max(rows.div_ceil(15)))
                    .min_by_key(|&p| busiest(p))
                    .unwrap_or(default)
            } else if rows < 256 * 16 {
                // Small batches: up to 256 groups, at least one row per 2²⁰ elements each.
                (rows.div_ceil(256).max((rows * d).div_ceil(1 << 20))).clamp(1, 16)
            } else {
                default
            };
            (per_group, rows.div_ceil(per_group))
        }
        let rows = (0..3000)
            .chain((3000..200_000).step_by(997))
            .chain([1 << 20, 1 << 24]);
        for rows in rows {
            for d in [1, 128, 256, 257, 512, 513, 4096, 32768, 32769, 65536] {
                let base = base_rows_per_group(rows, d);
                assert_eq!((base, rows.div_ceil(base)), scan(rows, d), "{rows}×{d}");
            }
        }
        let start = std::time::Instant::now();
        for (rows, d) in [
            (1 << 40, 40000),
            (u32::MAX as usize, 1 << 20),
            (usize::MAX, usize::MAX),
        ] {
            let (per_group, groups) = group_layout(rows, d);
            assert!(per_group >= 4 && groups <= 512, "{rows}×{d}");
        }
        assert!(start.elapsed() < std::time::Duration::from_millis(50));
        assert!(workspace_len(Norm::Layer, usize::MAX, usize::MAX).is_err());
    }

    #[test]
    fn group_layouts_depend_on_the_shape_only() {
        // Rows of 4096–16384: groups of up to 64 rows while max(2²⁰ / d, 128) groups remain
        // (twice or four times the base's 16 or 32); dbias keeps four base groups per group.
        assert_eq!(group_layout(16384, 4096), (64, 256));
        assert_eq!(group_layout(8192, 8192), (64, 128));
        assert_eq!(group_layout(4096, 16384), (32, 128));
        assert_eq!(group_layout(65536, 4096), (128, 512));
        assert_eq!(group_layout(32768, 8192), (64, 512));
        assert_eq!(group_layout(5000, 8192), (32, 157));
        assert_eq!(group_layout(16384, 2048), (32, 512));
        assert_eq!(group_layout(8192, 32768), (16, 512));
        assert_eq!(dbias_group_layout(16384, 4096), (128, 128));
        assert_eq!(dbias_group_layout(8192, 8192), (64, 128));
        assert_eq!(group_layout(1024, 65536), (69, 15));
        assert_eq!(group_layout(64, 1 << 20), (5, 13));
        assert_eq!(group_layout(3, 1 << 20), (4, 1));
        assert_eq!(group_layout(0, 4096), (1, 0));
        // Small batches: rows spread over up to 256 groups (one row each at 64×4096).
        assert_eq!(group_layout(64, 4096), (1, 64));
        assert_eq!(group_layout(1024, 4096), (4, 256));
        assert_eq!(group_layout(4095, 4096), (16, 256));
        assert_eq!(group_layout(4096, 4096), (16, 256));
        // Narrow rows: more groups, so that about four blocks of segment teams per SM walk
        // them (QK-norm's d = 128).
        assert_eq!(group_layout(1 << 20, 128), (1024, 1024));
        assert_eq!(group_layout(262144, 512), (64, 4096));
        assert_eq!(group_layout(65536, 1024), (128, 512));
        assert_eq!(
            workspace_len(Norm::Layer, 16384, 4096),
            Ok(4 + 2 * 256 * 4096)
        );
    }
}
