//! Where an op runs: the GPU ([`crate::Gpu`], a [`crate::Context`] on one stream) or the CPU
//! emulator ([`crate::Emulator`]). Every public op is written once, generic over [`Executor`]: it
//! validates its arguments, takes the operands' addresses, asks its launch plan for the launches
//! and hands each to the executor.

use normkern_gpu::kernel::{Entry, Kernel};

use crate::error::Result;
use crate::tensor::{Buffer, Dtype};

/// Runs normkern's ops: [`crate::Gpu`] or [`crate::Emulator`]. Buffers are the executor's own:
/// cudarc views on the GPU, host slices in the emulator. Sealed: normkern provides both.
pub trait Executor: private::Sealed {
    /// A read-only buffer of `T`: `CudaView<'a, T>` on the GPU, `&'a [T]` in the emulator.
    type In<'a, T: Dtype>: Buffer<Elem = T>;
    /// A writable buffer of `T`: `CudaViewMut<'a, T>` on the GPU, `&'a mut [T]` in the emulator.
    type Out<'a, T: Dtype>: Buffer<Elem = T>;

    /// Keeps an operand ordered on the stream until the op's launches are enqueued.
    #[doc(hidden)]
    type Guard<'g>
    where
        Self: 'g;

    /// Checks, before any operand is touched, that the op can be enqueued at all.
    #[doc(hidden)]
    fn prepare(&self) -> Result<()>;

    /// The address of an input (checking that it belongs to this executor's device).
    #[doc(hidden)]
    fn input<'g, T: Dtype>(
        &'g self,
        what: &'static str,
        buffer: &'g Self::In<'_, T>,
    ) -> Result<(u64, Self::Guard<'g>)>;

    /// The address of an output (checking that it belongs to this executor's device).
    #[doc(hidden)]
    fn output<'g, T: Dtype>(
        &'g self,
        what: &'static str,
        buffer: &'g mut Self::Out<'_, T>,
    ) -> Result<(u64, Self::Guard<'g>)>;

    /// What launch plans need to know of the device.
    #[doc(hidden)]
    fn device(&self) -> &dyn private::Device;

    /// Enqueues (GPU) or runs (emulator) one launch.
    #[doc(hidden)]
    fn launch<K: Sync, P: Copy + Sync>(&self, launch: &private::Launch<K, P>) -> Result<()>;

    /// Zeroes `words` f32 at `address` (of an operand this call validated), in stream order.
    #[doc(hidden)]
    fn zero(&self, address: u64, words: usize) -> Result<()>;
}

/// The address of an optional input (0 when absent) and its guard.
pub(crate) fn optional_input<'g, E: Executor, T: Dtype>(
    exec: &'g E,
    what: &'static str,
    buffer: Option<&'g E::In<'_, T>>,
) -> Result<(u64, Option<E::Guard<'g>>)> {
    Ok(match buffer {
        Some(b) => {
            let (address, guard) = exec.input(what, b)?;
            (address, Some(guard))
        }
        None => (0, None),
    })
}

/// The address of an optional output (0 when absent) and its guard.
pub(crate) fn optional_output<'g, E: Executor, T: Dtype>(
    exec: &'g E,
    what: &'static str,
    buffer: Option<&'g mut E::Out<'_, T>>,
) -> Result<(u64, Option<E::Guard<'g>>)> {
    Ok(match buffer {
        Some(b) => {
            let (address, guard) = exec.output(what, b)?;
            (address, Some(guard))
        }
        None => (0, None),
    })
}

pub(crate) use private::{Device, Launch};

/// Types in [`Executor`]'s hidden methods: public to the trait, not to users.
pub(crate) mod private {
    use super::*;

    pub trait Sealed {}

    /// One kernel launch: which compiled kernel, its grid, and its parameters. Both executors
    /// consume it unchanged.
    #[derive(Clone, Copy, Debug)]
    pub struct Launch<K: 'static, P: 'static> {
        pub kernel: &'static Kernel<K, P>,
        /// Blocks in the grid: a multiple of `cluster`.
        pub grid: usize,
        pub block: usize,
        /// Blocks per thread-block cluster (sm_90); 1 launches without clusters.
        pub cluster: usize,
        pub shared_bytes: usize,
        /// All blocks resident at once (`CU_LAUNCH_ATTRIBUTE_COOPERATIVE`): they may wait for
        /// each other at a grid barrier.
        pub cooperative: bool,
        /// May start while the previous launch on the stream runs its last blocks
        /// (programmatic dependent launch, sm_90 builds): the kernel waits for that launch to
        /// complete before it reads what the launch wrote, so the two run in stream order.
        pub overlaps_previous: bool,
        pub params: P,
    }

    /// The device limits a launch plan reads. Pure data but for the occupancy queries, which the
    /// GPU answers once per distinct question.
    pub trait Device {
        /// Streaming multiprocessors (the emulator: the blocks it pretends are resident).
        fn sm_count(&self) -> usize;
        /// The most blocks a cluster may have: 8 on sm_90 and newer, 1 (no clusters) before.
        fn max_cluster(&self) -> usize;
        /// Whether a launch may overlap the one before it ([`Launch::overlaps_previous`]): the
        /// kernels of sm_90 builds wait for it themselves; sm_80's do not.
        fn overlaps_launches(&self) -> bool {
            false
        }
        /// The dynamic shared memory (bytes) one block may opt into.
        fn shared_opt_in(&self) -> usize;
        /// An upper bound on persistent grids set by the user (tests use it to prove grid
        /// invariance).
        fn grid_limit(&self) -> Option<usize>;
        /// The most threads one block of this kernel may have (the GPU's limit depends on its
        /// registers).
        fn max_threads(&self, kernel: Entry) -> Result<usize>;
        /// Blocks of this kernel that run at once on the whole device.
        fn resident_blocks(
            &self,
            kernel: Entry,
            block: usize,
            shared_bytes: usize,
        ) -> Result<usize>;
        /// Where this device keeps the row tiles it chose (none: choose every time).
        fn tile_memo(&self) -> Option<&crate::plan::TileMemo> {
            None
        }
        /// Clusters of `cluster` blocks of this kernel that run at once on the whole device.
        fn resident_clusters(
            &self,
            kernel: Entry,
            block: usize,
            cluster: usize,
            shared_bytes: usize,
        ) -> Result<usize>;
    }
}
