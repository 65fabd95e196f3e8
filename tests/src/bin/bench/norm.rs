//! RMSNorm and LayerNorm (with bias), forward and backward; both with the residual add fused in,
//! the residual stream in bf16 (and RMSNorm's in f32); and the sweep over d (`--sweep`).

use std::sync::Arc;

use half::{bf16, f16};
use normkern::cudarc::driver::{CudaSlice, CudaStream, ValidAsZeroBits};
use normkern::{Context, NormBackward, NormForward, Rows, layer_norm, rms_norm};
use normkern_tests::bench::{Timing, time};
use normkern_tests::{Rng, TestDtype};

use crate::{Measurement, Settings};

/// eps of every measured call.
const EPS: f32 = 1e-6;

/// H200's L2 is 60 MB (50 MiB on H100): rotate over input sets that together exceed it 3×.
const ROTATE_BYTES: usize = 180 << 20;

/// The d of the sweep: the powers of two from 128 (one attention head) to 64 Ki.
const SWEEP_DS: [usize; 10] = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536];

/// Elements of every sweep shape (rows = this / d): 64 Mi, far beyond L2 at any d.
const SWEEP_ELEMENTS: usize = 1 << 26;

/// One input set of the plain norms, rows in `T`.
struct Set<T: TestDtype> {
    x: CudaSlice<T>,
    dy: CudaSlice<T>,
    y: CudaSlice<T>,
    dx: CudaSlice<T>,
    mean: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
}

/// Operands of the plain norms at `rows × d` in `T`: input sets rotated to exceed L2, and the
/// parameters and their gradients (read and written by every call, so they stay in L2 anyway).
struct Operands<T: TestDtype> {
    rows: usize,
    d: usize,
    sets: Vec<Set<T>>,
    gamma: CudaSlice<T>,
    beta: CudaSlice<T>,
    dgamma: CudaSlice<T>,
    dbeta: CudaSlice<T>,
    workspace: CudaSlice<f32>,
}

impl<T: TestDtype + ValidAsZeroBits> Operands<T> {
    fn new(stream: &Arc<CudaStream>, rng: &mut Rng, (rows, d): (usize, usize)) -> Self {
        let n = rows * d;
        let sets_needed = (ROTATE_BYTES / (4 * n * size_of::<T>())).max(2);
        let host_x: Vec<T> = rng.vec_parallel(n, -2.0, 2.0);
        let host_dy: Vec<T> = rng.vec_parallel(n, -1.0, 1.0);
        let sets = (0..sets_needed)
            .map(|_| Set {
                x: stream.clone_htod(&host_x).unwrap(),
                dy: stream.clone_htod(&host_dy).unwrap(),
                y: stream.alloc_zeros(n).unwrap(),
                dx: stream.alloc_zeros(n).unwrap(),
                mean: stream.alloc_zeros(rows).unwrap(),
                rstd: stream.alloc_zeros(rows).unwrap(),
            })
            .collect();
        // LayerNorm's workspace holds dβ's partials too: enough for RMSNorm's as well.
        let workspace_len = layer_norm::workspace_len(rows, d).unwrap();
        Operands {
            rows,
            d,
            sets,
            gamma: stream.clone_htod(&rng.vec::<T>(d, 0.5, 1.5)).unwrap(),
            beta: stream.clone_htod(&rng.vec::<T>(d, -0.5, 0.5)).unwrap(),
            dgamma: stream.alloc_zeros(d).unwrap(),
            dbeta: stream.alloc_zeros(d).unwrap(),
            workspace: stream.alloc_zeros(workspace_len).unwrap(),
        }
    }
}

impl<T: TestDtype> Operands<T> {
    /// A measured row of this shape and dtype.
    fn measurement(&self, op: &'static str, timing: Timing, bytes: usize) -> Measurement {
        Measurement {
            op,
            rows: self.rows,
            d: self.d,
            dtype: T::NAME,
            timing,
            bytes: bytes as f64,
        }
    }
}

