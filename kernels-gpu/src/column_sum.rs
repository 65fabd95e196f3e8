//! The second pass of the deterministic parameter gradients (dγ, dβ, dbias): rows form groups of
//! consecutive rows, each group writes one fp32 partial row, and the column sum adds the partial
//! rows in a fixed order.
//!
//! The group layout ([`group_layout`]) is a function of the shape alone, never of the grid or the
//! GPU, and every column is summed in an order fixed by the layout: the gradients are the same bits
//! on any grid and any GPU, and the partial rows of the groups a GPU owns can be gathered from
//! several GPUs in group order and summed to the same bits again.

use crate::arch::{self, WARP};
use crate::element::{Access, Element, F32, Pack, load_f32s, store_f32s};
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::{Dtype, Table};

/// Most groups of a layout (of rows wider than [`NARROW_ROW_ELEMS`]), and fewest rows per group:
/// the fp32 partial rows (written and read once) stay a few percent of a backward's traffic.
pub const MAX_GROUPS: usize = 512;
pub const MIN_ROWS_PER_GROUP: usize = 16;
/// Rows of at most this many elements may take more groups, `2²¹ / d` up to
/// [`MAX_NARROW_GROUPS`]. A narrow row is little work for the block walking it, and each group is
/// walked by one block: 512 groups left 1 Mi rows of 512 to 512 blocks of two warps each. Rows of
/// 1024 keep 512 although their blocks then fill about four fifths of the resident slots: more
/// groups measured slower in every plain backward (`bench-results/h200.md`, forty-ninth session).
pub const NARROW_ROW_ELEMS: usize = 512;
pub const MAX_NARROW_GROUPS: usize = 8192;
/// Rows of at most this many elements take at most [`SEGMENT_ROW_GROUPS`] groups: their backward
/// runs segment teams (`crate::norm::segments`) — a block per group, many rows at a time — so a
/// group of many rows is no slower, 1024 of them keep about three blocks on every SM, and the
/// partial rows and their column sum stay small (8192 groups of 128 rows had one block sum 4 MB).
pub const SEGMENT_ROW_ELEMS: usize = 256;
pub const SEGMENT_ROW_GROUPS: usize = 1024;
/// Most groups of a small batch (see [`group_layout`]).
pub const SMALL_BATCH_GROUPS: usize = 256;
/// Elements of a small batch per row of each of its groups (see [`group_layout`]).
pub const SMALL_BATCH_ELEMS: usize = 1 << 20;
/// Rows wider than this many elements are split over clusters of 8 blocks, of which the 132-SM
/// Hopper parts (H100 SXM, H200) hold [`WIDE_ROW_TEAMS`] at a time.
const WIDE_ROW_ELEMS: usize = 32768;
const WIDE_ROW_TEAMS: usize = 15;
/// Fewest rows per group of rows wider than `WIDE_ROW_ELEMS`.
pub const MIN_WIDE_ROWS_PER_GROUP: usize = 4;
/// Rows of `LONG_GROUP_MIN_D` to `LONG_GROUP_MAX_D` elements take longer groups (2 or 4 times
/// the base, lengthened to at most `LONG_GROUP_MAX_ROWS` rows) where as many busy teams remain:
/// each group writes and reads back an fp32 partial row per gradient, 8·d bytes against the 6·d
/// of a 16-bit row of x, dy and dx — groups of 16 rows add 8 % to RMSNorm's backward traffic and
/// 17 % to LayerNorm's (dγ and dβ). Those row kernels run about one team per SM (132 on
/// Hopper, fewer with clusters), so the layout keeps at least `max(2²⁰ / d, 128)` groups: 256 at
/// 4096, where two blocks share an SM.
const LONG_GROUP_MIN_D: usize = 4096;
const LONG_GROUP_MAX_D: usize = 16384;
const LONG_GROUP_MAX_ROWS: usize = 64;
const LONG_GROUP_MIN_GROUPS: usize = 128;

