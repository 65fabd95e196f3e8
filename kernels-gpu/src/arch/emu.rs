//! The CPU twin of the nvptx `arch` module: the emulator that runs kernel bodies on the host.
//!
//! [`launch`] runs a grid cluster by cluster (a cluster of one block unless the launch asks for
//! more) on the calling OS thread; each GPU thread of a cluster is a stackful coroutine
//! (corosensei) that runs until it waits — at a barrier, a shuffle or an mbarrier — and then hands
//! control to the next, round-robin. A wait costs a context switch of a few nanoseconds instead of
//! an OS thread's wake-up, and no OS threads are spawned. Each block has a barrier, per-warp
//! exchange slots for the shuffles and its launch-sized shared memory, into which the other blocks
//! of its cluster can store asynchronously (distributed shared memory), counted by mbarriers; the
//! cluster has a barrier of its own.
//! Misuse is reported, not hung: when every unfinished thread of a cluster waits on something no
//! thread can any longer provide (a barrier or shuffle that not every thread reaches, an mbarrier
//! phase that cannot complete), the launch returns an [`EmuError`] naming the kernel and the wait;
//! shared-memory accesses are bounds-checked; a panic in any thread (an out-of-bounds index, say)
//! ends the launch with its message.
//!
//! Where the emulator's arithmetic differs from the GPU's: `rsqrt` is `1/sqrt` rounded twice in
//! f32 (the GPU's `rsqrt.approx.f32` is within a few ulp of that), `exp2` is the host libm's (the
//! GPU's `ex2.approx.f32` is within about 2 ulp), `rcp_approx` is the exact quotient (the GPU's
//! `rcp.approx` is within 1 ulp), and the `_ftz` forms flush subnormals as the GPU does;
//! conversions to f16/bf16 round
//! to nearest even exactly as `cvt.rn` does, and `fma` is the host's fused multiply-add. Everything
//! else is the same IEEE f32 arithmetic, so results agree to the rounding of those approximations,
//! not bitwise.

extern crate std;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::string::{String, ToString};
use std::sync::atomic::{AtomicU32, Ordering};
use std::vec::Vec;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};

pub use super::MAX_CLUSTER;
use super::WARP;

/// Stack of one emulated thread (kernel bodies keep their register tiles on it).
const THREAD_STACK_BYTES: usize = 256 * 1024;
/// Stacks an OS thread keeps for its next launches (more are freed after use).
const POOLED_STACKS: usize = 2048;

/// Why an emulated launch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmuError {
    pub kernel: String,
    pub message: String,
}

impl core::fmt::Display for EmuError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "emulated kernel `{}`: {}", self.kernel, self.message)
    }
}

impl std::error::Error for EmuError {}

/// What an emulated thread tells its cluster's scheduler when it hands control back.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Yield {
    /// It ran since it was last resumed (and may have changed what others wait for).
    Ran,
    /// It only found that what it waits for is still missing.
    Blocked,
}

/// What the scheduler tells an emulated thread it resumes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Resume {
    Run,
    /// Every unfinished thread of the cluster is blocked, so none of the waits can end: report.
    Stuck,
}

type ThreadYielder = Yielder<Resume, Yield>;

/// Hands control to the other threads of the cluster until `done()`. When no thread can move any
/// more, the scheduler resumes this one with [`Resume::Stuck`] and it panics with `stuck()`.
fn wait_until(done: impl Fn() -> bool, stuck: impl Fn() -> String) {
    if done() {
        return;
    }
    let (tid, rank, yielder, cluster) = with_ctx(|c| (c.tid, c.rank, c.yielder, c.cluster.clone()));
    // The first hand-over says `Ran`: this thread may have changed shared state since it was
    // resumed. Later ones only re-checked, which the scheduler's stuck test relies on.
    let mut how = Yield::Ran;
    loop {
        // SAFETY: the yielder lives on this coroutine's stack, which is running.
        let resume = unsafe { &*yielder }.suspend(how);
        enter(tid, rank, yielder, &cluster);
        if resume == Resume::Stuck {
            panic!("{}", stuck());
        }
        if done() {
            return;
        }
        how = Yield::Blocked;
    }
}

