//! Data-parallel parameter gradients over NCCL on two GPUs (one thread per rank, as a training
//! process per GPU would have them): exact mode gives dγ, dβ and dbias bitwise equal to one GPU
//! over the whole batch, on every rank, for even and uneven splits, eagerly and replayed from a
//! CUDA graph; fast mode is within fp32 rounding of it. Needs the `nccl` feature, two GPUs and
//! libnccl on the loader's path; skipped with a printed reason without them, failed instead with
//! `NORMKERN_REQUIRE_GPUS=2`.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use normkern::activation::{self, Activation};
use normkern::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use normkern::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use normkern::distributed::{self, BatchSplit, Communicator, DataParallel, Id, Mode};
use normkern::{Context, Dtype, NormBackward, Rows, layer_norm, rms_norm};
use normkern_tests::{Rng, TestDtype};

const WORLD: usize = 2;

/// Whether there are two GPUs and NCCL (printed when not).
fn ranks_available() -> bool {
    let why = match (CudaContext::device_count(), Communicator::unique_id()) {
        (Ok(n), Ok(_)) if n as usize >= WORLD => return true,
        (Ok(n), Ok(_)) => format!("{n} GPUs, the test needs {WORLD}"),
        (Err(e), _) => format!("no CUDA driver: {e:?}"),
        (_, Err(e)) => e.to_string(),
    };
    if std::env::var("NORMKERN_REQUIRE_GPUS").is_ok_and(|v| v == "2") {
        panic!("NORMKERN_REQUIRE_GPUS=2 but: {why}");
    }
    eprintln!("skipping multi-GPU test: {why}");
    false
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Rms,
    Layer,
    /// LayerNorm with the fused residual's dresidual.
    LayerResidual,
    /// GELU backward with dbias.
    Gelu,
}

/// A batch on the host: x (the preactivation for GELU), dy, dresidual, γ.
struct Batch<T> {
    rows: usize,
    d: usize,
    x: Vec<T>,
    dy: Vec<T>,
    dresidual: Vec<T>,
    weight: Vec<T>,
}

impl<T: TestDtype> Batch<T> {
    fn new(rng: &mut Rng, rows: usize, d: usize) -> Self {
        Batch {
            rows,
            d,
            x: rng.vec(rows * d, -2.0, 2.0),
            dy: rng.vec(rows * d, -1.0, 1.0),
            dresidual: rng.vec(rows * d, -1.0, 1.0),
            weight: rng.vec(d, 0.5, 1.5),
        }
    }
}

/// What one backward wrote: the parameter gradients' bits (dγ then dβ, or dbias) and values,
/// and dx's bits.
#[derive(Clone, Debug, PartialEq)]
struct Grads {
    bits: Vec<u32>,
    values: Vec<f64>,
    dx: Vec<u32>,
}

/// One GPU's buffers for a backward over `rows` of a batch, outputs poisoned.
struct Buffers<T: Dtype> {
    x: CudaSlice<T>,
    dy: CudaSlice<T>,
    dresidual: CudaSlice<T>,
    weight: CudaSlice<T>,
    dx: CudaSlice<T>,
    /// dγ and dβ (f32), or dbias (in T, at `act_dbias`).
    grads: CudaSlice<f32>,
    act_dbias: CudaSlice<T>,
    workspace: CudaSlice<f32>,
    rows: usize,
    d: usize,
}

impl<T: TestDtype> Buffers<T> {
    fn new(
        stream: &Arc<CudaStream>,
        batch: &Batch<T>,
        rows: Range<usize>,
        workspace: usize,
    ) -> Self {
        let d = batch.d;
        let part = |v: &[T]| stream.clone_htod(&v[rows.start * d..rows.end * d]).unwrap();
        let n = rows.len() * d;
        Buffers {
            x: part(&batch.x),
            dy: part(&batch.dy),
            dresidual: part(&batch.dresidual),
            weight: stream.clone_htod(&batch.weight).unwrap(),
            dx: stream.clone_htod(&vec![T::poison(); n.max(1)]).unwrap(),
            grads: stream.clone_htod(&vec![f32::NAN; 2 * d]).unwrap(),
            act_dbias: stream.clone_htod(&vec![T::poison(); d]).unwrap(),
            workspace: stream
                .clone_htod(&normkern_tests::poisoned_workspace(workspace.max(1)))
                .unwrap(),
            rows: rows.len(),
            d,
        }
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) {
        stream
            .memcpy_htod(&vec![T::poison(); self.dx.len()], &mut self.dx)
            .unwrap();
        stream
            .memcpy_htod(&vec![f32::NAN; 2 * self.d], &mut self.grads)
            .unwrap();
        stream
            .memcpy_htod(&vec![T::poison(); self.d], &mut self.act_dbias)
            .unwrap();
    }