/// `(rows_per_group, groups)` for `rows` rows of `d` elements: a function of the shape alone,
/// which is what makes the gradients the same bits on every grid and every GPU. Every group has
/// `rows_per_group` rows but the last, which has the rest.
///
/// Rows of 4096 to 16384 elements in batches that are not small take groups two or four times
/// [`base_rows_per_group`]'s, lengthened to at most 64 rows and only while enough groups remain to
/// keep the row kernel's teams busy; the rest of this describes [`base_rows_per_group`], which
/// [`crate::activation::kernels::dbias_group_layout`] builds on.
pub fn group_layout(rows: usize, d: usize) -> (usize, usize) {
    let base = base_rows_per_group(rows, d);
    let per_group = if (LONG_GROUP_MIN_D..=LONG_GROUP_MAX_D).contains(&d)
        && rows >= SMALL_BATCH_GROUPS * MIN_ROWS_PER_GROUP
    {
        let least_groups = ((1 << 20) / d).max(LONG_GROUP_MIN_GROUPS);
        // Four, else two times the base where that keeps enough groups: dbias's groups, four
        // base groups each, stay whole numbers of these (one batch split serves both).
        let fits = |p: usize| p <= LONG_GROUP_MAX_ROWS && rows.div_ceil(p) >= least_groups;
        [4, 2]
            .map(|times| base.saturating_mul(times))
            .into_iter()
            .find(|&p| fits(p))
            .unwrap_or(base)
    } else {
        base
    };
    (per_group, rows.div_ceil(per_group))
}

/// Rows per group before [`group_layout`]'s longer groups: a function of the shape alone.
///
/// Small batches of rows up to `WIDE_ROW_ELEMS` (fewer than [`SMALL_BATCH_GROUPS`] ·
/// [`MIN_ROWS_PER_GROUP`] rows) take smaller
/// groups, down to one row, so that their few rows spread over the SMs instead of queueing in a
/// few blocks: up to [`SMALL_BATCH_GROUPS`] groups, each of at least one row per
/// [`SMALL_BATCH_ELEMS`] elements of the call, which bounds the partial rows' extra traffic where
/// it could cost bandwidth rather than latency.
///
/// Rows wider than `WIDE_ROW_ELEMS` have few teams walking the groups, so the count of groups
/// decides the balance: 64 groups of 16 over 15 clusters take 5 rounds where 4.3 would do. Their
/// group size is picked (from [`MIN_WIDE_ROWS_PER_GROUP`] up to one round's worth) for the shortest
/// busiest team of `WIDE_ROW_TEAMS`, counting each group's partial row (f32, written and read
/// once) as 4/3 of a row of 16-bit x, dy and dx: 1024 rows take 15 groups of 69 (one round), and
/// 64 rows 13 of 5. Any other team count still gets a valid layout, only a less even one.
///
/// The search is bounded: a group size's cost is the busiest team's rounds times its rows, and
/// for each number of rounds (at most `MAX_GROUPS / WIDE_ROW_TEAMS + 1`, as there are at most
/// `MAX_GROUPS` groups) only the smallest group size that needs no more rounds can be cheapest.
pub fn base_rows_per_group(rows: usize, d: usize) -> usize {
    let most_groups = if d <= SEGMENT_ROW_ELEMS {
        SEGMENT_ROW_GROUPS
    } else if d <= NARROW_ROW_ELEMS {
        ((1 << 21) / d).min(MAX_NARROW_GROUPS)
    } else {
        MAX_GROUPS
    };
    let fewest_groups = rows.div_ceil(most_groups);
    let default = fewest_groups.max(MIN_ROWS_PER_GROUP);
    if d <= WIDE_ROW_ELEMS && rows < SMALL_BATCH_GROUPS * MIN_ROWS_PER_GROUP {
        let by_size = rows.saturating_mul(d).div_ceil(SMALL_BATCH_ELEMS);
        (rows.div_ceil(SMALL_BATCH_GROUPS).max(by_size)).clamp(1, MIN_ROWS_PER_GROUP)
    } else if d > WIDE_ROW_ELEMS {
        let rounds = |p: usize| rows.div_ceil(p).div_ceil(WIDE_ROW_TEAMS);
        let cost = |p: usize| rounds(p).saturating_mul(p.saturating_mul(3).saturating_add(4));
        let lo = fewest_groups.max(MIN_WIDE_ROWS_PER_GROUP);
        let hi = default
            .saturating_mul(2)
            .max(rows.div_ceil(WIDE_ROW_TEAMS))
            .max(lo);
        // Smallest size first, and among equal costs the smaller size: the first minimum of a
        // scan over lo..=hi.
        let mut best = (cost(lo), lo);
        for r in 1..=rounds(lo) {
            let p = rows
                .div_ceil(WIDE_ROW_TEAMS.saturating_mul(r))
                .clamp(lo, hi);
            best = best.min((cost(p), p));
        }
        best.1
    } else {
        default
    }
}

