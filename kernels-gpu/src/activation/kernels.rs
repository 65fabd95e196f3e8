//! The activation kernels: an elementwise engine over `rows × d` with up to three row inputs and
//! two row outputs, and the backward with a fused dbias through the group partials.

use super::functions::{apply_stored, grad_stored};
use crate::arch;
use crate::column_sum::{
    GroupSums, MIN_ROWS_PER_GROUP, base_rows_per_group, finish_group_sums, group_layout,
    store_group_partials,
};
use crate::element::{Access, Element, Pack, row_addr};

/// Launch parameters of every activation kernel: up to three row inputs and two row outputs, each
/// with its own stride (elements), and the dbias group layout. Unused pointers are 0.
///
/// | family | in0 | in1 | in2 | out0 | out1 |
/// |---|---|---|---|---|---|
/// | `act_fwd` | x | | | y | |
/// | `act_bwd`, `act_bwd_dbias` | dy | preact | | dx (may be dy) | |
/// | `glu_fwd` | a | b | | h | |
/// | `glu_bwd` | dh | a | b | da | db |
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Params {
    pub inputs: [u64; 3],
    pub outputs: [u64; 2],
    pub input_strides: [u64; 3],
    pub output_strides: [u64; 2],
    /// `[groups, d]` fp32 dbias partials (`act_bwd_dbias` only; with atomic sums the f32 dbias).
    pub partials: u64,
    pub rows: u32,
    pub d: u32,
    pub rows_per_group: u32,
    pub groups: u32,
    /// `act_bwd_dbias` only: accesses (packs or elements) of a row per work item, a power of two
    /// dividing the block size; the block takes `block_dim / columns` rows of a group at once.
    pub columns: u32,
    pub _pad: u32,
    /// `act_bwd_dbias` only: what becomes of the partial rows ([`GroupSums`]).
    pub sums: GroupSums,
}

impl Params {
    /// Address of row `row` of input `k`.
    #[inline(always)]
    fn input_row<T: Element>(&self, k: usize, row: usize) -> u64 {
        let (base, stride) = pick(k, &self.inputs, &self.input_strides);
        row_addr::<T>(base, row, stride)
    }
    /// Address of row `row` of output `k`.
    #[inline(always)]
    fn output_row<T: Element>(&self, k: usize, row: usize) -> u64 {
        let (base, stride) = pick(k, &self.outputs, &self.output_strides);
        row_addr::<T>(base, row, stride)
    }
}

/// `(bases[k], strides[k])` by selects, never by a dynamic index: if LLVM leaves a loop over
/// operands rolled, indexing the kernel-parameter arrays would copy them to local memory.
#[inline(always)]
fn pick<const N: usize>(k: usize, bases: &[u64; N], strides: &[u64; N]) -> (u64, u64) {
    let mut picked = (bases[0], strides[0]);
    for j in 1..N {
        if k == j {
            picked = (bases[j], strides[j]);
        }
    }
    picked
}

/// The elementwise kernels' engine: for every element of the `rows × d` grid, `outputs = f(inputs)`
/// with `IN` row inputs and `OUT` row outputs, each on its own stride. Accesses are spread over all
/// blocks in tiles of `block_dim · UNROLL` consecutive accesses (thread `t` takes accesses `t`,
/// `t + block_dim`, …: coalesced), tiles by grid stride. The host launches one block per tile:
/// a persistent grid loses its last, partly filled trip (measured: `bench-results/h200.md`).
/// All loads of a tile are issued before any result is computed, so a thread keeps
/// `UNROLL · IN · 16` bytes in flight; [`Family::unroll`] keeps that near 64 to 128 bytes, in
/// registers.
/// An output may alias an input (in-place backward): every element is read before it is written,
/// by the same thread.
#[inline(always)]
fn elementwise<
    T: Element,
    const VEC: bool,
    const IN: usize,
    const OUT: usize,
    const UNROLL: usize,