    /// The backward of `op` on `gpu`: on one device (`dp` = None) or as a rank.
    fn run(
        &mut self,
        gpu: &normkern::Gpu<'_>,
        op: Op,
        dp: Option<DataParallel<'_>>,
    ) -> normkern::Result<()> {
        let (rows, d) = (self.rows, self.d);
        let n = rows * d;
        let (dweight, dbias) = self.grads.split_at_mut(d);
        let norm = |dx| {
            let args = NormBackward::new(
                Rows::new(self.dy.slice(..n), rows, d)?,
                Rows::new(self.x.slice(..n), rows, d)?,
                self.weight.as_view(),
                dx,
                dweight,
                self.workspace.as_view_mut(),
            );
            Ok::<_, normkern::Error>(match op {
                Op::Rms => args,
                Op::Layer => args.dbias(dbias),
                _ => args
                    .dbias(dbias)
                    .dresidual(Rows::new(self.dresidual.slice(..n), rows, d)?),
            })
        };
        let dx = Rows::new(self.dx.slice_mut(..n), rows, d)?;
        match (op, dp) {
            (Op::Rms, None) => rms_norm::backward(gpu, norm(dx)?),
            (Op::Rms, Some(dp)) => distributed::rms_norm_backward(gpu, dp, norm(dx)?),
            (Op::Layer | Op::LayerResidual, None) => layer_norm::backward(gpu, norm(dx)?),
            (Op::Layer | Op::LayerResidual, Some(dp)) => {
                distributed::layer_norm_backward(gpu, dp, norm(dx)?)
            }
            (Op::Gelu, dp) => {
                let args = activation::Backward::new(
                    Activation::GeluErf,
                    Rows::new(self.dy.slice(..n), rows, d)?,
                    Rows::new(self.x.slice(..n), rows, d)?,
                    dx,
                )
                .dbias(self.act_dbias.as_view_mut(), self.workspace.as_view_mut());
                match dp {
                    None => activation::backward(gpu, args),
                    Some(dp) => distributed::activation_backward(gpu, dp, args),
                }
            }
        }
    }

    fn read(&self, stream: &Arc<CudaStream>, op: Op) -> Grads {
        let (bits, values) = match op {
            Op::Gelu => {
                let v = stream.clone_dtoh(&self.act_dbias).unwrap();
                (
                    v.iter().map(|x| x.bits()).collect(),
                    v.iter().map(|x| x.to_f64()).collect(),
                )
            }
            _ => {
                let sums = if op == Op::Rms { 1 } else { 2 };
                let v = stream.clone_dtoh(&self.grads).unwrap();
                let v = &v[..sums * self.d];
                (
                    v.iter().map(|x| x.to_bits()).collect(),
                    v.iter().map(|&x| x as f64).collect(),
                )
            }
        };
        let dx = stream.clone_dtoh(&self.dx).unwrap();
        let dx = dx[..self.rows * self.d].iter().map(|x| x.bits()).collect();
        Grads { bits, values, dx }
    }
}

fn workspace_len(op: Op, split: &BatchSplit, rank: usize, mode: Mode) -> usize {
    match op {
        Op::Rms => split.rms_norm_workspace_len(rank, mode),
        Op::Layer | Op::LayerResidual => split.layer_norm_workspace_len(rank, mode),
        Op::Gelu => split.activation_workspace_len(rank, mode),
    }
    .unwrap()
}

/// What every rank computed for one case: exact eagerly, exact from a graph replay, fast; and
/// rank 0's whole-batch run on its one GPU.
struct RankResult {
    exact: Grads,
    replayed: Grads,
    fast: Grads,
    whole: Option<Grads>,
}

