//! The CPU executor: runs the very kernel bodies that are compiled to PTX, block by block, with
//! each block's threads as OS threads (see `normkern_gpu::arch::emu`). Same validation, same launch
//! planning, host slices instead of device buffers. For tests and for machines without a GPU; it
//! is slow (thousands of OS threads per launch), so keep shapes small.

use normkern_gpu::arch::emu;
use normkern_gpu::{activation, norm, reduce};

use crate::error::{Error, Result};
use crate::launch::{Executor, Kernel, Shape};

/// Blocks the emulator pretends are resident at once: a small device, so persistent grids walk
/// several rows or groups per block as they do on a GPU.
const EMULATED_RESIDENT_BLOCKS: usize = 4;

/// Clusters the emulator offers by default: up to 2 blocks, like a small sm_90 device. Wider
/// clusters cost an OS thread per emulated thread of every block at once.
const EMULATED_MAX_CLUSTER: usize = 2;

/// Dynamic shared memory a block may opt into: the H100's and H200's 227 KiB.
const EMULATED_SHARED_OPT_IN: usize = 227 * 1024;

/// Runs normkern's kernels on the CPU. Methods mirror the GPU functions of each op module.
#[derive(Clone, Copy, Debug)]
pub struct Emulator {
    grid_limit: Option<usize>,
    max_cluster: usize,
    block_limit: usize,
}

impl Default for Emulator {
    fn default() -> Self {
        Self::new()
    }
}

impl Emulator {
    pub fn new() -> Self {
        Emulator {
            grid_limit: None,
            max_cluster: EMULATED_MAX_CLUSTER,
            block_limit: 1024,
        }
    }

    /// Lets rows be split over clusters of up to `blocks` blocks (1: no clusters, like a GPU
    /// before sm_90; at most 8). The default is 2.
    pub fn with_clusters(mut self, blocks: usize) -> Result<Self> {
        if !(1..=emu::MAX_CLUSTER).contains(&blocks) {
            return Err(Error::Emulator(format!(
                "clusters of {blocks} blocks: the emulator offers 1 to {}",
                emu::MAX_CLUSTER
            )));
        }
        self.max_cluster = blocks;
        Ok(self)
    }

    /// Caps every block at `threads` threads (a multiple of 32, at most 1024), as a kernel's
    /// registers cap it on a GPU: narrow rows then take the tiles that wide rows take there.
    pub fn with_block_limit(mut self, threads: usize) -> Result<Self> {
        if threads == 0 || threads > 1024 || threads % 32 != 0 {
            return Err(Error::Emulator(format!(
                "a block limit of {threads} threads: a multiple of 32 up to 1024 is required"
            )));
        }
        self.block_limit = threads;
        Ok(self)
    }

    /// Caps persistent grids at `blocks` blocks, like [`crate::Context::with_grid_limit`].
    pub fn with_grid_limit(mut self, blocks: usize) -> Result<Self> {
        if blocks == 0 {
            return Err(Error::ZeroGrid);
        }
        self.grid_limit = Some(blocks);
        Ok(self)
    }
}

impl Executor for Emulator {
    fn max_threads(&self, _kernel: &Kernel) -> Result<usize> {
        Ok(self.block_limit)
    }

    fn max_cluster(&self) -> usize {
        self.max_cluster
    }

    fn shared_opt_in(&self) -> usize {
        EMULATED_SHARED_OPT_IN
    }

    fn sm_count(&self) -> usize {
        EMULATED_RESIDENT_BLOCKS
    }

    fn resident_blocks(
        &self,
        _kernel: &Kernel,
        _block: usize,
        _shared_bytes: usize,
    ) -> Result<usize> {
        Ok(EMULATED_RESIDENT_BLOCKS)
    }

    fn grid_limit(&self) -> Option<usize> {
        self.grid_limit
    }

    fn launch(&self, kernel: &Kernel, shape: Shape) -> Result<()> {
        let name = kernel.entry_name();
        let run = |body: &(dyn Fn() + Sync)| {
            emu::launch(
                name.as_str(),
                shape.grid,
                shape.block,
                shape.cluster,
                shape.shared_bytes,
                body,
            )
            .map_err(|e| Error::Emulator(e.to_string()))
        };
        // SAFETY (each arm): the op that built the parameters validated every buffer against them.
        match *kernel {
            Kernel::NormForward(n, v, p) => {
                let body = norm::forward_body(n, p.residual_family(), v);
                run(&|| unsafe { body(&p) })
            }
            Kernel::NormBackward(n, v, p) => {
                let body = norm::backward_body(n, p.residual_family(), v);
                run(&|| unsafe { body(&p) })
            }
            Kernel::ColumnSum(dt, p) => {
                let body = reduce::column_sum_body(dt);
                run(&|| unsafe { body(&p) })
            }
            Kernel::Activation(family, v, p) => {
                let body = activation::body(family, v);
                run(&|| unsafe { body(&p) })
            }
        }
    }
}
