//! Warp, block and cluster reductions, and the team of threads that shares one row.
//!
//! Every sum here has an order fixed by the launch shape alone: the butterfly gives every lane the
//! same bits (fp addition is commutative, so partners add the same two values), warps are combined
//! in warp order, blocks of a cluster by a butterfly over their ranks. Nothing depends on timing.

use crate::arch::{self, MAX_CLUSTER, WARP};

/// Sums of `N` values over the 32 lanes of a warp; every lane gets the totals.
#[inline(always)]
pub fn warp_sums<const N: usize>(mut v: [f32; N]) -> [f32; N] {
    let mut mask = WARP as u32 / 2;
    while mask > 0 {
        for x in v.iter_mut() {
            *x += arch::shfl_xor(*x, mask);
        }
        mask >>= 1;
    }
    v
}

/// Sums of `N` values over this lane's aligned segment of `lanes` lanes (a power of two, at most
/// 32; one row's team, [`Team::lanes`]), by butterfly: every lane of the segment gets the same
/// bits, and only the segment takes part.
#[inline(always)]
pub fn segment_sums<const N: usize>(mut v: [f32; N], lanes: usize) -> [f32; N] {
    let mut mask = lanes as u32 / 2;
    while mask > 0 {
        for x in v.iter_mut() {
            *x += arch::shfl_xor_within(*x, mask, lanes);
        }
        mask >>= 1;
    }
    v
}

/// Sum over the 32 lanes of a warp; every lane gets the total.
#[inline(always)]
pub fn warp_sum(v: f32) -> f32 {
    warp_sums([v])[0]
}

/// The mean of a part of a row: its `sum` over `count` elements (0 for an empty part), by the
/// reciprocal to 1 ulp: any value the same in every lane serves as a part's mean (its deviations
/// are taken about it and merged from it), without IEEE division's slow path and registers.
#[inline(always)]
fn part_mean(sum: f32, count: f32) -> f32 {
    if count > 0.0 {
        sum * arch::rcp_approx(count)
    } else {
        0.0
    }
}

/// Chan et al.'s combination of the parts in the lanes of a warp, each a `[sum, count,
/// deviations about its mean]` (empty parts all 0): the whole's sum and count, and its
/// deviations about its mean, `Σ deviations + count·(part mean − mean)²`. Every lane gets the
/// same bits (the butterfly's sums, then the same arithmetic in every lane).
#[inline(always)]
pub fn merge_moments(part: [f32; 3]) -> [f32; 3] {
    let [sum, count, m2] = part;
    let [total, n] = warp_sums([sum, count]);
    let off = part_mean(sum, count) - part_mean(total, n);
    [total, n, warp_sum(arch::fma(count * off, off, m2))]
}

/// Most values one [`RowReducer`] call that may span a cluster reduces at once (the width of its
/// mailboxes): a part's sum, count and deviations ([`RowReducer::mean_and_deviations`]).
pub const MAX_CLUSTER_SUMS: usize = 3;
/// Most values of a reduction started and finished apart ([`RowReducer::start`]: the backward's
/// two dot products).
pub const MAX_PENDING_SUMS: usize = 2;
/// Most values one block-only call reduces at once ([`RowReducer::block_sums`]: two rows' two
/// sums, LayerNorm's backward taking rows in pairs).
pub const MAX_BLOCK_ONLY_SUMS: usize = 4;
/// The block's slots: two of one word per warp per value.
const BLOCK_SLOTS: usize = 0;
/// Mailbox slots per block. Between starting a call and finishing it, a block starts at most
/// [`MAX_LEAD`] more. While a block has not read call c it has started at most c + `MAX_LEAD`, so
/// no other block can have finished more than that (each finish waits for every block's totals),
/// nor started more than c + 2·`MAX_LEAD` + 1: a slot is written again only after it was read.
const MAILBOX_SLOTS: usize = 2 * MAX_LEAD + 2;
/// Most calls started between a call's [`RowReducer::start`] and its [`RowReducer::finish`]. The
/// kernels finish each call before starting the next (pass 1 of a row starts its sums, pass 2
/// finishes them); starting the next row's sums first, to overlap the exchange with a pass,
/// measured no faster (`bench-results/h200.md`), so one call of lead is all that is kept.
pub const MAX_LEAD: usize = 1;
/// The cluster's mailboxes: per slot, one word per block per value, written by the blocks of the
/// cluster.
const MAILBOXES: usize = BLOCK_SLOTS + 2 * MAX_BLOCK_ONLY_SUMS * WARP;
/// One mbarrier (two words, 8-byte aligned) per mailbox slot, counting the bytes that landed.
const MAILBOX_BARRIERS: usize = MAILBOXES + MAILBOX_SLOTS * MAX_CLUSTER * MAX_CLUSTER_SUMS;
/// Words of dynamic shared memory a [`RowReducer`] needs.
pub const ROW_REDUCER_SHARED_WORDS: usize = MAILBOX_BARRIERS + 2 * MAILBOX_SLOTS;

