//! Storage dtypes and how rows are read and written: 16-byte packs or single elements.
//!
//! Kernels keep raw packs (`[u32; 4]`, the bits as stored) in registers and convert one element at
//! a time when they need it: a bf16 row costs half the registers of its f32 image, which is what
//! lets the backward keep x, dy and γ of a whole row on chip.

use crate::arch;

/// Bits of one 16-byte pack as loaded; a scalar access uses word 0 only.
pub type Pack = [u32; 4];

/// A storage dtype. All arithmetic happens in f32; only loads and stores see the storage type.
pub trait Element: Copy + 'static {
    /// Bytes per element.
    const BYTES: usize;
    /// Element `i` of a pack (`i < 16 / BYTES`; a scalar load puts its element at `i == 0`).
    fn get(pack: &Pack, i: usize) -> f32;
    /// Rounds `v` to this dtype and writes it as element `i` of `pack` (other elements kept).
    fn set(pack: &mut Pack, i: usize, v: f32);
    /// Rounds `vals[..len]` to this dtype, packed as [`get`](Self::get) reads them (`len` is
    /// 1 for a scalar access). Halves convert two at a time: one instruction per pair.
    fn pack(vals: &[f32; 8], len: usize) -> Pack;
    /// Loads the single element at `p` into word 0 of a pack.
    ///
    /// # Safety
    /// `p` is readable and aligned for the dtype.
    unsafe fn load_one(p: *const u8) -> Pack;
    /// Stores element 0 of `pack` at `p`.
    ///
    /// # Safety
    /// `p` is writable and aligned for the dtype.
    unsafe fn store_one(p: *mut u8, pack: &Pack);
    /// `v` as this dtype stores it, back in f32.
    #[inline(always)]
    fn round(v: f32) -> f32 {
        let mut pack: Pack = [0; 4];
        Self::set(&mut pack, 0, v);
        Self::get(&pack, 0)
    }
}

/// IEEE binary32.
#[derive(Clone, Copy)]
pub struct F32;
/// IEEE binary16.
#[derive(Clone, Copy)]
pub struct F16;
/// bfloat16.
#[derive(Clone, Copy)]
pub struct Bf16;

impl Element for F32 {
    const BYTES: usize = 4;
    #[inline(always)]
    fn get(pack: &Pack, i: usize) -> f32 {
        f32::from_bits(pack[i])
    }
    #[inline(always)]
    fn set(pack: &mut Pack, i: usize, v: f32) {
        pack[i] = v.to_bits();
    }
    #[inline(always)]
    fn pack(vals: &[f32; 8], _len: usize) -> Pack {
        [vals[0], vals[1], vals[2], vals[3]].map(f32::to_bits)
    }
    #[inline(always)]
    unsafe fn load_one(p: *const u8) -> Pack {
        [unsafe { (p as *const u32).read() }, 0, 0, 0]
    }
    #[inline(always)]
    unsafe fn store_one(p: *mut u8, pack: &Pack) {
        unsafe { (p as *mut u32).write(pack[0]) }
    }
}

#[inline(always)]
fn half_bits(pack: &Pack, i: usize) -> u16 {
    (pack[i / 2] >> (16 * (i % 2))) as u16
}

#[inline(always)]
fn set_half_bits(pack: &mut Pack, i: usize, h: u16) {
    let shift = 16 * (i % 2);
    pack[i / 2] = (pack[i / 2] & !(0xffff << shift)) | ((h as u32) << shift);
}

