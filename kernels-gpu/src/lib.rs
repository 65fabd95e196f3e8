//! normkern's kernels: fused normalization and activation kernels written as `no_std` Rust and
//! compiled to PTX by `cargo xtask build-ptx`; on the host the same bodies run in the CPU emulator
//! ([`arch::emu`]).
//!
//! Layout: [`arch`] holds every intrinsic; [`reduce`] the warp/block/cluster sums; [`element`]
//! storage dtypes and 16-byte access; one module per op family ([`norm`], [`activation`],
//! [`column_sum`]) with its launch parameters, bodies and its table of compiled kernels
//! ([`kernel`]), from which both the PTX entry points and the host's list come.
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
pub mod column_sum;
pub mod element;
pub mod kernel;
pub mod norm;
pub mod reduce;

/// Every kernel normkern compiles, whatever its family: what the host loads.
#[cfg(not(target_arch = "nvptx64"))]
pub fn kernels() -> impl Iterator<Item = kernel::Entry> {
    (norm::FORWARD.iter().map(|k| k.entry()))
        .chain(norm::BACKWARD.iter().map(|k| k.entry()))
        .chain(column_sum::KERNELS.iter().map(|k| k.entry()))
        .chain(activation::KERNELS.iter().map(|k| k.entry()))
}
