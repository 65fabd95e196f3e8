//! normkern under CUDA graphs and concurrent streams, on the GPU (skipped with a printed reason
//! without one): a captured forward + backward replays to the bits of eager runs on the setup the
//! README documents; capturing with cudarc's event tracking on is a typed error that leaves the
//! capture intact; ops on several streams at once give the bits of the same ops one after another.

use std::sync::Arc;

use half::bf16;
use normkern::activation::{self, Activation, GatedBackward, GatedForward, GatedGrad, GatedInput};
use normkern::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{
    Context, Error, Gpu, NormBackward, NormForward, Rows, RowsRef, layer_norm, rms_norm,
};
use normkern_tests::{Rng, TestDtype};

const EPS: f32 = 1e-5;

/// A context for these tests, or `None` (printed) when there is no GPU.
fn context() -> Option<Context> {
    normkern_tests::gpu()?;
    Some(Context::new(0).expect("a second context on the same GPU"))
}

/// The operands of one pre-norm block step on one stream: LayerNorm forward with the residual add
/// and its backward with dresidual, RMSNorm forward and backward, a SiLU forward and backward with
/// dbias, and a SwiGLU forward and backward.
struct Block {
    rows: usize,
    d: usize,
    inputs: Inputs,
    outputs: Outputs,
}

/// Everything the ops read: changed between graph replays.
struct Inputs {
    x: CudaSlice<bf16>,
    residual: CudaSlice<f32>,
    dy: CudaSlice<bf16>,
    dresidual: CudaSlice<f32>,
    weight: CudaSlice<bf16>,
    bias: CudaSlice<bf16>,
}

/// Everything the ops write.
struct Outputs {
    y: CudaSlice<bf16>,
    h: CudaSlice<f32>,
    mean: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
    dx: CudaSlice<bf16>,
    dweight: CudaSlice<bf16>,
    dbias: CudaSlice<bf16>,
    rms_y: CudaSlice<bf16>,
    rms_rstd: CudaSlice<f32>,
    rms_dx: CudaSlice<bf16>,
    rms_dweight: CudaSlice<bf16>,
    act_y: CudaSlice<bf16>,
    act_dx: CudaSlice<bf16>,
    act_dbias: CudaSlice<bf16>,
    gated_h: CudaSlice<bf16>,
    gated_da: CudaSlice<bf16>,
    gated_db: CudaSlice<bf16>,
    workspace: CudaSlice<f32>,
    act_workspace: CudaSlice<f32>,
}

impl Block {
    fn new(stream: &Arc<CudaStream>, rng: &mut Rng, rows: usize, d: usize) -> Self {
        let n = rows * d;
        let zeros = |n| stream.alloc_zeros::<bf16>(n).unwrap();
        let zeros32 = |n| stream.alloc_zeros::<f32>(n).unwrap();
        let workspace = layer_norm::workspace_len(rows, d).unwrap();
        let act_workspace = activation::workspace_len(rows, d).unwrap();
        let mut block = Block {
            rows,
            d,
            inputs: Inputs {
                x: zeros(n),
                residual: zeros32(n),
                dy: zeros(n),
                dresidual: zeros32(n),
                weight: zeros(d),
                bias: zeros(d),
            },
            outputs: Outputs {
                y: zeros(n),
                h: zeros32(n),
                mean: zeros32(rows),
                rstd: zeros32(rows),
                dx: zeros(n),
                dweight: zeros(d),
                dbias: zeros(d),
                rms_y: zeros(n),
                rms_rstd: zeros32(rows),
                rms_dx: zeros(n),
                rms_dweight: zeros(d),
                act_y: zeros(n),
                act_dx: zeros(n),
                act_dbias: zeros(d),
                gated_h: zeros(n),
                gated_da: zeros(n),
                gated_db: zeros(n),
                workspace: zeros32(workspace),
                act_workspace: zeros32(act_workspace),
            },
        };
        block.fresh_inputs(stream, rng);
        block
    }