/// A reusable barrier for `n` threads.
struct Barrier {
    n: usize,
    arrived: Cell<usize>,
    generation: Cell<u64>,
}

impl Barrier {
    fn new(n: usize) -> Self {
        Barrier {
            n,
            arrived: Cell::new(0),
            generation: Cell::new(0),
        }
    }

    fn wait(&self, block: usize, what: &str) {
        let generation = self.generation.get();
        let arrived = self.arrived.get() + 1;
        if arrived == self.n {
            self.arrived.set(0);
            self.generation.set(generation + 1);
            return;
        }
        self.arrived.set(arrived);
        wait_until(
            || self.generation.get() != generation,
            || {
                std::format!(
                    "{what} not reached by all {} threads (block {block}; a barrier or shuffle \
                     inside divergent control flow?)",
                    self.n
                )
            },
        );
    }
}

/// What the threads of one emulated block share.
struct Block {
    idx: usize,
    dim: usize,
    grid: usize,
    barrier: Barrier,
    warp_barriers: Vec<Barrier>,
    warp_slots: Vec<AtomicU32>,
    /// Barriers of the warp segments that shuffle on their own ([`shfl_xor_within`]), by first
    /// thread and lanes, made on first use.
    segment_barriers: RefCell<BTreeMap<(usize, usize), Rc<Barrier>>>,
    shared: Vec<AtomicU32>,
    /// The mbarriers in `shared`, by word: kept beside the words, which they make unusable.
    mbarriers: RefCell<BTreeMap<usize, Mbarrier>>,
    /// Each thread's asynchronous copies in flight, by thread.
    async_copies: RefCell<BTreeMap<usize, Vec<AsyncCopy>>>,
}

/// An asynchronous copy in flight: the first shared word it lands on, and the 16 bytes it read.
type AsyncCopy = (usize, [u32; 4]);

/// An emulated mbarrier: a phase completes when every expected arrival has arrived and the bytes
/// expected of asynchronous stores equal those that landed (either may come first, as on the GPU).
#[derive(Clone, Copy)]
struct Mbarrier {
    arrivals: u32,
    pending: u32,
    /// Bytes expected minus bytes landed in the current phase.
    tx: i64,
    phase: u32,
    /// The thread that made it, and how many block and cluster barriers had completed then:
    /// another thread may use it only after one more (see [`Mbarrier::check_published`]).
    made_by: (usize, usize),
    made_at: (u64, u64),
}

impl Mbarrier {
    /// Panics when thread `tid` of block `rank` uses this mbarrier (at word `i`) before a block
    /// or cluster barrier has published it: on the GPU it may not exist yet for that thread (nor
    /// for the copy engine), and no interleaving the emulator runs shows it, since the maker runs
    /// up to its next barrier first.
    fn check_published(
        &self,
        cluster: &Cluster,
        (rank, tid): (usize, usize),
        i: usize,
        what: &str,
    ) {
        let now = (
            cluster.blocks[self.made_by.0].barrier.generation.get(),
            cluster.barrier.generation.get(),
        );
        if (rank, tid) != self.made_by && now == self.made_at {
            panic!(
                "{what} on the mbarrier at word {i} of block rank {} by thread {tid} of rank \
                 {rank} before a block or cluster barrier published it (thread {} made it)",
                self.made_by.0, self.made_by.1
            );
        }
    }
}

impl Block {
    /// Applies `f` to the mbarrier at word `i`, then completes its phase if it is due.
    fn update_mbarrier(&self, i: usize, what: &str, f: impl FnOnce(&mut Mbarrier)) {
        let mut bars = self.mbarriers.borrow_mut();
        let Some(bar) = bars.get_mut(&i) else {
            panic!("{what} on word {i}, which holds no initialized mbarrier")
        };
        f(bar);
        if bar.pending == 0 && bar.tx == 0 {
            bar.phase += 1;
            bar.pending = bar.arrivals;
        }
    }
}

/// What the blocks of one emulated cluster share.
struct Cluster {
    idx: usize,
    count: usize,
    blocks: Vec<Block>,
    barrier: Barrier,
}