macro_rules! half_element {
    ($ty:ident, $to_f32:path, $from_f32:path, $pair_from_f32:path) => {
        impl Element for $ty {
            const BYTES: usize = 2;
            #[inline(always)]
            fn get(pack: &Pack, i: usize) -> f32 {
                $to_f32(half_bits(pack, i))
            }
            #[inline(always)]
            fn set(pack: &mut Pack, i: usize, v: f32) {
                set_half_bits(pack, i, $from_f32(v));
            }
            #[inline(always)]
            fn pack(vals: &[f32; 8], len: usize) -> Pack {
                let mut pack = [0; 4];
                for (w, word) in pack.iter_mut().enumerate() {
                    if 2 * w < len {
                        *word = $pair_from_f32(vals[2 * w], vals[2 * w + 1]);
                    }
                }
                pack
            }
            #[inline(always)]
            unsafe fn load_one(p: *const u8) -> Pack {
                [unsafe { (p as *const u16).read() } as u32, 0, 0, 0]
            }
            #[inline(always)]
            unsafe fn store_one(p: *mut u8, pack: &Pack) {
                unsafe { (p as *mut u16).write(pack[0] as u16) }
            }
        }
    };
}
half_element!(
    F16,
    arch::f16_to_f32,
    arch::f32_to_f16,
    arch::f32x2_to_f16x2
);
half_element!(
    Bf16,
    arch::bf16_to_f32,
    arch::f32_to_bf16,
    arch::f32x2_to_bf16x2
);

/// Address of row `row` of rows laid `stride` elements apart from `base`.
#[inline(always)]
pub fn row_addr<T: Element>(base: u64, row: usize, stride: u64) -> u64 {
    base + row as u64 * stride * T::BYTES as u64
}

/// How a kernel walks a row: `VEC` packs of 16 bytes (the fast path: all pointers 16-byte
/// aligned, strides and `d` multiples of the pack) or single elements (any layout).
#[derive(Clone, Copy)]
pub struct Access<T: Element, const VEC: bool>(core::marker::PhantomData<T>);

impl<T: Element, const VEC: bool> Access<T, VEC> {
    /// Elements per access.
    pub const LEN: usize = if VEC { 16 / T::BYTES } else { 1 };

    /// Loads the access that starts at element `elem` of the row at `row`.
    ///
    /// # Safety
    /// The access lies inside the row, aligned as `VEC` requires.
    #[inline(always)]
    pub unsafe fn load(row: u64, elem: usize) -> Pack {
        let p = (row as usize + elem * T::BYTES) as *const u8;
        if VEC {
            unsafe { arch::load16(p) }
        } else {
            unsafe { T::load_one(p) }
        }
    }

    /// [`Self::load`] of a row a later pass reads again from L2 (`arch::load16_kept`; single
    /// elements load as ever).
    ///
    /// # Safety
    /// As for [`Self::load`].
    #[inline(always)]
    pub unsafe fn load_kept(row: u64, elem: usize) -> Pack {
        let p = (row as usize + elem * T::BYTES) as *const u8;
        if VEC {
            unsafe { arch::load16_kept(p) }
        } else {
            unsafe { T::load_one(p) }
        }
    }

    /// [`Self::store`] of output nothing in the launch reads again (`arch::store16_streaming`;
    /// single elements store as ever).
    ///
    /// # Safety
    /// As for [`Self::store`].
    #[inline(always)]
    pub unsafe fn store_streaming(row: u64, elem: usize, pack: &Pack) {
        let p = (row as usize + elem * T::BYTES) as *mut u8;
        if VEC {
            unsafe { arch::store16_streaming(p, *pack) }
        } else {
            unsafe { T::store_one(p, pack) }
        }
    }

    /// Stores one access at element `elem` of the row at `row`.
    ///
    /// # Safety
    /// As for [`Self::load`], writable.
    #[inline(always)]
    pub unsafe fn store(row: u64, elem: usize, pack: &Pack) {
        let p = (row as usize + elem * T::BYTES) as *mut u8;
        if VEC {
            unsafe { arch::store16(p, *pack) }
        } else {
            unsafe { T::store_one(p, pack) }
        }
    }
}

/// f32 accumulators written to the fp32 workspace `LEN` at a time (16-byte stores when `LEN == 4`,
/// two of them when a pack of halves holds 8).
///
/// # Safety
/// `ws_row + elem` .. `+ len` is writable f32 memory, 16-byte aligned when `VEC`.
#[inline(always)]
pub unsafe fn store_f32s<const VEC: bool>(ws_row: u64, elem: usize, vals: &[f32; 8], len: usize) {
    let base = ws_row as usize + elem * 4;
    if VEC {
        let mut c = 0;
        while c < len {
            let pack = [
                vals[c].to_bits(),
                vals[c + 1].to_bits(),
                vals[c + 2].to_bits(),
                vals[c + 3].to_bits(),
            ];
            unsafe { arch::store16((base + c * 4) as *mut u8, pack) };
            c += 4;
        }
    } else {
        unsafe { (base as *mut f32).write(vals[0]) };
    }
}