/// Parameters of the column sum: `out[j] = Σ_g partials[g·d + j]`, g in a fixed order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ColumnSumParams {
    /// `[groups, d]` fp32 partials.
    pub partials: u64,
    /// `d` elements of the output dtype.
    pub out: u64,
    /// A second sum of the same shape in the same launch (dβ next to dγ): its partials and
    /// output, `out2` = 0 for none.
    pub partials2: u64,
    pub out2: u64,
    pub groups: u32,
    pub d: u32,
    /// Columns per thread: [`COLUMN_SUM_VECTOR`] (16-byte loads; `d` a multiple of it, the
    /// partials 16-byte aligned) or else one.
    pub columns: u32,
    /// Nonzero: slabs of [`CHAIN_COLUMNS`] columns, each slice's rounds in flight
    /// [`CHAIN_PARTS`] at a time (`columns` is then one; see [`column_sum`]).
    pub chained: u32,
}

/// Threads per block of [`column_sum`]: 32 lanes × `COLUMN_SUM_SLICES` group slices.
pub const COLUMN_SUM_THREADS: usize = 512;
/// Loads each thread of [`column_sum`] keeps in flight with one column (a quarter as many, of
/// four columns each, with [`COLUMN_SUM_VECTOR`]): 32 sums a slice's share of 512 groups in one
/// round trip. The sum order does not depend on it.
const COLUMN_SUM_UNROLL: usize = 32;
/// Group slices per block of [`column_sum`]: slice `s` sums groups `s, s + 16, s + 32, …`, then the
/// slices are added in slice order.
pub const COLUMN_SUM_SLICES: usize = COLUMN_SUM_THREADS / WARP;
/// Columns per thread of the vector column sum: one 16-byte load of f32.
pub const COLUMN_SUM_VECTOR: usize = 4;
/// Groups one round of every slice covers (32 loads by each slice's thread):
/// more groups than this take the chained sum, which keeps several rounds in flight.
pub const COLUMN_SUM_ROUND_GROUPS: usize = COLUMN_SUM_UNROLL * COLUMN_SUM_SLICES;
/// Columns of a slab of the chained column sum: a warp is one slice of 8 columns, its four
/// quarter-warps ([`CHAIN_PARTS`]) each loading one round of them (32 bytes of a partial row per
/// quarter-warp, a whole sector).
pub const CHAIN_COLUMNS: usize = 8;
/// Rounds of each slice in flight at once in the chained column sum.
pub const CHAIN_PARTS: usize = WARP / CHAIN_COLUMNS;

/// Column sum of the fp32 partials into `out` in dtype `T` (and of `partials2` into `out2`);
/// launch with [`COLUMN_SUM_THREADS`] threads and `COLUMN_SUM_THREADS · columns` words of shared
/// memory, any grid (blocks walk slabs of `32 · columns` columns, the first sum's then the
/// second's).
///
/// Every column is summed in the same order whatever `columns` is (its slice's groups in order,
/// then the slices in order), so the two give the same bits: the vector one is the same sum with
/// a quarter of the loads and slabs four times wider: wide rows' one-column sums were
/// latency-bound walking thousands of slabs of 32 columns (`bench-results/h200.md`).
///
/// Many groups (more than [`COLUMN_SUM_ROUND_GROUPS`]) take each slice through several rounds of
/// loads, one round trip each, and few slabs leave most SMs idle: 4096 groups of rows of 512 are
/// 8 round trips on 16 blocks. The chained sum (`chained`) keeps [`CHAIN_PARTS`] rounds of a
/// slice in flight at once, on four times as many blocks, and adds them in the same order: the
/// round's part adds its loads to the running sum of the rounds before, then hands the sum to
/// the next part with a shuffle. Same order, same bits.
///
/// # Safety
/// The params describe valid buffers.
#[inline(always)]
pub unsafe fn column_sum<T: Element>(p: &ColumnSumParams) {
    // Launched to overlap the backward that wrote the partial rows: wait for all of them.
    arch::wait_for_previous_launch();
    unsafe {
        if p.chained != 0 {
            column_sum_chained::<T>(p)
        } else if p.columns as usize == COLUMN_SUM_VECTOR {
            column_sum_by::<T, COLUMN_SUM_VECTOR, true>(p, 0)
        } else {
            column_sum_by::<T, 1, true>(p, 0)
        }
    }
}

