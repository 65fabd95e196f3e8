//! A data-parallel training step over NCCL, checked against one GPU: every visible GPU (two on
//! the test machine) runs one rank on its own thread; the model is a pre-norm SwiGLU layer,
//! `h = SwiGLU(RMSNorm(x; γ) · W1)`, trained to a teacher's outputs by SGD on the mean squared
//! error. normkern runs the norm and the gate; cuBLAS (through cudarc) the matmuls; the loss and
//! the update run on the host for brevity.
//!
//! dγ is summed over the ranks in exact mode; W1's gradient with a plain NCCL all-reduce. The
//! example trains the same model on one GPU over the whole batch, then on all GPUs, and checks:
//! after the first step dγ is bitwise the one-GPU dγ on every rank, and the loss curves agree
//! within 1e-4 relative over the steps (W1's all-reduce adds in another order than one GPU's
//! accumulation, so the runs drift apart by rounding only).
//!
//! Both runs compute their matmuls in micro-batches of the same size (one rank's rows): cuBLAS
//! picks its algorithm by the matrix shape, so equal shapes keep every row's products equal and
//! the comparison about normkern's reduction.
//!
//! Run: `cargo run --release -p normkern --features nccl --example data_parallel` (libnccl.so and
//! libcublas.so on the loader's path).

use std::sync::Arc;
use std::time::Instant;

use normkern::activation::{self, Activation, GatedBackward, GatedForward, GatedGrad, GatedInput};
use normkern::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use normkern::cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut};
use normkern::distributed::{self, BatchSplit, Communicator, DataParallel, Mode};
use normkern::{Context, Gpu, NormBackward, NormForward, Rows, rms_norm};

const ROWS: usize = 8192;
const D: usize = 1024;
const F: usize = 1024;
const STEPS: usize = 20;
const LR: f32 = 200.0;
const EPS: f32 = 1e-6;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Deterministic pseudo-random numbers in [-1, 1).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The model's parameters, on the host (the update runs there).
#[derive(Clone)]
struct Params {
    gamma: Vec<f32>,
    /// `[D, 2F]`, row-major: each row of `RMSNorm(x) · W1` is SwiGLU's `[a | b]`.
    w1: Vec<f32>,
}

impl Params {
    fn initial() -> Self {
        let scale = 1.0 / (D as f32).sqrt();
        Params {
            gamma: noise(1, D).iter().map(|v| 1.0 + 0.1 * v).collect(),
            w1: noise(2, D * 2 * F)
                .iter()
                .map(|v| v * scale * 1.7)
                .collect(),
        }
    }

    /// The teacher: the initial model moved by a fixed direction.
    fn teacher() -> Self {
        let mut p = Params::initial();
        for (w, n) in p.w1.iter_mut().zip(noise(3, D * 2 * F)) {
            *w += 0.5 * n / (D as f32).sqrt();
        }
        for (g, n) in p.gamma.iter_mut().zip(noise(4, D)) {
            *g += 0.2 * n;
        }
        p
    }
}

