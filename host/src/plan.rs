//! What the launch plans of every op share: how a row is tiled over a block or a cluster, how big
//! a persistent grid is, when 16-byte packs serve, and the column-sum launch of the parameter
//! gradients. Each op's plan (`norm::forward::plan`, …) is a pure function of the call and the
//! [`Device`]; these are its pieces.

// Launch arithmetic on validated sizes (rows, d < 2³², at most 8192 groups) and launch shapes
// (blocks of 32 to 1024 threads, clusters of 1 to 16): nothing here overflows or divides by 0.
#![allow(clippy::arithmetic_side_effects)]

use normkern_gpu::activation::kernels::dbias_group_layout;
use normkern_gpu::column_sum::{
    self, CHAIN_COLUMNS, COLUMN_SUM_ROUND_GROUPS, COLUMN_SUM_THREADS, COLUMN_SUM_VECTOR,
    ColumnSumParams, GROUP_SUMS_ATOMIC, GROUP_SUMS_IN_LAUNCH, GROUP_SUMS_LOCKED,
    GROUP_SUMS_SHARED_WORDS, GROUP_SUMS_SYNC_WORDS, GroupSums,
};
use normkern_gpu::kernel::{Dtype, Entry, Kernel};
use normkern_gpu::norm::STREAM;

use crate::error::{Error, Result};
use crate::executor::{Device, Launch};

/// A persistent grid for `work` items (rows or groups), each taken by a cluster of `cluster`
/// blocks (1: by a block): never more clusters than items, and no more than the fewest that
/// still walk the items in the same number of rounds, so every cluster takes the same count
/// (±1) and none is left alone on a last, nearly empty round. Returns the grid in blocks. A
/// grid limit below one cluster still launches one.
pub(crate) fn persistent_grid(
    device: &dyn Device,
    kernel: Entry,
    work: usize,
    block: usize,
    cluster: usize,
    shared_bytes: usize,
) -> Result<usize> {
    let resident = if cluster == 1 {
        device.resident_blocks(kernel, block, shared_bytes)?
    } else {
        device.resident_clusters(kernel, block, cluster, shared_bytes)?
    };
    let limit = device
        .grid_limit()
        .map_or(usize::MAX, |blocks| blocks / cluster);
    Ok(balanced_teams(work, resident.min(limit)) * cluster)
}

/// One block per tile of work (elementwise kernels), unless the user set a lower limit.
pub(crate) fn full_grid(device: &dyn Device, tiles: usize) -> usize {
    tiles.min(device.grid_limit().unwrap_or(usize::MAX)).max(1)
}

/// Teams (blocks or clusters) for `work` items when at most `most` may run: as few as walk the
/// items in the fewest rounds. 16384 rows over 528 resident blocks take 32 rounds either way, but
/// 528 blocks leave 512 of them idle for the last; 512 blocks take 32 rows each.
fn balanced_teams(work: usize, most: usize) -> usize {
    let rounds = work.div_ceil(most.max(1)).max(1);
    work.div_ceil(rounds).max(1)
}

/// The most blocks of a cluster every sm_90 device runs; past it (up to
/// `normkern_gpu::arch::MAX_CLUSTER`) only where the occupancy query finds such a cluster resident.
pub(crate) const PORTABLE_CLUSTER: usize = 8;

/// Threads a block prefers when the row fits in registers: enough warps per block to keep several
/// blocks resident per SM and the per-row reduction short.
pub(crate) const PREFERRED_THREADS: usize = 256;

/// The block sizes a row tile is picked within ([`row_tile`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSizes {
    /// Threads a register tile's block may have before larger blocks and clusters are tried
    /// ([`PREFERRED_THREADS`] unless the kernel family says otherwise).
    pub preferred: usize,
    /// The most threads of a streaming block.
    pub stream: usize,
}

/// Blocks per cluster the row tiles try, smallest first: each halves the block's share of a row.
pub(crate) const CLUSTER_SIZES: &[usize] = &[2, 4, 8];
/// Most threads per block of the backward's streaming instance (the forward's:
/// `forward_stream_threads`); a cluster of such blocks shares a row.
pub(crate) const STREAM_THREADS: usize = 1024;

/// How one row is spread over a block, or over a cluster of `cluster` blocks: `vpt` accesses per
/// thread (or [`STREAM`]) and the block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowTile {
    pub vpt: usize,
    pub threads: usize,
    pub cluster: usize,
    /// Lanes of a segment team per row (`normkern_gpu::norm::segments`); 0: a block or cluster.
    pub lanes: usize,
}

