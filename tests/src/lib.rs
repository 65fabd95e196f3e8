//! Shared test and bench support: the f64 reference of every op, random inputs, dtype conversion,
//! tolerances, poisoning, and access to a GPU when there is one.

pub mod backend;
pub mod reference;

use std::sync::Arc;
use std::sync::OnceLock;

use half::{bf16, f16};
use normkern::cudarc::driver::CudaStream;
use normkern::{Context, Dtype};

/// A storage dtype as the tests see it: conversions to and from f64, a poison value, and the
/// tolerance its outputs are held to against the f64 reference.
pub trait TestDtype: Dtype + PartialEq + std::fmt::Debug {
    const NAME: &'static str;
    /// Round-trips through the dtype: what the kernel actually reads.
    fn from_f64(v: f64) -> Self;
    /// `v` rounded to nearest even, as the kernels' stores round (half's `from_f64` for bf16
    /// drops the low mantissa bits before rounding, so it can differ just above a tie).
    fn from_f32(v: f32) -> Self;
    fn to_f64(self) -> f64;
    /// The stored bits, for bitwise comparisons (NaN poison included).
    fn bits(self) -> u32;
    /// A NaN bit pattern no kernel writes from finite inputs: marks unwritten outputs.
    fn poison() -> Self;
    /// `(relative, absolute-relative-to-rms)` tolerance of one output against the f64 reference:
    /// a couple of output roundings plus f32 arithmetic.
    const TOLERANCE: (f64, f64);
}

impl TestDtype for f32 {
    const NAME: &'static str = "f32";
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn poison() -> Self {
        f32::from_bits(0x7fc0_dead)
    }
    const TOLERANCE: (f64, f64) = (2e-5, 2e-5);
}

impl TestDtype for f16 {
    const NAME: &'static str = "f16";
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
    fn poison() -> Self {
        f16::from_bits(0x7e5a)
    }
    const TOLERANCE: (f64, f64) = (2e-3, 2e-3);
}

impl TestDtype for bf16 {
    const NAME: &'static str = "bf16";
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
    fn poison() -> Self {
        bf16::from_bits(0x7fda)
    }
    const TOLERANCE: (f64, f64) = (1.6e-2, 1.6e-2);
}

/// splitmix64: small, fast, good enough for test data.
pub struct Rng(u64);

impl Rng {
    /// A fresh seed every run (printed, so a failure can be replayed with `NORMKERN_SEED`).
    pub fn fresh(what: &str) -> Self {
        let seed = std::env::var("NORMKERN_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                t.as_nanos() as u64 ^ (std::process::id() as u64) << 32
            });
        eprintln!("{what}: seed {seed} (replay with NORMKERN_SEED={seed})");
        Rng(seed)
    }
    pub fn seeded(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// `n` values of dtype `T`, uniform in [lo, hi) before rounding to `T`.
    pub fn vec<T: TestDtype>(&mut self, n: usize, lo: f64, hi: f64) -> Vec<T> {
        let mut out = vec![T::from_f64(lo); n];
        self.fill(&mut out, lo, hi);
        out
    }
    /// Overwrites `out` with the values [`Self::vec`] would draw.
    pub fn fill<T: TestDtype>(&mut self, out: &mut [T], lo: f64, hi: f64) {
        for v in out {
            *v = T::from_f64(self.uniform(lo, hi));
        }
    }
    /// As [`Self::vec`], filled on every core: one of the bench's inputs of 2²⁷ elements took
    /// about a second on one, and a shape draws about fourteen. Chunks of 2²⁰ values, each from
    /// its own stream seeded by one draw of this one, so the values are a function of the seed
    /// (not the same as [`Self::vec`]'s).
    pub fn vec_parallel<T: TestDtype + Send>(&mut self, n: usize, lo: f64, hi: f64) -> Vec<T> {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 20;
        let seed = self.next_u64();
        let mut out = vec![T::from_f64(lo); n];
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(i, chunk)| {
                Rng::seeded(seed ^ (i as u64).wrapping_mul(0xd1b5_4a32_d192_ed03))
                    .fill(chunk, lo, hi)
            });
        out
    }
}

/// Whether two buffers hold the same bits (NaN poison compares equal to itself).
pub fn same_bits<T: TestDtype>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.bits() == y.bits())
}

pub fn to_f64<T: TestDtype>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// Elements `[r * stride .. r * stride + d]` of each row, as f64.
pub fn gather_rows<T: TestDtype>(v: &[T], rows: usize, d: usize, stride: usize) -> Vec<f64> {
    (0..rows)
        .flat_map(|r| v[r * stride..r * stride + d].iter().map(|x| x.to_f64()))
        .collect()
}

/// Root mean square of `v`: the scale absolute tolerances are measured in.
pub fn rms(v: &[f64]) -> f64 {
    (v.iter().map(|r| r * r).sum::<f64>() / v.len().max(1) as f64).sqrt()
}