/// The bench's fixed shapes: RMSNorm and LayerNorm forward and backward, both with the residual
/// add (bf16 residual stream), and RMSNorm's with an f32 residual stream, all bf16.
pub fn run(ctx: &Context, stream: &Arc<CudaStream>, s: &Settings) -> Vec<Measurement> {
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
    let on = (ctx, stream);
    for &shape in shapes {
        out.extend(bf16_norms(on, s, &mut rng, shape));
        let dtype = "bf16, f32 residual";
        out.extend(norm_residual::<f32>(false, on, s, &mut rng, shape, dtype));
    }
    out
}

/// The sweep over d at 64 Mi elements: RMSNorm and LayerNorm forward and backward, plain and with
/// the residual add (bf16 residual stream), all bf16; both plain norms also in f32 and f16, so a
/// dtype that falls off a cliff at some d shows. `--shapes` replaces the d's, `--dtypes` picks
/// the dtypes (one shape and dtype of a cliff).
pub fn sweep(ctx: &Context, stream: &Arc<CudaStream>, s: &Settings) -> Vec<Measurement> {
    let mut out = Vec::new();
    let mut rng = Rng::seeded(7);
    let on = (ctx, stream);
    let shapes = s
        .shapes
        .clone()
        .unwrap_or_else(|| SWEEP_DS.map(|d| (SWEEP_ELEMENTS / d, d)).to_vec());
    let measured = |dtype: &str| {
        s.dtypes
            .as_ref()
            .is_none_or(|d| d.iter().any(|t| t == dtype))
    };
    for shape in shapes {
        if measured("bf16") {
            out.extend(bf16_norms(on, s, &mut rng, shape));
        }
        if measured("f32") {
            out.extend(plain_norms::<f32>(on, s, &mut rng, shape));
        }
        if measured("f16") {
            out.extend(plain_norms::<f16>(on, s, &mut rng, shape));
        }
    }
    out
}

/// RMSNorm and LayerNorm forward and backward, plain, in `T` at one shape.
fn plain_norms<T: TestDtype + ValidAsZeroBits>(
    on: (&Context, &Arc<CudaStream>),
    s: &Settings,
    rng: &mut Rng,
    shape: (usize, usize),
) -> Vec<Measurement> {
    let mut operands = Operands::<T>::new(on.1, rng, shape);
    let mut out = Vec::from(rms_norm_fwd_bwd(on, s, &mut operands));
    out.extend(layer_norm_fwd_bwd(on, s, &mut operands));
    out
}

/// What the bench and the sweep both measure in bf16 at one shape: RMSNorm and LayerNorm, plain
/// and with the residual add (bf16 residual stream).
fn bf16_norms(
    on: (&Context, &Arc<CudaStream>),
    s: &Settings,
    rng: &mut Rng,
    shape: (usize, usize),
) -> Vec<Measurement> {
    // The plain norms' operands are freed before the residual's sets are allocated.
    let mut out = plain_norms::<bf16>(on, s, rng, shape);
    out.extend(norm_residual::<bf16>(false, on, s, rng, shape, "bf16"));
    out.extend(norm_residual::<bf16>(true, on, s, rng, shape, "bf16"));
    out
}