/// Sums over the threads that share one row: the block, or (sm_90) every block of the cluster.
///
/// Within a block: one barrier per call. Successive calls alternate between two shared-memory
/// slots: a warp can only store into a slot again after passing the barrier of the call in
/// between, which every other warp reaches only after reading that slot, so no second barrier is
/// needed.
///
/// Across a cluster, each block sends its totals into a mailbox in every block's shared memory
/// (`st.async`) and waits on its own mailbox's mbarrier until all have landed. No cluster barrier:
/// its release semantics would wait for every load and store in flight (the next row's prefetch,
/// this row's stores) on every row. A reduction can be started ([`Self::start`]) and finished
/// later ([`Self::finish`]), with other work between.
/// Every thread of every block of the cluster must make the same sequence of calls.
pub struct RowReducer {
    block_slot: usize,
    /// Cluster calls so far: their mailbox slot and mbarrier phase.
    calls: u32,
    cluster: bool,
    /// A team of this many lanes within a warp ([`Team::lanes`]): sums by shuffles alone.
    lanes: usize,
}

/// A reduction of `N` values begun: the block's totals, and where the cluster's will be.
#[must_use]
#[derive(Clone, Copy)]
pub struct Pending<const N: usize> {
    block: [f32; N],
    slot: usize,
    phase: u32,
}

/// A reduction begun by [`RowReducer::start`] (of at most [`MAX_PENDING_SUMS`] values, the width
/// the backward carries from a row's first pass to its second).
pub type PendingSums = Pending<MAX_PENDING_SUMS>;

impl<const N: usize> Pending<N> {
    /// A reduction already complete (a segment's or a block's): its totals.
    #[inline(always)]
    fn of(block: [f32; N]) -> Self {
        Pending {
            block,
            slot: 0,
            phase: 0,
        }
    }

    /// The same reduction, its totals padded with zeros (or cut) to `M` values.
    #[inline(always)]
    fn resized<const M: usize>(self) -> Pending<M> {
        Pending {
            block: core::array::from_fn(|i| if i < N { self.block[i] } else { 0.0 }),
            slot: self.slot,
            phase: self.phase,
        }
    }
}

impl RowReducer {
    /// A reducer over the team: the lanes of a warp segment, the block, or every block of the
    /// cluster: constants of the kernel instance, so a block-only instance carries no cluster
    /// code (nor its registers), and a segment's none of the block's.
    ///
    /// # Safety
    /// Every thread of the block (of the cluster) calls it (with `cluster`, it contains a cluster
    /// barrier); a block or cluster team's launch provides [`ROW_REDUCER_SHARED_WORDS`] words of
    /// dynamic shared memory.
    #[inline(always)]
    pub unsafe fn new(team: Team) -> Self {
        let cluster = team.cluster;
        if cluster {
            if arch::thread_idx() == 0 {
                let shared = arch::shared_f32();
                for slot in 0..MAILBOX_SLOTS {
                    unsafe { shared.mbarrier_init(MAILBOX_BARRIERS + 2 * slot, 1) };
                }
                arch::fence_mbarrier_init();
            }
            // No block may send before every block's mbarriers exist.
            arch::sync_cluster();
        }
        RowReducer {
            block_slot: 0,
            calls: 0,
            cluster,
            lanes: team.lanes,
        }
    }

    /// Sums of `N ≤ MAX_PENDING_SUMS` values over the block (a multiple of 32 threads, at most
    /// 1024) and, in a cluster, over its blocks; every thread gets the totals. The order is
    /// fixed: lanes by butterfly, then warps, then blocks by a butterfly over their ranks, so
    /// every block of the cluster computes the same bits.
    ///
    /// # Safety
    /// Every thread of the block (of the cluster) calls it (it contains a barrier); the reducer
    /// was made by [`Self::new`] in this launch.
    #[inline(always)]
    pub unsafe fn sums<const N: usize>(&mut self, v: [f32; N]) -> [f32; N] {
        unsafe {
            let pending = self.start(v);
            self.finish(pending)
        }
    }

