//! Warp and block reductions, and the fixed-order column sum that turns `[groups, d]` fp32
//! partials into one row (the second pass of the deterministic dγ/dβ/dbias scheme).
//!
//! Every sum here has an order fixed by the launch shape alone: the butterfly gives every lane the
//! same bits (fp addition is commutative, so partners add the same two values), warps are combined
//! in warp order, and the column sum walks groups in a fixed pattern. Nothing depends on timing.

use crate::arch::{self, WARP};
use crate::element::{Access, Element, Pack};

/// Sum over the 32 lanes of a warp; every lane gets the total.
#[inline(always)]
pub fn warp_sum(mut v: f32) -> f32 {
    let mut mask = WARP as u32 / 2;
    while mask > 0 {
        v += arch::shfl_xor(v, mask);
        mask >>= 1;
    }
    v
}

/// Two sums over a warp at once.
#[inline(always)]
pub fn warp_sum2(mut a: f32, mut b: f32) -> (f32, f32) {
    let mut mask = WARP as u32 / 2;
    while mask > 0 {
        a += arch::shfl_xor(a, mask);
        b += arch::shfl_xor(b, mask);
        mask >>= 1;
    }
    (a, b)
}

/// Words of dynamic shared memory [`block_sum`] and [`block_sum2`] need.
pub const BLOCK_SUM_SHARED_WORDS: usize = 2 * WARP;

/// Sum over the whole block (a multiple of 32 threads, at most 1024); every thread gets the total.
/// Uses the first [`BLOCK_SUM_SHARED_WORDS`] words of dynamic shared memory.
///
/// # Safety
/// Every thread of the block calls it (it contains barriers); the launch provides the shared words.
#[inline(always)]
pub unsafe fn block_sum(v: f32) -> f32 {
    unsafe { block_sum2(v, 0.0).0 }
}

/// Two sums over the whole block at once (one pair of barriers for both).
///
/// # Safety
/// As for [`block_sum`].
#[inline(always)]
pub unsafe fn block_sum2(a: f32, b: f32) -> (f32, f32) {
    let shared = arch::shared_f32();
    let tid = arch::thread_idx();
    let (lane, warp, warps) = (tid % WARP, tid / WARP, arch::block_dim() / WARP);
    let (a, b) = warp_sum2(a, b);
    if lane == 0 {
        unsafe {
            shared.store(warp, a);
            shared.store(WARP + warp, b);
        }
    }
    arch::sync_threads();
    let (a, b) = if lane < warps {
        unsafe { (shared.load(lane), shared.load(WARP + lane)) }
    } else {
        (0.0, 0.0)
    };
    let total = warp_sum2(a, b);
    // The next call stores into the same words: nobody may still be reading them.
    arch::sync_threads();
    total
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
pub const COLUMN_SUM_THREADS: usize = 256;
/// Group slices per block of [`column_sum`]: slice `s` sums groups `s, s + 8, s + 16, …`, then the
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
            let mut g = slice;
            while g < groups {
                acc += unsafe { partials.add(g * d + col).read() };
                g += COLUMN_SUM_SLICES;
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