    /// New random inputs, written into the same buffers (so a captured graph reads them).
    fn fresh_inputs(&mut self, stream: &Arc<CudaStream>, rng: &mut Rng) {
        let (n, d) = (self.rows * self.d, self.d);
        let i = &mut self.inputs;
        stream
            .memcpy_htod(&rng.vec::<bf16>(n, -2.0, 2.0), &mut i.x)
            .unwrap();
        stream
            .memcpy_htod(&rng.vec::<f32>(n, -2.0, 2.0), &mut i.residual)
            .unwrap();
        stream
            .memcpy_htod(&rng.vec::<bf16>(n, -1.0, 1.0), &mut i.dy)
            .unwrap();
        stream
            .memcpy_htod(&rng.vec::<f32>(n, -1.0, 1.0), &mut i.dresidual)
            .unwrap();
        stream
            .memcpy_htod(&rng.vec::<bf16>(d, 0.5, 1.5), &mut i.weight)
            .unwrap();
        stream
            .memcpy_htod(&rng.vec::<bf16>(d, -0.5, 0.5), &mut i.bias)
            .unwrap();
    }

    /// Poisons every output, so a run that skips one is caught.
    fn poison(&mut self, stream: &Arc<CudaStream>) {
        let o = &mut self.outputs;
        for buf in [
            &mut o.y,
            &mut o.dx,
            &mut o.dweight,
            &mut o.dbias,
            &mut o.rms_y,
            &mut o.rms_dx,
            &mut o.rms_dweight,
            &mut o.act_y,
            &mut o.act_dx,
            &mut o.act_dbias,
            &mut o.gated_h,
            &mut o.gated_da,
            &mut o.gated_db,
        ] {
            let n = buf.len();
            stream.memcpy_htod(&vec![bf16::poison(); n], buf).unwrap();
        }
        for buf in [&mut o.h, &mut o.mean, &mut o.rstd, &mut o.rms_rstd] {
            let n = buf.len();
            stream.memcpy_htod(&vec![f32::NAN; n], buf).unwrap();
        }
    }