>(
    p: &Params,
    f: impl Fn([f32; IN]) -> [f32; OUT],
) {
    let len = Access::<T, VEC>::LEN;
    let rows = p.rows as usize;
    let per_row = (p.d as usize) / len;
    let (threads, tile) = (arch::block_dim(), arch::block_dim() * UNROLL);
    let total = rows * per_row;
    let mut tile_start = arch::block_idx() * tile;
    if rows == 1 {
        // One row (the host hands contiguous operands over as one): positions are plain indices,
        // no cursor arithmetic and no row addresses.
        while tile_start < total {
            let first = (0, tile_start + arch::thread_idx());
            let advance = |(row, access): (usize, usize)| (row, access + threads);
            elementwise_tile::<T, VEC, IN, OUT, UNROLL>(p, &f, first, advance, |(_, a)| a < total);
            tile_start += arch::grid_dim() * tile;
        }
        return;
    }
    // Within a tile the cursor moves by whole rows and leftover accesses: no division per access.
    let (step_rows, step_accesses) = (threads / per_row, threads % per_row);
    let advance = |(row, access): (usize, usize)| {
        let (row, access) = (row + step_rows, access + step_accesses);
        if access >= per_row {
            (row + 1, access - per_row)
        } else {
            (row, access)
        }
    };
    while tile_start < total {
        // The host rejects more than 2³² − 1 accesses, so u32 division is exact here.
        let (first, per_row32) = ((tile_start + arch::thread_idx()) as u32, per_row as u32);
        let first = ((first / per_row32) as usize, (first % per_row32) as usize);
        elementwise_tile::<T, VEC, IN, OUT, UNROLL>(p, &f, first, advance, |(r, _)| r < rows);
        tile_start += arch::grid_dim() * tile;
    }
}

/// One thread's share of one tile of [`elementwise`]: the `UNROLL` positions `first`,
/// `advance(first)`, … (row, access in the row), those that are `inside` the grid.
#[inline(always)]
fn elementwise_tile<
    T: Element,
    const VEC: bool,
    const IN: usize,
    const OUT: usize,
    const UNROLL: usize,
>(
    p: &Params,
    f: &impl Fn([f32; IN]) -> [f32; OUT],
    first: (usize, usize),
    advance: impl Fn((usize, usize)) -> (usize, usize),
    inside: impl Fn((usize, usize)) -> bool,
) {
    let len = Access::<T, VEC>::LEN;
    let mut ins = [[[0u32; 4]; IN]; UNROLL];
    let mut at = first;
    for packs in ins.iter_mut() {
        if inside(at) {
            for (j, pack) in packs.iter_mut().enumerate() {
                let row = p.input_row::<T>(j, at.0);
                *pack = unsafe { Access::<T, VEC>::load(row, at.1 * len) };
            }
        }
        at = advance(at);
    }
    // Walk the same positions again (cheaper than keeping them in registers). Always use slot 0
    // and shift the others down: should LLVM leave this loop rolled (big bodies), a dynamic
    // `ins[k]` would put the packs in local memory.
    let mut at = first;
    for _ in 0..UNROLL {
        let ((row, access), packs) = (at, ins[0]);
        for k in 1..UNROLL {
            ins[k - 1] = ins[k];
        }
        if inside(at) {
            let mut outs = [[0.0f32; 8]; OUT];
            for i in 0..len {
                let mut args = [0.0f32; IN];
                for (j, arg) in args.iter_mut().enumerate() {
                    *arg = T::get(&packs[j], i);
                }
                let results = f(args);
                // Indexed, not `zip`/`into_iter`: LLVM leaves array iterators rolled, and a
                // rolled loop over `outs` means local memory.
                #[allow(clippy::needless_range_loop)]
                for o in 0..OUT {
                    outs[o][i] = results[o];
                }
            }
            for (o, vals) in outs.iter().enumerate() {
                let out = p.output_row::<T>(o, row);
                unsafe { Access::<T, VEC>::store(out, access * len, &T::pack(vals, len)) };
            }
        }
        at = advance(at);
    }
}

/// `y = f(x)`. Launch any grid of any block size (a multiple of 32).
///
/// # Safety
/// The params describe valid buffers laid out as the kernel's key requires.
#[inline(always)]
pub unsafe fn forward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 1, 1, { Family::Forward.unroll() }>(p, |[x]| [apply_stored::<T, ACT>(x)]);
}

/// `dx = dy · f'(preact)`; `dx` may be `dy` itself.
///
/// # Safety
/// As for [`forward`].
#[inline(always)]
pub unsafe fn backward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 2, 1, { Family::Backward.unroll() }>(p, |[dy, pre]| {
        [dy * grad_stored::<T, ACT>(pre)]
    });
}

/// Rows of a group [`backward_dbias`] loads before using any: bytes in flight per thread. Eight
/// rows of dy and preact are 256 bytes per thread with 16-byte packs, and half as many round trips
/// per work item as four: the sum's order does not depend on it (rows are still added in order).
const DBIAS_ROWS_IN_FLIGHT: usize = 8;

