//! What a fresh process pays before its first result, in three parts: the driver's own start
//! (cuInit and the primary context), loading normkern's kernels (the cubin, or the PTX the driver
//! compiles), and the first RMSNorm forward + backward (4096×4096 bf16, to completion).
//!
//! `coldstart [cubin|ptx]` (default: what `Context::from_cuda` picks). Run it with
//! `CUDA_CACHE_DISABLE=1` to keep the driver's JIT cache out of it, as on a fresh machine.

use std::time::Instant;

use half::bf16;
use normkern::cudarc::driver::CudaContext;
use normkern::{Context, KernelImage, NormBackward, NormForward, Rows, rms_norm};

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let image = match std::env::args().nth(1).as_deref() {
        None => None,
        Some("cubin") => Some(KernelImage::Cubin),
        Some("ptx") => Some(KernelImage::Ptx),
        Some(other) => return Err(format!("usage: coldstart [cubin|ptx], not {other}").into()),
    };
    // SAFETY: only asks whether the driver library can be loaded.
    if !unsafe { normkern::cudarc::driver::sys::is_culib_present() } {
        println!("coldstart: no CUDA driver here");
        return Ok(());
    }
    let start = Instant::now();
    let cuda = match CudaContext::new(0) {
        Ok(cuda) => cuda,
        Err(e) => {
            println!("coldstart: no GPU ({e})");
            return Ok(());
        }
    };
    let driver_ms = ms(start);
    let load = Instant::now();
    let ctx = match image {
        None => Context::from_cuda(cuda)?,
        Some(image) => Context::from_cuda_with_image(cuda, image)?,
    };
    let load_ms = ms(load);

    let stream = ctx.cuda().new_stream()?;
    let gpu = ctx.on(&stream)?;
    let (rows, d) = (4096, 4096);
    let data: Vec<bf16> = (0..rows * d)
        .map(|i| bf16::from_f32((i % 251) as f32 / 125.0 - 1.0))
        .collect();
    let x = stream.clone_htod(&data)?;
    let dy = stream.clone_htod(&data)?;
    let weight = stream.clone_htod(&data[..d])?;
    let mut y = stream.alloc_zeros::<bf16>(rows * d)?;
    let mut dx = stream.alloc_zeros::<bf16>(rows * d)?;
    let mut dweight = stream.alloc_zeros::<bf16>(d)?;
    let mut rstd = stream.alloc_zeros::<f32>(rows)?;
    let mut ws = stream.alloc_zeros::<f32>(rms_norm::workspace_len(rows, d)?)?;
    stream.synchronize()?;
    let first = Instant::now();
    rms_norm::forward(
        &gpu,
        NormForward::new(
            Rows::new(x.as_view(), rows, d)?,
            weight.as_view(),
            Rows::new(y.as_view_mut(), rows, d)?,
        )
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
            ws.as_view_mut(),
        )
        .rstd(rstd.as_view()),
    )?;
    stream.synchronize()?;
    let first_ms = ms(first);
    println!(
        "coldstart {:?}: driver start (cuInit, primary context) {driver_ms:.1} ms, normkern's \
         kernels loaded {load_ms:.1} ms, first forward + backward {first_ms:.1} ms",
        ctx.kernel_image()
    );
    Ok(())
}