/// `c = op(a) · op(b)` for row-major matrices, `op(a)` `[m, k]`, `op(b)` `[k, n]`, added to c
/// when `accumulate`. cuBLAS is column-major: a row-major `[r, c]` matrix is its transpose, so
/// it computes `cᵀ = op(b)ᵀ · op(a)ᵀ`.
#[allow(clippy::too_many_arguments)]
fn matmul(
    blas: &CudaBlas,
    (a, a_transposed): (&CudaView<'_, f32>, bool),
    (b, b_transposed): (&CudaView<'_, f32>, bool),
    c: &mut CudaViewMut<'_, f32>,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
) -> Result<(), Error> {
    let op = |t| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let cfg = GemmConfig {
        transa: op(b_transposed),
        transb: op(a_transposed),
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: if b_transposed { k } else { n } as i32,
        ldb: if a_transposed { m } else { k } as i32,
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: n as i32,
    };
    // SAFETY: the views hold the matrices the shapes describe (checked by the callers' sizes).
    unsafe { blas.gemm(cfg, b, a, c) }?;
    Ok(())
}

/// One rank's (or the one GPU's) buffers and the data of its rows.
struct Worker<'a> {
    gpu: Gpu<'a>,
    stream: &'a Arc<CudaStream>,
    blas: CudaBlas,
    rows: usize,
    /// Rows per matmul micro-batch.
    chunk: usize,
    x: CudaSlice<f32>,
    target: Vec<f32>,
    gamma: CudaSlice<f32>,
    w1: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
    u: CudaSlice<f32>,
    h: CudaSlice<f32>,
    du: CudaSlice<f32>,
    dnormed: CudaSlice<f32>,
    dx: CudaSlice<f32>,
    dgamma: CudaSlice<f32>,
    dw1: CudaSlice<f32>,
    workspace: CudaSlice<f32>,
}

impl<'a> Worker<'a> {
    fn new(
        gpu: Gpu<'a>,
        stream: &'a Arc<CudaStream>,
        batch_rows: std::ops::Range<usize>,
        chunk: usize,
        workspace: usize,
    ) -> Result<Self, Error> {
        let rows = batch_rows.len();
        let x = noise(5, ROWS * D)[batch_rows.start * D..batch_rows.end * D].to_vec();
        let p = Params::initial();
        let mut w = Worker {
            gpu,
            stream,
            blas: CudaBlas::new(stream.clone())?,
            rows,
            chunk,
            x: stream.clone_htod(&x)?,
            target: Vec::new(),
            gamma: stream.clone_htod(&p.gamma)?,
            w1: stream.clone_htod(&p.w1)?,
            normed: stream.alloc_zeros(rows * D)?,
            rstd: stream.alloc_zeros(rows)?,
            u: stream.alloc_zeros(rows * 2 * F)?,
            h: stream.alloc_zeros(rows * F)?,
            du: stream.alloc_zeros(rows * 2 * F)?,
            dnormed: stream.alloc_zeros(rows * D)?,
            dx: stream.alloc_zeros(rows * D)?,
            dgamma: stream.alloc_zeros(D)?,
            dw1: stream.alloc_zeros(D * 2 * F)?,
            workspace: stream.alloc_zeros(workspace)?,
        };
        // The teacher's outputs for these rows, through the same forward.
        w.load(&Params::teacher())?;
        w.forward()?;
        w.target = stream.clone_dtoh(&w.h)?;
        w.load(&Params::initial())?;
        Ok(w)
    }

    fn load(&mut self, p: &Params) -> Result<(), Error> {
        self.stream.memcpy_htod(&p.gamma, &mut self.gamma)?;
        self.stream.memcpy_htod(&p.w1, &mut self.w1)?;
        Ok(())
    }

    /// `h = SwiGLU(RMSNorm(x; γ) · W1)`.
    fn forward(&mut self) -> Result<(), Error> {
        let rows = self.rows;
        rms_norm::forward(
            &self.gpu,
            NormForward::new(
                Rows::new(self.x.as_view(), rows, D)?,
                self.gamma.as_view(),
                Rows::new(self.normed.as_view_mut(), rows, D)?,
            )
            .eps(EPS)
            .rstd(self.rstd.as_view_mut()),
        )?;
        for start in (0..rows).step_by(self.chunk) {
            let n = self.chunk.min(rows - start);
            let normed = self.normed.slice(start * D..(start + n) * D);
            let mut u = self.u.slice_mut(start * 2 * F..(start + n) * 2 * F);
            matmul(
                &self.blas,
                (&normed, false),
                (&self.w1.as_view(), false),
                &mut u,
                (n, D, 2 * F),
                false,
            )?;
        }
        activation::gated_forward(
            &self.gpu,
            GatedForward {
                activation: Activation::Silu,
                input: GatedInput::Packed(Rows::new(self.u.as_view(), rows, 2 * F)?),
                h: Rows::new(self.h.as_view_mut(), rows, F)?,
            },
        )?;
        Ok(())
    }

    /// This worker's share of the loss `Σ (h − t)² / (ROWS · F)`; uploads its gradient into `h`.
    fn loss_and_dh(&mut self) -> Result<f64, Error> {
        let h = self.stream.clone_dtoh(&self.h)?;
        let scale = 1.0 / (ROWS * F) as f64;
        let mut loss = 0.0f64;
        let dh: Vec<f32> = h
            .iter()
            .zip(&self.target)
            .map(|(&h, &t)| {
                let e = (h - t) as f64;
                loss += e * e * scale;
                (2.0 * e * scale) as f32
            })
            .collect();
        self.stream.memcpy_htod(&dh, &mut self.h)?;
        Ok(loss)
    }

    /// dγ (through `reduce_gamma`) and this worker's dW1, from dh in `h`.
    fn backward(
        &mut self,
        reduce_gamma: impl FnOnce(&Gpu<'a>, NormBackward<'_, Gpu<'a>, f32>) -> normkern::Result<()>,
    ) -> Result<(), Error> {
        let rows = self.rows;
        activation::gated_backward(
            &self.gpu,
            GatedBackward {
                activation: Activation::Silu,
                dh: Rows::new(self.h.as_view(), rows, F)?,
                input: GatedInput::Packed(Rows::new(self.u.as_view(), rows, 2 * F)?),
                grad: GatedGrad::Packed(Rows::new(self.du.as_view_mut(), rows, 2 * F)?),
            },
        )?;
        for (i, start) in (0..rows).step_by(self.chunk).enumerate() {
            let n = self.chunk.min(rows - start);
            let normed = self.normed.slice(start * D..(start + n) * D);
            let du = self.du.slice(start * 2 * F..(start + n) * 2 * F);
            // dW1 += normedᵀ · du; dnormed = du · W1ᵀ.
            let mut dw1 = self.dw1.as_view_mut();
            matmul(
                &self.blas,
                (&normed, true),
                (&du, false),
                &mut dw1,
                (D, n, 2 * F),
                i > 0,
            )?;
            let mut dnormed = self.dnormed.slice_mut(start * D..(start + n) * D);
            matmul(
                &self.blas,
                (&du, false),
                (&self.w1.as_view(), true),
                &mut dnormed,
                (n, 2 * F, D),
                false,
            )?;
        }
        let args = NormBackward::new(
            Rows::new(self.dnormed.as_view(), rows, D)?,
            Rows::new(self.x.as_view(), rows, D)?,
            self.gamma.as_view(),
            Rows::new(self.dx.as_view_mut(), rows, D)?,
            self.dgamma.as_view_mut(),
            self.workspace.as_view_mut(),
        )
        .eps(EPS)
        .rstd(self.rstd.as_view());
        reduce_gamma(&self.gpu, args)?;
        Ok(())
    }

    /// `STEPS` steps of SGD from the initial parameters; `backward` leaves this worker's dγ and
    /// dW1 (summed over the ranks, for a rank) in its buffers.
    fn train(
        mut self,
        mut backward: impl FnMut(&mut Self) -> Result<(), Error>,
    ) -> Result<Run, Error> {
        let mut p = Params::initial();
        let (mut losses, mut first_dgamma) = (Vec::new(), Vec::new());
        let start = Instant::now();
        for step in 0..STEPS {
            self.forward()?;
            losses.push(self.loss_and_dh()?);
            backward(&mut self)?;
            let grads = self.gradients()?;
            if step == 0 {
                first_dgamma = grads.0.clone();
            }
            sgd(&mut p, &grads);
            self.load(&p)?;
        }
        let ms_per_step = start.elapsed().as_secs_f64() * 1e3 / STEPS as f64;
        Ok(Run {
            losses,
            first_dgamma,
            ms_per_step,
        })
    }

    /// The gradients on the host: (dγ, dW1).
    fn gradients(&self) -> Result<(Vec<f32>, Vec<f32>), Error> {
        Ok((
            self.stream.clone_dtoh(&self.dgamma)?,
            self.stream.clone_dtoh(&self.dw1)?,
        ))
    }
}

fn sgd(p: &mut Params, (dgamma, dw1): &(Vec<f32>, Vec<f32>)) {
    for (w, g) in p.gamma.iter_mut().zip(dgamma) {
        *w -= LR * g;
    }
    for (w, g) in p.w1.iter_mut().zip(dw1) {
        *w -= LR * g;
    }
}

/// What a run records: the loss of each step, the first step's dγ, and ms per step.
struct Run {
    losses: Vec<f64>,
    first_dgamma: Vec<f32>,
    ms_per_step: f64,
}

/// The whole batch on GPU 0.
fn one_gpu(chunk: usize) -> Result<Run, Error> {
    let ctx = Context::new(0)?;
    let stream = ctx.cuda().new_stream()?;
    let w = Worker::new(
        ctx.on(&stream)?,
        &stream,
        0..ROWS,
        chunk,
        rms_norm::workspace_len(ROWS, D)?,
    )?;
    w.train(|w| w.backward(rms_norm::backward))
}

/// Rank `rank` of `world`: its rows of the batch, dγ in exact mode, dW1 all-reduced.
fn rank(
    rank: usize,
    world: usize,
    id: distributed::Id,
    split: &BatchSplit,
    chunk: usize,
) -> Result<Run, Error> {
    let ctx = Context::new(rank)?;
    let stream = ctx.cuda().new_stream()?;
    let comm = Communicator::from_rank(&ctx, rank, world, &id)?;
    let dp = DataParallel {
        comm: &comm,
        split,
        mode: Mode::Exact,
    };
    let workspace = split.rms_norm_workspace_len(rank, Mode::Exact)?;
    let w = Worker::new(
        ctx.on(&stream)?,
        &stream,
        split.rank_rows(rank)?,
        chunk,
        workspace,
    )?;
    w.train(|w| {
        w.backward(|gpu, args| distributed::rms_norm_backward(gpu, dp, args))?;
        comm.all_reduce_sum(&w.gpu, &mut w.dw1.as_view_mut())?;
        Ok(())
    })
}

fn main() -> Result<(), Error> {
    let world = CudaContext::device_count()? as usize;
    let split = BatchSplit::even(ROWS, D, world)?;
    // Every rank's rows in one micro-batch; one GPU takes the batch in as many.
    let mut chunk = 1;
    for r in 0..world {
        chunk = chunk.max(split.rank_rows(r)?.len());
    }
    println!(
        "model: RMSNorm({D}) → [{D} × {}] matmul → SwiGLU({F}); batch {ROWS} rows; {world} GPUs; SGD lr {LR}",
        2 * F
    );
    let single = one_gpu(chunk)?;
    let id = Communicator::unique_id()?;
    let ranks: Vec<Run> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let split = &split;
                scope.spawn(move || rank(r, world, id, split, chunk))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect::<Result<_, _>>()
    })?;

    println!("step | loss, 1 GPU | loss, {world} GPUs | relative difference");
    let mut worst = 0f64;
    for step in 0..STEPS {
        let one = single.losses[step];
        let many: f64 = ranks.iter().map(|r| r.losses[step]).sum();
        let diff = (many - one).abs() / one;
        worst = worst.max(diff);
        println!("{step:4} | {one:.6e} | {many:.6e} | {diff:.1e}");
    }
    let bitwise = ranks.iter().all(|r| {
        r.first_dgamma.len() == D
            && r.first_dgamma
                .iter()
                .zip(&single.first_dgamma)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    });
    println!(
        "time per step: 1 GPU {:.1} ms, {world} GPUs {:.1} ms (host loss and update included)",
        single.ms_per_step,
        ranks.iter().map(|r| r.ms_per_step).fold(0.0, f64::max)
    );
    println!("step 1 dγ on every rank bitwise equal to 1 GPU's: {bitwise}");
    println!("loss curves: max relative difference {worst:.2e}");
    let first = single.losses[0];
    let last = single.losses[STEPS - 1];
    println!("loss {first:.4e} → {last:.4e}");
    let trained = last < 0.5 * first; // false for a NaN loss too
    if !bitwise || worst > 1e-4 || !trained {
        return Err("the data-parallel run does not match one GPU (or did not train)".into());
    }
    Ok(())
}
