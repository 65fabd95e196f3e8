//! normkern's fused norms and gated activations as [candle](https://crates.io/crates/candle-core)
//! modules whose backward passes are registered with candle's autograd: gradients flow through
//! [`RmsNorm`], [`LayerNorm`] and [`SwiGlu`]/[`GeGlu`] to x, γ and β (candle-nn's own fused
//! `rms_norm`/`layer_norm` stop them).
//!
//! - CUDA tensors (the `cuda` feature): normkern's kernels run on candle's own stream over
//!   candle's buffers, with no copies; the backward runs normkern's backward (statistics
//!   recomputed from x, dγ/dβ deterministic: the same bits on every run).
//! - CPU tensors: the same kernels in normkern's CPU emulator (for tests and small models; it runs
//!   every GPU thread on one core).
//! - f32, f16 and bf16; γ and β in x's dtype. A non-contiguous input is copied to a contiguous one
//!   first (the result is right either way).
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use normkern_candle::RmsNorm;
//!
//! let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 64), &Device::Cpu)?)?;
//! let norm = RmsNorm::new(Tensor::ones(64, DType::F32, &Device::Cpu)?, 1e-6);
//! let loss = norm.forward(&x)?.sqr()?.sum_all()?;
//! let grads = loss.backward()?;
//! assert_eq!(grads.get(&x).unwrap().dims(), &[4, 64]);
//! # Ok::<(), candle_core::Error>(())
//! ```

mod activation;
mod exec;
mod norm;

pub use activation::{GeGlu, SwiGlu};
pub use norm::{LayerNorm, RmsNorm};
