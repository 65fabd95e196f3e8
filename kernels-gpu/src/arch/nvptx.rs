//! The nvptx64 implementation of [`crate::arch`]: one PTX instruction per function.

use core::arch::asm;
use core::arch::nvptx;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // A `loop {}` handler would hang the GPU; trap ends the kernel with an error the host sees.
    unsafe { nvptx::trap() }
}

#[inline(always)]
pub fn thread_idx() -> usize {
    unsafe { nvptx::_thread_idx_x() as usize }
}
#[inline(always)]
pub fn block_idx() -> usize {
    unsafe { nvptx::_block_idx_x() as usize }
}
#[inline(always)]
pub fn block_dim() -> usize {
    unsafe { nvptx::_block_dim_x() as usize }
}
#[inline(always)]
pub fn grid_dim() -> usize {
    unsafe { nvptx::_grid_dim_x() as usize }
}

/// Reads a 32-bit special register (`%cluster_ctarank` and the like).
#[cfg(target_feature = "sm_90")]
macro_rules! special_register {
    ($reg:literal) => {{
        let r: u32;
        unsafe {
            asm!(concat!("mov.u32 {r}, ", $reg, ";"), r = out(reg32) r,
                 options(pure, nomem, nostack, preserves_flags));
        }
        r as usize
    }};
}

// Thread-block clusters (sm_90): the blocks of a cluster run at once on one GPC and can read each
// other's shared memory. A block launched without a cluster is a cluster of one. The sm_80 build has
// no clusters, so there every block is its own cluster and these fall back to the block's values.

/// This block's rank in its cluster (`%cluster_ctarank`).
#[inline(always)]
pub fn cluster_rank() -> usize {
    #[cfg(target_feature = "sm_90")]
    return special_register!("%cluster_ctarank");
    #[cfg(not(target_feature = "sm_90"))]
    return 0;
}
/// Blocks in this block's cluster (`%cluster_nctarank`).
#[inline(always)]
pub fn cluster_size() -> usize {
    #[cfg(target_feature = "sm_90")]
    return special_register!("%cluster_nctarank");
    #[cfg(not(target_feature = "sm_90"))]
    return 1;
}
/// This cluster's index in the grid (`%clusterid.x`).
#[inline(always)]
pub fn cluster_idx() -> usize {
    #[cfg(target_feature = "sm_90")]
    return special_register!("%clusterid.x");
    #[cfg(not(target_feature = "sm_90"))]
    return block_idx();
}
/// Clusters in the grid (`%nclusterid.x`).
#[inline(always)]
pub fn cluster_count() -> usize {
    #[cfg(target_feature = "sm_90")]
    return special_register!("%nclusterid.x");
    #[cfg(not(target_feature = "sm_90"))]
    return grid_dim();
}

/// `barrier.cluster.arrive` + `barrier.cluster.wait` (release and acquire by default): every thread of every
/// block of the cluster must reach it; shared-memory stores before it are visible to every block
/// of the cluster after it. A block barrier on sm_80.
///
/// Costly inside a loop: the release compiles to `MEMBAR.ALL.GPU`, which waits until every load
/// and store the thread has in flight (a prefetched row, the last row's stores) has completed.
/// Row loops exchange through [`SharedF32::store_async_to`] and mbarriers instead.
#[inline(always)]
pub fn sync_cluster() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!(
            "barrier.cluster.arrive;",
            "barrier.cluster.wait;",
            options(nostack, preserves_flags)
        );
    }
    #[cfg(not(target_feature = "sm_90"))]
    sync_threads();
}

/// `bar.sync 0`: every thread of the block must reach it.
#[inline(always)]
pub fn sync_threads() {
    unsafe { nvptx::_syncthreads() }
}

/// Butterfly shuffle over the full warp: returns `v` of lane `lane ^ lane_mask`.
///
/// Deliberately *not* `pure`/`nomem`: LLVM does not know a shuffle is convergent, and a pure asm
/// whose result is used in one branch gets sunk into that branch (seen: the first round of a block
/// reduction moved under `if lane == 0`), where the other 31 lanes never arrive and the warp hangs.
/// Declaring side effects keeps every shuffle where the source puts it.
#[inline(always)]
pub fn shfl_xor(v: f32, lane_mask: u32) -> f32 {
    let out: u32;
    unsafe {
        asm!(
            "shfl.sync.bfly.b32 {out}, {v}, {m}, 0x1f, 0xffffffff;",
            out = out(reg32) out,
            v = in(reg32) v.to_bits(),
            m = in(reg32) lane_mask,
            options(nostack, preserves_flags)
        );
    }
    f32::from_bits(out)
}

