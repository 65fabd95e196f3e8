//! Every GPU intrinsic and every line of inline assembly in normkern lives here.
//!
//! Kernel bodies call only these functions, never `core::arch::nvptx` or `asm!` directly. On
//! `nvptx64` they are single PTX instructions; on any other target the [`emu`] twin implements
//! them for the CPU emulator (threads of a cluster are coroutines taking turns at barriers, shuffles
//! are warp-wide exchanges), so the very same kernel bodies run in `cargo test` without a GPU.

#[cfg(target_arch = "nvptx64")]
mod nvptx;
#[cfg(target_arch = "nvptx64")]
pub use nvptx::*;

#[cfg(not(target_arch = "nvptx64"))]
pub mod emu;
#[cfg(not(target_arch = "nvptx64"))]
pub use emu::{
    SharedF32, atomic_add_f32, bf16_to_f32, block_dim, block_idx, block_lock, block_unlock,
    cluster_count, cluster_idx, cluster_rank, cluster_size, dynamic_shared_words, exp2, exp2_ftz,
    f16_to_f32, f32_to_bf16, f32_to_f16, f32x2_to_bf16x2, f32x2_to_f16x2, fence_mbarrier_init, fma,
    grid_barrier, grid_dim, launch_dependents, load16, load16_kept, opaque, rcp_approx, rsqrt,
    shared_f32, shfl_idx, shfl_xor, shfl_xor_within, store16, store16_streaming, sync_cluster,
    sync_threads, thread_idx, wait_async_copies, wait_for_previous_launch,
};

/// Lanes in a warp; every block size normkern launches is a multiple of it.
pub const WARP: usize = 32;

/// Whether this build targets sm_90 (the emulator stands in for sm_90): kernels compiled for
/// sm_80 too ask it where the two differ. [`SharedF32::bulk_copy_from`] is the copy engine's
/// only on sm_90; on sm_80 it is a plain copy by one thread.
pub const SM_90: bool = cfg!(any(target_feature = "sm_90", not(target_arch = "nvptx64")));

/// `v` (a row index, a thread's index), which sm_80 builds recompute where it is used in a loop
/// rather than carry across it: sm_80's ptxas spills what LLVM derives from such a value and
/// holds across a loop (a group's per-operand row steps, a lane's "reads a warp's partial"
/// flag), where sm_90's keeps it in registers. Through [`opaque`] each use computes it afresh (a
/// multiply-add per operand, a compare); sm_90 builds and the emulator compile exactly what they
/// did without it.
#[inline(always)]
pub fn recomputed_on_sm80(v: usize) -> usize {
    if SM_90 { v } else { opaque(v) }
}

/// Most blocks in a cluster: sm_90's non-portable limit (the portable one is 8), which the host
/// opts each kernel into.
pub const MAX_CLUSTER: usize = 16;
