//! Rows narrower than a warp's reach: a team of `lanes` lanes (an aligned warp segment, 8 to 32
//! lanes) per row, several rows per warp, sums by shuffles within the segment and no block
//! barrier per row (QK-norm's d = 128 is 16 lanes of one 16-byte access).
//!
//! The forward is the register tile's body over such teams (`super::forward`), in blocks of any
//! whole number of warps (`policy::forward_segments_one_shot` says which grid); its teams reach
//! rows of 256 16-bit elements, wider rows take a block each. The backward keeps the
//! deterministic group partials: a block walks the groups, its teams take a group's
//! rows in turn (team t: rows t, t + teams, …), each thread adds its columns of every row it
//! visits in fp32 registers, and at the group's end the teams' sums meet in a fixed order — a
//! butterfly over the teams of a warp, then the warps in order through shared memory — into the
//! group's one partial row. The order depends on the instance (lanes, and the fixed
//! [`SEGMENT_THREADS`]), which the launch plan picks from the call's d, dtype and layout alone,
//! so dγ and dβ are still the same bits on every grid and every GPU.

use super::Normalization;
use super::params::BackwardParams;
use super::rows::{RowSource, group_rows};
use super::tile::BackwardTile;
use crate::arch::{self, WARP};
use crate::column_sum::{GroupSums, store_group_partials};
use crate::element::Element;
use crate::reduce::{RowReducer, Team};

/// Threads of every backward segment-team block (the warps whose sums a group adds in order) and
/// of the forward's one-shot blocks at most.
pub const SEGMENT_THREADS: usize = 256;
const SEGMENT_WARPS: usize = SEGMENT_THREADS / WARP;

/// Words of one warp's slot in the backward's combine area: its team's columns (at most 8 per
/// access of `vpt` per lane).
const fn combine_slot_words(vpt: usize, lanes: usize) -> usize {
    lanes * vpt * 8
}

/// The first word of the backward's combine area (16-byte aligned after `start`), and its end.
pub(super) const fn combine_words(start: usize, vpt: usize, lanes: usize) -> (usize, usize) {
    let first = start.next_multiple_of(4);
    (
        first,
        first + SEGMENT_WARPS * combine_slot_words(vpt, lanes),
    )
}

/// The backward over segment teams: launch [`SEGMENT_THREADS`] threads, any grid (blocks walk
/// groups by grid stride), dynamic shared memory up to the combine area's end at `area`.
///
/// # Safety
/// As for `super::backward::backward`; `team` is a segment team whose `lanes · VPT` accesses
/// cover the row.
#[inline(always)]
pub(super) unsafe fn backward_segments<
    T: Element,
    const VEC: bool,
    const VPT: usize,
    N: Normalization,
    S: RowSource<T, VEC>,
>(
    p: &BackwardParams,
    src: S,
    team: Team,
    area: usize,
) {
    let mut reducer = unsafe { RowReducer::new(team) };
    let tile = unsafe { BackwardTile::<T, VEC, VPT, N, S>::new(p, src, team) };
    let teams = arch::block_dim() / team.lanes;
    let index = arch::thread_idx() / team.lanes;
    let (rows, per_group) = (p.rows as usize, p.rows_per_group as usize);
    let prefetch = tile.prefetch;
    let mut group = arch::block_idx();
    while group < p.groups as usize {
        let (first, end) = group_rows(group, per_group, rows, true);
        let mut dgamma = [[0.0f32; 8]; VPT];
        let mut dbeta = [[0.0f32; 8]; VPT];
        let mut row = first + index;
        let mut next = BackwardTile::<T, VEC, VPT, N, S>::empty();
        if prefetch && row < end {
            next = unsafe { tile.load(row) };
        }
        while row < end {
            let this = if prefetch {
                next
            } else {
                unsafe { tile.load(arch::recomputed_on_sm80(row)) }
            };
            if prefetch && row + teams < end {
                next = unsafe { tile.load(arch::recomputed_on_sm80(row + teams)) };
            }
            unsafe {
                let row = arch::recomputed_on_sm80(row);
                let pass1 = tile.pass1(&mut reducer, row, &this);
                tile.pass2(&mut reducer, row, &this, pass1, &mut dgamma, &mut dbeta);
            }
            row += teams;
        }
        let d = p.d as usize;
        let len = BackwardTile::<T, VEC, VPT, N, S>::LEN;
        let combine = |partials: u64, sums: &[[f32; 8]; VPT]| unsafe {
            combine_teams::<VPT>(&p.sums, partials, (group, d), team, len, sums, area)
        };
        combine(p.partials, &dgamma);
        if tile.with_dbeta() {
            combine(p.dbeta_partials, &dbeta);
        }
        group += arch::grid_dim();
    }
}

/// Adds the block's teams' sums of one group (`vals`: this thread's accesses, `len` columns
/// each) in a fixed order and writes (or atomically adds) the group's partial row: a butterfly
/// over the teams of each warp (every lane of a team position gets the same bits), then the
/// warps' sums in warp order through shared memory from word `area`.
///
/// # Safety
/// Every thread of the block calls it (it has barriers); the launch provides the combine area.
#[inline(always)]
unsafe fn combine_teams<const VPT: usize>(
    sums: &GroupSums,
    partials: u64,
    (group, d): (usize, usize),
    team: Team,
    len: usize,
    vals: &[[f32; 8]; VPT],
    area: usize,
) {
    let mut v = *vals;
    let mut mask = team.lanes;
    while mask < WARP {
        for access in v.iter_mut() {
            for (i, x) in access.iter_mut().enumerate() {
                if i < len {
                    *x += arch::shfl_xor(*x, mask as u32);
                }
            }
        }
        mask <<= 1;
    }
    let shared = arch::shared_f32();
    let tid = arch::thread_idx();
    let (lane, warp) = (tid % WARP, tid / WARP);
    let slot = combine_slot_words(VPT, team.lanes);
    if lane < team.lanes {
        for (k, access) in v.iter().enumerate() {
            let elem = (lane + k * team.lanes) * len;
            for (i, x) in access.iter().enumerate() {
                if i < len && elem + i < d {
                    unsafe { shared.store(area + warp * slot + elem + i, *x) };
                }
            }
        }
    }
    arch::sync_threads();
    let mut column = tid;
    while column < d {
        let mut total = unsafe { shared.load(area + column) };
        for w in 1..arch::block_dim() / WARP {
            total += unsafe { shared.load(area + w * slot + column) };
        }
        let mut one = [0.0f32; 8];
        one[0] = total;
        unsafe { store_group_partials::<false>(sums, partials, (group, d), column, &one, 1) };
        column += arch::block_dim();
    }
    // The area is written again for the next sum only after every thread has read it.
    arch::sync_threads();
}
