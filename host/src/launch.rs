//! What every op shares between validation and the driver: the launch description, how a row is
//! tiled over a block, how rows form dγ groups, and the executors (GPU or CPU emulator).

use normkern_gpu::activation;
use normkern_gpu::norm::{self, Norm};
use normkern_gpu::reduce::{self, ColumnSumParams};
use normkern_gpu::variant::{ActVariant, Dtype, EntryName, STREAM, Variant};

use crate::error::{Error, Result};

/// One kernel launch, with its parameters: the single description both executors consume.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kernel {
    NormForward(Norm, Variant, norm::ForwardParams),
    NormBackward(Norm, Variant, norm::BackwardParams),
    ColumnSum(Dtype, ColumnSumParams),
    Activation(activation::Family, ActVariant, activation::Params),
}

impl Kernel {
    pub(crate) fn entry_name(&self) -> EntryName {
        match self {
            Kernel::NormForward(n, v, p) => v.entry_name(n.families(p.residual_family()).0),
            Kernel::NormBackward(n, v, p) => v.entry_name(n.families(p.residual_family()).1),
            Kernel::ColumnSum(dt, _) => EntryName::new("column_sum", *dt),
            Kernel::Activation(family, v, _) => v.entry_name(family.prefix()),
        }
    }

    /// Dynamic shared memory of one block of `threads` threads of a row kernel.
    pub(crate) fn row_shared_bytes(&self, threads: usize) -> usize {
        match self {
            Kernel::NormBackward(n, v, _) => {
                norm::backward_shared_bytes(*n, v.vpt, threads, self.staged())
            }
            _ => ROW_KERNEL_SHARED_BYTES,
        }
    }

    /// Whether a forward register tile loads the next row before reducing this one
    /// ([`norm::forward_prefetches`]).
    pub(crate) fn prefetches(&self) -> bool {
        match self {
            Kernel::NormForward(n, v, p) => {
                norm::forward_prefetches(*n == Norm::Layer, p.residual_family(), v.vpt)
            }
            _ => false,
        }
    }

    /// Whether the kernel stages rows through shared memory beyond [`DEFAULT_SHARED_BYTES`],
    /// which its function must opt into (the context does so when it loads it).
    pub(crate) fn staged(&self) -> bool {
        match self {
            Kernel::NormBackward(_, v, p) => norm::staged(v.cluster, p.residual_family(), v.vpt),
            _ => false,
        }
    }

    /// The most threads (a multiple of 32, at most 1024; 0 for none) a block of this row kernel
    /// may have within its dynamic shared memory: [`DEFAULT_SHARED_BYTES`], or for
    /// [`Self::staged`] kernels the device's opt-in limit `opt_in` (227 KiB on H100 and H200, less
    /// on some later parts).
    pub(crate) fn threads_within_shared(&self, opt_in: usize) -> usize {
        let limit = if self.staged() {
            opt_in
        } else {
            DEFAULT_SHARED_BYTES
        };
        (32..=1024)
            .step_by(32)
            .take_while(|&threads| self.row_shared_bytes(threads) <= limit)
            .last()
            .unwrap_or(0)
    }
}

/// Dynamic shared memory every kernel may use without opting in.
const DEFAULT_SHARED_BYTES: usize = 48 * 1024;

/// Grid, block, cluster and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Blocks in the grid: a multiple of `cluster`.
    pub grid: usize,
    pub block: usize,
    /// Blocks per thread-block cluster (sm_90); 1 launches without clusters.
    pub cluster: usize,
    pub shared_bytes: usize,
}