    /// The first half of [`Self::sums`]: the block's sum, and in a cluster its totals sent to
    /// every block. Finish it with [`Self::finish`]; calls finish in the order they started, with
    /// at most [`MAX_LEAD`] others started in between.
    ///
    /// # Safety
    /// As for [`Self::sums`].
    #[inline(always)]
    pub unsafe fn start<const N: usize>(&mut self, v: [f32; N]) -> PendingSums {
        if self.lanes != 0 {
            return Pending::of(segment_sums(v, self.lanes)).resized();
        }
        unsafe { self.exchange(warp_sums(v), warp_sums).resized() }
    }

    /// Sums of `N ≤ MAX_BLOCK_ONLY_SUMS` values over a block team, complete on return (one
    /// barrier); every thread gets the totals, each value's the bits [`Self::sums`] gives it alone.
    ///
    /// # Safety
    /// As for [`Self::sums`]; the team is a block (not a cluster, not a warp's segment).
    #[inline(always)]
    pub unsafe fn block_sums<const N: usize>(&mut self, v: [f32; N]) -> [f32; N] {
        unsafe { self.exchange(warp_sums(v), warp_sums).block }
    }

    /// The mean of the team's elements and their squared deviations about it (LayerNorm's μ and
    /// M2), in one exchange where a sum and then the deviations about its mean would take two:
    /// each warp sums its elements and their count, and its deviations about its own mean
    /// (`deviations(c)`: this thread's Σ (x − c)² over the `count` elements of its `sum`); the
    /// warps' and then the blocks' parts meet by Chan et al.'s combination ([`merge_moments`]).
    /// Every part is a sum of squares about a mean, so nothing cancels when the mean is large
    /// against the spread.
    ///
    /// # Safety
    /// As for [`Self::sums`]; the team is a block or a cluster (a segment team's lanes would be
    /// summed with their warp's others); no call of this reducer is unfinished.
    #[inline(always)]
    pub unsafe fn mean_and_deviations(
        &mut self,
        count: f32,
        sum: f32,
        deviations: impl Fn(f32) -> f32,
    ) -> (f32, f32) {
        let [sum, count] = warp_sums([sum, count]);
        let mean = part_mean(sum, count);
        let m2 = warp_sum(deviations(mean));
        let [sum, count, m2] = unsafe {
            let pending = self.exchange([sum, count, m2], merge_moments);
            self.finish_with(pending, merge_moments)
        };
        (part_mean(sum, count), m2)
    }

    /// A block or cluster reduction from `warp` (this warp's totals, the same in every lane): the
    /// warps' totals meet in `combine` (given lane w warp w's, 0 past the last warp), and in a
    /// cluster the block's are sent to every block.
    ///
    /// # Safety
    /// As for [`Self::sums`].
    #[inline(always)]
    unsafe fn exchange<const N: usize>(
        &mut self,
        warp: [f32; N],
        combine: impl Fn([f32; N]) -> [f32; N],
    ) -> Pending<N> {
        // The block slots' width (`block_sums`, block teams only, takes up to 4); a cluster's
        // mailboxes take at most `MAX_CLUSTER_SUMS` (`start`: `MAX_PENDING_SUMS`;
        // `mean_and_deviations`: 3).
        const { assert!(N <= MAX_BLOCK_ONLY_SUMS) };
        let shared = arch::shared_f32();
        let base = BLOCK_SLOTS + self.block_slot * MAX_BLOCK_ONLY_SUMS * WARP;
        self.block_slot ^= 1;
        let tid = arch::recomputed_on_sm80(arch::thread_idx());
        let (lane, warp_idx, warps) = (tid % WARP, tid / WARP, arch::block_dim() / WARP);
        if lane == 0 {
            for (i, x) in warp.iter().enumerate() {
                unsafe { shared.store(base + i * WARP + warp_idx, *x) };
            }
        }
        arch::sync_threads();
        let mut partial = [0.0f32; N];
        if lane < warps {
            for (i, x) in partial.iter_mut().enumerate() {
                *x = unsafe { shared.load(base + i * WARP + lane) };
            }
        }
        let block = combine(partial);
        if !self.cluster {
            return Pending::of(block);
        }
        let call = self.calls;
        self.calls = call.wrapping_add(1);
        // Each slot's mbarrier completes one phase per use of the slot.
        let (slot, phase) = (
            call as usize % MAILBOX_SLOTS,
            call / MAILBOX_SLOTS as u32 % 2,
        );
        let (blocks, rank) = (arch::cluster_size(), arch::cluster_rank());
        let (mailbox, barrier) = Self::mailbox(slot);
        if tid == 0 {
            unsafe { shared.mbarrier_arrive_expect_tx(barrier, (4 * N * blocks) as u32) };
        }
        // Thread t sends this block's totals to block t, into the words of this block's rank.
        if tid < blocks {
            for (i, x) in block.iter().enumerate() {
                let word = mailbox + i * MAX_CLUSTER + rank;
                unsafe { shared.store_async_to(tid, word, *x, barrier) };
            }
        }
        Pending { block, slot, phase }
    }

