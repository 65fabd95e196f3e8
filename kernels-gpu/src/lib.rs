//! normkern's kernels: fused normalization kernels written as `no_std` Rust and compiled to PTX by
//! `cargo xtask build-ptx`; on the host the same bodies run in the CPU emulator ([`arch::emu`]).
//!
//! Layout: [`arch`] holds every intrinsic; [`reduce`] the warp/block sums and the fixed-order
//! column sum; one module per op family ([`norm`], [`activation`]) holds its launch parameters and bodies.
//! Element storage and 16-byte access live in [`element`]; [`variant`] names compiled instances.
#![cfg_attr(target_arch = "nvptx64", no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(
        abi_ptx,
        stdarch_nvptx,
        asm_experimental_arch,
        core_intrinsics,
        gpu_intrinsics,
        gpu_launch_sized_workgroup_mem
    )
)]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
// Per-thread register tiles are indexed with loop counters that LLVM unrolls into constants;
// iterator chains over them are no clearer and sometimes leave arrays in local memory.
#![allow(clippy::needless_range_loop)]

pub mod activation;
pub mod arch;
pub mod element;
pub mod norm;
pub mod reduce;
pub mod variant;