/// Runs [`Kernel`]s: the GPU ([`crate::Context`] on a stream) or the CPU emulator.
pub(crate) trait Executor {
    /// The most threads one block of this kernel may have (the GPU's limit depends on registers).
    fn max_threads(&self, kernel: &Kernel) -> Result<usize>;
    /// Blocks of this kernel that run at once on the whole device: the most a persistent grid has.
    fn resident_blocks(&self, kernel: &Kernel, block: usize, shared_bytes: usize) -> Result<usize>;
    /// Clusters of `cluster` blocks of this kernel that run at once on the whole device.
    fn resident_clusters(
        &self,
        kernel: &Kernel,
        block: usize,
        cluster: usize,
        shared_bytes: usize,
    ) -> Result<usize> {
        Ok(self.resident_blocks(kernel, block, shared_bytes)? / cluster)
    }
    /// The most blocks a cluster may have on this device: 8 on sm_90 and newer, 1 (no clusters)
    /// before.
    fn max_cluster(&self) -> usize;
    /// The dynamic shared memory (bytes) one block may opt into, which [`Kernel::staged`]
    /// kernels may use.
    fn shared_opt_in(&self) -> usize;
    /// Streaming multiprocessors (the emulator: the blocks it pretends are resident).
    fn sm_count(&self) -> usize;
    /// An upper bound on the grid set by the user (tests use it to prove grid invariance).
    fn grid_limit(&self) -> Option<usize>;
    /// Enqueues (GPU) or runs (emulator) one launch.
    fn launch(&self, kernel: &Kernel, shape: Shape) -> Result<()>;

    /// One block per tile of work (elementwise kernels), unless the user set a lower limit.
    fn full_grid(&self, tiles: usize) -> usize {
        tiles.min(self.grid_limit().unwrap_or(usize::MAX)).max(1)
    }

    /// A persistent grid for `work` items (rows or groups), each taken by a cluster of `cluster`
    /// blocks (1: by a block): never more clusters than items, and no more than the fewest that
    /// still walk the items in the same number of rounds, so every cluster takes the same count
    /// (±1) and none is left alone on a last, nearly empty round. Returns the grid in blocks. A
    /// grid limit below one cluster still launches one.
    fn persistent_grid(
        &self,
        kernel: &Kernel,
        work: usize,
        block: usize,
        cluster: usize,
        shared_bytes: usize,
    ) -> Result<usize> {
        let resident = if cluster == 1 {
            self.resident_blocks(kernel, block, shared_bytes)?
        } else {
            self.resident_clusters(kernel, block, cluster, shared_bytes)?
        };
        let limit = self
            .grid_limit()
            .map_or(usize::MAX, |blocks| blocks / cluster);
        Ok(balanced_teams(work, resident.min(limit)) * cluster)
    }
}

/// Teams (blocks or clusters) for `work` items when at most `most` may run: as few as walk the
/// items in the fewest rounds. 16384 rows over 528 resident blocks take 32 rounds either way, but
/// 528 blocks leave 512 of them idle for the last; 512 blocks take 32 rows each.
fn balanced_teams(work: usize, most: usize) -> usize {
    let rounds = work.div_ceil(most.max(1)).max(1);
    work.div_ceil(rounds).max(1)
}

/// Shared memory every row kernel gets: the words of a block reduction.
const ROW_KERNEL_SHARED_BYTES: usize = reduce::ROW_REDUCER_SHARED_WORDS * 4;

/// Threads a block prefers when the row fits in registers: enough warps per block to keep several
/// blocks resident per SM and the per-row reduction short.
const PREFERRED_THREADS: usize = 256;

/// How one row is spread over a block, or over a cluster of `cluster` blocks: `vpt` accesses per
/// thread (or [`STREAM`]) and the block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowTile {
    pub vpt: usize,
    pub threads: usize,
    pub cluster: usize,
}

/// Blocks per cluster the row tiles try, smallest first: each halves the block's share of a row.
const CLUSTER_SIZES: [usize; 3] = [2, 4, 8];
/// Most threads per block of a streaming instance: a cluster of such blocks shares a row.
const STREAM_THREADS: usize = 1024;

