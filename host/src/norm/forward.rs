//! The norm forward: its arguments, validation and launch plan.

use normkern_gpu::norm::{
    FORWARD, ForwardParams, Norm, NormKey, forward_clusters, forward_fewest_accesses,
    forward_stream_threads, forward_wide_block_first,
};

use super::{RowLaunch, check_config, inv, params_f32, stored_f32, stride_in_elems};
use crate::error::{Error, Result};
use crate::executor::{Device, Executor, Launch, optional_input, optional_output};
use crate::plan::{BlockSizes, CLUSTER_SIZES, PREFERRED_THREADS, packs_fit};
use crate::tensor::{Buffer, Dtype, Rows, expect_len};

/// The arguments of a norm forward ([`crate::rms_norm::forward`], [`crate::layer_norm::forward`]):
/// `x` and `y` in the activations' dtype `T`, `weight` (and `bias`) in `T` or f32.
///
/// Build it with [`NormForward::new`] and the optional parts' methods, or as a struct literal.
#[must_use = "the arguments do nothing until passed to rms_norm::forward or layer_norm::forward"]
pub struct NormForward<'a, E: Executor, T: Dtype, W: Dtype = T, R: Dtype = T, H: Dtype = T> {
    /// `rows × d` input rows.
    pub x: Rows<E::In<'a, T>>,
    /// `d` elements: γ.
    pub weight: E::In<'a, W>,
    /// `d` elements: β (LayerNorm only; `None` for none).
    pub bias: Option<E::In<'a, W>>,
    /// `rows × d` output rows, x's shape, their own stride.
    pub y: Rows<E::Out<'a, T>>,
    /// One f32 per row: the mean, for the backward (LayerNorm only).
    pub mean: Option<E::Out<'a, f32>>,
    /// One f32 per row: `1/sqrt(var + eps)` (the mean square for RMSNorm), for the backward.
    pub rstd: Option<E::Out<'a, f32>>,
    /// The residual add of a pre-norm block, fused in: see [`ResidualAdd`].
    pub residual: Option<ResidualAdd<'a, E, R, H>>,
    /// Added to the variance before the square root: finite, > 0. Default [`super::DEFAULT_EPS`].
    pub eps: f32,
    /// Added to γ in fp32 before use: `y = x̂·(γ + offset)` (Gemma stores γ − 1 and uses 1). dγ is
    /// unaffected. Finite; default 0.
    pub weight_offset: f32,
}

/// The residual add of a pre-norm block, fused into the forward: `h = x + residual` (an fp32
/// sum, rounded once) is written to `residual_out`, and the forward normalizes h *as stored* in
/// `residual_out`'s dtype, so a backward given `residual_out` as its x differentiates exactly the
/// row that was normalized. Both have x's shape and their own strides, and each is in x's dtype or
/// f32 (an fp32 residual stream next to bf16 activations). Neither may overlap another operand:
/// for an in-place residual stream, alternate two buffers.
pub struct ResidualAdd<'a, E: Executor, R: Dtype, H: Dtype> {
    /// `rows × d`: the residual stream coming in.
    pub residual: Rows<E::In<'a, R>>,
    /// `rows × d`: `h = x + residual`, the residual stream going on (and the row normalized).
    pub residual_out: Rows<E::Out<'a, H>>,
}

impl<'a, E: Executor, T: Dtype, W: Dtype> NormForward<'a, E, T, W> {
    /// `y = norm(x)·weight` with eps = [`super::DEFAULT_EPS`], no bias, no saved statistics.
    pub fn new(x: Rows<E::In<'a, T>>, weight: E::In<'a, W>, y: Rows<E::Out<'a, T>>) -> Self {
        NormForward {
            x,
            weight,
            bias: None,
            y,
            mean: None,
            rstd: None,
            residual: None,
            eps: super::DEFAULT_EPS,
            weight_offset: 0.0,
        }
    }
}

impl<'a, E: Executor, T: Dtype, W: Dtype, R: Dtype, H: Dtype> NormForward<'a, E, T, W, R, H> {
    /// Sets eps.
    pub fn eps(self, eps: f32) -> Self {
        NormForward { eps, ..self }
    }

    /// Uses γ as `γ + offset`.
    pub fn weight_offset(self, weight_offset: f32) -> Self {
        NormForward {
            weight_offset,
            ..self
        }
    }

    /// Adds β (LayerNorm only).
    pub fn bias(self, bias: E::In<'a, W>) -> Self {
        NormForward {
            bias: Some(bias),
            ..self
        }
    }

