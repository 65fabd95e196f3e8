//! Warp and block reductions, and the fixed-order column sum that turns `[groups, d]` fp32
//! partials into one row (the second pass of the deterministic dγ/dβ/dbias scheme).
//!
//! Every sum here has an order fixed by the launch shape alone: the butterfly gives every lane the
//! same bits (fp addition is commutative, so partners add the same two values), warps are combined
//! in warp order, and the column sum walks groups in a fixed pattern. Nothing depends on timing.

use crate::arch::{self, WARP};
use crate::element::{Access, Element, Pack};

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

/// Sum over the 32 lanes of a warp; every lane gets the total.
#[inline(always)]
pub fn warp_sum(v: f32) -> f32 {
    warp_sums([v])[0]
}

/// Most values one [`BlockReducer::sums`] call reduces at once.
pub const MAX_BLOCK_SUMS: usize = 2;
/// Words of dynamic shared memory a [`BlockReducer`] needs: two slots of one word per warp per value.
pub const BLOCK_SUM_SHARED_WORDS: usize = 2 * MAX_BLOCK_SUMS * WARP;

/// Block-wide sums with one barrier each. Successive calls alternate between two shared-memory
/// slots: a warp can only store into a slot again after passing the barrier of the call in between,
/// which every other warp reaches only after reading that slot, so no second barrier is needed.
/// Every thread of the block must make the same sequence of calls on its own reducer.
pub struct BlockReducer {
    slot: usize,
}

impl BlockReducer {
    #[inline(always)]
    pub fn new() -> Self {
        BlockReducer { slot: 0 }
    }

    /// Sums of `N ≤ 2` values over the whole block (a multiple of 32 threads, at most 1024); every
    /// thread gets the totals, summed in a fixed order (lanes by butterfly, then warps).
    ///
    /// # Safety
    /// Every thread of the block calls it (it contains a barrier); the launch provides
    /// [`BLOCK_SUM_SHARED_WORDS`] words of dynamic shared memory.
    #[inline(always)]
    pub unsafe fn sums<const N: usize>(&mut self, v: [f32; N]) -> [f32; N] {
        let shared = arch::shared_f32();
        let base = self.slot * MAX_BLOCK_SUMS * WARP;
        self.slot ^= 1;
        let tid = arch::thread_idx();
        let (lane, warp, warps) = (tid % WARP, tid / WARP, arch::block_dim() / WARP);
        let v = warp_sums(v);
        if lane == 0 {
            for (i, x) in v.iter().enumerate() {
                unsafe { shared.store(base + i * WARP + warp, *x) };
            }
        }
        arch::sync_threads();
        let mut partial = [0.0f32; N];
        if lane < warps {
            for (i, x) in partial.iter_mut().enumerate() {
                *x = unsafe { shared.load(base + i * WARP + lane) };
            }
        }
        warp_sums(partial)
    }

    /// The sum of one value over the block; see [`Self::sums`].
    ///
    /// # Safety
    /// As for [`Self::sums`].
    #[inline(always)]
    pub unsafe fn sum(&mut self, v: f32) -> f32 {
        unsafe { self.sums([v])[0] }
    }
}

impl Default for BlockReducer {
    fn default() -> Self {
        Self::new()
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
    pub groups: u32,
    pub d: u32,
}

/// Threads per block of [`column_sum`]: 32 columns × `COLUMN_SUM_SLICES` group slices.
pub const COLUMN_SUM_THREADS: usize = 512;
/// Loads each thread of [`column_sum`] keeps in flight: 16 (96 registers, one 512-thread block
/// per SM) sums 512 groups in two round trips instead of four. It took the dbias backwards from
/// 79.5–83.5 % to 82.6–84.8 % of copy at 16384×4096 (H200); the sum order does not depend on it.
const COLUMN_SUM_UNROLL: usize = 16;
/// Group slices per block of [`column_sum`]: slice `s` sums groups `s, s + 16, s + 32, …`, then the
/// slices are added in slice order.
pub const COLUMN_SUM_SLICES: usize = COLUMN_SUM_THREADS / WARP;

/// Column sum of the fp32 partials into `out` in dtype `T`; launch with [`COLUMN_SUM_THREADS`]
/// threads and `COLUMN_SUM_THREADS` words of shared memory, any grid.
///
/// # Safety
/// The params describe valid buffers.
pub unsafe fn column_sum<T: Element>(p: &ColumnSumParams) {
    let shared = arch::shared_f32();
    let tid = arch::thread_idx();
    let (lane, slice) = (tid % WARP, tid / WARP);
    let (d, groups) = (p.d as usize, p.groups as usize);
    let partials = p.partials as *const f32;
    let mut block = arch::block_idx();
    while block * WARP < d {
        let col = block * WARP + lane;
        let mut acc = 0.0f32;
        if col < d {
            // Issue COLUMN_SUM_UNROLL independent loads, then add them in group order: the order
            // is the plain sequential one, the loads overlap instead of waiting one by one.
            let mut g = slice;
            while g < groups {
                let mut vals = [0.0f32; COLUMN_SUM_UNROLL];
                for u in 0..COLUMN_SUM_UNROLL {
                    let gu = g + u * COLUMN_SUM_SLICES;
                    if gu < groups {
                        vals[u] = unsafe { partials.add(gu * d + col).read() };
                    }
                }
                for u in 0..COLUMN_SUM_UNROLL {
                    acc += vals[u];
                }
                g += COLUMN_SUM_UNROLL * COLUMN_SUM_SLICES;
            }
        }
        unsafe { shared.store(tid, acc) };
        arch::sync_threads();
        if slice == 0 && col < d {
            let mut total = 0.0f32;
            for s in 0..COLUMN_SUM_SLICES {
                total += unsafe { shared.load(s * WARP + lane) };
            }
            let mut pack: Pack = [0; 4];
            T::set(&mut pack, 0, total);
            unsafe { Access::<T, false>::store(p.out, col, &pack) };
        }
        arch::sync_threads();
        block += arch::grid_dim();
    }
}

macro_rules! export_column_sum {
    ($($name:literal => $t:ident),*) => {$(
        #[cfg(target_arch = "nvptx64")]
        const _: () = {
            #[unsafe(export_name = $name)]
            unsafe extern "ptx-kernel" fn entry(p: ColumnSumParams) {
                unsafe { column_sum::<crate::element::$t>(&p) }
            }
        };
    )*};
}
export_column_sum!("column_sum_f32" => F32, "column_sum_f16" => F16, "column_sum_bf16" => Bf16);

/// The column-sum body for an output dtype, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn column_sum_body(out: crate::variant::Dtype) -> unsafe fn(&ColumnSumParams) {
    use crate::element::{Bf16, F16, F32};
    use crate::variant::Dtype;
    match out {
        Dtype::F32 => column_sum::<F32>,
        Dtype::F16 => column_sum::<F16>,
        Dtype::Bf16 => column_sum::<Bf16>,
    }
}