/// Picks the tile for a row of `d` elements read `len` at a time among the compiled register
/// tiles `register_tiles` (ascending) and the streaming one. `max_threads(vpt, cluster)` is the
/// most threads a block of that kernel in clusters of `cluster` blocks may have, or `None` when no
/// such kernel is compiled (or a cluster that size is never resident). In order: one block of up
/// to `sizes.preferred` threads; one block of up to the kernel's limit, the tiles for which
/// `wide_first(vpt)` holds first; the smallest cluster of `cluster_sizes` (ascending, up to
/// `max_cluster` blocks) whose blocks need at most `sizes.preferred` (fewest accesses per thread
/// first), then at most the kernel's limit; else streaming, in blocks of at most `sizes.stream`,
/// by a cluster of `max_cluster` blocks (at most [`PORTABLE_CLUSTER`]). The choice depends on the
/// shape, the device and the kernels' register counts only, never on the grid, so reductions keep
/// their order.
pub(crate) fn row_tile(
    d: usize,
    len: usize,
    register_tiles: &[usize],
    (cluster_sizes, max_cluster): (&[usize], usize),
    sizes: BlockSizes,
    max_threads: impl Fn(usize, usize) -> Result<Option<usize>>,
    wide_first: impl Fn(usize) -> bool,
) -> Result<RowTile> {
    let accesses = d.div_ceil(len);
    let threads_for = |vpt: usize, cluster: usize| {
        accesses
            .div_ceil(vpt * cluster)
            .next_multiple_of(32)
            .max(32)
    };
    let clusters = cluster_sizes.iter().copied().filter(|&c| c <= max_cluster);
    // (vpt, cluster, within the preferred size), in order of preference.
    // Past the preferred size few blocks fill an SM: which tile keeps the most resident or hides
    // a row's latency best is the kernel family's call (`wide_first`).
    let wide_first = &wide_first;
    let larger_blocks = [true, false].into_iter().flat_map(|first| {
        (register_tiles.iter().skip(1))
            .filter(move |&&vpt| wide_first(vpt) == first)
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
        let Some(max) = max_threads(vpt, cluster)? else {
            continue;
        };
        let threads = threads_for(vpt, cluster);
        let max = max.min(1024);
        let limit = if preferred {
            sizes.preferred.min(max)
        } else {
            max
        };
        if threads <= limit {
            return Ok(RowTile {
                vpt,
                threads,
                cluster,
                lanes: 0,
            });
        }
    }
    // Streaming: over the widest cluster there is, else one block.
    for cluster in [max_cluster.clamp(1, PORTABLE_CLUSTER), 1] {
        if let Some(max) = max_threads(STREAM, cluster)? {
            let threads = threads_for(1, cluster).min(max.min(sizes.stream) / 32 * 32);
            return Ok(RowTile {
                vpt: STREAM,
                threads,
                cluster,
                lanes: 0,
            });
        }
    }
    Err(Error::Internal(
        "the kernel table has no streaming kernel for this row",
    ))
}

/// The most threads a block of `kernel` may have on `device`: the function's own limit (its
/// registers) and what its dynamic shared memory allows ([`threads_within_shared`]).
pub(crate) fn max_block_threads<K, P>(
    device: &dyn Device,
    kernel: &'static Kernel<K, P>,
) -> Result<usize> {
    let shared = threads_within_shared(
        kernel.large_shared,
        kernel.shared_bytes,
        device.shared_opt_in(),
    );
    Ok(device.max_threads(kernel.entry())?.min(shared))
}

/// [`max_block_threads`] for blocks in clusters of `cluster` (1: none), or `None` where that
/// cluster is past [`PORTABLE_CLUSTER`] and the device never keeps one resident (asked at the most
/// threads: fewer only need less).
pub(crate) fn max_cluster_block_threads<K, P>(
    device: &dyn Device,
    kernel: &'static Kernel<K, P>,
    cluster: usize,
) -> Result<Option<usize>> {
    let threads = max_block_threads(device, kernel)?;
    let resident = cluster <= PORTABLE_CLUSTER
        || threads > 0
            && device.resident_clusters(
                kernel.entry(),
                threads,
                cluster,
                (kernel.shared_bytes)(threads),
            )? > 0;
    Ok(resident.then_some(threads))
}

/// Dynamic shared memory every kernel may use without opting in.
pub(crate) const DEFAULT_SHARED_BYTES: usize = 48 * 1024;

/// The most threads (a multiple of 32, at most 1024; 0 for none) a block of `kernel` may have
/// within its dynamic shared memory `shared_bytes(threads)`: the default 48 KiB, or for kernels
/// that may need more the device's opt-in limit `opt_in`.
pub(crate) fn threads_within_shared(
    large_shared: bool,
    shared_bytes: fn(usize) -> usize,
    opt_in: usize,
) -> usize {
    let limit = if large_shared {
        opt_in
    } else {
        DEFAULT_SHARED_BYTES
    };
    // Shared memory grows with the block: the most warps within the limit, by bisection.
    let (mut fits, mut most) = (0usize, 32usize);
    while fits < most {
        let warps = (fits + most).div_ceil(2);
        if shared_bytes(32 * warps) <= limit {
            fits = warps;
        } else {
            most = warps - 1;
        }
    }
    32 * fits
}

/// Answers that depend only on their question, kept after the first time they are worked out
/// (the driver's occupancy answers, the row tiles the plans choose). Asked on every call: hashed
/// with foldhash's fixed-seed hasher (the questions are the plans' own, no hostile keys).
pub struct Memo<K, V>(
    std::sync::Mutex<std::collections::HashMap<K, V, foldhash::fast::FixedState>>,
);

impl<K, V> Default for Memo<K, V> {
    fn default() -> Self {
        Memo(std::sync::Mutex::new(std::collections::HashMap::default()))
    }
}

impl<K: Eq + std::hash::Hash, V: Copy> Memo<K, V> {
    /// The kept answer to `question`, or `work_out`'s, kept.
    pub(crate) fn get_or(&self, question: K, work_out: impl FnOnce() -> Result<V>) -> Result<V> {
        // A panic elsewhere cannot leave the map half-updated: use it as it is.
        let lock = || self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&answer) = lock().get(&question) {
            return Ok(answer);
        }
        let answer = work_out()?;
        lock().insert(question, answer);
        Ok(answer)
    }
}