/// The emulated thread running on this OS thread now, and its cluster.
struct ThreadCtx {
    tid: usize,
    rank: usize,
    yielder: *const ThreadYielder,
    cluster: Rc<Cluster>,
}

impl ThreadCtx {
    fn block(&self) -> &Block {
        &self.cluster.blocks[self.rank]
    }
}

std::thread_local! {
    static CTX: RefCell<Option<ThreadCtx>> = const { RefCell::new(None) };
}

/// Makes thread `tid` of block `rank` of `cluster` the current one (each coroutine does on every
/// resume).
fn enter(tid: usize, rank: usize, yielder: *const ThreadYielder, cluster: &Rc<Cluster>) {
    CTX.with(|c| {
        let mut c = c.borrow_mut();
        let c = c
            .as_mut()
            .expect("an emulated thread runs inside its launch");
        (c.tid, c.rank, c.yielder) = (tid, rank, yielder);
        if !Rc::ptr_eq(&c.cluster, cluster) {
            c.cluster = cluster.clone();
        }
    })
}

fn with_ctx<R>(f: impl FnOnce(&ThreadCtx) -> R) -> R {
    CTX.with(|c| {
        let c = c.borrow();
        let ctx = c
            .as_ref()
            .expect("arch function called outside an emulated launch");
        f(ctx)
    })
}

pub fn thread_idx() -> usize {
    with_ctx(|c| c.tid)
}
pub fn block_idx() -> usize {
    with_ctx(|c| c.block().idx)
}
pub fn block_dim() -> usize {
    with_ctx(|c| c.block().dim)
}
pub fn grid_dim() -> usize {
    with_ctx(|c| c.block().grid)
}
pub fn cluster_rank() -> usize {
    with_ctx(|c| c.rank)
}
pub fn cluster_size() -> usize {
    with_ctx(|c| c.cluster.blocks.len())
}
pub fn cluster_idx() -> usize {
    with_ctx(|c| c.cluster.idx)
}
pub fn cluster_count() -> usize {
    with_ctx(|c| c.cluster.count)
}

pub fn sync_threads() {
    let (cluster, rank) = with_ctx(|c| (c.cluster.clone(), c.rank));
    let block = &cluster.blocks[rank];
    block.barrier.wait(block.idx, "block barrier");
}

/// Every thread of every block of the cluster waits for all the others.
pub fn sync_cluster() {
    let (cluster, rank) = with_ctx(|c| (c.cluster.clone(), c.rank));
    let idx = cluster.blocks[rank].idx;
    cluster.barrier.wait(idx, "cluster barrier");
}

/// Every lane of the warp publishes its value, waits for the whole warp, reads its partner's, and
/// waits again so no slot is overwritten before it was read. A missing lane is reported.
pub fn shfl_xor(v: f32, lane_mask: u32) -> f32 {
    warp_exchange(v, |lane| lane ^ (lane_mask as usize & (WARP - 1)))
}

/// Lane `src_lane`'s value, exchanged as [`shfl_xor`] does.
pub fn shfl_idx(v: f32, src_lane: u32) -> f32 {
    warp_exchange(v, |_| src_lane as usize % WARP)
}

/// The warp-wide exchange of the shuffles: this lane's value out, lane `partner(lane)`'s in.
fn warp_exchange(v: f32, partner: impl Fn(usize) -> usize) -> f32 {
    let (cluster, rank, tid) = with_ctx(|c| (c.cluster.clone(), c.rank, c.tid));
    let block = &cluster.blocks[rank];
    let warp = tid / WARP;
    block.warp_slots[tid].store(v.to_bits(), Ordering::SeqCst);
    block.warp_barriers[warp].wait(block.idx, "warp shuffle");
    let out = block.warp_slots[warp * WARP + partner(tid % WARP)].load(Ordering::SeqCst);
    block.warp_barriers[warp].wait(block.idx, "warp shuffle");
    f32::from_bits(out)
}

