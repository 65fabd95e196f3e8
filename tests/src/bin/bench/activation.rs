//! Activations: plain, gated and with fused dbias, bf16, at 16384×4096 (an MLP's hidden layer)
//! and 1048576×128 (narrow rows: dbias over many rows per column).

use std::sync::Arc;

use half::bf16;
use normkern::activation::{self, Activation, GatedGrad, GatedInput};
use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{Context, Rows};
use normkern_tests::Rng;
use normkern_tests::bench::{Timing, copy_timing, time};

use crate::{Measurement, Settings};

/// Two sets of operands, each far larger than L2, used alternately.
struct Set {
    a: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    g: CudaSlice<bf16>,
    out0: CudaSlice<bf16>,
    out1: CudaSlice<bf16>,
}

/// The activation shapes the bench measures (`--quick`: the first; `--shapes` others).
const SHAPES: [(usize, usize); 2] = [(16384, 4096), (1048576, 128)];

pub fn run(ctx: &Context, stream: &Arc<CudaStream>, s: &Settings) -> Vec<Measurement> {
    let shapes = match &s.shapes {
        Some(shapes) => &shapes[..],
        None if s.quick => &SHAPES[..1],
        None => &SHAPES[..],
    };
    shapes
        .iter()
        .flat_map(|&(rows, d)| run_shape(ctx, stream, s, rows, d))
        .collect()
}

fn run_shape(
    ctx: &Context,
    stream: &Arc<CudaStream>,
    s: &Settings,
    rows: usize,
    d: usize,
) -> Vec<Measurement> {
    let gpu = ctx.on(stream).expect("the stream is the context's");
    let n = rows * d;
    let mut rng = Rng::seeded(11);
    let host_a: Vec<bf16> = rng.vec_parallel(n, -4.0, 4.0);
    let host_g: Vec<bf16> = rng.vec_parallel(n, -1.0, 1.0);
    let mut sets: Vec<Set> = (0..2)
        .map(|_| Set {
            a: stream.clone_htod(&host_a).unwrap(),
            b: stream.clone_htod(&host_g).unwrap(),
            g: stream.clone_htod(&host_g).unwrap(),
            out0: stream.alloc_zeros(n).unwrap(),
            out1: stream.alloc_zeros(n).unwrap(),
        })
        .collect();
    let mut dbias = stream.alloc_zeros::<bf16>(d).unwrap();
    let mut ws = stream
        .alloc_zeros::<f32>(activation::workspace_len(rows, d).unwrap())
        .unwrap();
    let tensor = (n * 2) as f64;
    let mut out = Vec::new();
    let mut record = |op: String, timing: Timing, bytes: f64| {
        out.push(Measurement {
            op: leak(op),
            rows,
            d,
            dtype: "bf16",
            timing,
            bytes,
        })
    };
    // The copy of one tensor: what an elementwise op moving these bytes can hope for, next to
    // the 1 GiB copy every row is reported against (a smaller copy pays its ramp and tail).
    let (_, copy) = copy_timing(ctx.cuda(), stream, n / 2, s.reps);
    record("copy (one tensor)".into(), copy, 2.0 * tensor);
    let acts: &[(Activation, &str)] = if s.quick {
        &[(Activation::Silu, "silu")]
    } else {
        &[
            (Activation::Relu, "relu"),
            (Activation::Silu, "silu"),
            (Activation::GeluErf, "gelu_erf"),
            (Activation::GeluTanh, "gelu_tanh"),
        ]
    };
    let mut time = |f: &mut dyn FnMut(&mut Set)| {
        time(
            ctx.cuda(),
            stream,
            s.warmup,
            s.reps,
            |i| f(&mut sets[i % 2]),
        )
    };
    for &(act, name) in acts {
        let us = time(&mut |set| {
            let y = Rows::new(set.out0.as_view_mut(), rows, d).unwrap();
            activation::forward(&gpu, activation::Forward::new(act, v(rows, d, &set.a), y)).unwrap()
        });
        record(format!("{name} fwd"), us, 2.0 * tensor);
        let us = time(&mut |set| {
            let dx = Rows::new(set.out0.as_view_mut(), rows, d).unwrap();
            let args = activation::Backward::new(act, v(rows, d, &set.g), v(rows, d, &set.a), dx);
            activation::backward(&gpu, args).unwrap()
        });
        record(format!("{name} bwd"), us, 3.0 * tensor);
        let us = time(&mut |set| {
            let dx = Rows::new(set.out0.as_view_mut(), rows, d).unwrap();
            let args = activation::Backward::new(act, v(rows, d, &set.g), v(rows, d, &set.a), dx);
            let args = args.param_gradients(s.strategy);
            activation::backward(&gpu, args.dbias(dbias.as_view_mut(), ws.as_view_mut())).unwrap()
        });
        // dy and preact read, dx written, dbias written (the workspace is not counted).
        record(
            format!("{name} bwd+dbias"),
            us,
            3.0 * tensor + (d * 2) as f64,
        );
        if act == Activation::Relu {
            continue;
        }
        let us = time(&mut |set| {
            let (a, b) = (v(rows, d, &set.a), v(rows, d, &set.b));
            let h = Rows::new(set.out0.as_view_mut(), rows, d).unwrap();
            let args = activation::GatedForward {
                activation: act,
                input: GatedInput::Separate { a, b },
                h,
            };
            activation::gated_forward(&gpu, args).unwrap()
        });
        record(format!("{name} gated fwd"), us, 3.0 * tensor);
        let us = time(&mut |set| {
            let Set {
                a,
                b,
                g,
                out0,
                out1,
            } = set;
            let args = activation::GatedBackward {
                activation: act,
                dh: v(rows, d, g),
                input: GatedInput::Separate {
                    a: v(rows, d, a),
                    b: v(rows, d, b),
                },
                grad: GatedGrad::Separate {
                    da: Rows::new(out0.as_view_mut(), rows, d).unwrap(),
                    db: Rows::new(out1.as_view_mut(), rows, d).unwrap(),
                },
            };
            activation::gated_backward(&gpu, args).unwrap()
        });
        record(format!("{name} gated bwd"), us, 5.0 * tensor);
    }
    out
}

fn v(
    rows: usize,
    d: usize,
    x: &CudaSlice<bf16>,
) -> Rows<normkern::cudarc::driver::CudaView<'_, bf16>> {
    Rows::new(x.as_view(), rows, d).unwrap()
}

/// Table labels live for the whole (short) run.
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}