/// The sum of one group slice of a column (or of `COLUMNS` adjacent ones): groups `slice`,
/// `slice + COLUMN_SUM_SLICES`, … in order. `d` is a multiple of `COLUMNS`, and `col < d`.
#[inline(always)]
unsafe fn slice_sum<const COLUMNS: usize>(
    partials: u64,
    (col, d): (usize, usize),
    slice: usize,
    groups: usize,
) -> [f32; COLUMNS] {
    let mut acc = [0.0f32; COLUMNS];
    // Issue COLUMN_SUM_UNROLL independent loads, then add them in group order: the order is the
    // plain sequential one, the loads overlap instead of waiting one by one. Four columns per
    // thread keep a quarter as many loads in flight (as many registers).
    let unroll = if COLUMNS > 1 {
        COLUMN_SUM_UNROLL / 4
    } else {
        COLUMN_SUM_UNROLL
    };
    let mut g = slice;
    while g < groups {
        let mut vals = [[0.0f32; COLUMNS]; COLUMN_SUM_UNROLL];
        for u in 0..unroll {
            let gu = g + u * COLUMN_SUM_SLICES;
            if COLUMNS > 1 {
                // Unconditional loads (of the last group past the end, then dropped), so all of
                // them issue before the first add waits.
                let row = partials + (gu.min(groups - 1) * d * 4) as u64;
                let loaded = unsafe { load_f32s::<true>(row, col, COLUMNS) };
                for c in 0..COLUMNS {
                    vals[u][c] = if gu < groups { loaded[c] } else { 0.0 };
                }
            } else if gu < groups {
                let row = partials + (gu * d * 4) as u64;
                vals[u][0] = unsafe { load_f32s::<false>(row, col, 1) }[0];
            }
        }
        for u in 0..unroll {
            for c in 0..COLUMNS {
                acc[c] += vals[u][c];
            }
        }
        g += unroll * COLUMN_SUM_SLICES;
    }
    acc
}

