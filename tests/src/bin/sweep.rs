//! One call of every op × dtype × kernel family at small shapes, for the compute-sanitizer tools
//! (`./run.sh sanitize` in a bundle runs this under memcheck, racecheck, initcheck and synccheck).
//! The shapes reach each tile family on an H200: block register tiles (d up to 8192), clusters
//! of register tiles and the staged backward (16384, 65536), the backward's ring instances (small
//! batches of d = 512 to 2048: one row a block, and 8 rows a block at 2000×512), streaming
//! (131072), single-element access (d not a multiple of the pack, rows off 16-byte alignment),
//! segment teams of 8 to 32 lanes (d up to 1024, several rows per warp, the backward's per-group
//! combine), the residual forms, saved and recomputed statistics, and every activation kernel.
//! It checks that every call succeeds; correctness is the tests' job.
//!
//! `sweep [f32] [f16] [bf16]` runs only those dtypes (default: all three), so a slow tool such as
//! racecheck can take them in separate runs: the kernels' shared-memory code is the same generic
//! body for every dtype.

use std::sync::Arc;

use half::{bf16, f16};
use normkern::activation::{self, Activation, GatedGrad, GatedInput};
use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{Context, Gpu, NormBackward, NormForward, Rows, RowsRef, layer_norm, rms_norm};
use normkern_tests::{Rng, TestDtype};

/// (rows, d): enough rows for every team to take work, few enough for racecheck.
const NORM_SHAPES: [(usize, usize); 12] = [
    (40, 64),
    (300, 256),
    (70, 512),
    // The backward's ring instances walking 8 rows a block, round their 4-row ring twice.
    (2000, 512),
    (33, 1024),
    (24, 2048),
    (24, 4096),
    (24, 8192),
    (12, 16384),
    (8, 65536),
    (4, 131072),
    (24, 1001),
];

fn main() {
    let ctx = match Context::new(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("sweep: no GPU ({e}); nothing to run");
            return;
        }
    };
    let stream = ctx.cuda().new_stream().expect("stream");
    let gpu = ctx.on(&stream).expect("the stream is the context's");
    let asked: Vec<String> = std::env::args().skip(1).collect();
    if let Some(bad) = asked
        .iter()
        .find(|a| !["f32", "f16", "bf16"].contains(&a.as_str()))
    {
        eprintln!("sweep: unknown dtype {bad:?} (f32, f16, bf16)");
        std::process::exit(2);
    }
    let runs = |dtype: &str| asked.is_empty() || asked.iter().any(|a| a == dtype);
    let mut rng = Rng::seeded(5);
    let mut calls = 0;
    if runs("f32") {
        calls += sweep::<f32>(&gpu, &stream, &mut rng);
    }
    if runs("f16") {
        calls += sweep::<f16>(&gpu, &stream, &mut rng);
    }
    if runs("bf16") {
        calls += sweep::<bf16>(&gpu, &stream, &mut rng);
    }
    stream.synchronize().expect("synchronize");
    println!("sweep: {calls} calls, every one accepted and run");
}

/// Every op in dtype `T`; returns the calls made.
fn sweep<T: TestDtype>(gpu: &Gpu<'_>, stream: &Arc<CudaStream>, rng: &mut Rng) -> usize {
    let mut calls = 0;
    for (rows, d) in NORM_SHAPES {
        for offset in [0, 1] {
            calls += norms::<T>(gpu, stream, rng, (rows, d), offset);
        }
    }
    calls + activations::<T>(gpu, stream, rng)
}

/// `rows × d` of `b` from element `offset` on.
fn rows_at<T: TestDtype>(b: &CudaSlice<T>, offset: usize, rows: usize, d: usize) -> RowsRef<'_, T> {
    Rows::new(b.slice(offset..), rows, d).unwrap()
}

fn upload<T: TestDtype>(stream: &Arc<CudaStream>, rng: &mut Rng, n: usize) -> CudaSlice<T> {
    stream.clone_htod(&rng.vec::<T>(n, -2.0, 2.0)).unwrap()
}

