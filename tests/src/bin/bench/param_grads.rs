//! `--param-grads`: small-batch latency (every launch of a call, CUDA events, eager and as a
//! CUDA-graph replay; host µs per call) and the dγ strategies side by side (time, % of copy,
//! workspace, launches, bitwise repeatability). Needs cudarc's event tracking off (graph
//! capture), which `main` sets for it.

use std::sync::Arc;

use half::bf16;
use normkern::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{Context, Dtype, Gpu, NormBackward, NormForward, ParamGradients, Rows};
use normkern::{layer_norm, rms_norm};
use normkern_tests::Rng;
use normkern_tests::bench::{Queue, time, time_on};

const EPS: f32 = 1e-6;

/// Operands of one norm call at `rows × d`, bf16 activations, gradients in `G`.
struct Operands<G: Dtype> {
    rows: usize,
    d: usize,
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    weight: CudaSlice<bf16>,
    bias: CudaSlice<bf16>,
    mean: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
    dweight: CudaSlice<G>,
    dbias: CudaSlice<G>,
    workspace: CudaSlice<f32>,
}

impl<G: Dtype + normkern_tests::TestDtype + normkern::cudarc::driver::ValidAsZeroBits> Operands<G> {
    fn new(stream: &Arc<CudaStream>, rng: &mut Rng, rows: usize, d: usize) -> Self {
        let n = rows * d;
        let upload = |v: Vec<bf16>| stream.clone_htod(&v).unwrap();
        Operands {
            rows,
            d,
            x: upload(rng.vec_parallel(n, -2.0, 2.0)),
            dy: upload(rng.vec_parallel(n, -1.0, 1.0)),
            y: stream.alloc_zeros(n).unwrap(),
            dx: stream.alloc_zeros(n).unwrap(),
            weight: upload(rng.vec(d, 0.5, 1.5)),
            bias: upload(rng.vec(d, -0.5, 0.5)),
            mean: stream.alloc_zeros(rows).unwrap(),
            rstd: stream.alloc_zeros(rows).unwrap(),
            dweight: stream.alloc_zeros(d).unwrap(),
            dbias: stream.alloc_zeros(d).unwrap(),
            workspace: stream
                // LayerNorm's, or the locked baseline's locks and up to 16 rows of each gradient.
                .alloc_zeros((layer_norm::workspace_len(rows, d).unwrap()).max(20 + 32 * d))
                .unwrap(),
        }
    }

    fn rms_forward(&mut self, gpu: &Gpu) {
        let (rows, d) = (self.rows, self.d);
        let x = Rows::new(self.x.as_view(), rows, d).unwrap();
        let y = Rows::new(self.y.as_view_mut(), rows, d).unwrap();
        let args = NormForward::new(x, self.weight.as_view(), y).eps(EPS);
        rms_norm::forward(gpu, args.rstd(self.rstd.as_view_mut())).unwrap();
    }

    fn backward(&mut self, gpu: &Gpu, layer: bool, strategy: ParamGradients) {
        self.try_backward(gpu, layer, strategy).unwrap()
    }

    fn try_backward(
        &mut self,
        gpu: &Gpu,
        layer: bool,
        strategy: ParamGradients,
    ) -> normkern::Result<()> {
        let (rows, d) = (self.rows, self.d);
        let dy = Rows::new(self.dy.as_view(), rows, d).unwrap();
        let x = Rows::new(self.x.as_view(), rows, d).unwrap();
        let dx = Rows::new(self.dx.as_view_mut(), rows, d).unwrap();
        let (dweight, ws) = (self.dweight.as_view_mut(), self.workspace.as_view_mut());
        let args = NormBackward::new(dy, x, self.weight.as_view(), dx, dweight, ws)
            .eps(EPS)
            .param_gradients(strategy);
        if layer {
            let args = args.mean_rstd(self.mean.as_view(), self.rstd.as_view());
            layer_norm::backward(gpu, args.dbias(self.dbias.as_view_mut()))
        } else {
            rms_norm::backward(gpu, args.rstd(self.rstd.as_view()))
        }
    }

    /// The LayerNorm forward, saving what its backward reads.
    fn layer_forward(&mut self, gpu: &Gpu) {
        let (rows, d) = (self.rows, self.d);
        let x = Rows::new(self.x.as_view(), rows, d).unwrap();
        let y = Rows::new(self.y.as_view_mut(), rows, d).unwrap();
        let args = NormForward::new(x, self.weight.as_view(), y).eps(EPS);
        let args = args.bias(self.bias.as_view()).mean(self.mean.as_view_mut());
        layer_norm::forward(gpu, args.rstd(self.rstd.as_view_mut())).unwrap();
    }
}

/// Median µs of `call` eager (CUDA events around it on an idle stream: a lone call's latency) with
/// its median host µs, and of one replay of a graph that captured it (likewise).
fn eager_and_graph(
    ctx: &Context,
    stream: &Arc<CudaStream>,
    mut call: impl FnMut(),
) -> (f64, f64, f64) {
    let eager = time_on(ctx.cuda(), stream, (20, 200), Queue::Idle, |_| call());
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    call();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    let graph = graph.expect("a captured graph");
    let replay = time_on(ctx.cuda(), stream, (20, 200), Queue::Idle, |_| {
        graph.launch().unwrap()
    });
    let replay = replay.device_us;
    (eager.device_us, replay, eager.host_us)
}