    /// Saves each row's mean (LayerNorm only).
    pub fn mean(self, mean: E::Out<'a, f32>) -> Self {
        NormForward {
            mean: Some(mean),
            ..self
        }
    }

    /// Saves each row's rstd.
    pub fn rstd(self, rstd: E::Out<'a, f32>) -> Self {
        NormForward {
            rstd: Some(rstd),
            ..self
        }
    }

    /// Fuses the residual add in: see [`ResidualAdd`].
    pub fn residual<R2: Dtype, H2: Dtype>(
        self,
        residual: Rows<E::In<'a, R2>>,
        residual_out: Rows<E::Out<'a, H2>>,
    ) -> NormForward<'a, E, T, W, R2, H2> {
        NormForward {
            x: self.x,
            weight: self.weight,
            bias: self.bias,
            y: self.y,
            mean: self.mean,
            rstd: self.rstd,
            residual: Some(ResidualAdd {
                residual,
                residual_out,
            }),
            eps: self.eps,
            weight_offset: self.weight_offset,
        }
    }
}

/// A validated forward: addresses (host or device) and row strides of every operand; 0 for an
/// operand that is absent.
pub(crate) struct Call {
    pub key: NormKey,
    pub rows: usize,
    pub d: usize,
    pub x: (u64, usize),
    pub y: (u64, usize),
    pub weight: u64,
    pub bias: u64,
    pub mean: u64,
    pub rstd: u64,
    pub eps: f32,
    pub weight_offset: f32,
    /// Weight and bias stored as f32 rather than in the activations' dtype.
    pub params_f32: bool,
    /// The residual operands: `(address, stride, stored as f32)` of `residual` and `residual_out`.
    pub residual: Option<[(u64, usize, bool); 2]>,
}

/// Runs the forward of `norm` on `exec`.
pub(crate) fn run<E: Executor, T: Dtype, W: Dtype, R: Dtype, H: Dtype>(
    norm: Norm,
    exec: &E,
    mut args: NormForward<'_, E, T, W, R, H>,
) -> Result<()> {
    let (rows, d) = (args.x.rows, args.x.d);
    check_config(args.eps, args.weight_offset)?;
    args.y.expect_shape("y", rows, d)?;
    expect_len("weight", args.weight.elements(), d)?;
    if let Some(b) = &args.bias {
        expect_len("bias", b.elements(), d)?;
    }
    for (what, stat) in [("mean", &args.mean), ("rstd", &args.rstd)] {
        if let Some(s) = stat {
            expect_len(what, s.elements(), rows)?;
        }
    }
    if norm == Norm::Rms {
        let no = "RMSNorm has none";
        if args.bias.is_some() {
            return Err(Error::Argument {
                what: "bias",
                problem: no,
            });
        }
        if args.mean.is_some() {
            return Err(Error::Argument {
                what: "mean",
                problem: no,
            });
        }
    }
    let params_f32 = params_f32::<T, W>()?;
    let residual_f32 = match &args.residual {
        Some(r) => {
            r.residual.expect_shape("residual", rows, d)?;
            r.residual_out.expect_shape("residual_out", rows, d)?;
            let supported = "residual rows must be in the activations' dtype or f32";
            Some((
                stored_f32::<T, R>("residual", supported)?,
                stored_f32::<T, H>("residual_out", supported)?,
            ))
        }
        None => None,
    };
    exec.prepare()?;
    let (x, _x) = exec.input("x", &args.x.data)?;
    let (weight, _weight) = exec.input("weight", &args.weight)?;
    let (bias, _bias) = optional_input(exec, "bias", args.bias.as_ref())?;
    let (y, _y) = exec.output("y", &mut args.y.data)?;
    let (mean, _mean) = optional_output(exec, "mean", args.mean.as_mut())?;
    let (rstd, _rstd) = optional_output(exec, "rstd", args.rstd.as_mut())?;
    let mut residual_guards = None;
    let mut residual = None;
    if let (Some(r), Some((in_f32, out_f32))) = (args.residual.as_mut(), residual_f32) {
        let (input, input_guard) = exec.input("residual", &r.residual.data)?;
        let out_stride = r.residual_out.stride;
        let (output, output_guard) = exec.output("residual_out", &mut r.residual_out.data)?;
        residual = Some([
            (input, r.residual.stride, in_f32),
            (output, out_stride, out_f32),
        ]);
        residual_guards = Some((input_guard, output_guard));
    }
    let call = Call {
        key: NormKey::call(norm, residual.is_some(), T::KERNEL),
        rows,
        d,
        x: (x, args.x.stride),
        y: (y, args.y.stride),
        weight,
        bias,
        mean,
        rstd,
        eps: args.eps,
        weight_offset: args.weight_offset,
        params_f32,
        residual,
    };
    if let Some(launch) = plan(&call, exec.device())? {
        exec.launch(&launch)?;
    }
    drop(residual_guards);
    Ok(())
}