/// Row tiles chosen so far, by (table address, kernel key with the tile fields unset, d, the
/// cluster sizes tried (their list's address) and most blocks per cluster): the choice depends
/// on nothing else, so a device keeps it and later calls skip the search.
pub type TileMemo = Memo<
    (
        usize,
        normkern_gpu::norm::NormKey,
        usize,
        (usize, usize),
        BlockSizes,
    ),
    RowTile,
>;

/// Whether 16-byte packs of `16 / elem_bytes` elements can serve every operand: each base address
/// 16-byte aligned, every stride and `d` a multiple of the pack. An absent operand may be passed
/// as address and stride 0.
pub(crate) fn packs_fit(elem_bytes: usize, d: usize, addrs: &[u64], strides: &[usize]) -> bool {
    let len = 16 / elem_bytes;
    d % len == 0 && addrs.iter().all(|a| a % 16 == 0) && strides.iter().all(|s| s % len == 0)
}

/// Narrowest rows whose column sums take four columns per thread: 128 slabs of 128 columns, about
/// one per SM. Narrower rows keep more, narrower slabs. (One column per thread at 16384, 512 slabs,
/// measured no better overall: `bench-results/h200.md`, forty-ninth session.)
const VECTOR_COLUMN_SUM_MIN_D: usize = 16384;

/// The second pass of every deterministic parameter gradient (dγ, dβ, dbias): sums the
/// `[groups, d]` fp32 partials at `partials` in a fixed order into `d` elements of `dtype` at
/// `out`, and in the same launch those of `second` (dβ's, next to dγ's) if any. With
/// `groups == 0` it writes zeros (the gradient over no rows).
pub(crate) fn column_sum(
    device: &dyn Device,
    dtype: Dtype,
    (partials, out): (u64, u64),
    second: Option<(u64, u64)>,
    groups: usize,
    d: usize,
) -> Result<Launch<Dtype, ColumnSumParams>> {
    let kernel = column_sum::KERNELS
        .find(&dtype)
        .ok_or(Error::Internal("no column sum for this dtype"))?;
    let sums = 1 + second.is_some() as usize;
    let aligned = partials % 16 == 0 && second.is_none_or(|(p, _)| p % 16 == 0);
    let second = second.unwrap_or((0, 0));
    // Four columns per thread where rows of partials are 16-byte aligned and wide enough for
    // slabs of 128 columns to fill the GPU; the same bits either way (the same order per column).
    let columns = if d % COLUMN_SUM_VECTOR == 0 && aligned && d >= VECTOR_COLUMN_SUM_MIN_D {
        COLUMN_SUM_VECTOR
    } else {
        1
    };
    // Groups that take each slice through more than one round of loads: several rounds in
    // flight at once, on slabs of 8 columns (the same order, the same bits).
    let chained = columns == 1 && groups > COLUMN_SUM_ROUND_GROUPS;
    let block = COLUMN_SUM_THREADS;
    let shared_bytes = (kernel.shared_bytes)(block);
    let slab = if chained { CHAIN_COLUMNS } else { 32 * columns };
    let slabs = d.div_ceil(slab) * sums;
    let grid = persistent_grid(device, kernel.entry(), slabs, block, 1, shared_bytes)?;
    Ok(Launch {
        kernel,
        grid,
        block,
        cluster: 1,
        shared_bytes,
        cooperative: false,
        // It follows the launch that wrote the partial rows and waits for it in the kernel
        // (`normkern_gpu::arch::wait_for_previous_launch`): its blocks take the SMs that the
        // backward's last blocks leave instead of waiting for a new launch to start.
        overlaps_previous: device.overlaps_launches(),
        params: ColumnSumParams {
            partials,
            out,
            partials2: second.0,
            out2: second.1,
            groups: groups as u32,
            d: d as u32,
            columns: columns as u32,
            chained: chained as u32,
        },
    })
}