/// Butterfly shuffle within this lane's aligned segment of `lanes` lanes (a power of two, 2 to
/// 32): returns `v` of lane `lane ^ lane_mask` (`lane_mask < lanes`). Only the segment's lanes
/// take part, so the segments of a warp (teams sharing one row each) may diverge, e.g. when one
/// has no row left. Not pure, as [`shfl_xor`].
#[inline(always)]
pub fn shfl_xor_within(v: f32, lane_mask: u32, lanes: usize) -> f32 {
    let lane = thread_idx() as u32 % 32;
    let members = if lanes >= 32 {
        u32::MAX
    } else {
        ((1u32 << lanes) - 1) << (lane & !(lanes as u32 - 1))
    };
    let out: u32;
    unsafe {
        asm!(
            "shfl.sync.bfly.b32 {out}, {v}, {m}, 0x1f, {members};",
            out = out(reg32) out,
            v = in(reg32) v.to_bits(),
            m = in(reg32) lane_mask,
            members = in(reg32) members,
            options(nostack, preserves_flags)
        );
    }
    f32::from_bits(out)
}

/// Indexed shuffle over the full warp: returns `v` of lane `src_lane`. Not pure, as
/// [`shfl_xor`].
#[inline(always)]
pub fn shfl_idx(v: f32, src_lane: u32) -> f32 {
    let out: u32;
    unsafe {
        asm!(
            "shfl.sync.idx.b32 {out}, {v}, {src}, 0x1f, 0xffffffff;",
            out = out(reg32) out,
            v = in(reg32) v.to_bits(),
            src = in(reg32) src_lane,
            options(nostack, preserves_flags)
        );
    }
    f32::from_bits(out)
}

/// The launch-sized dynamic shared memory of the block, seen as f32 words.
#[derive(Clone, Copy)]
pub struct SharedF32(*mut f32);

#[inline(always)]
pub fn shared_f32() -> SharedF32 {
    SharedF32(core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>())
}

impl SharedF32 {
    /// # Safety
    /// `i` lies inside the launch's dynamic shared memory.
    #[inline(always)]
    pub unsafe fn load(self, i: usize) -> f32 {
        unsafe { self.0.add(i).read_volatile() }
    }
    /// # Safety
    /// `i` lies inside the launch's dynamic shared memory.
    #[inline(always)]
    pub unsafe fn store(self, i: usize, v: f32) {
        unsafe { self.0.add(i).write_volatile(v) }
    }
    /// Words `i..i + 4` in one 16-byte load (`ld.shared.v4.f32`).
    ///
    /// # Safety
    /// The words lie inside the launch's dynamic shared memory; `i` is a multiple of 4.
    #[inline(always)]
    pub unsafe fn load4(self, i: usize) -> [f32; 4] {
        let (a, b, c, d): (u32, u32, u32, u32);
        unsafe {
            asm!(
                "ld.shared.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
                p = in(reg32) self.shared_address(i),
                a = out(reg32) a,
                b = out(reg32) b,
                c = out(reg32) c,
                d = out(reg32) d,
                options(nostack, preserves_flags, readonly)
            );
        }
        [a, b, c, d].map(f32::from_bits)
    }
    /// Words `i..i + 4` in one 16-byte store (`st.shared.v4.f32`).
    ///
    /// # Safety
    /// The words lie inside the launch's dynamic shared memory; `i` is a multiple of 4.
    #[inline(always)]
    pub unsafe fn store4(self, i: usize, v: [f32; 4]) {
        let [a, b, c, d] = v.map(f32::to_bits);
        unsafe {
            asm!(
                "st.shared.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};",
                p = in(reg32) self.shared_address(i),
                a = in(reg32) a,
                b = in(reg32) b,
                c = in(reg32) c,
                d = in(reg32) d,
                options(nostack, preserves_flags)
            );
        }
    }

