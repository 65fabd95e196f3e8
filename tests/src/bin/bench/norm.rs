//! RMSNorm and LayerNorm (with bias), forward and backward; RMSNorm with the residual add fused
//! in, the residual stream in bf16 and in f32.

use std::sync::Arc;

use half::bf16;
use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{Context, NormBackward, NormForward, Rows, layer_norm, rms_norm};
use normkern_tests::bench::time;
use normkern_tests::{Rng, TestDtype};

use crate::{Measurement, Settings};

/// eps of every measured call.
const EPS: f32 = 1e-6;

/// H200's L2 is 60 MB (50 MiB on H100): rotate over input sets that together exceed it 3×.
const ROTATE_BYTES: usize = 180 << 20;

struct Set {
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    mean: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
}

pub fn run(ctx: &Context, stream: &Arc<CudaStream>, s: &Settings) -> Vec<Measurement> {
    let gpu = ctx.on(stream).expect("the stream is the context's");
    let shapes: &[(usize, usize)] = if let Some(shapes) = &s.shapes {
        shapes
    } else if s.quick {
        &[(16384, 4096)]
    } else {
        &[
            (16384, 4096),
            (4096, 16384),
            (65536, 1024),
            (16384, 8192),
            (1024, 65536),
            (64, 1 << 20),
        ]
    };
    let mut out = Vec::new();
    let mut rng = Rng::seeded(7);
    for &(rows, d) in shapes {
        let n = rows * d;
        let sets_needed = (ROTATE_BYTES / (4 * n * 2)).max(2);
        let host_x: Vec<bf16> = rng.vec(n, -2.0, 2.0);
        let host_dy: Vec<bf16> = rng.vec(n, -1.0, 1.0);
        let sets: Vec<Set> = (0..sets_needed)
            .map(|_| Set {
                x: stream.clone_htod(&host_x).unwrap(),
                dy: stream.clone_htod(&host_dy).unwrap(),
                y: stream.alloc_zeros(n).unwrap(),
                dx: stream.alloc_zeros(n).unwrap(),
                mean: stream.alloc_zeros(rows).unwrap(),
                rstd: stream.alloc_zeros(rows).unwrap(),
            })
            .collect();
        let gamma = stream.clone_htod(&rng.vec::<bf16>(d, 0.5, 1.5)).unwrap();
        let beta = stream.clone_htod(&rng.vec::<bf16>(d, -0.5, 0.5)).unwrap();
        let mut dgamma = stream.alloc_zeros::<bf16>(d).unwrap();
        let mut dbeta = stream.alloc_zeros::<bf16>(d).unwrap();
        let ws_len = layer_norm::workspace_len(rows, d).unwrap();
        let mut ws = stream.alloc_zeros::<f32>(ws_len).unwrap();
        let mut sets = sets;
        let shape = format!("{rows}×{d}");

        let fwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
            let k = i % sets.len();
            let set = &mut sets[k];
            let x = Rows::new(set.x.as_view(), rows, d).unwrap();
            let y = Rows::new(set.y.as_view_mut(), rows, d).unwrap();
            let args = NormForward::new(x, gamma.as_view(), y).eps(EPS);
            rms_norm::forward(&gpu, args.rstd(set.rstd.as_view_mut())).unwrap();
        });
        // x read, y written, rstd written, γ read.
        let fwd_bytes = (2 * n * 2 + rows * 4 + d * 2) as f64;
        out.push(Measurement {
            op: "rms_norm fwd",
            shape: shape.clone(),
            dtype: "bf16",
            timing: fwd,
            bytes: fwd_bytes,
        });

        let bwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
            let k = i % sets.len();
            let set = &mut sets[k];
            let x = Rows::new(set.x.as_view(), rows, d).unwrap();
            let dy = Rows::new(set.dy.as_view(), rows, d).unwrap();
            let dx = Rows::new(set.dx.as_view_mut(), rows, d).unwrap();
            let (dgamma, ws) = (dgamma.as_view_mut(), ws.as_view_mut());
            let args = NormBackward::new(dy, x, gamma.as_view(), dx, dgamma, ws).eps(EPS);
            let args = args.param_gradients(s.strategy);
            rms_norm::backward(&gpu, args.rstd(set.rstd.as_view())).unwrap();
        });
        // x and dy read, dx written, rstd and γ read, dγ written (the workspace is not counted).
        let bwd_bytes = (3 * n * 2 + rows * 4 + 2 * d * 2) as f64;
        out.push(Measurement {
            op: "rms_norm bwd",
            shape,
            dtype: "bf16",
            timing: bwd,
            bytes: bwd_bytes,
        });
        eprintln!(
            "rms_norm {rows}×{d}: fwd {:.1} µs, bwd {:.1} µs",
            fwd.device_us, bwd.device_us
        );

        let fwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
            let k = i % sets.len();
            let Set {
                x, y, mean, rstd, ..
            } = &mut sets[k];
            let x = Rows::new(x.as_view(), rows, d).unwrap();
            let y = Rows::new(y.as_view_mut(), rows, d).unwrap();
            let args = NormForward::new(x, gamma.as_view(), y).eps(EPS);
            let args = args.bias(beta.as_view());
            layer_norm::forward(&gpu, args.mean(mean.as_view_mut()).rstd(rstd.as_view_mut()))
                .unwrap();
        });
        // x read, y written, mean and rstd written, γ and β read.
        let bytes = (2 * n * 2 + 2 * rows * 4 + 2 * d * 2) as f64;
        out.push(Measurement {
            op: "layer_norm fwd",
            shape: format!("{rows}×{d}"),
            dtype: "bf16",
            timing: fwd,
            bytes,
        });
        let bwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
            let k = i % sets.len();
            let Set {
                x,
                dy,
                dx,
                mean,
                rstd,
                ..
            } = &mut sets[k];
            let dy = Rows::new(dy.as_view(), rows, d).unwrap();
            let x = Rows::new(x.as_view(), rows, d).unwrap();
            let dx = Rows::new(dx.as_view_mut(), rows, d).unwrap();
            let (dgamma, ws) = (dgamma.as_view_mut(), ws.as_view_mut());
            let args = NormBackward::new(dy, x, gamma.as_view(), dx, dgamma, ws).eps(EPS);
            let args = args.param_gradients(s.strategy);
            let args = args.mean_rstd(mean.as_view(), rstd.as_view());
            layer_norm::backward(&gpu, args.dbias(dbeta.as_view_mut())).unwrap();
        });
        // x and dy read, dx written, mean, rstd and γ read, dγ and dβ written.
        let bytes = (3 * n * 2 + 2 * rows * 4 + 3 * d * 2) as f64;
        out.push(Measurement {
            op: "layer_norm bwd",
            shape: format!("{rows}×{d}"),
            dtype: "bf16",
            timing: bwd,
            bytes,
        });
        eprintln!(
            "layer_norm {rows}×{d}: fwd {:.1} µs, bwd {:.1} µs",
            fwd.device_us, bwd.device_us
        );
        drop(sets);
        let shape = (rows, d);
        let on = (ctx, stream);
        out.extend(rms_norm_residual::<bf16>(on, s, &mut rng, shape, "bf16"));
        let dtype = "bf16, f32 residual";
        out.extend(rms_norm_residual::<f32>(on, s, &mut rng, shape, dtype));
    }
    out
}