    /// The step's ops, in order, on `gpu`.
    fn run(&mut self, gpu: &Gpu<'_>) -> normkern::Result<()> {
        let (rows, d) = (self.rows, self.d);
        let (i, o) = (&self.inputs, &mut self.outputs);
        fn rows_of(
            b: &CudaSlice<bf16>,
            (rows, d): (usize, usize),
        ) -> normkern::Result<RowsRef<'_, bf16>> {
            Rows::new(b.as_view(), rows, d)
        }
        let shape = (rows, d);
        let h = Rows::new(o.h.as_view_mut(), rows, d)?;
        let y = Rows::new(o.y.as_view_mut(), rows, d)?;
        let residual = Rows::new(i.residual.as_view(), rows, d)?;
        let forward = NormForward::new(rows_of(&i.x, shape)?, i.weight.as_view(), y)
            .eps(EPS)
            .bias(i.bias.as_view())
            .mean(o.mean.as_view_mut())
            .rstd(o.rstd.as_view_mut())
            .residual(residual, h);
        layer_norm::forward(gpu, forward)?;
        let backward = NormBackward::new(
            rows_of(&i.dy, shape)?,
            Rows::new(o.h.as_view(), rows, d)?,
            i.weight.as_view(),
            Rows::new(o.dx.as_view_mut(), rows, d)?,
            o.dweight.as_view_mut(),
            o.workspace.as_view_mut(),
        )
        .eps(EPS)
        .mean_rstd(o.mean.as_view(), o.rstd.as_view())
        .dbias(o.dbias.as_view_mut())
        .dresidual(Rows::new(i.dresidual.as_view(), rows, d)?);
        layer_norm::backward(gpu, backward)?;
        let y = Rows::new(o.rms_y.as_view_mut(), rows, d)?;
        let forward = NormForward::new(rows_of(&i.x, shape)?, i.weight.as_view(), y).eps(EPS);
        rms_norm::forward(gpu, forward.rstd(o.rms_rstd.as_view_mut()))?;
        let backward = NormBackward::new(
            rows_of(&i.dy, shape)?,
            rows_of(&i.x, shape)?,
            i.weight.as_view(),
            Rows::new(o.rms_dx.as_view_mut(), rows, d)?,
            o.rms_dweight.as_view_mut(),
            o.workspace.as_view_mut(),
        );
        rms_norm::backward(gpu, backward.eps(EPS).rstd(o.rms_rstd.as_view()))?;
        let y = Rows::new(o.act_y.as_view_mut(), rows, d)?;
        activation::forward(
            gpu,
            activation::Forward::new(Activation::Silu, rows_of(&i.x, shape)?, y),
        )?;
        // SwiGLU with a = x, b = dy and the gradient dh = dy.
        let gate = || -> normkern::Result<GatedInput<'_, Gpu<'_>, bf16>> {
            Ok(GatedInput::Separate {
                a: rows_of(&i.x, shape)?,
                b: rows_of(&i.dy, shape)?,
            })
        };
        let h = Rows::new(o.gated_h.as_view_mut(), rows, d)?;
        let forward = GatedForward {
            activation: Activation::Silu,
            input: gate()?,
            h,
        };
        activation::gated_forward(gpu, forward)?;
        let backward = GatedBackward {
            activation: Activation::Silu,
            dh: rows_of(&i.dy, shape)?,
            input: gate()?,
            grad: GatedGrad::Separate {
                da: Rows::new(o.gated_da.as_view_mut(), rows, d)?,
                db: Rows::new(o.gated_db.as_view_mut(), rows, d)?,
            },
        };
        activation::gated_backward(gpu, backward)?;
        let dx = Rows::new(o.act_dx.as_view_mut(), rows, d)?;
        let act = activation::Backward::new(
            Activation::Silu,
            rows_of(&i.dy, shape)?,
            rows_of(&i.x, shape)?,
            dx,
        )
        .dbias(o.act_dbias.as_view_mut(), o.act_workspace.as_view_mut());
        activation::backward(gpu, act)
    }

    /// Every output's bits.
    fn outputs(&self, stream: &Arc<CudaStream>) -> Vec<u32> {
        stream.synchronize().unwrap();
        let o = &self.outputs;
        let mut bits = Vec::new();
        for buf in [
            &o.y,
            &o.dx,
            &o.dweight,
            &o.dbias,
            &o.rms_y,
            &o.rms_dx,
            &o.rms_dweight,
            &o.act_y,
            &o.act_dx,
            &o.act_dbias,
            &o.gated_h,
            &o.gated_da,
            &o.gated_db,
        ] {
            bits.extend(stream.clone_dtoh(buf).unwrap().iter().map(|v| v.bits()));
        }
        for buf in [&o.h, &o.mean, &o.rstd, &o.rms_rstd] {
            bits.extend(stream.clone_dtoh(buf).unwrap().iter().map(|v| v.to_bits()));
        }
        bits
    }
}

/// The README's setup for graph capture: event tracking off before any buffer exists, a stream of
/// the context's own. A forward + backward step (norms with the residual forms, activations with
/// dbias, gated activations) is captured once and replayed with new inputs each time; every
/// replay writes every output and gives the bits of an eager run on the same inputs. The shapes
/// take each way of summing dγ/dβ/dbias that `Auto` picks: the single launch (1000×4096), the
/// two-pass row kernel and column sum (16384×512: more than 2²² elements over rows of 257–512),
/// and rows split over clusters (64×65536, sm_90).
#[test]
fn gpu_graph_replays_match_eager_runs() {
    let Some(ctx) = context() else { return };
    // SAFETY: these buffers live on one stream, so no cross-stream ordering is needed.
    unsafe { ctx.cuda().disable_event_tracking() };
    let stream = ctx.cuda().new_stream().unwrap();
    let gpu = ctx.on(&stream).unwrap();
    let mut rng = Rng::fresh("graph replays");
    for (rows, d) in [(1000, 4096), (16384, 512), (64, 65536)] {
        let mut block = Block::new(&stream, &mut rng, rows, d);
        // The first eager run answers the plan's occupancy questions outside the capture.
        block.run(&gpu).unwrap();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let captured = block.run(&gpu);
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph");
        captured.unwrap();
        for replay in 0..8 {
            block.fresh_inputs(&stream, &mut rng);
            block.poison(&stream);
            graph.launch().unwrap();
            let replayed = block.outputs(&stream);
            block.poison(&stream);
            block.run(&gpu).unwrap();
            let eager = block.outputs(&stream);
            assert!(
                replayed == eager,
                "{rows}×{d}: replay {replay} differs from the eager run"
            );
            assert!(
                !eager.contains(&bf16::poison().bits()),
                "{rows}×{d}: an output was not written"
            );
        }
        eprintln!("{rows}×{d}: 8 replays with new inputs, each bitwise equal to an eager run");
    }
}