/// Picks the tile for a row of `d` elements read `len` at a time, among register tiles when
/// `registers` (the family has them for this access) or else streaming. In order: one block of up
/// to [`PREFERRED_THREADS`]; one block of up to the kernel's limit, tiles that `prefetches` the
/// next row first; the smallest cluster (up to `max_cluster` blocks) whose blocks need at most
/// [`PREFERRED_THREADS`] (fewest accesses per thread first), then at most the kernel's limit;
/// else streaming, by a cluster of `max_cluster` blocks. `max_threads` takes the tile and whether
/// it is a cluster instance. The choice depends on the shape, the device and the kernels'
/// register counts only, never on the grid, so reductions keep their order.
///
/// H200, bf16 forward at 4096×16384, one call: RMSNorm's 4 packs × 512 threads, which prefetch,
/// read 82.3 % of copy against 67.3 % for 2 × 1024, which do not; LayerNorm's 2 × 1024, which do
/// too, 79.0 % against 75.8 % for 4 × 512.
///
/// H200, bf16 backward (`bench-results/h200.md`): 4096×16384 takes 4 packs × 256 threads over
/// clusters of 2 (RMSNorm 72.8 %, LayerNorm 61.6 % of copy at 2b7a4c1; streaming 40.3 / 27.8 %
/// earlier), 1024×65536 4 × 256 over 8 (72.1 / 59.5 %; streaming 24.2 / 16.5 %). Tiles with more
/// resident warps measured no faster: 2 packs × 512 threads over 8 read 57.2 / 45.0 % against
/// 57.6 / 46.1 % for 4 × 256 in one call (with the cluster mailboxes, before the staged rows).
pub(crate) fn row_tile(
    d: usize,
    len: usize,
    registers: bool,
    max_cluster: usize,
    max_threads: impl Fn(usize, bool) -> Result<usize>,
    prefetches: impl Fn(usize) -> bool,
) -> Result<RowTile> {
    let accesses = d.div_ceil(len);
    let threads_for = |vpt: usize, cluster: usize| {
        accesses
            .div_ceil(vpt * cluster)
            .next_multiple_of(32)
            .max(32)
    };
    let register_tiles: &[usize] = if registers { &[1, 2, 4] } else { &[] };
    let clusters = CLUSTER_SIZES.into_iter().filter(|&c| c <= max_cluster);
    // (vpt, cluster, within the preferred size), in order of preference.
    // Past the preferred size a block fills the SM alone: the tiles that keep the next row in
    // flight first (a block that waits for its row with nothing else to do idles the SM).
    let prefetches = &prefetches;
    let larger_blocks = [true, false].into_iter().flat_map(|prefetching| {
        (register_tiles.iter().skip(1))
            .filter(move |&&vpt| prefetches(vpt) == prefetching)
            .map(|&vpt| (vpt, 1, false))
    });
    let one_block = (register_tiles.iter().map(|&vpt| (vpt, 1, true))).chain(larger_blocks);
    let clustered = [true, false].into_iter().flat_map(|preferred| {
        (clusters.clone()).flat_map(move |cluster| {
            register_tiles
                .iter()
                .map(move |&vpt| (vpt, cluster, preferred))
        })
    });
    for (vpt, cluster, preferred) in one_block.chain(clustered) {
        let threads = threads_for(vpt, cluster);
        let max = max_threads(vpt, cluster > 1)?.min(1024);
        let limit = if preferred {
            PREFERRED_THREADS.min(max)
        } else {
            max
        };
        if threads <= limit {
            return Ok(RowTile {
                vpt,
                threads,
                cluster,
            });
        }
    }
    let cluster = max_cluster.clamp(1, 8);
    let max = max_threads(STREAM, cluster > 1)?.min(STREAM_THREADS);
    let threads = threads_for(1, cluster).min(max / 32 * 32);
    Ok(RowTile {
        vpt: STREAM,
        threads,
        cluster,
    })
}