/// The launch of a forward: one row kernel, or none for no rows.
pub(crate) fn plan(
    call: &Call,
    device: &dyn Device,
) -> Result<Option<Launch<NormKey, ForwardParams>>> {
    let (rows, d, dtype) = (call.rows, call.d, call.key.dtype);
    if rows == 0 {
        return Ok(None);
    }
    let bytes = dtype.bytes();
    // Absent operands are 0, which fits packs; f32 residual strides count in 16-byte units too.
    let [r_in, r_out] = call.residual.unwrap_or([(0, 0, false); 2]);
    let vec = packs_fit(
        bytes,
        d,
        &[call.x.0, call.y.0, call.weight, call.bias, r_in.0, r_out.0],
        &[
            call.x.1,
            call.y.1,
            stride_in_elems(r_in.1, r_in.2, bytes)?,
            stride_in_elems(r_out.1, r_out.2, bytes)?,
        ],
    );
    let params = ForwardParams {
        x: call.x.0,
        y: call.y.0,
        gamma: call.weight,
        beta: call.bias,
        mean: call.mean,
        rstd: call.rstd,
        x_stride: call.x.1 as u64,
        y_stride: call.y.1 as u64,
        rows: rows as u32,
        d: d as u32,
        eps: call.eps,
        inv_d: inv(d),
        gamma_offset: call.weight_offset,
        params_f32: call.params_f32 as u32,
        residual: r_in.0,
        residual_out: r_out.0,
        residual_stride: r_in.1 as u64,
        residual_out_stride: r_out.1 as u64,
        residual_f32: r_in.2 as u32,
        residual_out_f32: r_out.2 as u32,
    };
    let key = NormKey { vec, ..call.key };
    let centered = key.norm == Norm::Layer;
    // What a row moves: x and y, and the residual's input and output in their own dtypes.
    let stored = |f32: bool| if f32 { 4 } else { bytes };
    let residual_bytes = (call.residual).map_or(0, |[input, output]| {
        stored(input.2).saturating_add(stored(output.2))
    });
    let row_bytes_per_element = bytes.saturating_mul(2).saturating_add(residual_bytes);
    let launch = RowLaunch {
        table: &FORWARD,
        key,
        d,
        work: rows,
        cluster_sizes: if forward_clusters(
            centered,
            key.residual,
            rows < device.sm_count(),
            d,
            bytes,
        ) {
            CLUSTER_SIZES
        } else {
            &[]
        },
        fewest_accesses: forward_fewest_accesses(centered, key.residual),
        block_sizes: BlockSizes {
            preferred: PREFERRED_THREADS,
            stream: forward_stream_threads(key.residual, d.saturating_mul(bytes)),
        },
        items_per_team: true,
        forward_row_bytes: Some(d.saturating_mul(row_bytes_per_element)),
        params,
    }
    .plan(device, |vpt| forward_wide_block_first(key.residual, vpt))?;
    Ok(Some(launch))
}

#[cfg(test)]
mod tests {
    use super::*;
    use normkern_gpu::kernel::Dtype as KernelDtype;
    use normkern_gpu::norm::STREAM;

    use crate::norm::backward::tests::H200;
    use crate::plan::tests::FakeH200;

    /// A forward of `norm` over dense, 16-byte aligned bf16 rows.
    fn call(norm: Norm, rows: usize, d: usize) -> Call {
        let buffer = 1 << 20;
        Call {
            key: NormKey::call(norm, false, KernelDtype::Bf16),
            rows,
            d,
            x: (buffer, d),
            y: (2 * buffer, d),
            weight: 3 * buffer,
            bias: 0,
            mean: 0,
            rstd: 4 * buffer,
            eps: 1e-5,
            weight_offset: 0.0,
            params_f32: false,
            residual: None,
        }
    }