/// How a backward that sums over rows (the norms' dγ and dβ, the activations' dbias) turns its
/// rows' contributions into the gradients. Every strategy starts alike: rows form groups of
/// consecutive rows ([`crate::group_layout`], a function of the shape alone) and each group's
/// contribution is summed in fp32 registers; they differ in what becomes of the groups' partial
/// rows. `docs/param-gradients.md` compares them, measured.
///
/// The deterministic strategies give the same bits as each other on the same shape, on any grid
/// and any GPU. Their workspace ([`crate::rms_norm::workspace_len`] and the like) starts with a
/// few words the single launch counts in: **allocate it zeroed** (`alloc_zeros`); every call
/// leaves them zero, so one zeroing at allocation serves every later call and every CUDA-graph
/// replay. (A count of the grid's size or more when a call starts makes its kernel trap, and the
/// CUDA context with it; a smaller stray count would let the sums start early, so never share the
/// workspace with anything else.) The rest of the workspace may hold anything between calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ParamGradients {
    /// normkern's choice for the shape among the deterministic strategies (so the choice never
    /// changes a result): [`Self::SingleLaunch`] for calls of up to 2²² elements (`rows × d`),
    /// where launches are most of the time; [`Self::TwoPass`] for larger ones, whose column sum
    /// overlaps the row kernel on sm_90 builds. sm_80 builds, where it cannot, also take the
    /// single launch for norm backwards of any size over rows of up to 256 or of 513 to 8192
    /// elements, where it was measured no slower.
    #[default]
    Auto,
    /// Each group of rows writes an fp32 partial row into the workspace; a second kernel sums the
    /// partial rows, each column in a fixed order. Two launches.
    TwoPass,
    /// As [`Self::TwoPass`], in one launch: once every block has written its partial rows (a grid
    /// barrier; the launch is cooperative, so all its blocks are resident at once), the same
    /// blocks sum them in the same order: the same bits. Rows whose kernel has no room for the
    /// sums' shared memory cannot use it ([`Error::Argument`]).
    SingleLaunch,
    /// Opt-in and **not deterministic**: every group adds its partial row into the gradients with
    /// fp32 atomics as it finishes (the streaming rows of very wide `d`: every row does), so the
    /// last bits vary from run to run. One launch, no workspace (any length will do). The
    /// gradients must be f32, and the call **adds** into them: zero them before the first call
    /// (or keep them, to accumulate over micro-batches).
    Atomic,
    /// A benchmark baseline, not for use: the Triton tutorial's scheme. Each group adds its
    /// partial row into one of a few zeroed partial rows (group `g` into `g % 16`) under that
    /// row's spin lock, then a column sum adds those rows: three launches (the zeroing, the row
    /// kernel, the sum), not deterministic (the adds into a row land in lock order). Row kernels
    /// of one block holding the row in registers only; others are refused (`Error::Argument`),
    /// as are activations.
    #[doc(hidden)]
    LockedPartials,
}

/// Most partial rows of [`ParamGradients::LockedPartials`] (per gradient), each with its lock.
const LOCKED_BUFFERS: usize = 16;

/// Partial rows [`ParamGradients::LockedPartials`] uses for `rows × d`: one per group, up to
/// [`LOCKED_BUFFERS`].
fn locked_buffers(rows: usize, d: usize) -> usize {
    LOCKED_BUFFERS
        .min(column_sum::group_layout(rows, d).1)
        .max(1)
}

/// Where the group partials of a backward's parameter gradients (dγ, dβ, dbias) go and how they
/// become the gradients. Every layout keeps the sums' fixed order; they differ in whose rows
/// the partial rows cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Partials {
    /// One device: the call's own group layout, summed as the [`ParamGradients`] strategy says.
    Own(ParamGradients),
    /// A rank's share of a batch split over ranks (exact mode): groups of `rows_per_group` rows
    /// of the whole batch's layout, this rank's written at their place among the batch's `groups`
    /// partial rows; once the other ranks' rows are gathered in, the column sum over all of them
    /// gives the bits of one device over the whole batch.
    Shard {
        rows_per_group: usize,
        first_group: usize,
        groups: usize,
    },
    /// Fast mode: the call's own layout, column sums in fp32 right after the partials (summed
    /// over ranks there), then cast into the outputs.
    OwnSummedAcross,
}

