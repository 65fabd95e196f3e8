//! Trains one small pre-norm transformer-style MLP block twice from the same initial weights: once
//! with normkern-candle's RmsNorm and SwiGlu, once with the same model written in candle's
//! elementary tensor ops. Prints both loss curves side by side and the time per step of each.
//!
//! ```sh
//! cargo run --release -p normkern-candle --example train                 # CPU (emulator)
//! cargo run --release -p normkern-candle --no-default-features --features cuda --example train
//! ```
//! `--bf16` trains in bf16; `--steps N` (default 200).

use std::time::{Duration, Instant};

use candle_core::{D, DType, Device, Result, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use normkern_candle::{RmsNorm, SwiGlu};

/// x → x + W_down · swiglu(W_gate · rms(x), W_up · rms(x)) → rms → W_head.
struct Block {
    norm1: Var,
    gate: Var,
    up: Var,
    down: Var,
    norm2: Var,
    head: Var,
}

impl Block {
    fn new(init: &[Tensor]) -> Result<Block> {
        let v = |i: usize| Var::from_tensor(&init[i].copy()?);
        Ok(Block {
            norm1: v(0)?,
            gate: v(1)?,
            up: v(2)?,
            down: v(3)?,
            norm2: v(4)?,
            head: v(5)?,
        })
    }

    fn vars(&self) -> Vec<Var> {
        [
            &self.norm1,
            &self.gate,
            &self.up,
            &self.down,
            &self.norm2,
            &self.head,
        ]
        .map(|v| v.clone())
        .to_vec()
    }

    fn forward(&self, x: &Tensor, fused: bool) -> Result<Tensor> {
        let eps = 1e-6;
        let rms = |x: &Tensor, w: &Var| -> Result<Tensor> {
            if fused {
                RmsNorm::new(w.as_tensor().clone(), eps).forward(x)
            } else {
                let rstd = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
                x.broadcast_mul(&rstd)?.broadcast_mul(w.as_tensor())
            }
        };
        let h = rms(x, &self.norm1)?;
        let (a, b) = (
            h.matmul(self.gate.as_tensor())?,
            h.matmul(self.up.as_tensor())?,
        );
        let g = if fused {
            SwiGlu.forward(&a, &b)?
        } else {
            // σ(a) = 1 / (1 + e^(−a)), in ops that have gradients on every device.
            let sigmoid = (a.neg()?.exp()? + 1.0)?.recip()?;
            ((&a * sigmoid)? * &b)?
        };
        let x = (x + g.matmul(self.down.as_tensor())?)?;
        rms(&x, &self.norm2)?.matmul(self.head.as_tensor())
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dtype = if args.iter().any(|a| a == "--bf16") {
        DType::BF16
    } else {
        DType::F32
    };
    let steps: usize = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(200);
    #[cfg(feature = "cuda")]
    let device = Device::new_cuda(0)?;
    #[cfg(not(feature = "cuda"))]
    let device = Device::Cpu;
    // CPU runs go through normkern's emulator: keep them small.
    let (batch, d, hidden) = if device.is_cuda() {
        (4096, 1024, 2816)
    } else {
        (64, 128, 256)
    };

    let init = |shape: &[usize], scale: f64| -> Result<Tensor> {
        (Tensor::randn(0f32, 1.0, shape, &device)? * scale)?.to_dtype(dtype)
    };
    let ones = Tensor::ones(d, dtype, &device)?;
    let weights = [
        ones.clone(),
        init(&[d, hidden], (1.0 / d as f64).sqrt())?,
        init(&[d, hidden], (1.0 / d as f64).sqrt())?,
        init(&[hidden, d], (1.0 / hidden as f64).sqrt())?,
        ones,
        init(&[d, d], (1.0 / d as f64).sqrt())?,
    ];
    // The task: a fixed random nonlinear map of x.
    let teacher = init(&[d, d], (1.0 / d as f64).sqrt())?;
    let models = [Block::new(&weights)?, Block::new(&weights)?];
    let params = ParamsAdamW {
        lr: 3e-3,
        ..Default::default()
    };
    let mut optimizers = [
        AdamW::new(models[0].vars(), params.clone())?,
        AdamW::new(models[1].vars(), params)?,
    ];
    let mut time = [Duration::ZERO; 2];
    let mut worst = 0f32;
    println!(
        "{dtype:?} on {device:?}, batch {batch}, d {d}, hidden {hidden}: loss with normkern-candle | with candle's elementary ops"
    );
    for step in 0..steps {
        let x = init(&[batch, d], 1.0)?;
        let target = x.matmul(&teacher)?.tanh()?;
        let mut losses = [0f32; 2];
        for (m, fused) in [(0, true), (1, false)] {
            let start = Instant::now();
            let out = models[m].forward(&x, fused)?;
            let loss = (out - &target)?.sqr()?.to_dtype(DType::F32)?.mean_all()?;
            optimizers[m].backward_step(&loss)?;
            losses[m] = loss.to_scalar::<f32>()?; // waits for the step
            time[m] += start.elapsed();
        }
        worst = worst.max((losses[0] - losses[1]).abs() / losses[1].abs().max(1e-6));
        if step % (steps / 10).max(1) == 0 || step + 1 == steps {
            println!("step {step:>4}: {:.5} | {:.5}", losses[0], losses[1]);
        }
    }
    let per_step = |t: Duration| t.as_secs_f64() * 1e3 / steps as f64;
    println!(
        "time per step: {:.2} ms with normkern-candle | {:.2} ms with elementary ops",
        per_step(time[0]),
        per_step(time[1])
    );
    // Same math, different rounding order: the curves may drift apart by little, not diverge.
    let tolerance = if dtype == DType::F32 { 1e-3 } else { 5e-2 };
    println!(
        "largest relative difference of the two losses: {worst:.1e} (tolerance {tolerance:.0e})"
    );
    if worst > tolerance {
        candle_core::bail!("the loss curves differ by {worst:e}");
    }
    Ok(())
}
