//! The CPU twin of the nvptx `arch` module: the emulator that runs kernel bodies on the host.
//!
//! [`launch`] runs a grid cluster by cluster (a cluster of one block unless the launch asks for
//! more); the threads of a cluster are OS threads. Each block has a real barrier, per-warp
//! exchange slots for the shuffles and its launch-sized shared memory, into which the other blocks
//! of its cluster can store asynchronously (distributed shared memory), counted by mbarriers; the
//! cluster has a barrier of its own.
//! Misuse is reported, not hung: a barrier or shuffle that not every thread reaches times out and
//! the launch returns an [`EmuError`] naming the kernel; shared-memory accesses are bounds-checked;
//! a panic in any thread (an out-of-bounds index, say) ends the launch with its message.
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

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::string::{String, ToString};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use std::vec::Vec;

pub use super::MAX_CLUSTER;
use super::WARP;

/// How long a thread waits at a barrier or shuffle before the launch is declared stuck.
const STUCK_AFTER: Duration = Duration::from_secs(5);

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

/// A reusable barrier for `n` threads that gives up after [`STUCK_AFTER`] or when the block is
/// poisoned by a panicking thread.
struct Barrier {
    n: usize,
    state: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl Barrier {
    fn new(n: usize) -> Self {
        Barrier {
            n,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
        }
    }

    fn wait(&self, cluster: &Cluster, block: usize, what: &str) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = st.1;
        st.0 += 1;
        if st.0 == self.n {
            st.0 = 0;
            st.1 += 1;
            self.cv.notify_all();
            return;
        }
        wait_while(
            cluster,
            &self.cv,
            st,
            |st| st.1 == generation,
            |_| {
                std::format!(
                    "{what} not reached by all {} threads within {:?} (block {block}; a barrier \
                     or shuffle inside divergent control flow?)",
                    self.n,
                    STUCK_AFTER
                )
            },
        );
    }
}

/// Waits on `cv` while `blocked(state)`, giving up (poisoning the cluster, so its other threads
/// stop too) after [`STUCK_AFTER`] with the message `stuck(state)`, or when another thread of the
/// cluster has failed.
fn wait_while<T>(
    cluster: &Cluster,
    cv: &Condvar,
    mut state: std::sync::MutexGuard<'_, T>,
    blocked: impl Fn(&T) -> bool,
    stuck: impl Fn(&T) -> String,
) {
    let deadline = std::time::Instant::now() + STUCK_AFTER;
    while blocked(&state) {
        if cluster.poisoned.load(Ordering::SeqCst) {
            panic!("another thread of the cluster failed");
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            cluster.poisoned.store(true, Ordering::SeqCst);
            cv.notify_all();
            panic!("{}", stuck(&state));
        }
        let step = (deadline - now).min(Duration::from_millis(50));
        state = cv
            .wait_timeout(state, step)
            .unwrap_or_else(|e| e.into_inner())
            .0;
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
    shared: Vec<AtomicU32>,
    /// The mbarriers in `shared`, by word: kept beside the words, which they make unusable.
    mbarriers: Mutex<BTreeMap<usize, Mbarrier>>,
    mbarrier_changed: Condvar,
}

/// An emulated mbarrier: a phase completes when every expected arrival has arrived and the bytes
/// expected of asynchronous stores equal those that landed (either may come first, as on the GPU).
#[derive(Clone, Copy)]
struct Mbarrier {
    arrivals: u32,
    pending: u32,
    /// Bytes expected minus bytes landed in the current phase.
    tx: i64,
    phase: u32,
}

impl Block {
    /// Applies `f` to the mbarrier at word `i`, then completes its phase if it is due.
    fn update_mbarrier(&self, i: usize, what: &str, f: impl FnOnce(&mut Mbarrier)) {
        let mut bars = self.mbarriers.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bar) = bars.get_mut(&i) else {
            panic!("{what} on word {i}, which holds no initialized mbarrier")
        };
        f(bar);
        if bar.pending == 0 && bar.tx == 0 {
            bar.phase += 1;
            bar.pending = bar.arrivals;
            self.mbarrier_changed.notify_all();
        }
    }
}

/// What the blocks of one emulated cluster share.
struct Cluster {
    idx: usize,
    count: usize,
    blocks: Vec<Block>,
    barrier: Barrier,
    poisoned: AtomicBool,
}

struct ThreadCtx {
    tid: usize,
    rank: usize,
    cluster: Arc<Cluster>,
}

impl ThreadCtx {
    fn block(&self) -> &Block {
        &self.cluster.blocks[self.rank]
    }
}

std::thread_local! {
    static CTX: RefCell<Option<ThreadCtx>> = const { RefCell::new(None) };
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
    block.barrier.wait(&cluster, block.idx, "block barrier");
}

/// Every thread of every block of the cluster waits for all the others.
pub fn sync_cluster() {
    let (cluster, rank) = with_ctx(|c| (c.cluster.clone(), c.rank));
    let idx = cluster.blocks[rank].idx;
    cluster.barrier.wait(&cluster, idx, "cluster barrier");
}