/// RMSNorm's forward (saving rstd) and its backward (from the saved rstd).
fn rms_norm_fwd_bwd<T: TestDtype>(
    (ctx, stream): (&Context, &Arc<CudaStream>),
    s: &Settings,
    operands: &mut Operands<T>,
) -> [Measurement; 2] {
    let gpu = ctx.on(stream).expect("the stream is the context's");
    let Operands {
        rows,
        d,
        sets,
        gamma,
        dgamma,
        workspace,
        ..
    } = operands;
    let (rows, d) = (*rows, *d);
    let fwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
        let k = i % sets.len();
        let set = &mut sets[k];
        let x = Rows::new(set.x.as_view(), rows, d).unwrap();
        let y = Rows::new(set.y.as_view_mut(), rows, d).unwrap();
        let args = NormForward::new(x, gamma.as_view(), y).eps(EPS);
        rms_norm::forward(&gpu, args.rstd(set.rstd.as_view_mut())).unwrap();
    });
    let bwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
        let k = i % sets.len();
        let set = &mut sets[k];
        let x = Rows::new(set.x.as_view(), rows, d).unwrap();
        let dy = Rows::new(set.dy.as_view(), rows, d).unwrap();
        let dx = Rows::new(set.dx.as_view_mut(), rows, d).unwrap();
        let (dgamma, ws) = (dgamma.as_view_mut(), workspace.as_view_mut());
        let args = NormBackward::new(dy, x, gamma.as_view(), dx, dgamma, ws).eps(EPS);
        let args = args.param_gradients(s.strategy);
        rms_norm::backward(&gpu, args.rstd(set.rstd.as_view())).unwrap();
    });
    eprintln!(
        "rms_norm {rows}×{d} ({}): fwd {:.1} µs, bwd {:.1} µs",
        T::NAME,
        fwd.device_us,
        bwd.device_us
    );
    let (n, t) = (rows * d, size_of::<T>());
    [
        // x read, y written, rstd written, γ read.
        operands.measurement("rms_norm fwd", fwd, 2 * n * t + rows * 4 + d * t),
        // x and dy read, dx written, rstd and γ read, dγ written (the workspace is not counted).
        operands.measurement("rms_norm bwd", bwd, 3 * n * t + rows * 4 + 2 * d * t),
    ]
}

/// LayerNorm's forward with bias (saving mean and rstd) and its backward (from the saved
/// statistics, writing dβ).
fn layer_norm_fwd_bwd<T: TestDtype>(
    (ctx, stream): (&Context, &Arc<CudaStream>),
    s: &Settings,
    operands: &mut Operands<T>,
) -> [Measurement; 2] {
    let gpu = ctx.on(stream).expect("the stream is the context's");
    let Operands {
        rows,
        d,
        sets,
        gamma,
        beta,
        dgamma,
        dbeta,
        workspace,
    } = operands;
    let (rows, d) = (*rows, *d);
    let fwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
        let k = i % sets.len();
        let Set {
            x, y, mean, rstd, ..
        } = &mut sets[k];
        let x = Rows::new(x.as_view(), rows, d).unwrap();
        let y = Rows::new(y.as_view_mut(), rows, d).unwrap();
        let args = NormForward::new(x, gamma.as_view(), y).eps(EPS);
        let args = args.bias(beta.as_view());
        layer_norm::forward(&gpu, args.mean(mean.as_view_mut()).rstd(rstd.as_view_mut())).unwrap();
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
        let (dgamma, ws) = (dgamma.as_view_mut(), workspace.as_view_mut());
        let args = NormBackward::new(dy, x, gamma.as_view(), dx, dgamma, ws).eps(EPS);
        let args = args.param_gradients(s.strategy);
        let args = args.mean_rstd(mean.as_view(), rstd.as_view());
        layer_norm::backward(&gpu, args.dbias(dbeta.as_view_mut())).unwrap();
    });
    eprintln!(
        "layer_norm {rows}×{d} ({}): fwd {:.1} µs, bwd {:.1} µs",
        T::NAME,
        fwd.device_us,
        bwd.device_us
    );
    let (n, t) = (rows * d, size_of::<T>());
    [
        // x read, y written, mean and rstd written, γ and β read.
        operands.measurement("layer_norm fwd", fwd, 2 * n * t + 2 * rows * 4 + 2 * d * t),
        // x and dy read, dx written, mean, rstd and γ read, dγ and dβ written.
        operands.measurement("layer_norm bwd", bwd, 3 * n * t + 2 * rows * 4 + 3 * d * t),
    ]
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
    mean: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
}