/// RMSNorm and LayerNorm forward and backward, plain, with a residual stream in `T` and in f32,
/// with saved and recomputed statistics, rows starting `offset` elements into their buffers.
fn norms<T: TestDtype>(
    gpu: &Gpu<'_>,
    stream: &Arc<CudaStream>,
    rng: &mut Rng,
    (rows, d): (usize, usize),
    offset: usize,
) -> usize {
    let n = offset + rows * d;
    let (x, dy) = (upload::<T>(stream, rng, n), upload::<T>(stream, rng, n));
    let (weight, bias) = (upload::<T>(stream, rng, d), upload::<T>(stream, rng, d));
    let residual = upload::<T>(stream, rng, n);
    let residual32 = upload::<f32>(stream, rng, n);
    let (mut y, mut dx) = (upload::<T>(stream, rng, n), upload::<T>(stream, rng, n));
    let mut h = upload::<T>(stream, rng, n);
    let mut h32 = upload::<f32>(stream, rng, n);
    let (mut dweight, mut dbias) = (upload::<T>(stream, rng, d), upload::<T>(stream, rng, d));
    let (mut mean, mut rstd) = (
        upload::<f32>(stream, rng, rows),
        upload::<f32>(stream, rng, rows),
    );
    let ws_len = layer_norm::workspace_len(rows, d).unwrap();
    let mut ws = stream.alloc_zeros::<f32>(ws_len).unwrap();
    let mut calls = 0;
    for recompute in [false, true] {
        let y_rows = Rows::new(y.slice_mut(offset..), rows, d).unwrap();
        let args = NormForward::new(rows_at(&x, offset, rows, d), weight.as_view(), y_rows);
        rms_norm::forward(gpu, args.rstd(rstd.as_view_mut())).unwrap();
        let dx_rows = Rows::new(dx.slice_mut(offset..), rows, d).unwrap();
        let args = NormBackward::new(
            rows_at(&dy, offset, rows, d),
            rows_at(&x, offset, rows, d),
            weight.as_view(),
            dx_rows,
            dweight.as_view_mut(),
            ws.as_view_mut(),
        );
        let args = if recompute {
            args
        } else {
            args.rstd(rstd.as_view())
        };
        rms_norm::backward(gpu, args).unwrap();
        let y_rows = Rows::new(y.slice_mut(offset..), rows, d).unwrap();
        let args = NormForward::new(rows_at(&x, offset, rows, d), weight.as_view(), y_rows)
            .bias(bias.as_view());
        layer_norm::forward(gpu, args.mean(mean.as_view_mut()).rstd(rstd.as_view_mut())).unwrap();
        let dx_rows = Rows::new(dx.slice_mut(offset..), rows, d).unwrap();
        let args = NormBackward::new(
            rows_at(&dy, offset, rows, d),
            rows_at(&x, offset, rows, d),
            weight.as_view(),
            dx_rows,
            dweight.as_view_mut(),
            ws.as_view_mut(),
        )
        .dbias(dbias.as_view_mut());
        let args = if recompute {
            args
        } else {
            args.mean_rstd(mean.as_view(), rstd.as_view())
        };
        layer_norm::backward(gpu, args).unwrap();
        calls += 4;
    }
    // The residual forms: the stream in T, then in f32.
    let y_rows = Rows::new(y.slice_mut(offset..), rows, d).unwrap();
    let h_rows = Rows::new(h.slice_mut(offset..), rows, d).unwrap();
    let args = NormForward::new(rows_at(&x, offset, rows, d), weight.as_view(), y_rows)
        .bias(bias.as_view());
    let args = args.rstd(rstd.as_view_mut()).mean(mean.as_view_mut());
    layer_norm::forward(
        gpu,
        args.residual(rows_at(&residual, offset, rows, d), h_rows),
    )
    .unwrap();
    let dx_rows = Rows::new(dx.slice_mut(offset..), rows, d).unwrap();
    let args = NormBackward::new(
        rows_at(&dy, offset, rows, d),
        rows_at(&h, offset, rows, d),
        weight.as_view(),
        dx_rows,
        dweight.as_view_mut(),
        ws.as_view_mut(),
    );
    let args = args.mean_rstd(mean.as_view(), rstd.as_view());
    layer_norm::backward(
        gpu,
        args.dbias(dbias.as_view_mut())
            .dresidual(rows_at(&residual, offset, rows, d)),
    )
    .unwrap();
    let y_rows = Rows::new(y.slice_mut(offset..), rows, d).unwrap();
    let h_rows = Rows::new(h32.slice_mut(offset..), rows, d).unwrap();
    let args = NormForward::new(rows_at(&x, offset, rows, d), weight.as_view(), y_rows)
        .rstd(rstd.as_view_mut());
    rms_norm::forward(
        gpu,
        args.residual(rows_at(&residual32, offset, rows, d), h_rows),
    )
    .unwrap();
    let dx_rows = Rows::new(dx.slice_mut(offset..), rows, d).unwrap();
    let args = NormBackward::new(
        rows_at(&dy, offset, rows, d),
        rows_at(&h32, offset, rows, d),
        weight.as_view(),
        dx_rows,
        dweight.as_view_mut(),
        ws.as_view_mut(),
    );
    rms_norm::backward(
        gpu,
        args.rstd(rstd.as_view())
            .dresidual(rows_at(&residual32, offset, rows, d)),
    )
    .unwrap();
    calls + 4
}

