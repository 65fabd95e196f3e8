//! The README's walk-through as a whole program: RMSNorm forward and backward, the residual forms,
//! LayerNorm. The README's code block is this file's lines from `README: begin` to `README: end`
//! (less the lines that make the buffers); `tests/tests/readme.rs` checks that every line of the
//! block is here, in order, so the README's code compiles.
//!
//! ```sh
//! cargo run --release -p normkern --example tour
//! ```

use normkern::cudarc::driver::CudaSlice;

// Laid out as the README shows it.
#[rustfmt::skip]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    // README: begin
    use half::bf16;
    use normkern::{Context, NormBackward, NormForward, Rows, layer_norm, rms_norm};

    let ctx = Context::new(0)?;                        // loads the kernels for the device's arch
    let stream = ctx.cuda().new_stream()?;             // any cudarc stream of this context
    let gpu = ctx.on(&stream)?;                        // the executor: launches go to `stream`
    let (rows, d) = (16384, 4096);
    // Inputs with some spread (never zeros or constants).
    let values = |n: usize, scale: f32| -> Vec<bf16> {
        let wave = |i: usize| ((i * 7919 % 2003) as f32 / 1001.0 - 1.0) * scale;
        (0..n).map(|i| bf16::from_f32(1.0 + wave(i))).collect()
    };
    let x: CudaSlice<bf16> = stream.clone_htod(&values(rows * d, 2.0))?;
    let dy = stream.clone_htod(&values(rows * d, 1.0))?;
    let weight = stream.clone_htod(&values(d, 0.1))?;
    let bias = stream.clone_htod(&values(d, 0.1))?;
    let residual = stream.clone_htod(&vec![0.25f32; rows * d])?;
    let dh = stream.clone_htod(&vec![0.5f32; rows * d])?;
    let mut y = stream.alloc_zeros::<bf16>(rows * d)?;
    let mut dx = stream.alloc_zeros::<bf16>(rows * d)?;
    let mut h = stream.alloc_zeros::<f32>(rows * d)?;
    let mut dweight = stream.alloc_zeros::<bf16>(d)?;
    let (mut mean, mut rstd) = (stream.alloc_zeros::<f32>(rows)?, stream.alloc_zeros::<f32>(rows)?);
    let x_rows = || Rows::new(x.as_view(), rows, d);   // or Rows::with_stride(view, rows, d, stride)

    // y = x · rstd · weight, rstd saved for the backward.
    rms_norm::forward(&gpu, NormForward::new(x_rows()?, weight.as_view(), Rows::new(y.as_view_mut(), rows, d)?)
        .eps(1e-6)
        .rstd(rstd.as_view_mut()))?;                   // .weight_offset(1.0) for Gemma's 1 + γ

    // dx and dweight; the workspace holds the deterministic dγ partials (allocate it once).
    let mut ws = stream.alloc_zeros::<f32>(rms_norm::workspace_len(rows, d)?)?;
    rms_norm::backward(&gpu, NormBackward::new(Rows::new(dy.as_view(), rows, d)?, x_rows()?, weight.as_view(),
                                               Rows::new(dx.as_view_mut(), rows, d)?, dweight.as_view_mut(),
                                               ws.as_view_mut())
        .eps(1e-6)
        .rstd(rstd.as_view()))?;                       // leave it out to recompute rstd from x

    // Pre-norm block with the residual add fused in (residual stream in bf16 or f32, here f32):
    // h = x + residual is written to `h` and normalized as stored; the backward takes h as its x and
    // adds the gradient arriving on h into dx.
    rms_norm::forward(&gpu, NormForward::new(x_rows()?, weight.as_view(), Rows::new(y.as_view_mut(), rows, d)?)
        .residual(Rows::new(residual.as_view(), rows, d)?, Rows::new(h.as_view_mut(), rows, d)?))?;
    rms_norm::backward(&gpu, NormBackward::new(Rows::new(dy.as_view(), rows, d)?, Rows::new(h.as_view(), rows, d)?,
                                               weight.as_view(), Rows::new(dx.as_view_mut(), rows, d)?,
                                               dweight.as_view_mut(), ws.as_view_mut())
        .dresidual(Rows::new(dh.as_view(), rows, d)?))?;

    // LayerNorm: the same arguments with a bias and its saved mean (the backward: .mean_rstd, .dbias).
    layer_norm::forward(&gpu, NormForward::new(x_rows()?, weight.as_view(), Rows::new(y.as_view_mut(), rows, d)?)
        .bias(bias.as_view()).mean(mean.as_view_mut()).rstd(rstd.as_view_mut()))?;
    // README: end

    stream.synchronize()?;
    let y_host = stream.clone_dtoh(&y)?;
    println!(
        "LayerNorm forward of {rows}×{d} bf16 on sm_{}: y[0..4] = {:?}",
        ctx.ptx_arch(),
        &y_host[..4]
    );
    Ok(())
}