/// [`shfl_xor`] within this lane's aligned segment of `lanes` lanes: only the segment waits for
/// itself, so segments of one warp may diverge, as on the GPU.
pub fn shfl_xor_within(v: f32, lane_mask: u32, lanes: usize) -> f32 {
    if lanes >= WARP {
        return shfl_xor(v, lane_mask);
    }
    assert!(
        lanes.is_power_of_two() && (lane_mask as usize) < lanes,
        "shuffle of mask {lane_mask} within segments of {lanes} lanes"
    );
    let (cluster, rank, tid) = with_ctx(|c| (c.cluster.clone(), c.rank, c.tid));
    let block = &cluster.blocks[rank];
    let first = tid & !(lanes - 1);
    let barrier = (block.segment_barriers.borrow_mut())
        .entry((first, lanes))
        .or_insert_with(|| Rc::new(Barrier::new(lanes)))
        .clone();
    let partner = tid ^ lane_mask as usize;
    block.warp_slots[tid].store(v.to_bits(), Ordering::SeqCst);
    barrier.wait(block.idx, "segment shuffle");
    let out = block.warp_slots[partner].load(Ordering::SeqCst);
    barrier.wait(block.idx, "segment shuffle");
    f32::from_bits(out)
}

/// The block's launch-sized dynamic shared memory, seen as f32 words; bounds-checked here.
#[derive(Clone, Copy)]
pub struct SharedF32;

pub fn shared_f32() -> SharedF32 {
    SharedF32
}

impl SharedF32 {
    /// # Safety
    /// Safe in the emulator (bounds-checked); unsafe for symmetry with the GPU.
    pub unsafe fn load(self, i: usize) -> f32 {
        with_ctx(|c| f32::from_bits(shared_word(c.block(), i, "load").load(Ordering::SeqCst)))
    }
    /// # Safety
    /// Safe in the emulator (bounds-checked); unsafe for symmetry with the GPU.
    pub unsafe fn store(self, i: usize, v: f32) {
        with_ctx(|c| shared_word(c.block(), i, "store").store(v.to_bits(), Ordering::SeqCst))
    }

    /// # Safety
    /// Safe in the emulator (checked); unsafe for symmetry with the GPU.
    pub unsafe fn load4(self, i: usize) -> [f32; 4] {
        assert!(i.is_multiple_of(4), "16-byte shared load at word {i}");
        core::array::from_fn(|w| unsafe { self.load(i + w) })
    }
    /// # Safety
    /// Safe in the emulator (checked); unsafe for symmetry with the GPU.
    pub unsafe fn store4(self, i: usize, v: [f32; 4]) {
        assert!(i.is_multiple_of(4), "16-byte shared store at word {i}");
        for (w, x) in v.into_iter().enumerate() {
            unsafe { self.store(i + w, x) };
        }
    }

    /// # Safety
    /// Safe in the emulator (checked); unsafe for symmetry with the GPU.
    pub unsafe fn mbarrier_init(self, i: usize, arrivals: u32) {
        with_ctx(|c| {
            let block = c.block();
            assert!(i.is_multiple_of(2), "mbarrier at odd word {i}");
            shared_word(block, i + 1, "mbarrier");
            let bar = Mbarrier {
                arrivals,
                pending: arrivals,
                tx: 0,
                phase: 0,
                made_by: (c.rank, c.tid),
                made_at: (
                    block.barrier.generation.get(),
                    c.cluster.barrier.generation.get(),
                ),
            };
            block.mbarriers.borrow_mut().insert(i, bar);
        })
    }

    /// # Safety
    /// Safe in the emulator (checked); unsafe for symmetry with the GPU.
    pub unsafe fn mbarrier_arrive_expect_tx(self, i: usize, bytes: u32) {
        with_ctx(|c| {
            c.block().update_mbarrier(i, "mbarrier arrival", |bar| {
                assert!(
                    bar.pending > 0,
                    "more arrivals than the mbarrier at word {i} expects"
                );
                bar.tx += bytes as i64;
                bar.pending -= 1;
            })
        })
    }