/// The parameter-gradient half of a backward's plan: where the row kernel writes its partials,
/// what it does with them, and the launches that turn them into the gradients.
pub(crate) struct GradientPlan {
    /// The row kernel's grouping of the call's rows.
    pub rows_per_group: usize,
    pub groups: usize,
    /// Where the row kernel writes the partial rows of the first sum and of the second (0: none);
    /// with atomic sums, the f32 gradients it adds into.
    pub partials: [u64; 2],
    /// What the row kernel does with its partial rows (its parameters' `sums`).
    pub group_sums: GroupSums,
    /// Exact mode: the batch's partial rows (address, groups, sums), to be gathered from the
    /// ranks before `sums`.
    pub gather: Option<(u64, usize, usize)>,
    /// The column sums after the row kernel: none where the row kernel sums or adds itself.
    pub sums: Option<Launch<Dtype, ColumnSumParams>>,
    /// Fast mode: the fp32 sums `sums` wrote (address, elements), to be summed over the ranks,
    /// and the cast of them into the outputs.
    pub cast: Option<(u64, usize, Launch<Dtype, ColumnSumParams>)>,
    /// f32 words to zero before the row kernel (address, words): the locked baseline's buffers.
    pub zero: Option<(u64, usize)>,
    /// The strategy, `Auto` left only where the single launch is wanted if it fits
    /// ([`Self::fit`]).
    strategy: ParamGradients,
}

/// Most elements (`rows × d`) of a call for which [`ParamGradients::Auto`] picks the single
/// launch whatever the op (see [`auto_single_launch`] for larger ones).
const AUTO_SINGLE_LAUNCH_MAX_ELEMS: usize = 1 << 22;

/// Widest rows for which a norm backward of any size takes the single launch under
/// [`ParamGradients::Auto`] (see [`auto_single_launch`]).
const AUTO_SINGLE_LAUNCH_MAX_D: usize = 8192;

/// Whose parameter gradients a backward sums: [`ParamGradients::Auto`] decides by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GradientsOf {
    /// dγ and dβ of a norm.
    Norm,
    /// dbias of an activation.
    Activation,
}

impl GradientsOf {
    /// `(rows_per_group, groups)` of the op's partial rows over `rows × d`: a function of the op
    /// and the shape alone. Every boundary of the activations' layout is one of the norms'.
    pub(crate) fn group_layout(self, rows: usize, d: usize) -> (usize, usize) {
        match self {
            GradientsOf::Norm => column_sum::group_layout(rows, d),
            GradientsOf::Activation => dbias_group_layout(rows, d),
        }
    }
}

/// Whether [`ParamGradients::Auto`] takes the single launch for `rows × d` (a function of the op,
/// the shape and whether the column sum can overlap the row kernel; either way the bits are
/// two-pass's). Every call of up to 2²² elements does: there launches are much of the time.
///
/// Where the column sum overlaps the row kernel (`overlapped`, sm_90 builds), two-pass measured
/// faster than the single launch at the larger shapes where the single launch had been taken
/// (23 of 24 cells at 2²⁶ elements, `bench-results/h200.md`, fifty-first session; sizes between
/// 2²² and 2²⁶ not measured), so larger calls take two launches. Without the overlap, larger
/// norm backwards take the single launch where an H200 measured it no slower than two-pass at
/// 2²⁶ elements (fourteenth session): rows of up to 256 elements (segment teams, at most 1024
/// groups) and of 513 to 8192. Rows of 257–512 take up to 8192 groups, which the row kernel's
/// resident blocks sum more slowly than the (chained) column-sum kernel (RMSNorm 70 against 82 %
/// of copy at 262144×512, twenty-seventh and twenty-eighth sessions), and rows wider than 8192
/// lost 2.6–4 points; the activations' dbias lost 1.5 at 16384×4096 and keeps two launches there.
fn auto_single_launch(of: GradientsOf, rows: usize, d: usize, overlapped: bool) -> bool {
    rows.saturating_mul(d) <= AUTO_SINGLE_LAUNCH_MAX_ELEMS
        || (!overlapped
            && of == GradientsOf::Norm
            && (d <= column_sum::SEGMENT_ROW_ELEMS
                || (column_sum::NARROW_ROW_ELEMS < d && d <= AUTO_SINGLE_LAUNCH_MAX_D)))
}