/// Prints the latency table and the strategy table.
pub fn run(ctx: &Context, stream: &Arc<CudaStream>, copy_gbs: f64) {
    let gpu = ctx.on(stream).expect("the stream is the context's");
    let mut rng = Rng::seeded(16);
    println!();
    println!(
        "small-batch latency, bf16, µs per call (all launches; CUDA events) eager (host µs per call) | as a CUDA-graph replay"
    );
    println!(
        "| rows×d | RMS fwd | graph | RMS bwd (Auto) | graph | single launch | graph | two-pass | graph | LN fwd | graph | LN bwd (Auto) | graph |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let cells = |t: (f64, f64, f64)| format!("{:.1} ({:.1}) | {:.1}", t.0, t.2, t.1);
    for d in [2048, 4096, 8192] {
        for rows in [1, 8, 64, 256, 1024] {
            let mut o = Operands::<bf16>::new(stream, &mut rng, rows, d);
            let (auto, single, two) = (
                ParamGradients::Auto,
                ParamGradients::SingleLaunch,
                ParamGradients::TwoPass,
            );
            let rms_fwd = eager_and_graph(ctx, stream, || o.rms_forward(&gpu));
            let rms_bwd = eager_and_graph(ctx, stream, || o.backward(&gpu, false, auto));
            let rms_single = eager_and_graph(ctx, stream, || o.backward(&gpu, false, single));
            let rms_two = eager_and_graph(ctx, stream, || o.backward(&gpu, false, two));
            let ln_fwd = eager_and_graph(ctx, stream, || o.layer_forward(&gpu));
            let ln_bwd = eager_and_graph(ctx, stream, || o.backward(&gpu, true, auto));
            println!(
                "| {rows}×{d} | {} | {} | {} | {} | {} | {} |",
                cells(rms_fwd),
                cells(rms_bwd),
                cells(rms_single),
                cells(rms_two),
                cells(ln_fwd),
                cells(ln_bwd)
            );
        }
    }

    println!();
    println!("dγ strategies, RMSNorm backward, bf16 activations (dγ bf16; f32 for atomics)");
    println!(
        "| rows×d | strategy | µs | % of copy | host µs | workspace bytes | launches | identical dγ in 10 runs |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (rows, d) in [
        (64, 4096),
        (1024, 4096),
        (16384, 4096),
        (4096, 16384),
        (1024, 65536),
        (1 << 20, 128),
        (262144, 512),
    ] {
        let mut o = Operands::<bf16>::new(stream, &mut rng, rows, d);
        let mut o32 = Operands::<f32>::new(stream, &mut rng, rows, d);
        o.rms_forward(&gpu);
        o32.rms_forward(&gpu);
        // x and dy read, dx written, rstd and γ read, dγ written.
        let bytes = (3 * rows * d * 2 + rows * 4 + 2 * d * 2) as f64;
        let workspace = rms_norm::workspace_len(rows, d).unwrap() * 4;
        for (name, strategy, launches) in [
            ("two-pass", ParamGradients::TwoPass, 2),
            ("single launch", ParamGradients::SingleLaunch, 1),
            ("atomic", ParamGradients::Atomic, 1),
            // The zeroing of its buffers, the row kernel, the column sum.
            ("locked partials", ParamGradients::LockedPartials, 3),
        ] {
            let atomic = strategy == ParamGradients::Atomic;
            let probe = if atomic {
                o32.try_backward(&gpu, false, strategy)
            } else {
                o.try_backward(&gpu, false, strategy)
            };
            if let Err(e) = probe {
                println!("| {rows}×{d} | {name} | refused: {e} | | | | | |");
                continue;
            }
            let timing = if atomic {
                time(ctx.cuda(), stream, 20, 200, |_| {
                    o32.backward(&gpu, false, strategy)
                })
            } else {
                time(ctx.cuda(), stream, 20, 200, |_| {
                    o.backward(&gpu, false, strategy)
                })
            };
            let (us, host) = (timing.device_us, timing.host_us);
            let runs: Vec<Vec<u32>> = (0..10)
                .map(|_| {
                    if atomic {
                        stream.memset_zeros(&mut o32.dweight).unwrap();
                        o32.backward(&gpu, false, strategy);
                        let v = stream.clone_dtoh(&o32.dweight).unwrap();
                        v.iter().map(|x| x.to_bits()).collect()
                    } else {
                        o.backward(&gpu, false, strategy);
                        let v = stream.clone_dtoh(&o.dweight).unwrap();
                        v.iter().map(|x| x.to_bits() as u32).collect()
                    }
                })
                .collect();
            let same = runs.iter().filter(|r| **r == runs[0]).count();
            let gbs = bytes / (us * 1e-6) / 1e9;
            let ws = match strategy {
                ParamGradients::Atomic => 0,
                // The barrier's words and 16 locks, then a partial row per group up to 16.
                ParamGradients::LockedPartials => {
                    (20 + normkern::group_layout(rows, d).1.clamp(1, 16) * d) * 4
                }
                _ => workspace,
            };
            println!(
                "| {rows}×{d} | {name} | {us:.1} | {:.1} | {host:.1} | {ws} | {launches} | {same} / 10 |",
                100.0 * gbs / copy_gbs
            );
        }
    }
}