/// Reads what [`store_f32s`] wrote.
///
/// # Safety
/// As for [`store_f32s`], readable.
#[inline(always)]
pub unsafe fn load_f32s<const VEC: bool>(ws_row: u64, elem: usize, len: usize) -> [f32; 8] {
    let base = ws_row as usize + elem * 4;
    let mut vals = [0.0f32; 8];
    if VEC {
        let mut c = 0;
        while c < len {
            let pack = unsafe { arch::load16((base + c * 4) as *const u8) };
            for (j, w) in pack.iter().enumerate() {
                vals[c + j] = f32::from_bits(*w);
            }
            c += 4;
        }
    } else {
        vals[0] = unsafe { (base as *const f32).read() };
    }
    vals
}

/// One access (`Access::<T, VEC>::LEN` elements) of rows stored either in `T` or as f32, as loaded:
/// the bits of one pack of `T`, or of up to two packs of f32 (eight f32 next to 16-bit `T`).
pub type Wide = [Pack; 2];

/// Rows stored in the activations' dtype `T` or, when `f32` is set, as f32 whatever `T` is (an
/// fp32 residual stream next to bf16 activations). Accesses follow `T`'s: `Access::<T, VEC>::LEN`
/// elements at a time, so they line up with the `T` operands of the same kernel.
#[derive(Clone, Copy, Debug)]
pub struct MixedRows {
    pub base: u64,
    /// In elements of the stored dtype.
    pub stride: u64,
    pub is_f32: bool,
}

impl MixedRows {
    /// Address of row `row`.
    #[inline(always)]
    pub fn row<T: Element>(&self, row: usize) -> u64 {
        if self.is_f32 {
            row_addr::<F32>(self.base, row, self.stride)
        } else {
            row_addr::<T>(self.base, row, self.stride)
        }
    }

    /// Loads the access at element `elem` of the row at `row` (from [`Self::row`]; no conversion:
    /// see [`Self::get`]).
    ///
    /// # Safety
    /// The access lies inside the rows, aligned as `VEC` requires for the stored dtype.
    #[inline(always)]
    pub unsafe fn load<T: Element, const VEC: bool>(&self, row: u64, elem: usize) -> Wide {
        if !self.is_f32 {
            return [unsafe { Access::<T, VEC>::load(row, elem) }, [0; 4]];
        }
        // Constant indices only: a loop over the packs left `w` in local memory.
        let mut w: Wide = [unsafe { Access::<F32, VEC>::load(row, elem) }, [0; 4]];
        if Access::<T, VEC>::LEN > 4 {
            w[1] = unsafe { Access::<F32, VEC>::load(row, elem + 4) };
        }
        w
    }

    /// Element `i` of a loaded access, in f32.
    #[inline(always)]
    pub fn get<T: Element>(&self, w: &Wide, i: usize) -> f32 {
        if self.is_f32 {
            F32::get(&w[i / 4], i % 4)
        } else {
            T::get(&w[0], i)
        }
    }

    /// `v` rounded as these rows store it.
    #[inline(always)]
    pub fn round<T: Element>(&self, v: f32) -> f32 {
        if self.is_f32 { v } else { T::round(v) }
    }

    /// Stores the access at element `elem` of row `row` from f32 values.
    ///
    /// # Safety
    /// As for [`Self::load`], writable.
    #[inline(always)]
    pub unsafe fn store<T: Element, const VEC: bool>(&self, row: u64, elem: usize, v: &[f32; 8]) {
        let len = Access::<T, VEC>::LEN;
        if self.is_f32 {
            unsafe { store_f32s::<VEC>(row, elem, v, len) };
        } else {
            let mut pack: Pack = [0; 4];
            for i in 0..len {
                T::set(&mut pack, i, v[i]);
            }
            unsafe { Access::<T, VEC>::store(row, elem, &pack) };
        }
    }
}