/// Every activation kernel: plain, in place and dbias backwards, gated forms separate and
/// packed, aligned and not.
fn activations<T: TestDtype>(gpu: &Gpu<'_>, stream: &Arc<CudaStream>, rng: &mut Rng) -> usize {
    let mut calls = 0;
    for (rows, d, offset) in [(64, 1024, 0), (7, 1001, 1)] {
        let n = offset + 2 * rows * d;
        let (x, dy, b) = (
            upload::<T>(stream, rng, n),
            upload::<T>(stream, rng, n),
            upload::<T>(stream, rng, n),
        );
        let (mut out0, mut out1) = (upload::<T>(stream, rng, n), upload::<T>(stream, rng, n));
        let mut dbias = upload::<T>(stream, rng, d);
        let ws_len = activation::workspace_len(rows, d).unwrap();
        let mut ws = stream.alloc_zeros::<f32>(ws_len).unwrap();
        for act in [
            Activation::Relu,
            Activation::Silu,
            Activation::GeluErf,
            Activation::GeluTanh,
        ] {
            let y = Rows::new(out0.slice_mut(offset..), rows, d).unwrap();
            activation::forward(
                gpu,
                activation::Forward::new(act, rows_at(&x, offset, rows, d), y),
            )
            .unwrap();
            let dx = Rows::new(out0.slice_mut(offset..), rows, d).unwrap();
            let args = activation::Backward::new(
                act,
                rows_at(&dy, offset, rows, d),
                rows_at(&x, offset, rows, d),
                dx,
            );
            activation::backward(gpu, args).unwrap();
            let dx = Rows::new(out0.slice_mut(offset..), rows, d).unwrap();
            let args = activation::Backward::new(
                act,
                rows_at(&dy, offset, rows, d),
                rows_at(&x, offset, rows, d),
                dx,
            );
            let args = args.dbias(dbias.as_view_mut(), ws.as_view_mut());
            activation::backward(gpu, args).unwrap();
            let dy_out = Rows::new(out1.slice_mut(offset..), rows, d).unwrap();
            let args = activation::Backward::in_place(act, dy_out, rows_at(&x, offset, rows, d));
            activation::backward(gpu, args).unwrap();
            let h = Rows::new(out0.slice_mut(offset..), rows, d).unwrap();
            let input = GatedInput::Separate {
                a: rows_at(&x, offset, rows, d),
                b: rows_at(&b, offset, rows, d),
            };
            let args = activation::GatedForward {
                activation: act,
                input,
                h,
            };
            activation::gated_forward(gpu, args).unwrap();
            let h = Rows::new(out0.slice_mut(offset..), rows, d).unwrap();
            let args = activation::GatedForward {
                activation: act,
                input: GatedInput::Packed(rows_at(&x, offset, rows, 2 * d)),
                h,
            };
            activation::gated_forward(gpu, args).unwrap();
            let grad = GatedGrad::Separate {
                da: Rows::new(out0.slice_mut(offset..), rows, d).unwrap(),
                db: Rows::new(out1.slice_mut(offset..), rows, d).unwrap(),
            };
            let args = activation::GatedBackward {
                activation: act,
                dh: rows_at(&dy, offset, rows, d),
                input: GatedInput::Separate {
                    a: rows_at(&x, offset, rows, d),
                    b: rows_at(&b, offset, rows, d),
                },
                grad,
            };
            activation::gated_backward(gpu, args).unwrap();
            let args = activation::GatedBackward {
                activation: act,
                dh: rows_at(&dy, offset, rows, d),
                input: GatedInput::Packed(rows_at(&x, offset, rows, 2 * d)),
                grad: GatedGrad::Packed(Rows::new(out0.slice_mut(offset..), rows, 2 * d).unwrap()),
            };
            activation::gated_backward(gpu, args).unwrap();
            calls += 8;
        }
    }
    calls
}