/// Operands of one fused-residual forward + backward: bf16 activations, residual stream in `H`.
struct ResidualSet<H: TestDtype> {
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    residual: CudaSlice<H>,
    /// residual_out of the forward, x of the backward.
    h: CudaSlice<H>,
    /// The gradient arriving on residual_out.
    dresidual: CudaSlice<H>,
    rstd: CudaSlice<f32>,
}

/// RMSNorm's forward with the residual add and its backward with dresidual at `rows × d`, the
/// residual stream stored as `H`.
fn rms_norm_residual<H: TestDtype>(
    (ctx, stream): (&Context, &Arc<CudaStream>),
    s: &Settings,
    rng: &mut Rng,
    (rows, d): (usize, usize),
    dtype: &'static str,
) -> Vec<Measurement> {
    let gpu = &ctx.on(stream).expect("the stream is the context's");
    let n = rows * d;
    let h_bytes = std::mem::size_of::<H>();
    let set_bytes = n * (4 * 2 + 3 * h_bytes);
    let sets_needed = (ROTATE_BYTES / set_bytes).max(2);
    let host_x: Vec<bf16> = rng.vec(n, -2.0, 2.0);
    let host_dy: Vec<bf16> = rng.vec(n, -1.0, 1.0);
    let host_residual: Vec<H> = rng.vec(n, -4.0, 4.0);
    let host_dresidual: Vec<H> = rng.vec(n, -1.0, 1.0);
    let mut sets: Vec<ResidualSet<H>> = (0..sets_needed)
        .map(|_| ResidualSet {
            x: stream.clone_htod(&host_x).unwrap(),
            dy: stream.clone_htod(&host_dy).unwrap(),
            y: stream.alloc_zeros(n).unwrap(),
            dx: stream.alloc_zeros(n).unwrap(),
            residual: stream.clone_htod(&host_residual).unwrap(),
            h: stream.clone_htod(&host_residual).unwrap(),
            dresidual: stream.clone_htod(&host_dresidual).unwrap(),
            rstd: stream.alloc_zeros(rows).unwrap(),
        })
        .collect();
    let gamma = stream.clone_htod(&rng.vec::<bf16>(d, 0.5, 1.5)).unwrap();
    let mut dgamma = stream.alloc_zeros::<bf16>(d).unwrap();
    let mut ws = stream
        .alloc_zeros::<f32>(rms_norm::workspace_len(rows, d).unwrap())
        .unwrap();
    let fwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
        let k = i % sets.len();
        let set = &mut sets[k];
        let x = Rows::new(set.x.as_view(), rows, d).unwrap();
        let y = Rows::new(set.y.as_view_mut(), rows, d).unwrap();
        let residual = Rows::new(set.residual.as_view(), rows, d).unwrap();
        let h = Rows::new(set.h.as_view_mut(), rows, d).unwrap();
        let args = NormForward::new(x, gamma.as_view(), y).eps(EPS);
        let args = args.rstd(set.rstd.as_view_mut()).residual(residual, h);
        rms_norm::forward(gpu, args).unwrap();
    });
    let bwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
        let k = i % sets.len();
        let set = &mut sets[k];
        let dy = Rows::new(set.dy.as_view(), rows, d).unwrap();
        let h = Rows::new(set.h.as_view(), rows, d).unwrap();
        let dx = Rows::new(set.dx.as_view_mut(), rows, d).unwrap();
        let dresidual = Rows::new(set.dresidual.as_view(), rows, d).unwrap();
        let (dgamma, ws) = (dgamma.as_view_mut(), ws.as_view_mut());
        let args = NormBackward::new(dy, h, gamma.as_view(), dx, dgamma, ws).eps(EPS);
        let args = args.param_gradients(s.strategy);
        rms_norm::backward(gpu, args.rstd(set.rstd.as_view()).dresidual(dresidual)).unwrap();
    });
    eprintln!(
        "rms_norm + residual ({dtype}) {rows}×{d}: fwd {:.1} µs, bwd {:.1} µs",
        fwd.device_us, bwd.device_us
    );
    vec![
        Measurement {
            op: "rms_norm fwd + residual",
            shape: format!("{rows}×{d}"),
            dtype,
            timing: fwd,
            // x and residual read, y and residual_out written, rstd written, γ read.
            bytes: (2 * n * 2 + 2 * n * h_bytes + rows * 4 + d * 2) as f64,
        },
        Measurement {
            op: "rms_norm bwd + dresidual",
            shape: format!("{rows}×{d}"),
            dtype,
            timing: bwd,
            // dy read, dx written, x (residual_out) and dresidual read, rstd and γ read, dγ written.
            bytes: (2 * n * 2 + 2 * n * h_bytes + rows * 4 + 2 * d * 2) as f64,
        },
    ]
}