    /// [`call`], with a bf16 residual stream when `residual`.
    fn call_with(norm: Norm, residual: bool, rows: usize, d: usize) -> Call {
        let mut c = call(norm, rows, d);
        if residual {
            c.key = NormKey::call(norm, true, KernelDtype::Bf16);
            c.residual = Some([(5 << 20, d, false), (6 << 20, d, false)]);
        }
        c
    }

    /// The kernel, block and cluster the plan launches for `call` on an H200.
    fn launched(call: &Call) -> (&'static str, usize, usize) {
        let launch = plan(call, &H200).unwrap().unwrap();
        (launch.kernel.name, launch.block, launch.cluster)
    }

    #[test]
    fn narrow_rows_take_the_narrowest_segment_team_that_covers_them() {
        // RMSNorm: a one-shot grid of the fewest warps that move 4 KiB (x and y, 16 bits).
        for (d, name, block) in [
            (128, "rms_norm_fwd_bf16_v2l8", 64),
            (256, "rms_norm_fwd_bf16_v2l16", 64),
        ] {
            let rows = 1 << 20;
            let launch = plan(&call(Norm::Rms, rows, d), &H200).unwrap().unwrap();
            assert_eq!((launch.kernel.name, launch.block), (name, block), "{d}");
            let rows_per_block = block / launch.kernel.key.lanes;
            assert_eq!(launch.grid, rows / rows_per_block, "{d}");
        }
        // Plain LayerNorm: teams of 2 accesses walk 4 rows each in 128-thread blocks, or fewer
        // where that would leave fewer blocks than a team per row keeps resident (1320 on the
        // fake H200: 10 a SM by its registers); a grid limit still holds (then they walk more).
        for (d, name, rows, rows_per_team) in [
            (128, "layer_norm_fwd_bf16_v2l8", 1 << 20, 4),
            (128, "layer_norm_fwd_bf16_v2l8", 40000, 2),
            (128, "layer_norm_fwd_bf16_v2l8", 1000, 1),
            (256, "layer_norm_fwd_bf16_v2l16", 1 << 20, 4),
            (256, "layer_norm_fwd_bf16_v2l16", 1000, 1),
        ] {
            let launch = plan(&call(Norm::Layer, rows, d), &H200).unwrap().unwrap();
            assert_eq!((launch.kernel.name, launch.block), (name, 128), "{d}");
            let teams = launch.grid * 128 / launch.kernel.key.lanes;
            assert_eq!(rows.div_ceil(teams), rows_per_team, "{d} {rows}");
        }
        for d in [128, 256] {
            let limited = FakeH200 {
                grid_limit: Some(7),
                ..H200
            };
            let launch = plan(&call(Norm::Layer, 1 << 20, d), &limited)
                .unwrap()
                .unwrap();
            assert_eq!((launch.block, launch.grid), (128, 7), "{d}");
        }
        // Past the teams' reach (256 16-bit elements, 128 f32): a block per row on the one-shot
        // grid, of the fewest accesses the family takes (LayerNorm's plain tile 2, else 1).
        for (norm, residual, d, name, block) in [
            (Norm::Rms, false, 512, "rms_norm_fwd_bf16_v1", 64),
            (Norm::Rms, false, 1024, "rms_norm_fwd_bf16_v1", 128),
            (Norm::Layer, false, 512, "layer_norm_fwd_bf16_v2", 32),
            (Norm::Layer, false, 1024, "layer_norm_fwd_bf16_v2", 64),
            (Norm::Rms, true, 1024, "rms_norm_fwd_res_bf16_v1", 128),
            (Norm::Layer, true, 1024, "layer_norm_fwd_res_bf16_v1", 128),
            (Norm::Rms, false, 1032, "rms_norm_fwd_bf16_v1", 160),
        ] {
            let launch = plan(&call_with(norm, residual, 1 << 20, d), &H200)
                .unwrap()
                .unwrap();
            let what = format!("{norm:?} {d}, residual {residual}");
            assert_eq!((launch.kernel.name, launch.block), (name, block), "{what}");
            assert_eq!(launch.grid, 1 << 20, "{what}");
        }
        let mut f32_rows = call(Norm::Rms, 1 << 20, 256);
        f32_rows.key = NormKey::call(Norm::Rms, false, KernelDtype::F32);
        let launch = plan(&f32_rows, &H200).unwrap().unwrap();
        assert_eq!(
            (launch.kernel.name, launch.block),
            ("rms_norm_fwd_f32_v1", 64)
        );
    }