    /// The address of word `i` in the shared state space, as `ld.shared`, `mbarrier`, `mapa` and
    /// `st.async` take it.
    #[inline(always)]
    fn shared_address(self, i: usize) -> u32 {
        let a: u32;
        unsafe {
            asm!(
                "{{",
                ".reg .u64 s;",
                "cvta.to.shared.u64 s, {p};",
                "cvt.u32.u64 {a}, s;",
                "}}",
                // An address computation, not an access: passed as an integer.
                p = in(reg64) self.0.add(i) as u64,
                a = out(reg32) a,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        a
    }

    /// Makes words `i, i + 1` (8-byte aligned) an mbarrier whose phases complete after `arrivals`
    /// arrivals and every expected byte (`mbarrier.init`). A no-op on sm_80, which has no clusters.
    ///
    /// # Safety
    /// Words `i, i + 1` lie inside the launch's dynamic shared memory, `i` is even, and no other
    /// thread uses them as an mbarrier yet.
    #[inline(always)]
    pub unsafe fn mbarrier_init(self, i: usize, arrivals: u32) {
        #[cfg(target_feature = "sm_90")]
        unsafe {
            asm!(
                "mbarrier.init.shared::cta.b64 [{a}], {n};",
                a = in(reg32) self.shared_address(i),
                n = in(reg32) arrivals,
                options(nostack, preserves_flags)
            );
        }
        #[cfg(not(target_feature = "sm_90"))]
        let _ = (i, arrivals);
    }

    /// One arrival on the mbarrier at word `i`, which also expects `bytes` more of asynchronous
    /// stores ([`Self::store_async_to`]) in the current phase (`mbarrier.arrive.expect_tx`).
    /// A no-op on sm_80.
    ///
    /// # Safety
    /// Word `i` holds an initialized mbarrier.
    #[inline(always)]
    pub unsafe fn mbarrier_arrive_expect_tx(self, i: usize, bytes: u32) {
        #[cfg(target_feature = "sm_90")]
        unsafe {
            asm!(
                "{{",
                ".reg .b64 state;",
                "mbarrier.arrive.expect_tx.shared::cta.b64 state, [{a}], {n};",
                "}}",
                a = in(reg32) self.shared_address(i),
                n = in(reg32) bytes,
                options(nostack, preserves_flags)
            );
        }
        #[cfg(not(target_feature = "sm_90"))]
        let _ = (i, bytes);
    }

    /// Waits until the phase of parity `parity` of the mbarrier at word `i` has completed
    /// (`mbarrier.try_wait.parity`, acquire): the asynchronous stores it counted are then visible
    /// to this thread. Phases count from 0. On sm_80 (clusters of one block, where the stores were
    /// plain shared stores) a block barrier: every thread of the block must reach it.
    ///
    /// # Safety
    /// Word `i` holds an initialized mbarrier whose phase `parity` will complete.
    #[inline(always)]
    pub unsafe fn mbarrier_wait(self, i: usize, parity: u32) {
        #[cfg(target_feature = "sm_90")]
        {
            let a = self.shared_address(i);
            loop {
                let done: u32;
                unsafe {
                    asm!(
                        "{{",
                        ".reg .pred p;",
                        "mbarrier.try_wait.parity.shared::cta.b64 p, [{a}], {parity};",
                        "selp.u32 {done}, 1, 0, p;",
                        "}}",
                        a = in(reg32) a,
                        parity = in(reg32) parity,
                        done = out(reg32) done,
                        options(nostack, preserves_flags)
                    );
                }
                if done != 0 {
                    break;
                }
            }
        }
        #[cfg(not(target_feature = "sm_90"))]
        {
            let _ = (i, parity);
            sync_threads();
        }
    }

    /// Stores `v` into word `i` of the shared memory of block `rank` of this cluster, counting its
    /// 4 bytes against the mbarrier at word `mbarrier` of that block when they land
    /// (`st.async … mbarrier::complete_tx::bytes`). Unlike a cluster barrier this orders nothing
    /// else, so the loads and stores a thread has in flight keep flowing. On sm_80 (rank 0 only)
    /// a plain shared store.
    ///
    /// # Safety
    /// Words `i` and `mbarrier` lie inside the launch's dynamic shared memory; `rank` is below
    /// [`cluster_size`]; that block's mbarrier is initialized (a cluster barrier orders the two)
    /// and expects these bytes in its current phase.
    #[inline(always)]
    pub unsafe fn store_async_to(self, rank: usize, i: usize, v: f32, mbarrier: usize) {
        #[cfg(target_feature = "sm_90")]
        unsafe {
            asm!(
                "{{",
                ".reg .u32 word, bar;",
                "mapa.shared::cluster.u32 word, {w}, {rank};",
                "mapa.shared::cluster.u32 bar, {b}, {rank};",
                "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [word], {v}, [bar];",
                "}}",
                w = in(reg32) self.shared_address(i),
                b = in(reg32) self.shared_address(mbarrier),
                rank = in(reg32) rank as u32,
                v = in(reg32) v.to_bits(),
                options(nostack, preserves_flags)
            );
        }
        #[cfg(not(target_feature = "sm_90"))]
        {
            let _ = (rank, mbarrier);
            unsafe { self.store(i, v) }
        }
    }

    /// Copies `bytes` from global memory at `src` into words `i..` of this block's shared memory,
    /// counting them against the mbarrier at word `mbarrier` as they land
    /// (`cp.async.bulk … mbarrier::complete_tx::bytes`). One instruction moves the whole span
    /// through the copy engine: no thread waits for it, and no registers hold it on the way. On
    /// sm_80 (where only uncalled instances contain it) a plain copy by this thread.
    ///
    /// # Safety
    /// `src` and word `i` are 16-byte aligned and `bytes` is a multiple of 16; the span is readable
    /// global memory and lies inside the launch's dynamic shared memory, which nothing reads or
    /// writes until the mbarrier's phase completes; the mbarrier expects the bytes in its current
    /// phase.
    #[inline(always)]
    pub unsafe fn bulk_copy_from(self, i: usize, src: u64, bytes: u32, mbarrier: usize) {
        #[cfg(target_feature = "sm_90")]
        unsafe {
            asm!(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{s}], {n}, [{b}];",
                d = in(reg32) self.shared_address(i),
                s = in(reg64) src,
                n = in(reg32) bytes,
                b = in(reg32) self.shared_address(mbarrier),
                options(nostack, preserves_flags)
            );
        }
        #[cfg(not(target_feature = "sm_90"))]
        {
            let _ = mbarrier;
            for w in 0..bytes as usize / 16 {
                let v = unsafe { load16((src as usize + 16 * w) as *const u8) };
                unsafe { self.store4(i + 4 * w, v.map(f32::from_bits)) };
            }
        }
    }
}

impl SharedF32 {
    /// Starts copying 16 bytes from global memory at `src` into words `i..i + 4` of this block's
    /// shared memory (`cp.async.cg.shared.global`, sm_80): no register holds them on the way.
    /// This thread sees them after [`wait_async_copies`].
    ///
    /// # Safety
    /// `src` is a 16-byte-aligned global address with 16 readable bytes; the words lie inside the
    /// launch's dynamic shared memory, `i` a multiple of 4, and nothing else reads or writes them
    /// until this thread has waited.
    #[inline(always)]
    pub unsafe fn copy16_async_from(self, i: usize, src: u64) {
        unsafe {
            asm!(
                "cp.async.cg.shared.global [{d}], [{s}], 16;",
                d = in(reg32) self.shared_address(i),
                s = in(reg64) src,
                options(nostack, preserves_flags)
            );
        }
    }
}

/// `v`, through an instruction the compiler cannot see through: what is computed from it is not
/// derived from the previous loop iteration's (no stepped pointer holding registers across the
/// loop). The asm is `pure`, so LLVM may still merge or hoist it where its input does not change
/// in the loop: whether a use stops a spill is ptxas's report's to say (`cargo xtask ptxas`).
#[inline(always)]
pub fn opaque(v: usize) -> usize {
    let out: u64;
    unsafe {
        asm!("mov.b64 {o}, {i};", o = out(reg64) out, i = in(reg64) v as u64,
            options(pure, nomem, nostack, preserves_flags));
    }
    out as usize
}

/// Waits for this thread's [`SharedF32::copy16_async_from`] copies (`cp.async.wait_all`).
#[inline(always)]
pub fn wait_async_copies() {
    unsafe { asm!("cp.async.wait_all;", options(nostack, preserves_flags)) }
}

/// Makes this thread's `mbarrier_init`s visible to the other threads of the cluster (of the
/// block, in a launch without clusters) and to the copy engine, for their asynchronous stores
/// (`fence.mbarrier_init.release.cluster`); a cluster (block) barrier must follow.
#[inline(always)]
pub fn fence_mbarrier_init() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!(
            "fence.mbarrier_init.release.cluster;",
            options(nostack, preserves_flags)
        );
    }
}