/// f32 elements of workspace for `sums` (1 or 2) parameter gradients of `of` of `d` elements over
/// `rows` rows laid out as `partials` says: the single launch's barrier words, then the partial rows
/// (none for atomic sums).
pub(crate) fn gradient_workspace_len(
    of: GradientsOf,
    partials: Partials,
    rows: usize,
    d: usize,
    sums: usize,
) -> Result<usize> {
    let too_large = Error::TooLarge {
        what: "workspace (groups × d)",
        value: d,
    };
    let (groups, extra_rows) = match partials {
        Partials::Own(ParamGradients::Atomic) => return Ok(0),
        Partials::Own(ParamGradients::LockedPartials) => {
            // The barrier's words (unused), the locks, then the buffers of each gradient.
            let buffers = locked_buffers(rows, d);
            return (buffers.checked_mul(d))
                .and_then(|n| n.checked_mul(sums))
                .and_then(|n| n.checked_add(GROUP_SUMS_SYNC_WORDS + LOCKED_BUFFERS))
                .ok_or(too_large);
        }
        Partials::Own(_) => (of.group_layout(rows, d).1, 0),
        Partials::Shard { groups, .. } => (groups, 0),
        Partials::OwnSummedAcross => (of.group_layout(rows, d).1, 1),
    };
    groups
        .checked_add(extra_rows)
        .and_then(|r| r.checked_mul(d))
        .and_then(|n| n.checked_mul(sums))
        .and_then(|n| n.checked_add(GROUP_SUMS_SYNC_WORDS))
        .ok_or(too_large)
}

/// Checks that the gradients' storage `dtype` suits the strategy: atomic sums add into f32.
pub(crate) fn check_gradients(partials: Partials, dtype: Dtype, activations: Dtype) -> Result<()> {
    if partials == Partials::Own(ParamGradients::Atomic) && dtype != Dtype::F32 {
        return Err(Error::UnsupportedDtypes {
            what: "parameter gradients (ParamGradients::Atomic)",
            dtype: dtype.name(),
            activations: activations.name(),
            supported: "atomic sums add into f32 gradients",
        });
    }
    Ok(())
}

/// The plan of the parameter gradients of a backward over `rows × d`: partials in `workspace`
/// (at least [`gradient_workspace_len`] f32, checked by the caller), the sums into `outputs[0]`
/// and, when not 0, `outputs[1]`, stored as `dtype` (f32 for atomic sums, checked by
/// [`check_gradients`]). The row kernel's launch then goes through [`GradientPlan::fit`].
pub(crate) fn gradient_plan(
    device: &dyn Device,
    of: GradientsOf,
    partials: Partials,
    (rows, d): (usize, usize),
    workspace: u64,
    outputs: [u64; 2],
    dtype: Dtype,
) -> Result<GradientPlan> {
    let row_bytes = (d * 4) as u64;
    let (rows_per_group, first_group, all_groups) = match partials {
        Partials::Own(_) | Partials::OwnSummedAcross => {
            let (per_group, groups) = of.group_layout(rows, d);
            (per_group, 0, groups)
        }
        Partials::Shard {
            rows_per_group,
            first_group,
            groups,
        } => (rows_per_group, first_group, groups),
    };
    let groups = rows.div_ceil(rows_per_group);
    let second = outputs[1] != 0;
    let sync = workspace;
    let rows_at = workspace + (GROUP_SUMS_SYNC_WORDS * 4) as u64;
    // Each sum's partial rows, all of them: [all_groups, d] f32, the second's after the first's.
    let partials_of = |sum: u64| rows_at + sum * all_groups as u64 * row_bytes;
    let at = |sum: u64| partials_of(sum) + first_group as u64 * row_bytes;
    let if_second = |address: u64| if second { address } else { 0 };
    let plan = |out: [u64; 2], partials: [u64; 2], groups, dtype| {
        let second = (out[1] != 0).then_some((partials[1], out[1]));
        column_sum(device, dtype, (partials[0], out[0]), second, groups, d)
    };
    let strategy = match partials {
        Partials::Own(ParamGradients::Auto)
            if !auto_single_launch(of, rows, d, device.overlaps_launches()) =>
        {
            ParamGradients::TwoPass
        }
        Partials::Own(strategy) => strategy,
        _ => ParamGradients::TwoPass,
    };
    if strategy == ParamGradients::LockedPartials {
        let buffers = locked_buffers(rows, d);
        let locks = workspace + (GROUP_SUMS_SYNC_WORDS * 4) as u64;
        let first = locks + (LOCKED_BUFFERS * 4) as u64;
        let second_at = if second {
            first + (buffers * d * 4) as u64
        } else {
            0
        };
        let words = LOCKED_BUFFERS + buffers * d * (1 + second as usize);
        return Ok(GradientPlan {
            rows_per_group,
            groups,
            partials: [first, second_at],
            group_sums: GroupSums {
                mode: GROUP_SUMS_LOCKED,
                sync: locks,
                buffers: buffers as u32,
                ..GroupSums::default()
            },
            gather: None,
            sums: Some(plan(outputs, [first, second_at], buffers, dtype)?),
            cast: None,
            zero: Some((locks, words)),
            strategy,
        });
    }
    if strategy == ParamGradients::Atomic {
        return Ok(GradientPlan {
            rows_per_group,
            groups,
            partials: outputs,
            group_sums: GroupSums {
                mode: GROUP_SUMS_ATOMIC,
                ..GroupSums::default()
            },
            gather: None,
            sums: None,
            cast: None,
            zero: None,
            strategy,
        });
    }
    let mut gradient = GradientPlan {
        rows_per_group,
        groups,
        partials: [at(0), if_second(at(1))],
        group_sums: GroupSums {
            sync,
            out: outputs[0],
            out2: outputs[1],
            out_f32: (dtype == Dtype::F32) as u32,
            ..GroupSums::default()
        },
        gather: None,
        sums: Some(plan(
            outputs,
            [partials_of(0), partials_of(1)],
            all_groups,
            dtype,
        )?),
        cast: None,
        zero: None,
        strategy,
    };
    match partials {
        Partials::Own(_) => {}
        Partials::Shard { .. } => {
            gradient.gather = Some((rows_at, all_groups, 1 + second as usize));
        }
        Partials::OwnSummedAcross => {
            // fp32 sums after all partial rows, one row per sum; the cast is a column sum of one.
            let sums_at = partials_of(1 + second as u64);
            let fp32 = [sums_at, if_second(sums_at + row_bytes)];
            let count = d * (1 + second as usize);
            gradient.sums = Some(plan(
                fp32,
                [partials_of(0), partials_of(1)],
                all_groups,
                Dtype::F32,
            )?);
            gradient.cast = Some((sums_at, count, plan(outputs, fp32, 1, dtype)?));
        }
    }
    Ok(gradient)
}