    #[test]
    fn one_shot_blocks_count_the_residual_bytes_and_keep_a_grid_limit() {
        // x, y, the residual in and out: 4 rows of 128 bf16 move 4 KiB, a warp's worth.
        let mut residual = call(Norm::Layer, 1000, 128);
        residual.key = NormKey::call(Norm::Layer, true, KernelDtype::Bf16);
        residual.residual = Some([(5 << 20, 128, false), (6 << 20, 128, false)]);
        let launch = plan(&residual, &H200).unwrap().unwrap();
        assert_eq!((launch.block, launch.grid), (32, 250));
        // An f32 residual stream moves more per row: still a warp.
        residual.residual = Some([(5 << 20, 128, true), (6 << 20, 128, true)]);
        assert_eq!(plan(&residual, &H200).unwrap().unwrap().block, 32);
        let limited = FakeH200 {
            grid_limit: Some(7),
            ..H200
        };
        let launch = plan(&call(Norm::Rms, 1 << 20, 128), &limited)
            .unwrap()
            .unwrap();
        assert_eq!((launch.block, launch.grid), (64, 7));
    }

    #[test]
    fn rows_past_the_preferred_block_take_the_4_pack_tile() {
        let rms = plan(&call(Norm::Rms, 4096, 16384), &H200).unwrap().unwrap();
        assert_eq!((rms.kernel.name, rms.block), ("rms_norm_fwd_bf16_v4", 512));
        let layer = plan(&call(Norm::Layer, 16384, 4096), &H200)
            .unwrap()
            .unwrap();
        assert_eq!(
            (layer.kernel.name, layer.block),
            ("layer_norm_fwd_bf16_v2", 256)
        );
    }

    #[test]
    fn forward_block_tiles_take_a_block_per_row_or_persistent_rounds() {
        // (norm, residual, rows, d, the tile's accesses per thread, its grid: a block per row, or
        // the resident blocks' balanced rounds). On the fake H200 (64 registers a thread for every
        // v2 tile and RMSNorm's plain v4, 128 for the other v4) a v2 tile holds 4 blocks of 256
        // per SM or one of 1024, RMSNorm's v4 four of 256, two of 512 or one of 1024, the other v4
        // two of 256 or one of 512.
        for (norm, residual, rows, d, vpt, grid) in [
            // No prefetch (every tile but LayerNorm's plain v4): one-shot.
            (Norm::Rms, false, 16384, 4096, 2, 16384),
            (Norm::Layer, false, 16384, 4096, 2, 16384),
            (Norm::Rms, true, 4096, 16384, 2, 4096),
            (Norm::Layer, true, 16384, 4096, 2, 16384),
            (Norm::Rms, false, 8192, 8192, 4, 8192),
            (Norm::Rms, false, 4096, 16384, 4, 4096),
            // A 1024-thread block alone on its SM, still one-shot: its row (64 KiB) is read once.
            (Norm::Rms, false, 2048, 32768, 4, 2048),
            // LayerNorm's residual tile copies γ and β into shared memory: alone on its SM it
            // keeps the walk, which copies them once.
            (Norm::Layer, true, 4096, 16384, 2, 128),
            // LayerNorm's plain v4 prefetches: one-shot only with four blocks per SM (two of 256
            // here, one of 512).
            (Norm::Layer, false, 8192, 8192, 4, 256),
            (Norm::Layer, false, 4096, 16384, 4, 128),
        ] {
            let c = call_with(norm, residual, rows, d);
            let launch = plan(&c, &H200).unwrap().unwrap();
            let key = launch.kernel.key;
            let what = launch.kernel.name;
            assert_eq!((key.vpt, key.lanes, launch.cluster), (vpt, 0, 1), "{what}");
            assert_eq!(launch.grid, grid, "{what} {rows}x{d}");
            // A grid limit holds either way.
            let limited = FakeH200 {
                grid_limit: Some(7),
                ..H200
            };
            assert_eq!(plan(&c, &limited).unwrap().unwrap().grid, 7, "{what}");
        }
        // The residual forms' streaming blocks (one of 1024 threads per SM) keep their balanced
        // rounds: 256 rows over 128 blocks (plain rows of 64 KiB: a block per row, below).
        for norm in [Norm::Rms, Norm::Layer] {
            let stream = plan(&call_with(norm, true, 256, 262144), &H200)
                .unwrap()
                .unwrap();
            assert_eq!(stream.kernel.key.vpt, STREAM, "{norm:?}");
            assert_eq!(stream.grid, 128, "{norm:?}");
        }
    }