// Programmatic dependent launch (sm_90): a launch the host marks as overlapping the previous one
// on its stream may start while that one runs its last blocks; it must wait for it before reading
// what it wrote. Without the mark, or on sm_80 (no-ops there), launches run one after the other.

/// Lets the next launch on the stream start its blocks once every block of this one has called
/// this or exited (`griddepcontrol.launch_dependents`); it orders nothing about memory.
#[inline(always)]
pub fn launch_dependents() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!(
            "griddepcontrol.launch_dependents;",
            options(nostack, preserves_flags)
        );
    }
}

/// Waits until the launches this one overlaps have completed and their memory operations are
/// visible (`griddepcontrol.wait`); returns at once in a launch that overlaps none.
#[inline(always)]
pub fn wait_for_previous_launch() {
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack, preserves_flags));
    }
}

/// One 16-byte global load (`ld.global.v4.b32`).
///
/// # Safety
/// `p` is a 16-byte-aligned global address with 16 readable bytes.
#[inline(always)]
pub unsafe fn load16(p: *const u8) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "ld.global.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg64) p,
            a = out(reg32) a,
            b = out(reg32) b,
            c = out(reg32) c,
            d = out(reg32) d,
            options(readonly, nostack, preserves_flags)
        );
    }
    [a, b, c, d]
}