    /// Waits until the phase of parity `parity` has completed; a phase that can never complete is
    /// reported as a stuck launch.
    ///
    /// # Safety
    /// Safe in the emulator (checked); unsafe for symmetry with the GPU.
    pub unsafe fn mbarrier_wait(self, i: usize, parity: u32) {
        let (cluster, rank, tid) = with_ctx(|c| (c.cluster.clone(), c.rank, c.tid));
        let block = &cluster.blocks[rank];
        if let Some(bar) = block.mbarriers.borrow().get(&i) {
            bar.check_published(&cluster, (rank, tid), i, "a wait");
        }
        let phase = || match block.mbarriers.borrow().get(&i) {
            Some(bar) => bar.phase,
            None => panic!("mbarrier wait on word {i}, which holds no initialized mbarrier"),
        };
        wait_until(
            || phase() % 2 != parity,
            || {
                std::format!(
                    "mbarrier at word {i} cannot complete its phase {} (block {}; an arrival or \
                     asynchronous store missing?)",
                    phase(),
                    block.idx
                )
            },
        );
    }

    /// Stores into block `rank`'s word `i`, then counts 4 bytes against its mbarrier.
    ///
    /// # Safety
    /// Safe in the emulator (checked); unsafe for symmetry with the GPU.
    pub unsafe fn store_async_to(self, rank: usize, i: usize, v: f32, mbarrier: usize) {
        with_ctx(|c| {
            let Some(block) = c.cluster.blocks.get(rank) else {
                panic!(
                    "asynchronous store to rank {rank} of a cluster of {}",
                    c.cluster.blocks.len()
                )
            };
            if let Some(bar) = block.mbarriers.borrow().get(&mbarrier) {
                let sender = (c.rank, c.tid);
                bar.check_published(&c.cluster, sender, mbarrier, "an asynchronous store");
            }
            shared_word(block, i, "asynchronous store").store(v.to_bits(), Ordering::SeqCst);
            block.update_mbarrier(mbarrier, "asynchronous store", |bar| bar.tx -= 4);
        })
    }

    /// Copies the bytes into this block's words, then counts them against its mbarrier.
    ///
    /// # Safety
    /// `src` points at `bytes` readable bytes; the rest is checked.
    pub unsafe fn bulk_copy_from(self, i: usize, src: u64, bytes: u32, mbarrier: usize) {
        assert!(
            i.is_multiple_of(4) && src.is_multiple_of(16) && bytes.is_multiple_of(16),
            "bulk copy of {bytes} bytes from {src:#x} to word {i}: not 16-byte aligned"
        );
        with_ctx(|c| {
            let block = c.block();
            for w in 0..bytes as usize / 4 {
                let v = unsafe { (src as *const u32).add(w).read() };
                shared_word(block, i + w, "bulk copy").store(v, Ordering::SeqCst);
            }
            block.update_mbarrier(mbarrier, "bulk copy", |bar| bar.tx -= bytes as i64);
        })
    }
}

impl SharedF32 {
    /// Reads the 16 bytes now and keeps them with the thread's copies in flight: they land in
    /// shared memory only when the thread waits for them ([`wait_async_copies`]), so a body that
    /// reads its words before waiting reads what was there before, as it may on the GPU.
    ///
    /// # Safety
    /// `src` has 16 readable bytes.
    pub unsafe fn copy16_async_from(self, i: usize, src: u64) {
        assert!(
            i.is_multiple_of(4) && src.is_multiple_of(16),
            "16-byte asynchronous copy from {src:#x} to word {i}: not 16-byte aligned"
        );
        let v: [u32; 4] = core::array::from_fn(|w| unsafe { (src as *const u32).add(w).read() });
        with_ctx(|c| {
            let mut copies = c.block().async_copies.borrow_mut();
            copies.entry(c.tid).or_default().push((i, v));
        })
    }
}

/// `v` (the GPU's keeps the compiler from carrying what is computed from it across a loop).
pub fn opaque(v: usize) -> usize {
    core::hint::black_box(v)
}

/// Lands every copy this thread started (`cp.async.wait_all`).
pub fn wait_async_copies() {
    with_ctx(|c| {
        let block = c.block();
        let landing = block.async_copies.borrow_mut().remove(&c.tid);
        for (i, v) in landing.into_iter().flatten() {
            for (w, word) in v.into_iter().enumerate() {
                shared_word(block, i + w, "asynchronous copy").store(word, Ordering::SeqCst);
            }
        }
    })
}