    #[test]
    fn plain_layer_norm_takes_two_accesses_per_thread_rms_norm_one() {
        let layer = launched(&call(Norm::Layer, 32768, 2048));
        assert_eq!(layer, ("layer_norm_fwd_bf16_v2", 128, 1));
        let rms = launched(&call(Norm::Rms, 32768, 2048));
        assert_eq!(rms, ("rms_norm_fwd_bf16_v1", 256, 1));
    }

    #[test]
    fn few_wide_rows_and_rows_past_a_block_s_registers_are_split_over_clusters() {
        let few = plan(&call(Norm::Rms, 64, 65536), &H200).unwrap().unwrap();
        let tile = (few.kernel.name, few.block, few.cluster);
        assert_eq!(tile, ("rms_norm_fwd_bf16_v4c", 256, 8));
        // Rows past a block's registers take a cluster however many: RMSNorm's of more than
        // 64 KiB (its 64 KiB rows fit a block), plain or with the residual.
        let many = plan(&call(Norm::Rms, 1024, 65536), &H200).unwrap().unwrap();
        let tile = (many.kernel.name, many.block, many.cluster);
        assert_eq!(tile, ("rms_norm_fwd_bf16_v4c", 256, 8));
        assert_eq!(launched(&call_with(Norm::Rms, true, 1024, 65536)).2, 8);
        assert_eq!(launched(&call(Norm::Rms, 2048, 32768)).2, 1);
        // The tiles that hold their rows as f32 — LayerNorm's, and both residual families' —
        // take clusters past 16384 elements (16 bits: 32768 and 65536), LayerNorm's residual
        // rows up to 128 KiB, the others up to 256 KiB.
        let layer = launched(&call(Norm::Layer, 1024, 65536));
        assert_eq!(layer, ("layer_norm_fwd_bf16_v4c", 256, 8));
        assert_eq!(launched(&call(Norm::Layer, 2048, 32768)).2, 4);
        let residual = launched(&call_with(Norm::Layer, true, 1024, 65536));
        assert_eq!(residual, ("layer_norm_fwd_res_bf16_v4c", 256, 8));
        for norm in [Norm::Rms, Norm::Layer] {
            let (name, _, cluster) = launched(&call_with(norm, true, 2048, 32768));
            assert!(
                name.ends_with("_res_bf16_v4c") && cluster > 1,
                "{name} {cluster}"
            );
            assert_eq!(launched(&call_with(norm, true, 4096, 16384)).2, 1);
        }
        // f32: 32768 and 65536 (128 and 256 KiB) on clusters; 16384 (64 KiB) streams a block
        // per row.
        let f32_rows = |rows, d| {
            let mut c = call(Norm::Layer, rows, d);
            c.key.dtype = KernelDtype::F32;
            launched(&c)
        };
        assert_eq!(f32_rows(2048, 32768).2, 8);
        assert_eq!(f32_rows(4096, 16384), ("layer_norm_fwd_f32_vx", 512, 1));
        assert_eq!(f32_rows(1024, 65536).2, 8);
        // Rows past what a cluster holds in registers (256 KiB) stream, a block each.
        let huge = launched(&call(Norm::Rms, 256, 1 << 20));
        assert_eq!((huge.0, huge.2), ("rms_norm_fwd_bf16_vx", 1));
    }

    #[test]
    fn plain_streamed_rows_of_up_to_64_kib_take_two_blocks_per_sm() {
        // f32 LayerNorm rows of 16384 (64 KiB): 512 threads, a block per row.
        let mut f32_rows = call(Norm::Layer, 4096, 16384);
        f32_rows.key.dtype = KernelDtype::F32;
        assert_eq!(launched(&f32_rows), ("layer_norm_fwd_f32_vx", 512, 1));
        assert_eq!(plan(&f32_rows, &H200).unwrap().unwrap().grid, 4096);
        // The residual forms keep one block of 1024 threads per SM (rows past their clusters).
        for norm in [Norm::Rms, Norm::Layer] {
            let (name, block, _) = launched(&call_with(norm, true, 256, 262144));
            assert!(name.ends_with("_res_bf16_vx"), "{name}");
            assert_eq!(block, 1024);
        }
    }

    #[test]
    fn no_rows_launch_nothing() {
        assert!(plan(&call(Norm::Rms, 0, 4096), &H200).unwrap().is_none());
    }
}
