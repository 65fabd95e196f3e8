//! What RMSNorm and LayerNorm share on the host: their arguments ([`NormForward`],
//! [`NormBackward`]), validation and launch plans, over the shared kernel bodies of
//! `normkern_gpu::norm`. The public functions are [`crate::rms_norm`]'s and [`crate::layer_norm`]'s.

pub(crate) mod backward;
pub(crate) mod forward;

/// The public calls of one norm, for its module ([`crate::rms_norm`], [`crate::layer_norm`]):
/// `forward`, `backward` and `workspace_len`, each with its doc.
macro_rules! norm_calls {
    (
        $norm:expr,
        forward: { $(#[$forward:meta])* },
        backward: { $(#[$backward:meta])* },
        workspace: { $(#[$workspace:meta])* }
    ) => {
        $(#[$forward])*
        pub fn forward<E: Executor, T: Dtype, W: Dtype, R: Dtype, H: Dtype>(
            exec: &E,
            args: NormForward<'_, E, T, W, R, H>,
        ) -> Result<()> {
            $crate::norm::forward::run($norm, exec, args)
        }

        $(#[$backward])*
        pub fn backward<E: Executor, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
            exec: &E,
            args: NormBackward<'_, E, T, H, W, G>,
        ) -> Result<()> {
            $crate::norm::backward::run($norm, exec, args)
        }

        $(#[$workspace])*
        pub fn workspace_len(rows: usize, d: usize) -> Result<usize> {
            $crate::norm::backward::workspace_len($norm, rows, d)
        }
    };
}
pub(crate) use norm_calls;

pub use backward::NormBackward;
pub use forward::{NormForward, ResidualAdd};

use normkern_gpu::kernel::{Dtype as KernelDtype, Kernel, Table};
use normkern_gpu::norm::segments::SEGMENT_THREADS;
use normkern_gpu::norm::{
    FORWARD_WALK_ROWS_PER_TEAM, FORWARD_WALK_THREADS, ForwardTileGrid, Norm, NormKey, STREAM,
    forward_one_shot_threads, forward_segments_one_shot, forward_tile_grid,
};

use crate::error::{Error, Result};
use crate::executor::{Device, Launch};
use crate::plan::{
    BlockSizes, RowTile, full_grid, max_block_threads, max_cluster_block_threads, persistent_grid,
    row_tile,
};
use crate::tensor::Dtype;

/// eps as PyTorch's LayerNorm defaults it.
pub const DEFAULT_EPS: f32 = 1e-5;

/// eps finite and > 0; the weight offset finite.
pub(crate) fn check_config(eps: f32, weight_offset: f32) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::Eps(eps));
    }
    if !weight_offset.is_finite() {
        return Err(Error::WeightOffset(weight_offset));
    }
    Ok(())
}

/// Whether an operand stored as `S` next to activations stored as `T` is stored as f32 rather
/// than in `T`; any other `S` is an [`Error::UnsupportedDtypes`].
pub(crate) fn stored_f32<T: Dtype, S: Dtype>(
    what: &'static str,
    supported: &'static str,
) -> Result<bool> {
    if S::KERNEL == T::KERNEL {
        Ok(false)
    } else if S::KERNEL == KernelDtype::F32 {
        Ok(true)
    } else {
        Err(Error::UnsupportedDtypes {
            what,
            dtype: S::KERNEL.name(),
            activations: T::KERNEL.name(),
            supported,
        })
    }
}

/// Whether the weight and bias, stored as `W` next to activations stored as `T`, are f32
/// parameters (mixed precision). Supported: `W == T`, or `W == f32`.
pub(crate) fn params_f32<T: Dtype, W: Dtype>() -> Result<bool> {
    stored_f32::<T, W>(
        "weight/bias",
        "parameters must be in the activations' dtype or f32",
    )
}

/// A row stride in elements of the activations' dtype (`elem_bytes`), as
/// [`crate::plan::packs_fit`] counts them: an f32 row's stride scaled by `4 / elem_bytes`, so the
/// test "a multiple of the pack" becomes "a multiple of 16 bytes" for it too.
pub(crate) fn stride_in_elems(stride: usize, f32: bool, elem_bytes: usize) -> Result<usize> {
    if !f32 {
        return Ok(stride);
    }
    (stride.checked_mul(4))
        .and_then(|bytes| bytes.checked_div(elem_bytes))
        .ok_or(Error::TooLarge {
            what: "row stride (in bytes)",
            value: stride,
        })
}

/// `1/d`, rounded once.
pub(crate) fn inv(d: usize) -> f32 {
    (1.0f64 / d as f64) as f32
}

/// A row kernel of one of the norm tables to launch: its key but for the tile, which the plan
/// picks for the row.
pub(crate) struct RowLaunch<P: 'static> {
    pub table: &'static Table<NormKey, P>,
    /// The kernel's key; its tile (`vpt`, `cluster`) is chosen here.
    pub key: NormKey,
    pub d: usize,
    /// Items the teams walk: rows, or groups of rows.
    pub work: usize,
    /// The cluster sizes a row may be split over (ascending; none: one block per row).
    pub cluster_sizes: &'static [usize],
    /// Register tiles with fewer accesses per thread are passed over.
    pub fewest_accesses: usize,
    /// The block sizes the tile is picked within.
    pub block_sizes: BlockSizes,
    /// How a block of segment teams takes its work: each team its own item (rows: a block
    /// covers `SEGMENT_THREADS / lanes` of them), or the block one item (a group of rows).
    pub items_per_team: bool,
    /// The forward: the bytes each row moves, which size the block of segment teams on a
    /// one-shot grid (where `forward_segments_one_shot` takes one; the other segment teams walk
    /// up to `FORWARD_WALK_ROWS_PER_TEAM` rows each). `None` (the backward): the persistent grid
    /// of `SEGMENT_THREADS`.
    pub forward_row_bytes: Option<usize>,
    pub params: P,
}

impl<P: Copy> RowLaunch<P> {
    /// The tile for a row of `d` elements among the compiled ones, and a persistent grid over the
    /// work items (the forward's segment teams: a block per few rows, one a team on the one-shot
    /// grid, up to `FORWARD_WALK_ROWS_PER_TEAM` on the walk's; the forward's block tiles: a block
    /// per row, or persistent rounds, as `forward_tile_grid` says). `wide_first(vpt)`: whether a
    /// block past the preferred size tries that register tile first (`row_tile`).
    // Launch arithmetic on validated sizes and the table's few tiles.
    #[allow(clippy::arithmetic_side_effects)]
    pub(crate) fn plan(
        self,
        device: &dyn Device,
        wide_first: impl Fn(usize) -> bool,
    ) -> Result<Launch<NormKey, P>> {
        let base = self.key;
        let kernel = |vpt: usize, cluster: bool, lanes: usize| {
            self.table.find(&NormKey {
                vpt,
                cluster,
                lanes,
                ..base
            })
        };
        let max_cluster = if self.cluster_sizes.is_empty() {
            1
        } else {
            device.max_cluster()
        };
        let len = if base.vec { 16 / base.dtype.bytes() } else { 1 };
        let limit = |k: &'static Kernel<NormKey, P>| max_block_threads(device, k);
        let choose = || {
            // A row that a segment team covers takes the narrowest such team (several rows per
            // warp, no block barrier per row): a function of d, the dtype and the access alone,
            // as the backward's sum order requires.
            let mut segment: Option<(usize, &'static Kernel<NormKey, P>)> = None;
            // The compiled register tiles of this key, ascending.
            let mut register_tiles = [0usize; 8];
            let mut tiles = 0;
            for k in self.table.iter() {
                let block_tile = NormKey {
                    vpt: k.key.vpt,
                    cluster: false,
                    lanes: 0,
                    ..base
                };
                let segment_tile = NormKey {
                    lanes: k.key.lanes,
                    ..block_tile
                };
                if k.key.lanes != 0 && k.key == segment_tile {
                    let reach = k.key.lanes * k.key.vpt * len;
                    // A segment kernel the device cannot run as a block of 256 threads is
                    // passed over (the emulator's block limits stand in for registers).
                    if reach >= self.d
                        && segment.is_none_or(|(best, _)| reach < best)
                        && limit(k)? >= SEGMENT_THREADS
                    {
                        segment = Some((reach, k));
                    }
                } else if k.key == block_tile
                    && k.key.vpt != STREAM
                    && k.key.vpt >= self.fewest_accesses
                    && tiles < register_tiles.len()
                {
                    register_tiles[tiles] = k.key.vpt;
                    tiles += 1;
                }
            }
            if let Some((_, k)) = segment {
                return Ok(RowTile {
                    vpt: k.key.vpt,
                    threads: SEGMENT_THREADS,
                    cluster: 1,
                    lanes: k.key.lanes,
                });
            }
            register_tiles[..tiles].sort_unstable();
            row_tile(
                self.d,
                len,
                &register_tiles[..tiles],
                (self.cluster_sizes, max_cluster),
                self.block_sizes,
                |vpt, cluster| match kernel(vpt, cluster > 1, 0) {
                    Some(k) => max_cluster_block_threads(device, k, cluster),
                    None => Ok(None),
                },
                wide_first,
            )
        };
        let question = (
            self.table as *const _ as usize,
            base,
            self.d,
            (self.cluster_sizes.as_ptr() as usize, max_cluster),
            self.block_sizes,
        );
        let RowTile {
            vpt,
            threads,
            cluster,
            lanes,
        } = match device.tile_memo() {
            Some(memo) => memo.get_or(question, choose)?,
            None => choose()?,
        };
        let kernel = kernel(vpt, cluster > 1, lanes)
            .ok_or(Error::Internal("the chosen tile is not compiled"))?;
        // The forward's segment teams: one row each on the one-shot grid, else a short walk.
        let centered = self.key.norm == Norm::Layer;
        let one_shot = forward_segments_one_shot(centered, self.key.residual, vpt);
        let forward_teams = self.forward_row_bytes.filter(|_| lanes != 0);
        let threads = match forward_teams {
            Some(row_bytes) if one_shot => forward_one_shot_threads(lanes, row_bytes),
            Some(_) => FORWARD_WALK_THREADS,
            None => threads,
        };
        let shared_bytes = (kernel.shared_bytes)(threads);
        let tile_grid = match self.forward_row_bytes {
            Some(_) if lanes == 0 && cluster == 1 => {
                let resident = device.resident_blocks(kernel.entry(), threads, shared_bytes)?;
                let per_sm = resident / device.sm_count().max(1);
                forward_tile_grid(centered, base.residual, base.vec, vpt, per_sm)
            }
            _ => ForwardTileGrid::Persistent,
        };
        let grid = match (forward_teams, tile_grid) {
            // A block per `threads / lanes` rows, a team per row: no occupancy query; a grid
            // limit still holds (the teams walk the rows by grid stride).
            (Some(_), _) if one_shot => full_grid(device, self.work.div_ceil(threads / lanes)),
            // The walk: a team per `FORWARD_WALK_ROWS_PER_TEAM` rows, but never fewer blocks than
            // a team per row keeps resident: a small batch spreads over the SMs rather than
            // queueing several rows in each of a few teams.
            (Some(_), _) => {
                let teams = threads / lanes;
                let walking = full_grid(
                    device,
                    self.work.div_ceil(teams * FORWARD_WALK_ROWS_PER_TEAM),
                );
                let spread = self.work.div_ceil(teams);
                let resident =
                    persistent_grid(device, kernel.entry(), spread, threads, 1, shared_bytes)?;
                walking.max(resident)
            }
            // A block per row; a grid limit still holds (the blocks walk the rows by grid
            // stride).
            (None, ForwardTileGrid::OneShot) => full_grid(device, self.work),
            (None, ForwardTileGrid::Persistent) => {
                let work = if lanes != 0 && self.items_per_team {
                    self.work.div_ceil(threads / lanes)
                } else {
                    self.work
                };
                persistent_grid(device, kernel.entry(), work, threads, cluster, shared_bytes)?
            }
        };
        Ok(Launch {
            kernel,
            grid,
            block: threads,
            cluster,
            shared_bytes,
            cooperative: false,
            overlaps_previous: false,
            params: self.params,
        })
    }
}