impl GradientPlan {
    /// Fits the row kernel's launch (`rows`, a persistent grid over `work` items) to the
    /// strategy and returns what its parameters' `sums` must say. The single launch takes
    /// [`GROUP_SUMS_SHARED_WORDS`] more shared memory, a grid that is resident all at once (and
    /// has a block for each slab of the sums, up to that: blocks without rows wait at the barrier
    /// and sum), a cooperative launch, and drops the column sums; where the kernel has no room for that
    /// shared memory, `Auto` keeps two launches and a forced single launch is refused.
    pub(crate) fn fit<K, P>(
        &mut self,
        device: &dyn Device,
        rows: &mut Launch<K, P>,
        work: usize,
    ) -> Result<GroupSums> {
        let single = match self.strategy {
            ParamGradients::Atomic => return Ok(self.group_sums),
            // The norm plan checks the tile (`norm::backward::plan`).
            ParamGradients::LockedPartials => return Ok(self.group_sums),
            ParamGradients::TwoPass => false,
            ParamGradients::Auto | ParamGradients::SingleLaunch => true,
        };
        if !single {
            return Ok(self.group_sums);
        }
        let shared_bytes = rows.shared_bytes + GROUP_SUMS_SHARED_WORDS * 4;
        let limit = if rows.kernel.large_shared {
            device.shared_opt_in()
        } else {
            DEFAULT_SHARED_BYTES
        };
        if shared_bytes > limit {
            if self.strategy == ParamGradients::SingleLaunch {
                return Err(Error::Argument {
                    what: "ParamGradients::SingleLaunch",
                    problem: "this row kernel has no room for the sums' shared memory; use \
                              TwoPass or Auto",
                });
            }
            return Ok(self.group_sums);
        }
        // The sums' work items are slabs of 32 columns of each gradient: a grid that has fewer
        // blocks than them (one block for one row) would walk them one after another.
        let sums = self.sums.as_ref().map_or(0, |s| {
            let p = &s.params;
            (p.d as usize).div_ceil(32) * (1 + (p.out2 != 0) as usize)
        });
        let grid = persistent_grid(
            device,
            rows.kernel.entry(),
            work.max(sums),
            rows.block,
            rows.cluster,
            shared_bytes,
        )?;
        (rows.grid, rows.shared_bytes, rows.cooperative) = (grid, shared_bytes, true);
        self.sums = None;
        Ok(GroupSums {
            mode: GROUP_SUMS_IN_LAUNCH,
            ..self.group_sums
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The backward's block sizes.
    const SIZES: BlockSizes = BlockSizes {
        preferred: PREFERRED_THREADS,
        stream: STREAM_THREADS,
    };

    /// An H200 as the plans see it: 132 SMs, 64K registers and 2048 threads per SM, clusters of
    /// 8 in 15 GPCs and (where `max_cluster` allows) of 16 in 7; each kernel's registers per
    /// thread from `registers(entry name)`.
    pub(crate) struct FakeH200 {
        pub registers: fn(&str) -> usize,
        pub grid_limit: Option<usize>,
        /// 16, or 8 as a device (or driver) without non-portable clusters.
        pub max_cluster: usize,
        /// Whether launches may overlap (an sm_90 build); false plans as an sm_80 build would.
        pub overlaps: bool,
    }

    impl FakeH200 {
        fn per_sm(&self, kernel: Entry, block: usize, shared: usize) -> usize {
            let by_threads = 2048 / block;
            let by_registers = 65536 / ((self.registers)(kernel.name) * block);
            let by_shared = (228 * 1024) / (shared + 1024);
            by_threads.min(by_registers).min(by_shared).min(32)
        }
    }

    impl Device for FakeH200 {
        fn sm_count(&self) -> usize {
            132
        }
        fn max_cluster(&self) -> usize {
            self.max_cluster
        }
        fn overlaps_launches(&self) -> bool {
            self.overlaps
        }
        fn shared_opt_in(&self) -> usize {
            227 * 1024
        }
        fn grid_limit(&self) -> Option<usize> {
            self.grid_limit
        }
        fn max_threads(&self, kernel: Entry) -> Result<usize> {
            Ok((65536 / (self.registers)(kernel.name)).min(1024) / 32 * 32)
        }
        fn resident_blocks(&self, kernel: Entry, block: usize, shared: usize) -> Result<usize> {
            Ok(132 * self.per_sm(kernel, block, shared))
        }
        fn resident_clusters(
            &self,
            k: Entry,
            block: usize,
            cluster: usize,
            s: usize,
        ) -> Result<usize> {
            let per_sm = self.per_sm(k, block, s);
            // Clusters of 8 and 16 take the SMs of a GPC (up to 18, some fewer).
            Ok(if cluster > self.max_cluster {
                0
            } else if cluster == 16 {
                7 * per_sm
            } else if cluster == 8 {
                15 * per_sm
            } else {
                132 * per_sm / cluster
            })
        }
    }

    /// The tile for `d` elements of `len` per access on a device whose kernels take
    /// `regs(vpt, cluster)` registers per thread (64K per SM, 1024 threads per block at most).
    fn pick(d: usize, len: usize, max_cluster: usize, regs: fn(usize, bool) -> usize) -> RowTile {
        pick_with(d, len, max_cluster, regs, |_| false)
    }

    /// [`pick`] for kernels whose blocks past the preferred size try the tiles of `wide_first`
    /// first.
    fn pick_with(
        d: usize,
        len: usize,
        max_cluster: usize,
        regs: fn(usize, bool) -> usize,
        wide_first: fn(usize) -> bool,
    ) -> RowTile {
        let max_threads =
            |vpt, cluster: usize| Ok(Some((65536 / regs(vpt, cluster > 1)).min(1024) / 32 * 32));
        row_tile(
            d,
            len,
            &[1, 2, 4],
            (CLUSTER_SIZES, max_cluster),
            SIZES,
            max_threads,
            wide_first,
        )
        .unwrap()
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
            lanes: 0,
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
    fn rows_past_the_preferred_block_take_the_family_s_wide_tile_first() {
        use normkern_gpu::norm::forward_wide_block_first;
        // 16384 bf16: plain rows take the 4-pack tile, two 512-thread blocks per SM.
        let plain = |vpt| forward_wide_block_first(false, vpt);
        assert_eq!(pick_with(16384, 8, 8, forward_regs, plain), tile(4, 512, 1));
        // The residual kernels: the fewest accesses, more warps.
        let residual = |vpt| forward_wide_block_first(true, vpt);
        assert_eq!(
            pick_with(16384, 8, 8, forward_regs, residual),
            tile(2, 1024, 1)
        );
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

    #[test]
    fn tiles_that_are_not_compiled_are_skipped() {
        // No cluster instances (as for single-element access): the row streams in one block.
        let max_threads = |_vpt, cluster: usize| Ok((cluster == 1).then_some(1024));
        let t = row_tile(
            65536,
            8,
            &[1, 2, 4],
            (CLUSTER_SIZES, 8),
            SIZES,
            max_threads,
            |_| false,
        )
        .unwrap();
        assert_eq!(t, tile(STREAM, 1024, 1));
        // Only the streaming tile (the residual kernels' single-element access).
        let t = row_tile(
            100,
            1,
            &[],
            (CLUSTER_SIZES, 1),
            SIZES,
            |_, _| Ok(Some(1024)),
            |_| false,
        )
        .unwrap();
        assert_eq!(t, tile(STREAM, 128, 1));
    }
}