/// Whether 16-byte packs of `16 / elem_bytes` elements can serve every operand: each base address
/// 16-byte aligned, every stride and `d` a multiple of the pack. An absent operand may be passed
/// as address and stride 0.
pub(crate) fn packs_fit(elem_bytes: usize, d: usize, addrs: &[u64], strides: &[usize]) -> bool {
    let len = 16 / elem_bytes;
    d % len == 0 && addrs.iter().all(|a| a % 16 == 0) && strides.iter().all(|s| s % len == 0)
}

/// Rows of one dγ group: at most this many groups, and at least this many rows in each, so the
/// fp32 workspace (written and read once) stays a few percent of the backward's traffic.
const MAX_GROUPS: usize = 512;
const MIN_ROWS_PER_GROUP: usize = 16;
/// Rows wider than this many elements are split over clusters of 8 blocks, of which the 132-SM
/// Hopper parts (H100 SXM, H200) hold [`WIDE_ROW_TEAMS`] at a time.
const WIDE_ROW_ELEMS: usize = 32768;
const WIDE_ROW_TEAMS: usize = 15;

/// `(rows_per_group, groups)` for `rows` rows of `d` elements: a function of the shape alone,
/// which is what makes the dγ/dβ sums the same bits on every grid and every GPU.
///
/// Rows wider than [`WIDE_ROW_ELEMS`] have few teams walking the groups, so the count of groups
/// decides the balance: 64 groups of 16 over 15 clusters take 5 rounds where 4.3 would do. Their
/// group size is picked (from [`norm::STAGES`] up to one round's worth) for the shortest busiest
/// team of [`WIDE_ROW_TEAMS`], counting each group's partial row (f32, written and read once) as
/// 4/3 of a row of 16-bit x, dy and dx. 1024 rows take 15 groups of 69 (one round, and a third of
/// the partial rows of 45 groups of 23), and 64 rows, which had 4 groups of 16 for 15 clusters,
/// take 13 of 5. Any other team count still gets a valid layout, only a less even one. H200, bf16
/// backward at 1024×65536: RMSNorm 57.6 → 63.6 %, LayerNorm 46.1 → 52.1 % of copy (64 → 45
/// groups), then 75.2 → 77.3 % and 62.1 → 64.0 % (45 → 15 groups, one call); at 64×2²⁰ 10.7 →
/// 15.9 % and 7.0 → 9.7 %.
pub fn group_layout(rows: usize, d: usize) -> (usize, usize) {
    let fewest_groups = rows.div_ceil(MAX_GROUPS);
    let default = fewest_groups.max(MIN_ROWS_PER_GROUP);
    let per_group = if d > WIDE_ROW_ELEMS {
        let busiest = |p: usize| rows.div_ceil(p).div_ceil(WIDE_ROW_TEAMS) * (3 * p + 4);
        (fewest_groups.max(norm::STAGES)..=(2 * default).max(rows.div_ceil(WIDE_ROW_TEAMS)))
            .min_by_key(|&p| busiest(p))
            .unwrap_or(default)
    } else {
        default
    };
    (per_group, rows.div_ceil(per_group))
}

/// Narrowest rows whose column sums take four columns per thread: 128 slabs of 128 columns, about
/// one per SM. Narrower rows keep more, narrower slabs. H200, 1024×65536 (45 groups): one column
/// per thread took 25 µs per sum (ncu); with four, the backward (kernel and sums) went from 67.7 /
/// 50.9 % to 71.9 / 57.8 % of copy (RMSNorm / LayerNorm, one call), and to 72.1 / 59.5 % with dγ
/// and dβ in one launch (the next call).
const VECTOR_COLUMN_SUM_MIN_D: usize = 16384;