/// One 16-byte global store (`st.global.v4.b32`).
///
/// # Safety
/// `p` is a 16-byte-aligned global address with 16 writable bytes.
#[inline(always)]
pub unsafe fn store16(p: *mut u8, v: [u32; 4]) {
    unsafe {
        asm!(
            "st.global.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p,
            a = in(reg32) v[0],
            b = in(reg32) v[1],
            c = in(reg32) v[2],
            d = in(reg32) v[3],
            options(nostack, preserves_flags)
        );
    }
}

/// One 16-byte global load of row data a later pass of the same block reads again from L2: the
/// line is marked evict-last there (`createpolicy` + `.L2::cache_hint`), so the row's outputs
/// and other rows in flight push it out after the lines that are not needed again.
///
/// sm_80 builds load as [`load16`]: their PTX ISA (7.0) has no cache hints.
///
/// # Safety
/// As for [`load16`].
#[inline(always)]
pub unsafe fn load16_kept(p: *const u8) -> [u32; 4] {
    if !super::SM_90 {
        return unsafe { load16(p) };
    }
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!(
            "{{",
            ".reg .b64 keep;",
            "createpolicy.fractional.L2::evict_last.b64 keep, 1.0;",
            "ld.global.L2::cache_hint.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}], keep;",
            "}}",
            p = in(reg64) p,
            a = out(reg32) a,
            b = out(reg32) b,
            c = out(reg32) c,
            d = out(reg32) d,
            options(readonly, nostack, preserves_flags)
        );
    }
    [a, b, c, d]
}

/// One 16-byte global store of output nothing reads again in this launch
/// (`st.global.cs.v4.b32`: cached evict-first, so it does not push out lines that are).
///
/// # Safety
/// As for [`store16`].
#[inline(always)]
pub unsafe fn store16_streaming(p: *mut u8, v: [u32; 4]) {
    unsafe {
        asm!(
            "st.global.cs.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p,
            a = in(reg32) v[0],
            b = in(reg32) v[1],
            c = in(reg32) v[2],
            d = in(reg32) v[3],
            options(nostack, preserves_flags)
        );
    }
}

