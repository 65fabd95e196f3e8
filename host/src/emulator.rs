//! The CPU executor: runs the very kernel bodies that are compiled to PTX, cluster by cluster,
//! with each GPU thread as a coroutine on the calling OS thread (see `normkern_gpu::arch::emu`).
//! Same validation, same launch plans, host slices instead of device buffers. For tests and for
//! machines without a GPU: one core runs every emulated thread, so keep shapes modest.

use normkern_gpu::arch::emu;
use normkern_gpu::kernel::Entry;

use crate::error::{Error, Result};
use crate::executor::private::Sealed;
use crate::executor::{Device, Executor, Launch};
use crate::tensor::Dtype;

/// Blocks the emulator pretends are resident at once by default: a small device, so persistent
/// grids walk several rows or groups per block as they do on a GPU.
const EMULATED_RESIDENT_BLOCKS: usize = 4;

/// Clusters the emulator offers by default: up to 2 blocks, like a small sm_90 device. Wider
/// clusters cost a coroutine stack per emulated thread of every block at once.
const EMULATED_MAX_CLUSTER: usize = 2;

/// Dynamic shared memory a block may opt into: the H100's and H200's 227 KiB.
const EMULATED_SHARED_OPT_IN: usize = 227 * 1024;

/// Runs normkern's ops on the CPU, over host slices: pass `&Emulator` where a [`crate::Gpu`]
/// would go.
///
/// ```
/// use normkern::{Emulator, NormForward, Rows, rms_norm};
///
/// let (rows, d) = (4, 64);
/// let x = vec![0.5f32; rows * d];
/// let weight = vec![1.0f32; d];
/// let mut y = vec![0.0f32; rows * d];
/// let emu = Emulator::new();
/// rms_norm::forward(
///     &emu,
///     NormForward::new(Rows::new(&x[..], rows, d)?, &weight[..], Rows::new(&mut y[..], rows, d)?),
/// )?;
/// assert!((y[0] - 1.0).abs() < 1e-3);
/// # Ok::<(), normkern::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Emulator {
    resident_blocks: usize,
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
    /// An emulated device of 4 resident blocks with clusters of up to 2 blocks and blocks of up
    /// to 1024 threads.
    pub fn new() -> Self {
        Emulator {
            resident_blocks: EMULATED_RESIDENT_BLOCKS,
            grid_limit: None,
            max_cluster: EMULATED_MAX_CLUSTER,
            block_limit: 1024,
        }
    }

    /// Lets rows be split over clusters of up to `blocks` blocks (1: no clusters, like a GPU
    /// before sm_90; at most 16, as sm_90's non-portable clusters). The default is 2.
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

    /// Pretends `blocks` blocks are resident at once (the default is 4): a larger device, whose
    /// persistent grids are wider and whose small-batch plans (a resident block for every dγ
    /// group) reach batches of more rows, as on a GPU.
    pub fn with_resident_blocks(mut self, blocks: usize) -> Result<Self> {
        if blocks == 0 {
            return Err(Error::ZeroGrid);
        }
        self.resident_blocks = blocks;
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

impl Device for Emulator {
    fn sm_count(&self) -> usize {
        self.resident_blocks
    }

    fn max_cluster(&self) -> usize {
        self.max_cluster
    }

    /// As the sm_90 build it stands in for (its launches run one after the other anyway); with
    /// clusters off, as sm_80's.
    fn overlaps_launches(&self) -> bool {
        self.max_cluster > 1
    }

    fn shared_opt_in(&self) -> usize {
        EMULATED_SHARED_OPT_IN
    }

    fn grid_limit(&self) -> Option<usize> {
        self.grid_limit
    }

    fn max_threads(&self, _kernel: Entry) -> Result<usize> {
        Ok(self.block_limit)
    }

    fn resident_blocks(&self, _kernel: Entry, _block: usize, _shared: usize) -> Result<usize> {
        Ok(self.resident_blocks)
    }

    fn resident_clusters(&self, _: Entry, _: usize, cluster: usize, _: usize) -> Result<usize> {
        Ok(self.resident_blocks.checked_div(cluster).unwrap_or(0))
    }
}

impl Sealed for Emulator {}

impl Executor for Emulator {
    type In<'a, T: Dtype> = &'a [T];
    type Out<'a, T: Dtype> = &'a mut [T];
    type Guard<'g> = ();

    fn prepare(&self) -> Result<()> {
        Ok(())
    }

    fn input<'g, T: Dtype>(&'g self, _what: &'static str, buffer: &'g &[T]) -> Result<(u64, ())> {
        Ok((buffer.as_ptr() as u64, ()))
    }

    fn output<'g, T: Dtype>(
        &'g self,
        _what: &'static str,
        buffer: &'g mut &mut [T],
    ) -> Result<(u64, ())> {
        Ok((buffer.as_mut_ptr() as u64, ()))
    }

    fn device(&self) -> &dyn Device {
        self
    }

    fn zero(&self, address: u64, words: usize) -> Result<()> {
        // SAFETY: the call validated the operand these words lie in.
        unsafe { std::ptr::write_bytes(address as *mut f32, 0, words) };
        Ok(())
    }

    fn launch<K: Sync, P: Copy + Sync>(&self, launch: &Launch<K, P>) -> Result<()> {
        let (body, params) = (launch.kernel.body, launch.params);
        emu::launch(
            launch.kernel.name,
            (launch.grid, launch.block, launch.cluster),
            launch.shared_bytes,
            launch.cooperative,
            // SAFETY: the op that planned the launch validated every buffer the parameters
            // point to.
            &|| unsafe { body(&params) },
        )
        .map_err(|e| Error::Emulator(e.to_string()))
    }
}