/// The second pass of every deterministic parameter gradient (dγ, dβ, dbias): sums the
/// `[groups, d]` fp32 partials at `workspace` in a fixed order into `d` elements of `dtype` at
/// `out`, and in the same launch those of `second` (dβ's, next to dγ's) if any. With
/// `groups == 0` it writes zeros (the gradient over no rows).
pub(crate) fn launch_column_sum(
    exec: &dyn Executor,
    dtype: Dtype,
    (workspace, out): (u64, u64),
    second: Option<(u64, u64)>,
    groups: usize,
    d: usize,
) -> Result<()> {
    let sums = 1 + second.is_some() as usize;
    let aligned = workspace % 16 == 0 && second.is_none_or(|(partials, _)| partials % 16 == 0);
    let second = second.unwrap_or((0, 0));
    // Four columns per thread where rows of partials are 16-byte aligned and wide enough for
    // slabs of 128 columns to fill the GPU; the same bits either way (the same order per column).
    let vector = reduce::COLUMN_SUM_VECTOR;
    let columns = if d % vector == 0 && aligned && d >= VECTOR_COLUMN_SUM_MIN_D {
        vector
    } else {
        1
    };
    let kernel = Kernel::ColumnSum(
        dtype,
        ColumnSumParams {
            partials: workspace,
            out,
            partials2: second.0,
            out2: second.1,
            groups: groups as u32,
            d: d as u32,
            columns: columns as u32,
        },
    );
    let block = reduce::COLUMN_SUM_THREADS;
    let shared_bytes = reduce::COLUMN_SUM_THREADS * 4 * columns;
    let slabs = d.div_ceil(32 * columns) * sums;
    let grid = exec.persistent_grid(&kernel, slabs, block, 1, shared_bytes)?;
    exec.launch(
        &kernel,
        Shape {
            grid,
            block,
            cluster: 1,
            shared_bytes,
        },
    )
}

