//! RMSNorm and LayerNorm against the f64 reference. Each test case is written once over a
//! [`normkern_tests::backend::Backend`] and run in the CPU emulator (`emulator_…`) and on the GPU
//! (`gpu_…`, skipped with a printed reason when there is none); tests of neither prefix need no
//! executor.

mod case;
mod determinism;
mod kernels;
mod mixed_precision;
mod param_grads;
mod reference;
mod residual;
mod special_values;
mod validation;