/// [`column_sum`] in slabs of [`CHAIN_COLUMNS`] columns: warp `w` is slice `w` (a block of
/// [`COLUMN_SUM_THREADS`]), lane `l` column `l % 8` of the slab and part `l / 8`, which loads
/// rounds `part`, `part + 4`, … of its slice (round `r`: groups `slice + 16 · (32r + u)`, u <
/// 32, as in [`slice_sum`]). The rounds are added in round order along the chain of parts, and a
/// round with no group adds nothing, one with some adds all 32 loads (zeros past the end), as
/// [`slice_sum`] does: the same adds in the same order.
#[inline(always)]
unsafe fn column_sum_chained<T: Element>(p: &ColumnSumParams) {
    let shared = arch::shared_f32();
    let tid = arch::thread_idx();
    let (lane, slice) = (tid % WARP, tid / WARP);
    let (column, part) = (lane % CHAIN_COLUMNS, lane / CHAIN_COLUMNS);
    let (d, groups) = (p.d as usize, p.groups as usize);
    // The slab walk and the final slice total repeat `column_sum_by`'s: one helper for both
    // changed the code of the in-launch sum that every backward calls (ptxas: the sm_80
    // `act_bwd_dbias_*_s` kernels 40 → 56 registers), so each keeps its own.
    let slabs = d.div_ceil(CHAIN_COLUMNS);
    let sums = if p.out2 != 0 { 2 } else { 1 };
    let mut item = arch::block_idx();
    while item < sums * slabs {
        let (partials, out) = if item < slabs {
            (p.partials, p.out)
        } else {
            (p.partials2, p.out2)
        };
        let col = item % slabs * CHAIN_COLUMNS + column;
        // The running sum of this lane's column over the rounds so far, the same in every part.
        let mut carry = 0.0f32;
        // The first group of the slice's first round of this wave of `CHAIN_PARTS` rounds: the
        // same in every lane of the warp, so every lane takes every shuffle.
        let mut wave = slice;
        while wave < groups {
            let first = wave + part * COLUMN_SUM_ROUND_GROUPS;
            let mut vals = [0.0f32; COLUMN_SUM_UNROLL];
            if col < d {
                for (u, v) in vals.iter_mut().enumerate() {
                    let g = first + u * COLUMN_SUM_SLICES;
                    if g < groups {
                        *v =
                            unsafe { load_f32s::<false>(partials + (g * d * 4) as u64, col, 1) }[0];
                    }
                }
            }
            for link in 0..CHAIN_PARTS {
                // Every part adds its round to the carry; only part `link`'s sum is kept.
                let mut acc = carry;
                if first < groups {
                    for v in &vals {
                        acc += v;
                    }
                }
                carry = arch::shfl_idx(acc, (link * CHAIN_COLUMNS + column) as u32);
            }
            wave += CHAIN_PARTS * COLUMN_SUM_ROUND_GROUPS;
        }
        if part == 0 {
            unsafe { shared.store(slice * CHAIN_COLUMNS + column, carry) };
        }
        arch::sync_threads();
        if slice == 0 && part == 0 && col < d {
            let mut total = 0.0f32;
            for s in 0..COLUMN_SUM_SLICES {
                total += unsafe { shared.load(s * CHAIN_COLUMNS + column) };
            }
            let mut pack: Pack = [0; 4];
            T::set(&mut pack, 0, total);
            unsafe { Access::<T, false>::store(out, col, &pack) };
        }
        arch::sync_threads();
        item += arch::grid_dim();
    }
}

/// The column sum by a block: each slab of `32 · COLUMNS` columns has its
/// [`COLUMN_SUM_SLICES`] group slices summed (warp `w` slice `w` when `SLICE_PER_WARP`, the
/// column-sum kernel's 16 warps; else, for a block of any size, slices `w`, `w + warps`, … in
/// turn), each slice's sum put in shared memory at `base` (`COLUMN_SUM_SLICES · 32 · COLUMNS`
/// words), and the slices added in slice order: the same order, so the same bits, for every
/// block size.
#[inline(always)]
unsafe fn column_sum_by<T: Element, const COLUMNS: usize, const SLICE_PER_WARP: bool>(
    p: &ColumnSumParams,
    base: usize,
) {
    let shared = arch::shared_f32();
    let tid = arch::thread_idx();
    let (lane, warp) = (tid % WARP, tid / WARP);
    let warps = if SLICE_PER_WARP {
        COLUMN_SUM_SLICES
    } else {
        arch::block_dim() / WARP
    };
    let (d, groups) = (p.d as usize, p.groups as usize);
    // The first shared word of a slice's share of this lane's columns.
    let word = |slice: usize| base + (slice * WARP + lane) * COLUMNS;
    let slabs = d.div_ceil(WARP * COLUMNS);
    // The output says whether there is a second sum: with no rows the partials may be empty, and
    // an empty device allocation sits at address 0.
    let sums = if p.out2 != 0 { 2 } else { 1 };
    let mut item = arch::block_idx();
    while item < sums * slabs {
        let (partials, out) = if item < slabs {
            (p.partials, p.out)
        } else {
            (p.partials2, p.out2)
        };
        let col = (item % slabs * WARP + lane) * COLUMNS;
        let mut slice = warp;
        while slice < COLUMN_SUM_SLICES {
            // `d` is a multiple of `COLUMNS`: a thread's columns are all inside or all past it.
            let acc = if col < d {
                unsafe { slice_sum::<COLUMNS>(partials, (col, d), slice, groups) }
            } else {
                [0.0; COLUMNS]
            };
            for (c, a) in acc.iter().enumerate() {
                unsafe { shared.store(word(slice) + c, *a) };
            }
            if SLICE_PER_WARP {
                break;
            }
            slice += warps;
        }
        arch::sync_threads();
        if warp == 0 && col < d {
            for c in 0..COLUMNS {
                let mut total = 0.0f32;
                for s in 0..COLUMN_SUM_SLICES {
                    total += unsafe { shared.load(word(s) + c) };
                }
                let mut pack: Pack = [0; 4];
                T::set(&mut pack, 0, total);
                unsafe { Access::<T, false>::store(out, col + c, &pack) };
            }
        }
        arch::sync_threads();
        item += arch::grid_dim();
    }
}