/// Word `i` of a block's shared memory, or a panic naming the access.
fn shared_word<'a>(block: &'a Block, i: usize, what: &str) -> &'a AtomicU32 {
    match block.shared.get(i) {
        Some(w) => w,
        None => panic!(
            "shared-memory {what} of word {i} beyond the launch's {} words",
            block.shared.len()
        ),
    }
}

/// The emulator runs launches one after the other: every launch has already completed.
pub fn launch_dependents() {}
/// As [`launch_dependents`].
pub fn wait_for_previous_launch() {}

/// Nothing to order in the emulator: mbarriers live behind a lock.
pub fn fence_mbarrier_init() {}

/// # Safety
/// As on the GPU: `p` is 16-byte aligned with 16 readable bytes.
pub unsafe fn load16(p: *const u8) -> [u32; 4] {
    assert!(
        (p as usize).is_multiple_of(16),
        "16-byte load from misaligned address {p:p}"
    );
    unsafe { (p as *const [u32; 4]).read() }
}

/// # Safety
/// As on the GPU: `p` is 16-byte aligned with 16 writable bytes.
pub unsafe fn store16(p: *mut u8, v: [u32; 4]) {
    assert!(
        (p as usize).is_multiple_of(16),
        "16-byte store to misaligned address {p:p}"
    );
    unsafe { (p as *mut [u32; 4]).write(v) }
}

/// [`load16`]: the emulator has no caches to hint.
///
/// # Safety
/// As for [`load16`].
pub unsafe fn load16_kept(p: *const u8) -> [u32; 4] {
    unsafe { load16(p) }
}

/// [`store16`]: the emulator has no caches to hint.
///
/// # Safety
/// As for [`store16`].
pub unsafe fn store16_streaming(p: *mut u8, v: [u32; 4]) {
    unsafe { store16(p, v) }
}

pub fn bf16_to_f32(h: u16) -> f32 {
    half::bf16::from_bits(h).to_f32()
}
pub fn f32_to_bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}
pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}
pub fn rsqrt(v: f32) -> f32 {
    1.0 / v.sqrt()
}
pub fn exp2(v: f32) -> f32 {
    v.exp2()
}
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}
/// Flushes subnormal inputs and results to zero like `ex2.approx.ftz.f32`.
pub fn exp2_ftz(v: f32) -> f32 {
    flush_subnormal(flush_subnormal(v).exp2())
}
/// Exact `1/v`, flushed like `rcp.approx.ftz.f32` (which is within 1 ulp of it).
pub fn rcp_approx(v: f32) -> f32 {
    flush_subnormal(1.0 / flush_subnormal(v))
}
fn flush_subnormal(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}
pub fn f32x2_to_bf16x2(lo: f32, hi: f32) -> u32 {
    f32_to_bf16(lo) as u32 | (f32_to_bf16(hi) as u32) << 16
}
pub fn f32x2_to_f16x2(lo: f32, hi: f32) -> u32 {
    f32_to_f16(lo) as u32 | (f32_to_f16(hi) as u32) << 16
}

std::thread_local! {
    /// Stacks of finished emulated threads, for the next clusters run on this OS thread.
    static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
}

type Thread = Coroutine<Resume, Yield, (), DefaultStack>;

/// Clears this OS thread's current emulated thread when a cluster's run ends, however it ends.
struct LeaveCluster;