/// Runs `op` over every split on every rank (one thread per GPU, each with its own context,
/// stream and communicator), and the whole batch on rank 0's GPU.
fn run_ranks<T: TestDtype>(
    batch: &Batch<T>,
    op: Op,
    splits: &[BatchSplit],
) -> Vec<Vec<RankResult>> {
    // A unique id serves one group of communicators.
    let id: Id = Communicator::unique_id().unwrap();
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..WORLD)
            .map(|rank| {
                scope.spawn(move || {
                    let ctx = Context::new(rank).unwrap();
                    // SAFETY: every buffer lives on the one stream below; event tracking off lets
                    // the graph capture below take the backward.
                    unsafe { ctx.cuda().disable_event_tracking() };
                    let stream = ctx.cuda().new_stream().unwrap();
                    let gpu = ctx.on(&stream).unwrap();
                    let comm = Communicator::from_rank(&ctx, rank, WORLD, &id).unwrap();
                    splits
                        .iter()
                        .map(|split| {
                            let rows = split.rank_rows(rank).unwrap();
                            let result = |mode| {
                                let dp = DataParallel {
                                    comm: &comm,
                                    split,
                                    mode,
                                };
                                let ws = workspace_len(op, split, rank, mode);
                                let mut buffers = Buffers::new(&stream, batch, rows.clone(), ws);
                                buffers.run(&gpu, op, Some(dp)).unwrap();
                                let eager = buffers.read(&stream, op);
                                (eager, buffers, dp)
                            };
                            let (fast, _, _) = result(Mode::Fast);
                            let (exact, mut buffers, dp) = result(Mode::Exact);
                            // The same call captured into a graph and replayed (twice).
                            buffers.poison(&stream);
                            stream
                                .begin_capture(
                                    CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                                )
                                .unwrap();
                            let captured = buffers.run(&gpu, op, Some(dp));
                            let graph = stream
                                .end_capture(CUgraphInstantiate_flags(0))
                                .unwrap()
                                .expect("a graph");
                            captured.unwrap();
                            graph.launch().unwrap();
                            graph.launch().unwrap();
                            let replayed = buffers.read(&stream, op);
                            let whole = (rank == 0).then(|| {
                                let ws = match op {
                                    Op::Rms => rms_norm::workspace_len(batch.rows, batch.d),
                                    Op::Layer | Op::LayerResidual => {
                                        layer_norm::workspace_len(batch.rows, batch.d)
                                    }
                                    Op::Gelu => activation::workspace_len(batch.rows, batch.d),
                                }
                                .unwrap();
                                let mut whole = Buffers::new(&stream, batch, 0..batch.rows, ws);
                                whole.run(&gpu, op, None).unwrap();
                                whole.read(&stream, op)
                            });
                            RankResult {
                                exact,
                                replayed,
                                fast,
                                whole,
                            }
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

fn check<T: TestDtype>(rng: &mut Rng, (rows, d): (usize, usize), uneven: &[usize]) {
    let batch = Batch::<T>::new(rng, rows, d);
    let splits = [
        BatchSplit::even(rows, d, WORLD).unwrap(),
        BatchSplit::with_rows(uneven, d).unwrap(),
    ];
    for op in [Op::Rms, Op::Layer, Op::LayerResidual, Op::Gelu] {
        let results = run_ranks(&batch, op, &splits);
        for (s, split) in splits.iter().enumerate() {
            let whole = results[0][s].whole.as_ref().unwrap();
            let mut fast_error = 0f64;
            for (rank, per_split) in results.iter().enumerate() {
                let r = &per_split[s];
                let what = format!(
                    "{} {op:?} {rows}×{d} split {:?}, rank {rank}",
                    T::NAME,
                    (0..WORLD)
                        .map(|k| split.rank_rows(k).unwrap().len())
                        .collect::<Vec<_>>()
                );
                assert!(
                    r.exact.bits == whole.bits,
                    "{what}: exact mode differs from one GPU"
                );
                assert!(
                    r.replayed.bits == whole.bits,
                    "{what}: graph replay differs from one GPU"
                );
                let own = split.rank_rows(rank).unwrap();
                assert!(
                    r.exact.dx == whole.dx[own.start * d..own.end * d],
                    "{what}: dx"
                );
                assert!(
                    r.fast.bits == results[0][s].fast.bits,
                    "{what}: fast mode differs between ranks"
                );
                let scale = whole
                    .values
                    .iter()
                    .fold(0f64, |m, v| m.max(v.abs()))
                    .max(1.0);
                for (f, w) in r.fast.values.iter().zip(&whole.values) {
                    let err = (f - w).abs() / scale;
                    fast_error = fast_error.max(err);
                    // Another order of fp32 adds (the ranks' sums, then theirs), plus for dbias
                    // in T one rounding of the output either way.
                    let tolerance = if op == Op::Gelu { T::TOLERANCE.0 } else { 1e-5 };
                    assert!(err <= tolerance, "{what}: fast {f} vs {w}");
                }
                let same = r
                    .fast
                    .bits
                    .iter()
                    .zip(&whole.bits)
                    .filter(|(a, b)| a == b)
                    .count();
                if rank == 0 {
                    println!(
                        "{what}: exact = one GPU bitwise (eager and graph replay, every rank); fast: max |Δ|/max|g| = {fast_error:.2e}, {same}/{} elements bit-equal",
                        whole.bits.len()
                    );
                }
            }
        }
    }
}

#[test]
fn gpu_exact_mode_matches_one_gpu_bitwise_f32() {
    if !ranks_available() {
        return;
    }
    let mut rng = Rng::fresh("distributed f32");
    check::<f32>(&mut rng, (16384, 4096), &[6144, 10240]);
}

#[test]
fn gpu_exact_mode_matches_one_gpu_bitwise_bf16() {
    if !ranks_available() {
        return;
    }
    let mut rng = Rng::fresh("distributed bf16");
    check::<bf16>(&mut rng, (16384, 4096), &[6144, 10240]);
    // Wide rows (groups of 69 rows) and a narrow, odd shape.
    check::<bf16>(&mut rng, (1024, 65536), &[345, 679]);
    check::<bf16>(&mut rng, (3000, 1000), &[1344, 1656]);
}
