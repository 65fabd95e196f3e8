//! normkern on the caller's cudarc stream, as a candle application would hold one.

use std::sync::Arc;

use normkern::cudarc::driver::CudaStream;
use normkern::{Context, NormForward, Rows, rms_norm};

/// RMSNorm of `rows × d` f32 rows of `x` into `y` on `stream`.
pub fn rms_norm_on(
    ctx: &Context,
    stream: &Arc<CudaStream>,
    (rows, d): (usize, usize),
    x: &cudarc::driver::CudaSlice<f32>,
    weight: &cudarc::driver::CudaSlice<f32>,
    y: &mut cudarc::driver::CudaSlice<f32>,
) -> normkern::Result<()> {
    let gpu = ctx.on(stream)?;
    let x = Rows::new(x.as_view(), rows, d)?;
    let y = Rows::new(y.as_view_mut(), rows, d)?;
    rms_norm::forward(&gpu, NormForward::new(x, weight.as_view(), y))
}