pub(crate) fn check_eps(eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::Eps(eps));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile for `d` elements of `len` per access on a device whose kernels take
    /// `regs(vpt, cluster)` registers per thread (64K per SM, 1024 threads per block at most).
    fn pick(d: usize, len: usize, max_cluster: usize, regs: fn(usize, bool) -> usize) -> RowTile {
        pick_with(d, len, max_cluster, regs, |_| false)
    }

    /// [`pick`] for kernels whose tiles of `vpt` accesses prefetch as `prefetches` says.
    fn pick_with(
        d: usize,
        len: usize,
        max_cluster: usize,
        regs: fn(usize, bool) -> usize,
        prefetches: fn(usize) -> bool,
    ) -> RowTile {
        let max_threads = |vpt, cluster| Ok((65536 / regs(vpt, cluster)).min(1024) / 32 * 32);
        row_tile(d, len, true, max_cluster, max_threads, prefetches).unwrap()
    }

    /// Register counts of the bf16 backward instances (ptxas, sm_90).
    fn backward_regs(vpt: usize, cluster: bool) -> usize {
        match (vpt, cluster) {
            (1, _) => 80,
            (2, _) => 128,
            (4, _) => 241,
            _ => 80,
        }
    }

    fn tile(vpt: usize, threads: usize, cluster: usize) -> RowTile {
        RowTile {
            vpt,
            threads,
            cluster,
        }
    }

    #[test]
    fn rows_that_fit_a_block_take_one_block() {
        assert_eq!(pick(4096, 8, 8, backward_regs), tile(2, 256, 1));
        assert_eq!(pick(1000, 1, 8, backward_regs), tile(4, 256, 1));
        assert_eq!(pick(7, 8, 8, backward_regs), tile(1, 32, 1));
        // 8192 bf16: 4 packs × 256 threads still fit one block.
        assert_eq!(pick(8192, 8, 8, backward_regs), tile(4, 256, 1));
    }

    /// Register counts of the bf16 forward instances (ptxas, sm_90), RMSNorm's and LayerNorm's
    /// (which both fit 512 threads of 4 packs and 1024 of 2).
    fn forward_regs(vpt: usize, _cluster: bool) -> usize {
        match vpt {
            1 => 40,
            2 => 64,
            _ => 128,
        }
    }

    #[test]
    fn rows_past_the_preferred_block_take_a_tile_that_prefetches() {
        // 16384 bf16: RMSNorm's 2-pack tile does not prefetch, its 4-pack tile does.
        let rms = |vpt| norm::forward_prefetches(false, false, vpt);
        assert_eq!(pick_with(16384, 8, 8, forward_regs, rms), tile(4, 512, 1));
        // LayerNorm's both do: the one with more warps.
        let layer = |vpt| norm::forward_prefetches(true, false, vpt);
        assert_eq!(
            pick_with(16384, 8, 8, forward_regs, layer),
            tile(2, 1024, 1)
        );
        // Neither prefetches (the residual families): more warps.
        assert_eq!(pick(16384, 8, 8, forward_regs), tile(2, 1024, 1));
    }

    #[test]
    fn wide_rows_take_groups_for_one_even_round() {
        assert_eq!(group_layout(16384, 4096), (32, 512));
        assert_eq!(group_layout(1024, 65536), (69, 15));
        assert_eq!(group_layout(64, 1 << 20), (5, 13));
        assert_eq!(group_layout(3, 1 << 20), (4, 1));
    }

    #[test]
    fn persistent_grids_walk_the_items_in_even_rounds() {
        assert_eq!(balanced_teams(16384, 528), 512);
        assert_eq!(balanced_teams(16384, 660), 656);
        assert_eq!(balanced_teams(1000, 528), 500);
        assert_eq!(balanced_teams(45, 15), 15);
        assert_eq!(balanced_teams(13, 15), 13);
        assert_eq!(balanced_teams(0, 528), 1);
        assert_eq!(balanced_teams(7, 0), 1);
    }

    #[test]
    fn wider_rows_take_the_smallest_cluster_of_preferred_blocks() {
        assert_eq!(pick(16384, 8, 8, backward_regs), tile(4, 256, 2));
        assert_eq!(pick(65536, 8, 8, backward_regs), tile(4, 256, 8));
        // 73728 bf16 would need 288 threads of 4 packs in each of 8 blocks, past the 4-pack
        // tile's register limit (256): it streams.
        assert_eq!(pick(73728, 8, 8, backward_regs), tile(STREAM, 800, 8));
    }

    #[test]
    fn without_clusters_or_past_them_rows_stream() {
        assert_eq!(pick(16384, 8, 1, backward_regs), tile(STREAM, 800, 1));
        assert_eq!(pick(1 << 20, 8, 8, backward_regs), tile(STREAM, 800, 8));
    }

    /// The staged cluster backward (4 rows of x and dy in flight, LayerNorm's γ besides) needs
    /// more than the default 48 KiB: it gets the device's opt-in limit, and a device with less
    /// gets fewer threads per block rather than a failed launch.
    #[test]
    fn staged_backward_blocks_fit_the_opt_in_shared_memory() {
        let backward = |norm, vpt, cluster, residual: bool| {
            let params = norm::BackwardParams {
                dresidual: residual as u64,
                ..Default::default()
            };
            let variant = Variant {
                dtype: Dtype::Bf16,
                vec: true,
                vpt,
                cluster,
            };
            Kernel::NormBackward(norm, variant, params)
        };
        let staged = backward(Norm::Layer, 4, true, false);
        assert!(staged.staged());
        assert!(staged.row_shared_bytes(256) > 48 * 1024);
        assert_eq!(staged.threads_within_shared(227 * 1024), 352);
        assert_eq!(staged.threads_within_shared(99 * 1024), 128);
        // Block instances and residual instances keep within 48 KiB whatever the device offers.
        for kernel in [
            backward(Norm::Layer, 4, false, false),
            backward(Norm::Rms, 4, true, true),
        ] {
            assert!(!kernel.staged());
            let threads = kernel.threads_within_shared(227 * 1024);
            assert!(kernel.row_shared_bytes(threads) <= 48 * 1024, "{kernel:?}");
        }
    }
}