impl Drop for LeaveCluster {
    fn drop(&mut self) {
        CTX.with(|c| *c.borrow_mut() = None);
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a thread panicked".to_string())
}

/// Runs every thread of `clusters` (one cluster, or the whole grid of a cooperative launch) to
/// its end, each a coroutine resumed round-robin until it waits. A round in which every
/// unfinished thread only found its wait still unsatisfied changed nothing, so nothing ever will:
/// the first of them reports what it waits for.
fn run_clusters(
    clusters: &[Rc<Cluster>],
    block: usize,
    body: &(dyn Fn() + Sync),
) -> Result<(), String> {
    let Some(first) = clusters.first() else {
        return Ok(());
    };
    let threads: usize = clusters.iter().map(|c| c.blocks.len() * block).sum();
    CTX.with(|c| {
        *c.borrow_mut() = Some(ThreadCtx {
            tid: 0,
            rank: 0,
            yielder: core::ptr::null(),
            cluster: first.clone(),
        })
    });
    let _leave = LeaveCluster;
    let mut running: Vec<Option<Thread>> = Vec::with_capacity(threads);
    for cluster in clusters {
        for t in 0..cluster.blocks.len() * block {
            let stack = match STACKS.with(|s| s.borrow_mut().pop()) {
                Some(stack) => stack,
                None => DefaultStack::new(THREAD_STACK_BYTES).map_err(|e| {
                    std::format!("could not allocate the stack of thread {t} of {threads} ({e})")
                })?,
            };
            let (rank, tid) = (t / block, t % block);
            let cluster = cluster.clone();
            let start = move |yielder: &ThreadYielder, _: Resume| {
                enter(tid, rank, yielder, &cluster);
                body();
            };
            // SAFETY: `body` outlives every coroutine: each is run to its end or dropped (which
            // unwinds it) before this function returns.
            running.push(Some(unsafe { Thread::with_stack_unchecked(stack, start) }));
        }
    }
    let mut unfinished = threads;
    while unfinished > 0 {
        let mut moved = false;
        for slot in running.iter_mut() {
            let Some(thread) = slot else { continue };
            let resumed = std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| {
                thread.resume(Resume::Run)
            }));
            match resumed {
                Ok(CoroutineResult::Yield(Yield::Blocked)) => {}
                Ok(CoroutineResult::Yield(Yield::Ran)) => moved = true,
                Ok(CoroutineResult::Return(())) => {
                    if let Some(done) = slot.take() {
                        let stack = done.into_stack();
                        STACKS.with(|s| {
                            let mut s = s.borrow_mut();
                            if s.len() < POOLED_STACKS {
                                s.push(stack);
                            }
                        });
                    }
                    unfinished -= 1;
                    moved = true;
                }
                Err(payload) => return Err(panic_message(&*payload)),
            }
        }
        if !moved {
            let Some(thread) = running.iter_mut().flatten().next() else {
                break;
            };
            let resumed = std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| {
                thread.resume(Resume::Stuck)
            }));
            return Err(match resumed {
                Err(payload) => panic_message(&*payload),
                Ok(_) => "every thread waits and none reported what for".to_string(),
            });
        }
    }
    Ok(())
}

/// Runs `body` as kernel `kernel` over `grid` blocks of `block` threads, in clusters of `cluster`
/// blocks, with `shared_bytes` of dynamic shared memory per block. Clusters run one after another
/// on the calling OS thread, the threads of a cluster taking turns at their waits; a
/// `cooperative` launch runs every block at once instead (its blocks may wait for each other at
/// [`grid_barrier`], as on the GPU, where all of them are resident).
pub fn launch(
    kernel: &str,
    (grid, block, cluster): (usize, usize, usize),
    shared_bytes: usize,
    cooperative: bool,
    body: &(dyn Fn() + Sync),
) -> Result<(), EmuError> {
    let fail = |message: String| EmuError {
        kernel: kernel.to_string(),
        message,
    };
    if grid == 0
        || block == 0
        || block > 1024
        || !(1..=MAX_CLUSTER).contains(&cluster)
        || !grid.is_multiple_of(cluster)
    {
        return Err(fail(std::format!(
            "invalid launch shape: grid {grid}, block {block}, cluster {cluster}"
        )));
    }
    let count = grid / cluster;
    let make = |idx: usize| {
        let warps = block.div_ceil(WARP);
        let blocks = (0..cluster)
            .map(|rank| Block {
                idx: idx * cluster + rank,
                dim: block,
                grid,
                barrier: Barrier::new(block),
                // A partial last warp still expects 32 lanes: a full-mask shuffle there is misuse.
                warp_barriers: (0..warps).map(|_| Barrier::new(WARP)).collect(),
                warp_slots: (0..warps * WARP).map(|_| AtomicU32::new(0)).collect(),
                segment_barriers: RefCell::new(BTreeMap::new()),
                shared: (0..shared_bytes.div_ceil(4))
                    .map(|_| AtomicU32::new(0x7fc0_dead))
                    .collect(),
                mbarriers: RefCell::new(BTreeMap::new()),
                async_copies: RefCell::new(BTreeMap::new()),
            })
            .collect();
        Rc::new(Cluster {
            idx,
            count,
            blocks,
            barrier: Barrier::new(cluster * block),
        })
    };
    if cooperative {
        let clusters: Vec<_> = (0..count).map(make).collect();
        return run_clusters(&clusters, block, body)
            .map_err(|msg| fail(std::format!("cooperative grid: {msg}")));
    }
    for idx in 0..count {
        run_clusters(&[make(idx)], block, body)
            .map_err(|msg| fail(std::format!("cluster {idx}: {msg}")))?;
    }
    Ok(())
}