    /// The second half of [`Self::sums`]: waits for every block's totals and adds them.
    ///
    /// # Safety
    /// As for [`Self::sums`]; `pending` is the oldest unfinished [`Self::start`] of this reducer,
    /// which reduced `N` values.
    #[inline(always)]
    pub unsafe fn finish<const N: usize>(&mut self, pending: PendingSums) -> [f32; N] {
        unsafe { self.finish_with(pending.resized(), warp_sums) }
    }

    /// Waits for every block's totals and meets them in `combine` (given lane r block r's).
    ///
    /// # Safety
    /// As for [`Self::finish`].
    #[inline(always)]
    unsafe fn finish_with<const N: usize>(
        &mut self,
        pending: Pending<N>,
        combine: impl Fn([f32; N]) -> [f32; N],
    ) -> [f32; N] {
        if !self.cluster {
            return pending.block;
        }
        let shared = arch::shared_f32();
        let (mailbox, barrier) = Self::mailbox(pending.slot);
        unsafe { shared.mbarrier_wait(barrier, pending.phase) };
        // Lane r of every warp takes block r's totals.
        let lane = arch::thread_idx() % WARP;
        let mut partial = [0.0f32; N];
        if lane < arch::cluster_size() {
            for (i, x) in partial.iter_mut().enumerate() {
                *x = unsafe { shared.load(mailbox + i * MAX_CLUSTER + lane) };
            }
        }
        combine(partial)
    }

    /// The first word of a mailbox slot, and of its mbarrier.
    #[inline(always)]
    fn mailbox(slot: usize) -> (usize, usize) {
        (
            MAILBOXES + slot * MAX_CLUSTER * MAX_CLUSTER_SUMS,
            MAILBOX_BARRIERS + 2 * slot,
        )
    }

    /// The sum of one value over the block (the cluster); see [`Self::sums`].
    ///
    /// # Safety
    /// As for [`Self::sums`].
    #[inline(always)]
    pub unsafe fn sum(&mut self, v: f32) -> f32 {
        unsafe { self.sums([v])[0] }
    }
}

/// The threads that share one row: an aligned segment of `lanes` lanes of a warp (rows too
/// narrow for a warp, several rows per warp), the block, or (sm_90, cluster instances) every block
/// of a cluster, for rows too wide for one block's registers; their partial sums meet in
/// [`RowReducer`]. Teams walk rows (or groups of rows) by grid stride; a block's segment teams
/// have consecutive indices, so a warp's loads of consecutive rows coalesce.
#[derive(Clone, Copy)]
pub struct Team {
    /// This thread's index in the team: the blocks of a cluster in rank order.
    pub tid: usize,
    pub threads: usize,
    /// This team's first work item (row or group), and the number of teams.
    pub first: usize,
    pub stride: usize,
    pub cluster: bool,
    /// Lanes of a segment team; 0 for a block or cluster team.
    pub lanes: usize,
}

impl Team {
    /// The team of this thread: of `lanes` lanes (a power of two, 4 to 32) when not 0, else the
    /// block or with `cluster` the cluster.
    #[inline(always)]
    pub fn new(cluster: bool, lanes: usize) -> Self {
        let block = arch::block_dim();
        if let Some(per_block) = block.checked_div(lanes) {
            let tid = arch::thread_idx();
            return Team {
                tid: tid % lanes,
                threads: lanes,
                first: arch::block_idx() * per_block + tid / lanes,
                stride: arch::grid_dim() * per_block,
                cluster: false,
                lanes,
            };
        }
        if cluster {
            Team {
                tid: arch::cluster_rank() * block + arch::thread_idx(),
                threads: arch::cluster_size() * block,
                first: arch::cluster_idx(),
                stride: arch::cluster_count(),
                cluster,
                lanes: 0,
            }
        } else {
            Team {
                tid: arch::thread_idx(),
                threads: block,
                first: arch::block_idx(),
                stride: arch::grid_dim(),
                cluster,
                lanes: 0,
            }
        }
    }

    /// The end of a kernel: a block may not exit while its last stores into the shared memory of
    /// the others of its cluster may be in flight.
    #[inline(always)]
    pub fn finish(self) {
        if self.cluster {
            arch::sync_cluster();
        }
    }
}