#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Round to nearest even (`cvt.rn.bf16.f32`, sm_80+).
#[inline(always)]
pub fn f32_to_bf16(v: f32) -> u16 {
    let h: u16;
    unsafe {
        asm!("cvt.rn.bf16.f32 {h}, {v};", h = out(reg16) h, v = in(reg32) v.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    h
}

#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let v: u32;
    unsafe {
        asm!("cvt.f32.f16 {v}, {h};", v = out(reg32) v, h = in(reg16) h,
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(v)
}

/// Round to nearest even (`cvt.rn.f16.f32`).
#[inline(always)]
pub fn f32_to_f16(v: f32) -> u16 {
    let h: u16;
    unsafe {
        asm!("cvt.rn.f16.f32 {h}, {v};", h = out(reg16) h, v = in(reg32) v.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    h
}

/// `rsqrt.approx.f32`: an approximation good to a few ulp of f32, far inside every tolerance the
/// tests allow against the f64 reference.
#[inline(always)]
pub fn rsqrt(v: f32) -> f32 {
    let r: u32;
    unsafe {
        asm!("rsqrt.approx.f32 {r}, {v};", r = out(reg32) r, v = in(reg32) v.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(r)
}

/// `ex2.approx.f32`: 2^x to about 2 ulp (sm_75+); subnormal results are kept.
#[inline(always)]
pub fn exp2(v: f32) -> f32 {
    let r: u32;
    unsafe {
        asm!("ex2.approx.f32 {r}, {v};", r = out(reg32) r, v = in(reg32) v.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(r)
}

/// `ex2.approx.ftz.f32`: [`exp2`] with subnormal inputs and results flushed to zero — for callers
/// that add the result to 1 (σ), where a subnormal changes nothing; saves the range fix-up around
/// the MUFU operation.
#[inline(always)]
pub fn exp2_ftz(v: f32) -> f32 {
    let r: u32;
    unsafe {
        asm!("ex2.approx.ftz.f32 {r}, {v};", r = out(reg32) r, v = in(reg32) v.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(r)
}

/// `rcp.approx.ftz.f32`: `1/v` to 1 ulp in one MUFU operation, for `v ≥ 1` (σ and erfc's `t`),
/// where IEEE division would cost a range check, a refinement and a slow path per element.
/// Results below 2⁻¹²⁶ (v > 2¹²⁶) flush to zero.
#[inline(always)]
pub fn rcp_approx(v: f32) -> f32 {
    let r: u32;
    unsafe {
        asm!("rcp.approx.ftz.f32 {r}, {v};", r = out(reg32) r, v = in(reg32) v.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(r)
}

/// Two f32 rounded to bf16 (nearest even) in one `cvt.rn.bf16x2.f32`: `lo` in bits 0..16.
/// Half the conversion instructions of two single conversions.
#[inline(always)]
pub fn f32x2_to_bf16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {r}, {hi}, {lo};", r = out(reg32) r, hi = in(reg32) hi.to_bits(),
             lo = in(reg32) lo.to_bits(), options(pure, nomem, nostack, preserves_flags));
    }
    r
}

/// Two f32 rounded to f16 (nearest even) in one `cvt.rn.f16x2.f32`: `lo` in bits 0..16.
#[inline(always)]
pub fn f32x2_to_f16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    unsafe {
        asm!("cvt.rn.f16x2.f32 {r}, {hi}, {lo};", r = out(reg32) r, hi = in(reg32) hi.to_bits(),
             lo = in(reg32) lo.to_bits(), options(pure, nomem, nostack, preserves_flags));
    }
    r
}

/// `a·b + c` rounded once (`fma.rn.f32`). Rust never contracts `a*b + c` on its own, and
/// `f32::mul_add` is not in `core` on stable: polynomials call this to get one instruction per term.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    let r: u32;
    unsafe {
        asm!("fma.rn.f32 {r}, {a}, {b}, {c};", r = out(reg32) r, a = in(reg32) a.to_bits(),
             b = in(reg32) b.to_bits(), c = in(reg32) c.to_bits(),
             options(pure, nomem, nostack, preserves_flags));
    }
    f32::from_bits(r)
}

/// Polls of a grid barrier's generation word, about 64 ns apart, before it gives up (~9 s): a
/// grid that cannot all be resident, or a barrier word someone else wrote, traps rather than
/// hangs.
const GRID_BARRIER_POLLS: u32 = 1 << 27;

/// Waits until every block of the grid has reached it; every block's stores before it are
/// visible to every block after it. The grid must be co-resident (a cooperative launch). `sync`
/// is the global address of two u32 words: the arrivals, 0 between barriers (the last block to
/// arrive puts it back), and a generation the last block advances. An arrival count of the
/// grid's size or more means the words were not zeroed: trap.
///
/// # Safety
/// `sync` is an 8-byte-aligned global address that no other launch uses at the same time; every
/// thread of every block of the grid calls this.
#[inline(always)]
pub unsafe fn grid_barrier(sync: u64) {
    sync_threads();
    if thread_idx() == 0 {
        unsafe {
            let generation = sync + 4;
            let seen: u32;
            asm!("ld.relaxed.gpu.global.u32 {v}, [{p}];", v = out(reg32) seen,
                p = in(reg64) generation, options(nostack, preserves_flags));
            // Releases the block's stores (ordered before this thread's by `bar.sync`).
            let arrived: u32;
            asm!("atom.add.acq_rel.gpu.global.u32 {old}, [{p}], 1;", old = out(reg32) arrived,
                p = in(reg64) sync, options(nostack, preserves_flags));
            let blocks = grid_dim() as u32;
            if arrived >= blocks {
                nvptx::trap();
            }
            if arrived + 1 == blocks {
                asm!("st.relaxed.gpu.global.u32 [{p}], 0;", p = in(reg64) sync,
                    options(nostack, preserves_flags));
                asm!("st.release.gpu.global.u32 [{p}], {v};", p = in(reg64) generation,
                    v = in(reg32) seen.wrapping_add(1), options(nostack, preserves_flags));
            } else {
                let mut polls = 0u32;
                loop {
                    let now: u32;
                    asm!("ld.acquire.gpu.global.u32 {v}, [{p}];", v = out(reg32) now,
                        p = in(reg64) generation, options(nostack, preserves_flags));
                    if now != seen {
                        break;
                    }
                    polls += 1;
                    if polls == GRID_BARRIER_POLLS {
                        nvptx::trap();
                    }
                    asm!("nanosleep.u32 64;", options(nostack, preserves_flags));
                }
            }
            asm!("fence.acq_rel.gpu;", options(nostack, preserves_flags));
        }
    }
    sync_threads();
}

/// `red.relaxed.gpu.global.add.f32`: adds `v` to the global f32 at `p`, in whatever order the
/// adds of other threads land.
///
/// # Safety
/// `p` is a 4-byte-aligned global address.
#[inline(always)]
pub unsafe fn atomic_add_f32(p: u64, v: f32) {
    unsafe {
        asm!(
            "red.relaxed.gpu.global.add.f32 [{p}], {v};",
            p = in(reg64) p,
            v = in(reg32) v.to_bits(),
            options(nostack, preserves_flags)
        );
    }
}

/// Words of the launch's dynamic shared memory (`%dynamic_smem_size` / 4).
#[inline(always)]
pub fn dynamic_shared_words() -> usize {
    let bytes: u32;
    unsafe {
        asm!(
            "mov.u32 {b}, %dynamic_smem_size;",
            b = out(reg32) bytes,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    bytes as usize / 4
}

/// Takes the spin lock at global word `lock` (0 free, 1 held) for the whole block: thread 0
/// spins on `atom.cas.acquire`, the block waits at a barrier for it.
///
/// # Safety
/// `lock` is a 4-byte-aligned global address; every thread of the block calls this.
#[inline(always)]
pub unsafe fn block_lock(lock: u64) {
    sync_threads();
    if thread_idx() == 0 {
        loop {
            let old: u32;
            unsafe {
                asm!("atom.acquire.gpu.global.cas.b32 {old}, [{p}], 0, 1;", old = out(reg32) old,
                    p = in(reg64) lock, options(nostack, preserves_flags));
            }
            if old == 0 {
                break;
            }
            unsafe { asm!("nanosleep.u32 32;", options(nostack, preserves_flags)) };
        }
    }
    sync_threads();
}

/// Releases [`block_lock`]: every thread's stores before it are visible to the next holder.
///
/// # Safety
/// As for [`block_lock`], which this block holds.
#[inline(always)]
pub unsafe fn block_unlock(lock: u64) {
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack, preserves_flags)) };
    sync_threads();
    if thread_idx() == 0 {
        unsafe {
            asm!("st.release.gpu.global.u32 [{p}], 0;", p = in(reg64) lock,
                options(nostack, preserves_flags));
        }
    }
}