/// [`GroupSums::mode`]: store the partial rows for a column-sum launch after the row kernel.
pub const GROUP_SUMS_PARTIALS: u32 = 0;
/// [`GroupSums::mode`]: store them, then sum them in the same launch after a grid barrier.
pub const GROUP_SUMS_IN_LAUNCH: u32 = 1;
/// [`GroupSums::mode`]: add them into f32 gradients with atomics.
pub const GROUP_SUMS_ATOMIC: u32 = 2;
/// [`GroupSums::mode`]: add each group's partial row into one of [`GroupSums::buffers`] zeroed
/// partial rows (group `g` into `g % buffers`) under that row's lock, for a column sum over the
/// buffers after this launch: the Triton tutorial's scheme, a benchmark baseline (register tiles
/// of one block only).
pub const GROUP_SUMS_LOCKED: u32 = 3;

/// Words of shared memory [`finish_group_sums`] takes at the end of a block's dynamic shared
/// memory: one per lane and group slice.
pub const GROUP_SUMS_SHARED_WORDS: usize = COLUMN_SUM_SLICES * WARP;

/// Words at the start of a backward's workspace for its grid barrier (arrivals, generation; two
/// more keep the partial rows after them 16-byte aligned). Zero when allocated; every call
/// leaves them so.
pub const GROUP_SUMS_SYNC_WORDS: usize = 4;

/// What a backward's row kernel does with each group's partial row (part of its parameters).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupSums {
    /// [`GROUP_SUMS_PARTIALS`]: store the partial rows, for a [`column_sum`] launch after this
    /// one. [`GROUP_SUMS_IN_LAUNCH`]: store them, wait for every block at a grid barrier (a
    /// cooperative launch), then sum them exactly as the column sum does into `out` (and `out2`).
    /// [`GROUP_SUMS_ATOMIC`]: add each partial row into the f32 row the partials pointer names,
    /// with atomics (no fixed order).
    pub mode: u32,
    /// `out`/`out2` are f32 (else the activations' dtype).
    pub out_f32: u32,
    /// [`GROUP_SUMS_IN_LAUNCH`]: the barrier's words ([`GROUP_SUMS_SYNC_WORDS`]).
    pub sync: u64,
    pub out: u64,
    /// 0: one sum.
    pub out2: u64,
    /// [`GROUP_SUMS_LOCKED`]: the partial rows that groups add into, and `sync` holds one lock
    /// word per row.
    pub buffers: u32,
    pub _pad: u32,
}

/// Ends a row kernel's parameter gradients as `sums` says: nothing more for two-pass and atomics;
/// in-launch sums wait for every block, then sum the `groups` partial rows of `d` at `partials`
/// (and `partials2`) in the column sum's order. Call from every thread, after the block's last
/// partial row is stored and its cluster is done with shared memory.
///
/// # Safety
/// The partial rows and outputs are valid; an in-launch sum's launch is cooperative, and its
/// blocks have [`GROUP_SUMS_SHARED_WORDS`] words at the end of their dynamic shared memory.
#[inline(always)]
pub unsafe fn finish_group_sums<T: Element>(
    sums: &GroupSums,
    (partials, partials2): (u64, u64),
    groups: usize,
    d: usize,
) {
    if sums.mode == GROUP_SUMS_IN_LAUNCH {
        let (groups, d) = (groups as u32, d as u32);
        let (out, out2, out_f32) = (sums.out, sums.out2, sums.out_f32);
        unsafe {
            sum_in_launch::<T>(
                sums.sync, out, out2, out_f32, partials, partials2, groups, d,
            )
        }
    }
}