/// Every lane of the warp publishes its value, waits for the whole warp, reads its partner's, and
/// waits again so no slot is overwritten before it was read. A missing lane is a timeout.
pub fn shfl_xor(v: f32, lane_mask: u32) -> f32 {
    let (cluster, rank, tid) = with_ctx(|c| (c.cluster.clone(), c.rank, c.tid));
    let block = &cluster.blocks[rank];
    let warp = tid / WARP;
    let lane = tid % WARP;
    let partner = lane ^ (lane_mask as usize & (WARP - 1));
    block.warp_slots[tid].store(v.to_bits(), Ordering::SeqCst);
    block.warp_barriers[warp].wait(&cluster, block.idx, "warp shuffle");
    let out = block.warp_slots[warp * WARP + partner].load(Ordering::SeqCst);
    block.warp_barriers[warp].wait(&cluster, block.idx, "warp shuffle");
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
            };
            let mut bars = block.mbarriers.lock().unwrap_or_else(|e| e.into_inner());
            bars.insert(i, bar);
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

    /// Waits until the phase of parity `parity` has completed; a phase that never completes is
    /// reported as a stuck launch.
    ///
    /// # Safety
    /// Safe in the emulator (checked); unsafe for symmetry with the GPU.
    pub unsafe fn mbarrier_wait(self, i: usize, parity: u32) {
        let (cluster, rank) = with_ctx(|c| (c.cluster.clone(), c.rank));
        let block = &cluster.blocks[rank];
        let bars = block.mbarriers.lock().unwrap_or_else(|e| e.into_inner());
        let phase = |bars: &BTreeMap<usize, Mbarrier>| match bars.get(&i) {
            Some(bar) => bar.phase,
            None => panic!("mbarrier wait on word {i}, which holds no initialized mbarrier"),
        };
        wait_while(
            &cluster,
            &block.mbarrier_changed,
            bars,
            |bars| phase(bars) % 2 == parity,
            |bars| {
                std::format!(
                    "mbarrier at word {i} did not complete its phase {} within {STUCK_AFTER:?} \
                     (block {}; an arrival or asynchronous store missing?)",
                    phase(bars),
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

/// Marks the cluster poisoned if its thread unwinds, so the others stop waiting at once.
struct PoisonOnPanic(Arc<Cluster>);

impl Drop for PoisonOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::SeqCst);
        }
    }
}

/// Runs `body` as kernel `kernel` over `grid` blocks of `block` threads, in clusters of `cluster`
/// blocks, with `shared_bytes` of dynamic shared memory per block. Clusters run one after another;
/// the threads of a cluster run concurrently.
pub fn launch(
    kernel: &str,
    grid: usize,
    block: usize,
    cluster: usize,
    shared_bytes: usize,
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
    for idx in 0..count {
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
                shared: (0..shared_bytes.div_ceil(4))
                    .map(|_| AtomicU32::new(0x7fc0_dead))
                    .collect(),
                mbarriers: Mutex::new(BTreeMap::new()),
                mbarrier_changed: Condvar::new(),
            })
            .collect();
        let shared = Arc::new(Cluster {
            idx,
            count,
            blocks,
            barrier: Barrier::new(cluster * block),
            poisoned: AtomicBool::new(false),
        });
        let mut first_panic: Option<String> = None;
        std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(cluster * block);
            for t in 0..cluster * block {
                let thread_shared = shared.clone();
                let (rank, tid) = (t / block, t % block);
                let spawned = std::thread::Builder::new()
                    .stack_size(256 * 1024)
                    .spawn_scoped(s, move || {
                        let _guard = PoisonOnPanic(thread_shared.clone());
                        CTX.with(|c| {
                            *c.borrow_mut() = Some(ThreadCtx {
                                tid,
                                rank,
                                cluster: thread_shared,
                            })
                        });
                        body();
                        CTX.with(|c| *c.borrow_mut() = None);
                    });
                match spawned {
                    Ok(handle) => handles.push(handle),
                    Err(e) => {
                        // The threads already running would wait for this one at the first
                        // barrier: poison the cluster so they give up, then report.
                        shared.poisoned.store(true, Ordering::SeqCst);
                        first_panic = Some(std::format!(
                            "could not start thread {t} of {} ({e})",
                            cluster * block
                        ));
                        break;
                    }
                }
            }
            for h in handles {
                if let Err(payload) = h.join() {
                    let msg = payload
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "a thread panicked".to_string());
                    // Keep the root cause, not the "another thread failed" echoes.
                    if first_panic
                        .as_ref()
                        .is_none_or(|m| m.starts_with("another thread"))
                    {
                        first_panic = Some(msg);
                    }
                }
            }
        });
        if let Some(msg) = first_panic {
            return Err(fail(std::format!("cluster {idx}: {msg}")));
        }
    }
    Ok(())
}
