//! # normkern
//!
//! Fused normalization kernels for NVIDIA GPUs, written in Rust: the kernels are `no_std` Rust
//! compiled to PTX (crate `normkern-gpu`), embedded here and launched through typed, validated
//! wrappers on the caller's [`cudarc`] stream.
//!
//! ```no_run
//! use half::bf16;
//! use normkern::{rms_norm, Context, NormConfig, Rows};
//!
//! # fn main() -> normkern::Result<()> {
//! let ctx = Context::new(0)?;
//! let stream = ctx.cuda().default_stream();
//! let (rows, d) = (4096, 4096);
//! let x = stream.clone_htod(&vec![bf16::from_f32(0.5); rows * d]).unwrap();
//! let gamma = stream.clone_htod(&vec![bf16::ONE; d]).unwrap();
//! let mut y = stream.alloc_zeros::<bf16>(rows * d).unwrap();
//! let mut rstd = stream.alloc_zeros::<f32>(rows).unwrap();
//! rms_norm::forward(
//!     &ctx,
//!     &stream,
//!     &NormConfig::new(1e-6),
//!     &Rows::new(x.as_view(), rows, d)?,
//!     &gamma.as_view(),
//!     &mut Rows::new(y.as_view_mut(), rows, d)?,
//!     Some(&mut rstd.as_view_mut()),
//! )?;
//! # Ok(()) }
//! ```
//!
//! Every call validates shapes, lengths, eps and contexts first and returns [`Error`] without
//! touching any output when something is wrong. Calls enqueue work and return: no device allocation, no
//! synchronization, so they can be captured in CUDA graphs. [`Emulator`] runs the same kernels on
//! the CPU over host slices.

pub mod activation;
mod context;
mod emulator;
mod error;
mod launch;
pub mod layer_norm;
mod norm;
pub mod rms_norm;
mod tensor;

pub use context::Context;
pub use emulator::Emulator;
pub use error::{Error, Result};
pub use launch::group_layout;
pub use norm::NormConfig;
pub use tensor::{Buffer, Dtype, Rows, RowsMut, RowsRef};

pub use cudarc;
pub use half;