/// The in-launch sums of [`finish_group_sums`]: one function per output dtype, called at the end
/// of every backward rather than inlined into it, so that the backward's registers and code stay
/// its own and the sum's loops are unrolled as in the column-sum kernel. Scalars only: an
/// aggregate argument would go through local memory.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn sum_in_launch<T: Element>(
    sync: u64,
    out: u64,
    out2: u64,
    out_f32: u32,
    partials: u64,
    partials2: u64,
    groups: u32,
    d: u32,
) {
    unsafe { arch::grid_barrier(sync) };
    let params = ColumnSumParams {
        partials,
        out,
        partials2,
        out2,
        groups,
        d,
        columns: 1,
        chained: 0,
    };
    let base = arch::dynamic_shared_words() - GROUP_SUMS_SHARED_WORDS;
    unsafe {
        if out_f32 != 0 {
            column_sum_by::<F32, 1, false>(&params, base)
        } else {
            column_sum_by::<T, 1, false>(&params, base)
        }
    }
}

/// Stores `len` partial sums of group `group` at column `elem` of the `[groups, d]` partial rows
/// at `partials` or, with atomic sums, adds them into the f32 row at `partials`.
///
/// # Safety
/// The row (or group row) is valid for the columns.
#[inline(always)]
pub unsafe fn store_group_partials<const VEC: bool>(
    sums: &GroupSums,
    partials: u64,
    (group, d): (usize, usize),
    elem: usize,
    vals: &[f32; 8],
    len: usize,
) {
    if sums.mode == GROUP_SUMS_LOCKED {
        // The caller holds row `group`'s lock: read, add, write back.
        let row = partials + (group * d * 4) as u64;
        let mut total = unsafe { load_f32s::<VEC>(row, elem, len) };
        for (t, v) in total.iter_mut().zip(vals) {
            *t += *v;
        }
        unsafe { store_f32s::<VEC>(row, elem, &total, len) };
    } else if sums.mode == GROUP_SUMS_ATOMIC {
        // A constant trip count, so the loop unrolls and `vals` stays in registers (a loop to
        // `len` left every backward's partial sums in local memory).
        for (i, v) in vals.iter().enumerate() {
            if i < len {
                unsafe { arch::atomic_add_f32(partials + ((elem + i) * 4) as u64, *v) };
            }
        }
    } else {
        unsafe { store_f32s::<VEC>(partials + (group * d * 4) as u64, elem, vals, len) };
    }
}

#[cfg(target_arch = "nvptx64")]
const _: () = {
    crate::kernel::kernel!(export "column_sum_f32", ColumnSumParams, column_sum::<crate::element::F32>);
    crate::kernel::kernel!(export "column_sum_f16", ColumnSumParams, column_sum::<crate::element::F16>);
    crate::kernel::kernel!(export "column_sum_bf16", ColumnSumParams, column_sum::<crate::element::Bf16>);
};

/// Dynamic shared memory of a column-sum block: one word per column of each thread.
#[cfg(not(target_arch = "nvptx64"))]
fn column_sum_shared_bytes(threads: usize) -> usize {
    threads * 4 * COLUMN_SUM_VECTOR
}

/// The column sums, by output dtype.
#[cfg(not(target_arch = "nvptx64"))]
pub static KERNELS: Table<Dtype, ColumnSumParams> = Table::new(&[&[&[
    crate::kernel::kernel!(table "column_sum_f32", Dtype::F32, 80, column_sum_shared_bytes, false, 0,
        column_sum::<crate::element::F32>),
    crate::kernel::kernel!(table "column_sum_f16", Dtype::F16, 80, column_sum_shared_bytes, false, 0,
        column_sum::<crate::element::F16>),
    crate::kernel::kernel!(table "column_sum_bf16", Dtype::Bf16, 80, column_sum_shared_bytes, false, 0,
        column_sum::<crate::element::Bf16>),
]]]);
