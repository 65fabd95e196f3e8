//! RMSNorm forward and backward on cudarc buffers, the smallest complete program: open the
//! device, make buffers, call the forward and the backward, read the results back and check a row.
//! It prints how long the cold start took (context with the kernels loaded, then the first
//! forward + backward), which is what every fresh process pays.
//!
//! ```sh
//! cargo run --release -p normkern --example quickstart
//! ```

use std::time::Instant;

use half::bf16;
use normkern::{Context, NormBackward, NormForward, Rows, rms_norm};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let ctx = match Context::new(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("no GPU here ({e}); normkern's `Emulator` runs the same calls on the CPU");
            return Ok(());
        }
    };
    let context_ms = start.elapsed().as_secs_f64() * 1e3;

    let stream = ctx.cuda().new_stream()?;
    let gpu = ctx.on(&stream)?;
    let (rows, d, eps) = (4096, 4096, 1e-6f32);
    // Inputs with some spread (never test on zeros or constants).
    let pattern = |i: usize, scale: f32| ((i * 7919 % 2003) as f32 / 1001.0 - 1.0) * scale;
    let x_host: Vec<bf16> = (0..rows * d)
        .map(|i| bf16::from_f32(pattern(i, 2.0)))
        .collect();
    let dy_host: Vec<bf16> = (0..rows * d)
        .map(|i| bf16::from_f32(pattern(i + 17, 1.0)))
        .collect();
    let weight_host: Vec<bf16> = (0..d)
        .map(|j| bf16::from_f32(1.0 + pattern(j, 0.1)))
        .collect();

    let x = stream.clone_htod(&x_host)?;
    let dy = stream.clone_htod(&dy_host)?;
    let weight = stream.clone_htod(&weight_host)?;
    let mut y = stream.alloc_zeros::<bf16>(rows * d)?;
    let mut rstd = stream.alloc_zeros::<f32>(rows)?;
    let mut dx = stream.alloc_zeros::<bf16>(rows * d)?;
    let mut dweight = stream.alloc_zeros::<bf16>(d)?;
    // The backward's fp32 workspace for the deterministic dγ partials: allocate it once.
    let mut workspace = stream.alloc_zeros::<f32>(rms_norm::workspace_len(rows, d)?)?;

    let first_call = Instant::now();
    rms_norm::forward(
        &gpu,
        NormForward::new(
            Rows::new(x.as_view(), rows, d)?,
            weight.as_view(),
            Rows::new(y.as_view_mut(), rows, d)?,
        )
        .eps(eps)
        .rstd(rstd.as_view_mut()),
    )?;
    rms_norm::backward(
        &gpu,
        NormBackward::new(
            Rows::new(dy.as_view(), rows, d)?,
            Rows::new(x.as_view(), rows, d)?,
            weight.as_view(),
            Rows::new(dx.as_view_mut(), rows, d)?,
            dweight.as_view_mut(),
            workspace.as_view_mut(),
        )
        .eps(eps)
        .rstd(rstd.as_view()),
    )?;
    stream.synchronize()?;
    let first_ms = first_call.elapsed().as_secs_f64() * 1e3;

    // Row 0 of y against a CPU computation in f64.
    let y_host = stream.clone_dtoh(&y)?;
    let row: Vec<f64> = x_host[..d].iter().map(|v| v.to_f64()).collect();
    let rstd0 = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps as f64).sqrt();
    let max_error = (0..d)
        .map(|j| (y_host[j].to_f64() - row[j] * rstd0 * weight_host[j].to_f64()).abs())
        .fold(0.0f64, f64::max);
    let dweight_host = stream.clone_dtoh(&dweight)?;

    println!(
        "context: {context_ms:.1} ms (kernels for sm_{} from {:?}); first forward + backward \
         ({rows}×{d} bf16): {first_ms:.1} ms; since start: {:.1} ms",
        ctx.ptx_arch(),
        ctx.kernel_image(),
        start.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "row 0 of y: largest difference from f64 {max_error:.1e}; dγ[0..4] = {:?}",
        &dweight_host[..4]
    );
    // |y| < 2 here and bf16 keeps 8 bits: a right answer differs by under 2⁻⁷.
    if max_error > 2f64.powi(-7) {
        return Err(format!("row 0 of y is off by {max_error}").into());
    }
    Ok(())
}