/// RMSNorm's (`layer`: LayerNorm's, with bias) forward with the residual add and its backward
/// with dresidual at `rows × d`, the residual stream stored as `H`.
fn norm_residual<H: TestDtype>(
    layer: bool,
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
    let host_x: Vec<bf16> = rng.vec_parallel(n, -2.0, 2.0);
    let host_dy: Vec<bf16> = rng.vec_parallel(n, -1.0, 1.0);
    let host_residual: Vec<H> = rng.vec_parallel(n, -4.0, 4.0);
    let host_dresidual: Vec<H> = rng.vec_parallel(n, -1.0, 1.0);
    let mut sets: Vec<ResidualSet<H>> = (0..sets_needed)
        .map(|_| ResidualSet {
            x: stream.clone_htod(&host_x).unwrap(),
            dy: stream.clone_htod(&host_dy).unwrap(),
            y: stream.alloc_zeros(n).unwrap(),
            dx: stream.alloc_zeros(n).unwrap(),
            residual: stream.clone_htod(&host_residual).unwrap(),
            h: stream.clone_htod(&host_residual).unwrap(),
            dresidual: stream.clone_htod(&host_dresidual).unwrap(),
            mean: stream.alloc_zeros(rows).unwrap(),
            rstd: stream.alloc_zeros(rows).unwrap(),
        })
        .collect();
    let gamma = stream.clone_htod(&rng.vec::<bf16>(d, 0.5, 1.5)).unwrap();
    let beta = stream.clone_htod(&rng.vec::<bf16>(d, -0.5, 0.5)).unwrap();
    let mut dgamma = stream.alloc_zeros::<bf16>(d).unwrap();
    let mut dbeta = stream.alloc_zeros::<bf16>(d).unwrap();
    let workspace_len = if layer {
        layer_norm::workspace_len(rows, d)
    } else {
        rms_norm::workspace_len(rows, d)
    };
    let mut ws = stream.alloc_zeros::<f32>(workspace_len.unwrap()).unwrap();
    let fwd = time(ctx.cuda(), stream, s.warmup, s.reps, |i| {
        let k = i % sets.len();
        let set = &mut sets[k];
        let x = Rows::new(set.x.as_view(), rows, d).unwrap();
        let y = Rows::new(set.y.as_view_mut(), rows, d).unwrap();
        let residual = Rows::new(set.residual.as_view(), rows, d).unwrap();
        let h = Rows::new(set.h.as_view_mut(), rows, d).unwrap();
        let args = NormForward::new(x, gamma.as_view(), y).eps(EPS);
        let args = args.rstd(set.rstd.as_view_mut()).residual(residual, h);
        if layer {
            let args = args.bias(beta.as_view()).mean(set.mean.as_view_mut());
            layer_norm::forward(gpu, args).unwrap();
        } else {
            rms_norm::forward(gpu, args).unwrap();
        }
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
        let args = args.param_gradients(s.strategy).dresidual(dresidual);
        if layer {
            let args = args.mean_rstd(set.mean.as_view(), set.rstd.as_view());
            layer_norm::backward(gpu, args.dbias(dbeta.as_view_mut())).unwrap();
        } else {
            rms_norm::backward(gpu, args.rstd(set.rstd.as_view())).unwrap();
        }
    });
    let (name, fwd_op, bwd_op) = if layer {
        (
            "layer_norm",
            "layer_norm fwd + residual",
            "layer_norm bwd + dresidual",
        )
    } else {
        (
            "rms_norm",
            "rms_norm fwd + residual",
            "rms_norm bwd + dresidual",
        )
    };
    eprintln!(
        "{name} + residual ({dtype}) {rows}×{d}: fwd {:.1} µs, bwd {:.1} µs",
        fwd.device_us, bwd.device_us
    );
    // LayerNorm's mean, β and dβ besides.
    let (stats, params) = if layer { (2, 2) } else { (1, 1) };
    vec![
        Measurement {
            op: fwd_op,
            rows,
            d,
            dtype,
            timing: fwd,
            // x and residual read, y and residual_out written, the statistics written, γ (β) read.
            bytes: (2 * n * 2 + 2 * n * h_bytes + stats * rows * 4 + params * d * 2) as f64,
        },
        Measurement {
            op: bwd_op,
            rows,
            d,
            dtype,
            timing: bwd,
            // dy read, dx written, x (residual_out) and dresidual read, the statistics and γ
            // read, dγ (dβ) written.
            bytes: (2 * n * 2 + 2 * n * h_bytes + stats * rows * 4 + (1 + params) * d * 2) as f64,
        },
    ]
}