/// The emulator's [`crate::arch`] grid barrier: every block of a cooperative launch waits here
/// until all have arrived (see the nvptx one for the two words at `sync`). An arrival count of
/// the grid's size or more (words not zeroed) panics, as the GPU traps.
///
/// # Safety
/// `sync` is an 8-byte-aligned address of two live words no other launch uses meanwhile.
pub unsafe fn grid_barrier(sync: u64) {
    sync_threads();
    if thread_idx() == 0 {
        // SAFETY: as the caller promises.
        let (arrivals, generation) = unsafe {
            (
                &*(sync as *const AtomicU32),
                &*((sync + 4) as *const AtomicU32),
            )
        };
        let seen = generation.load(Ordering::SeqCst);
        let arrived = arrivals.fetch_add(1, Ordering::SeqCst) as usize;
        let blocks = grid_dim();
        if arrived >= blocks {
            panic!(
                "grid barrier: {arrived} arrivals counted before this one in a grid of {blocks} \
                 blocks (its words were not zero)"
            );
        }
        if arrived + 1 == blocks {
            arrivals.store(0, Ordering::SeqCst);
            generation.store(seen.wrapping_add(1), Ordering::SeqCst);
        } else {
            wait_until(
                || generation.load(Ordering::SeqCst) != seen,
                || {
                    std::format!(
                        "a grid barrier that not all {blocks} blocks reach (a launch that is not \
                         cooperative?)"
                    )
                },
            );
        }
    }
    sync_threads();
}

/// Adds `v` to the f32 at `p` atomically.
///
/// # Safety
/// `p` is a 4-byte-aligned address of a live f32.
pub unsafe fn atomic_add_f32(p: u64, v: f32) {
    // SAFETY: as the caller promises.
    let word = unsafe { &*(p as *const AtomicU32) };
    let mut old = word.load(Ordering::SeqCst);
    while let Err(seen) = word.compare_exchange_weak(
        old,
        (f32::from_bits(old) + v).to_bits(),
        Ordering::SeqCst,
        Ordering::SeqCst,
    ) {
        old = seen;
    }
}

/// Words of the launch's dynamic shared memory.
pub fn dynamic_shared_words() -> usize {
    with_ctx(|c| c.block().shared.len())
}

/// The emulator's [`crate::arch`] block lock: thread 0 takes the word at `lock` from 0 to 1,
/// handing control to the other emulated threads while another block holds it.
///
/// # Safety
/// `lock` is a 4-byte-aligned address of a live word; every thread of the block calls this.
pub unsafe fn block_lock(lock: u64) {
    sync_threads();
    if thread_idx() == 0 {
        // SAFETY: as the caller promises.
        let word = unsafe { &*(lock as *const AtomicU32) };
        let take = || {
            word.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        };
        wait_until(take, || "a block lock never released".to_string());
    }
    sync_threads();
}

/// Releases [`block_lock`].
///
/// # Safety
/// As for [`block_lock`], which this block holds.
pub unsafe fn block_unlock(lock: u64) {
    sync_threads();
    if thread_idx() == 0 {
        // SAFETY: as the caller promises.
        unsafe { &*(lock as *const AtomicU32) }.store(0, Ordering::SeqCst);
    }
}