/// With cudarc's event tracking on (its default once a second stream exists), a call on a
/// capturing stream is refused before it touches anything, and the capture stays valid; with
/// tracking turned off around the capture, the same buffers capture and replay.
#[test]
fn gpu_capture_with_event_tracking_is_a_typed_error() {
    let Some(ctx) = context() else { return };
    let stream = ctx.cuda().new_stream().unwrap();
    assert!(ctx.cuda().is_managing_stream_synchronization());
    let gpu = ctx.on(&stream).unwrap();
    let mut rng = Rng::fresh("capture with tracking");
    let mut block = Block::new(&stream, &mut rng, 64, 1024);
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let result = block.run(&gpu);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    assert_eq!(result, Err(Error::CaptureWithEventTracking));
    let capture = graph.as_ref().map(|_| ()).map_err(|e| format!("{e:?}"));
    assert_eq!(capture, Ok(()), "the capture was invalidated");
    // The stream works as before.
    block.run(&gpu).unwrap();
    let eager = block.outputs(&stream);
    // The README's other recipe: tracking off only around the capture, on again after it.
    unsafe { ctx.cuda().disable_event_tracking() };
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured = block.run(&gpu);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    // SAFETY: every buffer here lives on this one stream.
    unsafe { ctx.cuda().enable_event_tracking() };
    captured.unwrap();
    block.poison(&stream);
    graph.expect("a graph").launch().unwrap();
    assert!(
        block.outputs(&stream) == eager,
        "the replay differs from the eager run"
    );
}

/// Several streams of one context at once, each with its own buffers and workspace, give the
/// bits of the same steps run one after another on one stream.
#[test]
fn gpu_concurrent_streams_match_sequential_runs() {
    let Some(ctx) = context() else { return };
    let streams: Vec<_> = (0..4).map(|_| ctx.cuda().new_stream().unwrap()).collect();
    let mut rng = Rng::fresh("concurrent streams");
    let shapes = [(4096, 1024), (2048, 4096), (512, 16384), (64, 65536)];
    let mut blocks: Vec<Block> = (streams.iter().zip(shapes))
        .map(|(s, (rows, d))| Block::new(s, &mut rng, rows, d))
        .collect();
    // One after another, on the first stream.
    let sequential: Vec<Vec<u32>> = (blocks.iter_mut())
        .map(|b| {
            let gpu = ctx.on(&streams[0]).unwrap();
            b.poison(&streams[0]);
            b.run(&gpu).unwrap();
            b.outputs(&streams[0])
        })
        .collect();
    // All at once, each on its own stream, three rounds.
    for round in 0..3 {
        for (b, s) in blocks.iter_mut().zip(&streams) {
            b.poison(s);
        }
        for (b, s) in blocks.iter_mut().zip(&streams) {
            b.run(&ctx.on(s).unwrap()).unwrap();
        }
        for (i, (b, s)) in blocks.iter().zip(&streams).enumerate() {
            assert!(
                b.outputs(s) == sequential[i],
                "round {round}: stream {i} differs from the sequential run"
            );
        }
    }
    eprintln!("4 streams × 3 rounds: every output bitwise equal to the sequential runs");
}
