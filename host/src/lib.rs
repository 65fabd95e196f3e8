//! # normkern
//!
//! Fused normalization and activation kernels for NVIDIA GPUs, written in Rust: the kernels are
//! `no_std` Rust compiled to PTX (crate `normkern-gpu`), embedded here and launched through typed,
//! validated calls on the caller's [`cudarc`] stream.
//!
//! Every op takes an executor and one argument struct: [`Gpu`] (a [`Context`] on a stream, with
//! cudarc views as buffers) or [`Emulator`] (the same kernels on the CPU, over host slices).
//!
//! ```no_run
//! use half::bf16;
//! use normkern::{Context, NormForward, Rows, rms_norm};
//!
//! # fn main() -> normkern::Result<()> {
//! let ctx = Context::new(0)?;
//! let stream = ctx.cuda().new_stream().unwrap();
//! let gpu = ctx.on(&stream)?;
//! let (rows, d) = (4096, 4096);
//! let x = stream.clone_htod(&vec![bf16::from_f32(0.5); rows * d]).unwrap();
//! let weight = stream.clone_htod(&vec![bf16::ONE; d]).unwrap();
//! let mut y = stream.alloc_zeros::<bf16>(rows * d).unwrap();
//! let mut rstd = stream.alloc_zeros::<f32>(rows).unwrap();
//! let x = Rows::new(x.as_view(), rows, d)?;
//! let y = Rows::new(y.as_view_mut(), rows, d)?;
//! rms_norm::forward(&gpu, NormForward::new(x, weight.as_view(), y).eps(1e-6).rstd(rstd.as_view_mut()))?;
//! # Ok(()) }
//! ```
//!
//! Every call validates shapes, lengths, dtypes, eps and contexts first and returns [`Error`]
//! without touching any output when something is wrong. Calls enqueue work and return: no device
//! allocation, no synchronization.

#![warn(missing_docs)]
// Sizes come from users: every computation on them is checked, saturating or wrapping on purpose.
#![warn(clippy::arithmetic_side_effects)]

pub mod activation;
mod context;
pub mod distributed;
mod emulator;
mod error;
mod executor;
pub mod layer_norm;
mod norm;
mod plan;
pub mod rms_norm;
mod tensor;

pub use context::{Context, Gpu, KernelImage};
pub use emulator::Emulator;
pub use error::{Error, Result};
pub use executor::Executor;
pub use norm::{DEFAULT_EPS, NormBackward, NormForward, ResidualAdd};
pub use normkern_gpu::column_sum::group_layout;
pub use plan::ParamGradients;
pub use tensor::{Buffer, Dtype, Rows, RowsMut, RowsRef};

pub use cudarc;
pub use half;