/// Asserts `got` (stored as `T`) matches the f64 reference elementwise: each element within
/// `rel·|ref|` or within `abs` (an absolute bound the caller derives from the magnitude of the terms
/// that produced the value, so results of cancellation are judged fairly). NaN always fails, so
/// poison left unwritten is caught.
pub fn assert_close<T: TestDtype>(what: &str, got: &[f64], reference: &[f64], rel: f64, abs: f64) {
    assert_close_each::<T>(what, got, reference, rel, |_| abs);
}

/// [`assert_close`] with an absolute bound per element, for results whose terms differ in scale
/// from element to element (a norm's dx: each row has its own rstd).
pub fn assert_close_each<T: TestDtype>(
    what: &str,
    got: &[f64],
    reference: &[f64],
    rel: f64,
    abs_at: impl Fn(usize) -> f64,
) {
    assert_eq!(got.len(), reference.len(), "{what}: length");
    for (i, (g, r)) in got.iter().zip(reference).enumerate() {
        let abs = abs_at(i);
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} (unwritten or overflow); reference {r}"
        );
        assert!(
            approx::relative_eq!(*g, *r, epsilon = abs, max_relative = rel),
            "{what} [{}]: element {i} = {g}, reference {r} (tolerance {rel:e} relative or {abs:e} absolute)",
            T::NAME
        );
    }
}

/// The shared GPU context of a test process, or why there is none. With `NORMKERN_REQUIRE_GPU=1`
/// (the bundle's run script sets it) a missing GPU fails instead of skipping. With
/// `NORMKERN_TEST_PTX_ARCH=80` it runs the sm_80 build (A100's) on a newer GPU
/// (`Context::from_cuda_with_ptx_arch`): the tests of that build where there is no such GPU
/// (those on this shared context; tests that make their own `Context` keep the device's build).
pub fn gpu() -> Option<&'static (Context, Arc<CudaStream>)> {
    static GPU: OnceLock<Result<(Context, Arc<CudaStream>), String>> = OnceLock::new();
    let gpu = GPU.get_or_init(|| {
        let mut ctx = Context::new(0).map_err(|e| e.to_string())?;
        if let Ok(arch) = std::env::var("NORMKERN_TEST_PTX_ARCH") {
            // A bad value fails loudly: as an error it would skip every GPU test.
            let arch =
                (arch.parse()).unwrap_or_else(|e| panic!("NORMKERN_TEST_PTX_ARCH={arch}: {e}"));
            ctx = Context::from_cuda_with_ptx_arch(ctx.cuda().clone(), arch)
                .map_err(|e| e.to_string())?;
            eprintln!("tests on the sm_{arch} build (NORMKERN_TEST_PTX_ARCH)");
        }
        let stream = ctx.cuda().new_stream().map_err(|e| format!("{e:?}"))?;
        Ok((ctx, stream))
    });
    match gpu {
        Ok(g) => Some(g),
        Err(why) => {
            if std::env::var("NORMKERN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("NORMKERN_REQUIRE_GPU=1 but no GPU: {why}");
            }
            eprintln!("skipping GPU test: {why}");
            None
        }
    }
}

/// A 16-byte-aligned f32 buffer of `n` elements (the emulator's workspace takes 16-byte stores).
pub fn aligned_f32(n: usize) -> Vec<[f32; 4]> {
    vec![[f32::NAN; 4]; n.div_ceil(4).max(1)]
}

/// The first `n` floats of an [`aligned_f32`] buffer.
pub fn floats_mut(buf: &mut [[f32; 4]], n: usize) -> &mut [f32] {
    &mut buf.as_flattened_mut()[..n]
}

pub mod bench;

/// A backward's workspace of `len` f32 as a user may leave it between calls: zero in the words
/// the single launch counts in (zeroed at allocation, left zero by every call), NaN in the rest,
/// which no call may read before writing.
pub fn poisoned_workspace(len: usize) -> Vec<f32> {
    let mut workspace = vec![f32::NAN; len];
    let counters = normkern_gpu::column_sum::GROUP_SUMS_SYNC_WORDS.min(len);
    workspace[..counters].fill(0.0);
    workspace
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// The bench's parallel inputs: a function of the seed, in range, and no chunk repeating
    /// another's stream.
    #[test]
    fn parallel_random_values_follow_the_seed_and_differ_between_chunks() {
        let n = (3 << 20) + 5;
        let a: Vec<bf16> = Rng::seeded(11).vec_parallel(n, -2.0, 2.0);
        let b: Vec<bf16> = Rng::seeded(11).vec_parallel(n, -2.0, 2.0);
        let c: Vec<bf16> = Rng::seeded(12).vec_parallel(n, -2.0, 2.0);
        assert!(same_bits(&a, &b));
        assert!(!same_bits(&a, &c));
        // Rounded to bf16, a value just under 2 may become 2.
        assert!(a.iter().all(|v| (-2.0..=2.0).contains(&v.to_f64())));
        let chunk = 1 << 20;
        assert_ne!(a[..chunk], a[chunk..2 * chunk]);
        assert_ne!(a[..5], a[3 * chunk..]);
    }
}
