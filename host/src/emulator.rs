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

/// Runs normkern's kernels on the CPU. Methods mirror the GPU functions of each op module.
#[derive(Clone, Copy, Debug, Default)]
pub struct Emulator {
    grid_limit: Option<usize>,
}

impl Emulator {
    pub fn new() -> Self {
        Emulator { grid_limit: None }
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
        Ok(1024)
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