/// Rows of at least this many elements, in groups of at least [`MIN_ROWS_PER_GROUP`] in the
/// norms' layout ([`group_layout`]), take wide work items: [`DBIAS_WIDE_SLICES`] row slices of a
/// block each walk as many rows of the group as one thread walks in the norms' layout, on a
/// quarter of the columns, so the group is that many times longer and writes a quarter of the
/// partial rows (16384×4096: 2 MiB of f32 written and read again instead of 8 MiB, beside 384 MiB
/// of dy, preact and dx). Smaller groups (small batches) leave each slice too few rows to pay
/// for adding the slices' sums together.
pub const DBIAS_WIDE_ROW_ELEMS: usize = 2048;
/// Row slices of a wide row's work item, and how many of the norms' groups make one of dbias's.
pub const DBIAS_WIDE_SLICES: usize = 4;

/// `(rows_per_group, groups)` of dbias's partial rows for `rows × d`: like [`group_layout`], a
/// function of the shape alone, so dbias is the same bits on every grid and GPU. Where wide work
/// items serve ([`DBIAS_WIDE_ROW_ELEMS`]) its groups are [`DBIAS_WIDE_SLICES`] of the norms'
/// base groups ([`base_rows_per_group`]; its wide items already cut the partial rows that the
/// norms' longer groups cut), elsewhere the norms' own: every boundary of this layout is one of
/// the norms' too.
pub fn dbias_group_layout(rows: usize, d: usize) -> (usize, usize) {
    let wide = base_rows_per_group(rows, d).saturating_mul(DBIAS_WIDE_SLICES);
    if dbias_wide_items(d, wide) {
        (wide, rows.div_ceil(wide))
    } else {
        group_layout(rows, d)
    }
}

/// Whether dbias's groups of `rows_per_group` rows of `d` elements take wide work items: rows of
/// at least [`DBIAS_WIDE_ROW_ELEMS`], each slice walking at least [`MIN_ROWS_PER_GROUP`] rows. The
/// one test behind both [`dbias_group_layout`] and [`dbias_columns`]: the norms' groups are
/// shorter than `MIN_ROWS_PER_GROUP` wherever the layout keeps them, so a kept group never
/// passes it.
const fn dbias_wide_items(d: usize, rows_per_group: usize) -> bool {
    d >= DBIAS_WIDE_ROW_ELEMS && rows_per_group >= DBIAS_WIDE_SLICES * MIN_ROWS_PER_GROUP
}

/// Accesses of a row per [`backward_dbias`] work item (`Params::columns`) for rows of `d`
/// elements, `per_row` accesses each, in groups of `rows_per_group` ([`dbias_group_layout`]'s,
/// of the whole batch), in blocks of `threads`: rows narrower than a block share it as row slices
/// (a power of two of accesses each); the layout's wide groups take [`DBIAS_WIDE_SLICES`] slices.
/// Only the shape decides, so the sums' order never changes from one GPU or grid to another.
pub const fn dbias_columns(
    d: usize,
    rows_per_group: usize,
    per_row: usize,
    threads: usize,
) -> usize {
    let fit = per_row.next_power_of_two();
    if dbias_wide_items(d, rows_per_group) {
        threads / DBIAS_WIDE_SLICES
    } else if fit < threads {
        fit
    } else {
        threads
    }
}

/// Bytes of dynamic shared memory [`backward_dbias`] takes with `threads` per block: every
/// thread's partial sums, for the fixed-order combination of a group's row slices.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn dbias_shared(threads: usize) -> usize {
    threads * 8 * 4
}

/// [`backward`] plus `dbias = Σ_rows dx` through the deterministic group partials: each group of
/// `rows_per_group` consecutive rows writes one fp32 row of `partials`, summed afterwards by
/// `crate::reduce::column_sum`. A work item is one group × `p.columns` accesses of its rows; a
/// block takes `block_dim / columns` rows of the group at once (its row slices: narrow rows keep
/// every thread busy), so thread (slice `s`, column `c`) sums rows `s`, `s + slices`, … of the
/// group in order, and the slices' sums are added in slice order through shared memory. Blocks
/// take items by grid stride, so the host can launch one block per item; which block takes an
/// item never changes the order of any sum (that is fixed by the shape and `columns`). `p.sums`
/// may have the launch sum the partial rows itself or add them atomically instead.
///
/// # Safety
/// As for [`forward`]; `partials` holds `groups · d` f32, 16-byte aligned; `columns` divides the
/// block size; the block has [`dbias_shared`] bytes of dynamic shared memory.
#[inline(always)]
pub unsafe fn backward_dbias<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    // As the norms' backward: the column sum after this launch may start early.
    arch::launch_dependents();
    let len = Access::<T, VEC>::LEN;
    let (d, rows) = (p.d as usize, p.rows as usize);
    let per_row = d / len;
    let columns = p.columns as usize;
    let slices = arch::block_dim() / columns;
    let (slice, column) = (arch::thread_idx() / columns, arch::thread_idx() % columns);
    let chunks = per_row.div_ceil(columns);
    let shared = arch::shared_f32();
    let mut item = arch::block_idx();
    while item < p.groups as usize * chunks {
        let (group, chunk) = (item / chunks, item % chunks);
        item += arch::grid_dim();
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        let a = chunk * columns + column;
        let col = a * len;
        let mut dbias = [0.0f32; 8];
        if a < per_row {
            let mut row = first + slice;
            while row < end {
                // Load a few of the slice's rows, then use them in row order: the sum order
                // stays fixed.
                let mut dy: [Pack; DBIAS_ROWS_IN_FLIGHT] = [[0; 4]; DBIAS_ROWS_IN_FLIGHT];
                let mut pre: [Pack; DBIAS_ROWS_IN_FLIGHT] = [[0; 4]; DBIAS_ROWS_IN_FLIGHT];
                for r in 0..DBIAS_ROWS_IN_FLIGHT {
                    let at = row + r * slices;
                    if at < end {
                        dy[r] = unsafe { Access::<T, VEC>::load(p.input_row::<T>(0, at), col) };
                        pre[r] = unsafe { Access::<T, VEC>::load(p.input_row::<T>(1, at), col) };
                    }
                }
                for r in 0..DBIAS_ROWS_IN_FLIGHT {
                    let at = row + r * slices;
                    if at < end {
                        let mut dx = [0.0f32; 8];
                        for i in 0..len {
                            dx[i] = T::get(&dy[r], i) * grad_stored::<T, ACT>(T::get(&pre[r], i));
                            dbias[i] += dx[i];
                        }
                        let out = p.output_row::<T>(0, at);
                        unsafe { Access::<T, VEC>::store(out, col, &T::pack(&dx, len)) };
                    }
                }
                row += DBIAS_ROWS_IN_FLIGHT * slices;
            }
        }
        if slices > 1 {
            // Slice 0 adds the other slices' sums of its column, in slice order. (Block-uniform:
            // `slices` and the item loop are the same for every thread.)
            for (i, v) in dbias.iter().enumerate() {
                unsafe { shared.store(arch::thread_idx() * 8 + i, *v) };
            }
            arch::sync_threads();
            if slice == 0 {
                for s in 1..slices {
                    for (i, v) in dbias.iter_mut().enumerate() {
                        *v += unsafe { shared.load((s * columns + column) * 8 + i) };
                    }
                }
            }
            // The next item's stores wait for these loads.
            arch::sync_threads();
        }
        if slice == 0 && a < per_row {
            let at = (group, d);
            unsafe { store_group_partials::<VEC>(&p.sums, p.partials, at, col, &dbias, len) };
        }
    }
    unsafe { finish_group_sums::<T>(&p.sums, (p.partials, 0), p.groups as usize, d) };
}

/// Gated forward: `h = f(a) · b` (SwiGLU with SiLU, GeGLU with either GELU).
///
/// # Safety
/// As for [`forward`].
#[inline(always)]
pub unsafe fn gated_forward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 2, 1, { Family::GatedForward.unroll() }>(p, |[a, b]| {
        [apply_stored::<T, ACT>(a) * b]
    });
}

/// Gated backward in one pass: `da = dh · b · f'(a)`, `db = dh · f(a)`.
///
/// # Safety
/// As for [`forward`].
#[inline(always)]
pub unsafe fn gated_backward<T: Element, const VEC: bool, const ACT: u32>(p: &Params) {
    elementwise::<T, VEC, 3, 2, { Family::GatedBackward.unroll() }>(p, |[dh, a, b]| {
        [
            dh * b * grad_stored::<T, ACT>(a),
            dh * apply_stored::<T, ACT>(a),
        ]
    });
}

/// The activation kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Forward,
    Backward,
    BackwardDbias,
    GatedForward,
    GatedBackward,
}

impl Family {
    /// Accesses (16-byte packs) per thread of the elementwise families: the tile of a block is
    /// `threads · unroll` accesses. (The dbias family walks groups of rows instead.)
    pub const fn unroll(self) -> usize {
        match self {
            Family::Forward | Family::Backward | Family::GatedForward => 4,
            Family::GatedBackward => 2,
            Family::BackwardDbias => 1,
        }
    }
}
