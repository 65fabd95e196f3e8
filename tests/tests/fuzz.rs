//! Fuzzing: seeded random calls of every public operation, valid and invalid, through the CPU
//! emulator. RMSNorm and LayerNorm forward and backward with and without each optional operand
//! (bias, saved statistics, dbias, the fused residual, weight offsets, mixed precision), activations
//! (separate, in place, with dbias) and gated activations (separate and packed), on small shapes
//! with strides ≥ d, element offsets that break 16-byte alignment, and emulated devices of varied
//! block limits, cluster sizes and grids; besides, `workspace_len`, `group_layout` and the
//! emulator's own configuration.
//!
//! Every buffer is poison around its rows (before the first, between rows, after the last) and
//! every output is poison inside them too. A call must leave its inputs bitwise unchanged and the
//! poison around its outputs in place; a rejected call must write nothing at all, and return the
//! `normkern::Error` that a model of the documented rules predicts; an accepted one must write every
//! element of its outputs, within the other tests' tolerances of the f64 reference. No call may
//! panic.
//!
//! It runs for about 50 seconds (`NORMKERN_FUZZ_SECONDS` to change that); `NORMKERN_FUZZ_CALLS=N`
//! runs N calls instead. `NORMKERN_SEED` fixes the seed of the run, and `NORMKERN_FUZZ_REPLAY=S`
//! runs only the call of seed S (every failure names its call's seed).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use normkern::activation::{
    self, Activation, Backward, Forward, GatedBackward, GatedForward, GatedGrad, GatedInput,
};
use normkern::{
    DEFAULT_EPS, Emulator, Error, NormBackward, NormForward, Rows, group_layout, layer_norm,
    rms_norm,
};
use normkern_gpu::column_sum::GROUP_SUMS_SYNC_WORDS;
use normkern_tests::reference::activation::{self as act_reference, ALL};
use normkern_tests::reference::{layer_norm as layer_reference, rms_norm as rms_reference};
use normkern_tests::{Rng, TestDtype, rms};

/// Share of the kernel calls that are made invalid on purpose.
const INVALID_SHARE: f64 = 0.4;

/// Absolute accuracy of the device activation functions (`device_functions_are_accurate_on_the_host`
/// in tests/activation.rs holds them to it): it matters next to f32's storage tolerance when a
/// result is small compared with the factor the function's error is multiplied by.
const DEVICE_FN_ABS: f64 = 2e-6;

// ---------------------------------------------------------------------------------------------
// Dtypes chosen at run time.

/// A storage dtype picked per call and per operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dt {
    F32,
    F16,
    Bf16,
}

const DTYPES: [Dt; 3] = [Dt::F32, Dt::F16, Dt::Bf16];

/// Runs `$body` with `$t` standing for the Rust type of `$dt`.
macro_rules! with_dtype {
    ($dt:expr, |$t:ident| $body:expr) => {
        match $dt {
            Dt::F32 => {
                type $t = f32;
                $body
            }
            Dt::F16 => {
                type $t = f16;
                $body
            }
            Dt::Bf16 => {
                type $t = bf16;
                $body
            }
        }
    };
}

impl Dt {
    fn bytes(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::F16 | Dt::Bf16 => 2,
        }
    }

    fn name(self) -> &'static str {
        with_dtype!(self, |T| T::NAME)
    }

    /// Elements in a 16-byte pack.
    fn pack(self) -> usize {
        16 / self.bytes()
    }

    fn poison(self) -> u32 {
        with_dtype!(self, |T| T::poison().bits())
    }

    fn tolerance(self) -> (f64, f64) {
        with_dtype!(self, |T| T::TOLERANCE)
    }

    /// The bits of `v` rounded to this dtype.
    fn round(self, v: f64) -> u32 {
        with_dtype!(self, |T| T::from_f64(v).bits())
    }

    /// The bits of `v` rounded to this dtype as the kernels' stores round.
    fn round_f32(self, v: f32) -> u32 {
        with_dtype!(self, |T| T::from_f32(v).bits())
    }

    /// The spacing of this dtype's values next to zero (its smallest subnormal): a store rounds any
    /// result there to a multiple of it, whatever the relative tolerance.
    fn spacing_at_zero(self) -> f64 {
        self.value(1)
    }

    fn value(self, bits: u32) -> f64 {
        match self {
            Dt::F32 => f32::from_bits(bits) as f64,
            Dt::F16 => f16::from_bits(bits as u16).to_f64(),
            Dt::Bf16 => bf16::from_bits(bits as u16).to_f64(),
        }
    }

    /// Whether an operand in this dtype may go next to activations in `t`: `t` itself or f32.
    fn fits(self, t: Dt) -> bool {
        self == t || self == Dt::F32
    }

    /// A dtype that is neither `t` nor f32.
    fn unsupported_next_to(t: Dt, rng: &mut Rng) -> Dt {
        match t {
            Dt::F32 => rng.pick(&[Dt::F16, Dt::Bf16]),
            Dt::F16 => Dt::Bf16,
            Dt::Bf16 => Dt::F16,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Random draws.

trait Draw {
    fn below(&mut self, n: usize) -> usize;
    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: usize, hi: usize) -> usize;
    fn chance(&mut self, p: f64) -> bool;
    fn pick<T: Copy>(&mut self, items: &[T]) -> T;
}

impl Draw for Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    fn chance(&mut self, p: f64) -> bool {
        self.uniform(0.0, 1.0) < p
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// Rows of a call: a few empty calls, many of one to four rows (a partial group of dγ rows), up
/// to 40 (several groups). Mostly few: the emulator's cost grows with the rows each block walks.
fn draw_rows(rng: &mut Rng) -> usize {
    match rng.below(100) {
        0..=2 => 0,
        3..=54 => rng.between(1, 4),
        55..=84 => rng.between(5, 12),
        _ => rng.between(13, 40),
    }
}

/// Elements per row; a multiple of every pack when the call is `aligned`.
fn draw_d(rng: &mut Rng, aligned: bool) -> usize {
    let d = match rng.below(100) {
        0..=4 => 1,
        5..=29 => rng.between(2, 16),
        30..=64 => rng.between(17, 64),
        65..=84 => rng.between(65, 128),
        _ => rng.between(129, 300),
    };
    if aligned { d.next_multiple_of(8) } else { d }
}

/// A valid eps: the default, PyTorch's RMSNorm value, or log-uniform over 1e-8..1e-1.
fn draw_eps(rng: &mut Rng) -> f32 {
    match rng.below(4) {
        0 => DEFAULT_EPS,
        1 => 1e-6,
        _ => 10f64.powf(rng.uniform(-8.0, -1.0)) as f32,
    }
}

/// eps that is not finite and positive.
fn bad_eps(rng: &mut Rng) -> f32 {
    rng.pick(&[
        0.0,
        -0.0,
        -1e-5,
        -1.0,
        -f32::MIN_POSITIVE,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ])
}

/// `(weight offset, range of the stored weight)`: the weight as used, `stored + offset`, is in
/// 0.5..1.5 either way.
fn draw_weight(rng: &mut Rng) -> (f32, (f64, f64)) {
    match rng.below(4) {
        // Gemma: γ − 1 stored, 1 added.
        0 => (1.0, (-0.5, 0.5)),
        1 => {
            let offset = rng.pick(&[0.25f32, 0.5, -1.0, 2.0]);
            (offset, (0.5 - offset as f64, 1.5 - offset as f64))
        }
        _ => (0.0, (0.5, 1.5)),
    }
}

/// A scale for the norms' inputs: the tolerances are relative, the kernels must be too.
fn draw_scale(rng: &mut Rng) -> f64 {
    match rng.below(8) {
        0 => 0.01,
        1 => 100.0,
        _ => 1.0,
    }
}

// ---------------------------------------------------------------------------------------------
// Buffers.

/// Where an operand's elements lie in its buffer: `rows × d` rows `stride` apart from element
/// `offset` on. The view handed to the call holds `view` elements from `offset` (at least the
/// rows need, unless the view is made short on purpose); `tail` more follow it.
#[derive(Clone, Copy, Debug)]
struct Layout {
    rows: usize,
    d: usize,
    stride: usize,
    offset: usize,
    view: usize,
    tail: usize,
}

impl Layout {
    /// Elements from the first row's start to the last row's end.
    fn needed(&self) -> usize {
        if self.rows == 0 {
            0
        } else {
            (self.rows - 1) * self.stride + self.d
        }
    }

    fn total(&self) -> usize {
        self.offset + self.view + self.tail
    }

    fn at(&self, r: usize, j: usize) -> usize {
        self.offset + r * self.stride + j
    }

    /// Whether element `i` of the buffer lies in a row.
    fn inside(&self, i: usize) -> bool {
        i >= self.offset && {
            let k = i - self.offset;
            k < self.needed() && k % self.stride.max(1) < self.d
        }
    }
}

/// Rows of `dt` with a random stride (d, a little more, or a multiple of the pack) and offset
/// (none, whole packs, or a few elements that break 16-byte alignment); strides and offsets are
/// whole packs when `aligned`.
fn row_layout(rng: &mut Rng, dt: Dt, (rows, d): (usize, usize), aligned: bool) -> Layout {
    let pack = dt.pack();
    let mut stride = match rng.below(4) {
        0 | 1 => d,
        2 => d + rng.between(1, 9),
        _ => d.next_multiple_of(pack) + pack * rng.below(3),
    };
    let mut offset = match rng.below(4) {
        0 | 1 => 0,
        2 => pack * rng.between(1, 2),
        _ => rng.between(1, 9),
    };
    if aligned {
        stride = stride.next_multiple_of(pack);
        offset = offset.next_multiple_of(pack);
    }
    let mut layout = Layout {
        rows,
        d,
        stride,
        offset,
        view: 0,
        tail: rng.below(9),
    };
    let slack = if rng.chance(0.3) {
        rng.between(1, stride)
    } else {
        0
    };
    layout.view = layout.needed() + slack;
    layout
}

/// `len` elements of `dt` (weight, statistics, gradients of the parameters).
fn vector_layout(rng: &mut Rng, dt: Dt, len: usize, aligned: bool) -> Layout {
    let offset = if aligned || rng.chance(0.5) {
        dt.pack() * rng.below(2)
    } else {
        rng.between(1, 9)
    };
    Layout {
        rows: 1,
        d: len,
        stride: len.max(1),
        offset,
        view: len,
        tail: rng.below(9),
    }
}

/// A workspace of at least `needed` f32, mostly 16-byte aligned; only its first `needed`
/// elements may be written.
fn workspace_layout(rng: &mut Rng, needed: usize) -> Layout {
    let offset = if rng.chance(0.7) {
        4 * rng.below(2)
    } else {
        rng.between(1, 3)
    };
    let slack = if rng.chance(0.3) {
        rng.between(1, 16)
    } else {
        0
    };
    Layout {
        rows: 1,
        d: needed,
        stride: needed.max(1),
        offset,
        view: needed + slack,
        tail: rng.below(9),
    }
}

/// What a call does with an operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Input,
    Output,
    /// dy read and dx written over it.
    InPlace,
    /// Scratch: only its first `needed` elements may change.
    Workspace,
}

/// A view that cannot be built: `Rows::with_stride` must refuse it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    ZeroD,
    StrideBelowD,
    /// One element shorter than the rows need.
    Short,
}

/// 16 bytes, 16-byte aligned, as device allocations are.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(16))]
struct Chunk([u8; 16]);

/// One operand's buffer, its dtype picked at run time.
#[derive(Clone)]
struct Buf {
    name: &'static str,
    role: Role,
    dt: Dt,
    layout: Layout,
    /// Inputs' elements in rows are uniform in this range before rounding.
    range: (f64, f64),
    fault: Option<Fault>,
    chunks: Vec<Chunk>,
}

impl Buf {
    fn new(name: &'static str, role: Role, dt: Dt, layout: Layout, range: (f64, f64)) -> Buf {
        Buf {
            name,
            role,
            dt,
            layout,
            range,
            fault: None,
            chunks: Vec::new(),
        }
    }

    fn input(name: &'static str, dt: Dt, layout: Layout, range: (f64, f64)) -> Option<Buf> {
        Some(Buf::new(name, Role::Input, dt, layout, range))
    }

    fn output(name: &'static str, dt: Dt, layout: Layout) -> Option<Buf> {
        Some(Buf::new(name, Role::Output, dt, layout, (0.0, 0.0)))
    }

    /// Allocates the buffer: poison everywhere but in the rows of inputs, which get random values.
    fn materialize(&mut self, rng: &mut Rng) {
        let n = self.layout.total();
        self.chunks = vec![Chunk([0; 16]); (n * self.dt.bytes()).div_ceil(16).max(1)];
        let poison = self.dt.poison();
        let data = matches!(self.role, Role::Input | Role::InPlace);
        for i in 0..n {
            let bits = if data && self.layout.inside(i) {
                self.dt.round(rng.uniform(self.range.0, self.range.1))
            } else {
                poison
            };
            self.set_bits(i, bits);
        }
        if self.name == "workspace" {
            // The words the single launch counts in are zero when allocated (and stay so).
            for i in 0..GROUP_SUMS_SYNC_WORDS.min(self.layout.view) {
                self.set_bits(self.layout.offset + i, 0);
            }
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: a chunk is 16 plain bytes.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast(), self.chunks.len() * 16) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`, borrowed mutably.
        unsafe {
            std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr().cast(), self.chunks.len() * 16)
        }
    }

    fn bits(&self, i: usize) -> u32 {
        let b = self.dt.bytes();
        let s = &self.bytes()[i * b..(i + 1) * b];
        match b {
            4 => u32::from_ne_bytes(s.try_into().unwrap()),
            _ => u16::from_ne_bytes(s.try_into().unwrap()) as u32,
        }
    }

    fn set_bits(&mut self, i: usize, bits: u32) {
        let b = self.dt.bytes();
        let s = &mut self.bytes_mut()[i * b..(i + 1) * b];
        match b {
            4 => s.copy_from_slice(&bits.to_ne_bytes()),
            _ => s.copy_from_slice(&(bits as u16).to_ne_bytes()),
        }
    }

    /// The rows of `layout`, dense, as f64.
    fn gather_at(&self, l: Layout) -> Vec<f64> {
        (0..l.rows)
            .flat_map(|r| (0..l.d).map(move |j| (r, j)))
            .map(|(r, j)| self.dt.value(self.bits(l.at(r, j))))
            .collect()
    }

    fn gather(&self) -> Vec<f64> {
        self.gather_at(self.layout)
    }

    fn typed<T: TestDtype>(&self) -> &[T] {
        assert_eq!(T::NAME, self.dt.name(), "{} typed wrongly", self.name);
        // SAFETY: the chunks hold `total` elements of a plain floating-point dtype (any bits
        // valid), 16-byte aligned.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast(), self.layout.total()) }
    }

    fn typed_mut<T: TestDtype>(&mut self) -> &mut [T] {
        assert_eq!(T::NAME, self.dt.name(), "{} typed wrongly", self.name);
        let n = self.layout.total();
        // SAFETY: as for `typed`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr().cast(), n) }
    }

    /// `(d, stride, elements)` the view is built with: the layout's, but for a fault.
    fn view_shape(&self) -> (usize, usize, usize) {
        let l = self.layout;
        match self.fault {
            None => (l.d, l.stride, l.view),
            Some(Fault::ZeroD) => (0, l.stride, l.view),
            Some(Fault::StrideBelowD) => (l.d, l.d - 1, l.view),
            Some(Fault::Short) => (l.d, l.stride, l.needed() - 1),
        }
    }

    /// The error building the view must give.
    fn fault_error(&self) -> Option<Expect> {
        let l = self.layout;
        self.fault.map(|fault| match fault {
            Fault::ZeroD => Expect::EmptyRow,
            Fault::StrideBelowD => Expect::StrideTooSmall {
                stride: l.d - 1,
                d: l.d,
            },
            Fault::Short => Expect::Length {
                what: "rows view",
                expected: l.needed(),
                actual: l.needed() - 1,
            },
        })
    }

    fn rows<T: TestDtype>(&self) -> normkern::Result<Rows<&[T]>> {
        let (d, stride, view) = self.view_shape();
        let (rows, offset) = (self.layout.rows, self.layout.offset);
        Rows::with_stride(&self.typed::<T>()[offset..offset + view], rows, d, stride)
    }

    fn rows_mut<T: TestDtype>(&mut self) -> normkern::Result<Rows<&mut [T]>> {
        let (d, stride, view) = self.view_shape();
        let (rows, offset) = (self.layout.rows, self.layout.offset);
        Rows::with_stride(
            &mut self.typed_mut::<T>()[offset..offset + view],
            rows,
            d,
            stride,
        )
    }

    fn view<T: TestDtype>(&self) -> &[T] {
        let l = self.layout;
        &self.typed::<T>()[l.offset..l.offset + l.view]
    }

    fn view_mut<T: TestDtype>(&mut self) -> &mut [T] {
        let l = self.layout;
        &mut self.typed_mut::<T>()[l.offset..l.offset + l.view]
    }

    fn describe(&self) -> String {
        let l = self.layout;
        let fault = self
            .fault
            .map_or(String::new(), |f| format!(" fault {f:?}"));
        format!(
            "{} {} {}×{} stride {} offset {} view {} tail {}{fault}",
            self.name,
            self.dt.name(),
            l.rows,
            l.d,
            l.stride,
            l.offset,
            l.view,
            l.tail
        )
    }
}

/// The operands of one call, by role; the unused ones are `None`. `dy` is the gated backward's
/// dh, `x` the activation backward's preact.
#[derive(Clone, Default)]
struct Operands {
    x: Option<Buf>,
    y: Option<Buf>,
    weight: Option<Buf>,
    bias: Option<Buf>,
    mean: Option<Buf>,
    rstd: Option<Buf>,
    residual: Option<Buf>,
    residual_out: Option<Buf>,
    dy: Option<Buf>,
    dx: Option<Buf>,
    dresidual: Option<Buf>,
    dweight: Option<Buf>,
    dbias: Option<Buf>,
    workspace: Option<Buf>,
    a: Option<Buf>,
    b: Option<Buf>,
    ab: Option<Buf>,
    h: Option<Buf>,
    da: Option<Buf>,
    db: Option<Buf>,
    dab: Option<Buf>,
}

impl Operands {
    fn all(&self) -> Vec<&Buf> {
        [
            &self.x,
            &self.y,
            &self.weight,
            &self.bias,
            &self.mean,
            &self.rstd,
            &self.residual,
            &self.residual_out,
            &self.dy,
            &self.dx,
            &self.dresidual,
            &self.dweight,
            &self.dbias,
            &self.workspace,
            &self.a,
            &self.b,
            &self.ab,
            &self.h,
            &self.da,
            &self.db,
            &self.dab,
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn all_mut(&mut self) -> Vec<&mut Buf> {
        [
            &mut self.x,
            &mut self.y,
            &mut self.weight,
            &mut self.bias,
            &mut self.mean,
            &mut self.rstd,
            &mut self.residual,
            &mut self.residual_out,
            &mut self.dy,
            &mut self.dx,
            &mut self.dresidual,
            &mut self.dweight,
            &mut self.dbias,
            &mut self.workspace,
            &mut self.a,
            &mut self.b,
            &mut self.ab,
            &mut self.h,
            &mut self.da,
            &mut self.db,
            &mut self.dab,
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// The operand in `slot`, which the call's kind always has.
fn the(slot: &Option<Buf>) -> &Buf {
    slot.as_ref()
        .expect("an operand every call of this kind has")
}

fn the_mut(slot: &mut Option<Buf>) -> &mut Buf {
    slot.as_mut()
        .expect("an operand every call of this kind has")
}

// ---------------------------------------------------------------------------------------------
// Calls.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    RmsForward,
    LayerForward,
    RmsBackward,
    LayerBackward,
    ActForward,
    ActBackward,
    GatedForward,
    GatedBackward,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::RmsForward => "rms_norm::forward",
            Op::LayerForward => "layer_norm::forward",
            Op::RmsBackward => "rms_norm::backward",
            Op::LayerBackward => "layer_norm::backward",
            Op::ActForward => "activation::forward",
            Op::ActBackward => "activation::backward",
            Op::GatedForward => "activation::gated_forward",
            Op::GatedBackward => "activation::gated_backward",
        }
    }

    fn layer(self) -> bool {
        matches!(self, Op::LayerForward | Op::LayerBackward)
    }
}

/// A kernel call but for its buffers.
#[derive(Clone, Debug)]
struct Spec {
    op: Op,
    /// The activations' dtype.
    t: Dt,
    /// Weight and bias.
    w: Dt,
    /// The forward's `residual`.
    r: Dt,
    /// The forward's `residual_out`; the backward's x and dresidual.
    h: Dt,
    /// dweight and dbias.
    g: Dt,
    eps: f32,
    weight_offset: f32,
    act: Activation,
    in_place: bool,
    /// The shape every operand is checked against.
    rows: usize,
    d: usize,
}

impl Spec {
    fn new(op: Op, t: Dt, (rows, d): (usize, usize)) -> Spec {
        Spec {
            op,
            t,
            w: t,
            r: t,
            h: t,
            g: t,
            eps: DEFAULT_EPS,
            weight_offset: 0.0,
            act: Activation::Relu,
            in_place: false,
            rows,
            d,
        }
    }

    fn describe(&self) -> String {
        let mut s = format!("{} T={}", self.op.name(), self.t.name());
        match self.op {
            Op::RmsForward | Op::LayerForward | Op::RmsBackward | Op::LayerBackward => {
                write!(
                    s,
                    " W={} R={} H={} G={} eps={:e} weight_offset={}",
                    self.w.name(),
                    self.r.name(),
                    self.h.name(),
                    self.g.name(),
                    self.eps,
                    self.weight_offset
                )
                .unwrap();
            }
            _ => write!(s, " {:?} in_place={}", self.act, self.in_place).unwrap(),
        }
        write!(s, " rows={} d={}", self.rows, self.d).unwrap();
        s
    }
}

/// One generated call: what it is, its operands (not yet allocated), the executor and the
/// mutations that made it invalid (none for a valid call).
struct Call {
    spec: Spec,
    ops: Operands,
    exec: Emulator,
    exec_desc: String,
    mutations: Vec<String>,
}

impl Call {
    fn describe(&self) -> String {
        let mut s = format!("{} on {}", self.spec.describe(), self.exec_desc);
        for b in self.ops.all() {
            write!(s, "\n    {}", b.describe()).unwrap();
        }
        if !self.mutations.is_empty() {
            write!(s, "\n    mutated: {}", self.mutations.join("; ")).unwrap();
        }
        s
    }
}

/// The emulated device: sometimes narrower blocks (other tiles and clusters for the same row),
/// no clusters, or a grid capped to a few blocks (persistent blocks walking more rows).
fn draw_executor(rng: &mut Rng) -> (Emulator, String) {
    let mut exec = Emulator::new();
    let mut desc = String::from("Emulator::new()");
    // Narrow blocks are also the cheapest to emulate (a barrier wakes every thread).
    if rng.chance(0.4) {
        let threads = rng.pick(&[32, 32, 64, 128, 256]);
        exec = exec.with_block_limit(threads).expect("a valid block limit");
        write!(desc, ".with_block_limit({threads})").unwrap();
    }
    if rng.chance(0.3) {
        let blocks = rng.between(1, 2);
        exec = exec.with_clusters(blocks).expect("a valid cluster size");
        write!(desc, ".with_clusters({blocks})").unwrap();
    }
    if rng.chance(0.3) {
        let blocks = rng.between(1, 6);
        exec = exec.with_grid_limit(blocks).expect("a valid grid limit");
        write!(desc, ".with_grid_limit({blocks})").unwrap();
    }
    (exec, desc)
}

/// Another shape near `(rows, d)`: a row or column more or fewer, or a few.
fn other_shape(rng: &mut Rng, (rows, d): (usize, usize)) -> (usize, usize) {
    loop {
        let delta = if rng.chance(0.7) {
            1
        } else {
            rng.between(2, 8)
        };
        let shape = match rng.below(4) {
            0 => (rows + delta, d),
            1 => (rows.saturating_sub(delta), d),
            2 => (rows, d + delta),
            _ => (rows, d.saturating_sub(delta)),
        };
        if shape != (rows, d) && shape.1 >= 1 {
            return shape;
        }
    }
}

/// Another length near `len`.
fn other_len(rng: &mut Rng, len: usize) -> usize {
    loop {
        let n = match rng.below(4) {
            0 => len + 1,
            1 => len.saturating_sub(1),
            2 => len + rng.between(2, 8),
            _ => 0,
        };
        if n != len {
            return n;
        }
    }
}

/// Gives the rows in `slot` another shape.
fn reshape(rng: &mut Rng, slot: &mut Option<Buf>) -> String {
    let b = the_mut(slot);
    let shape = other_shape(rng, (b.layout.rows, b.layout.d));
    b.layout = row_layout(rng, b.dt, shape, false);
    // A new view: a fault of the old one (a short view, say) no longer applies.
    b.fault = None;
    format!("{} is {}×{}", b.name, shape.0, shape.1)
}

/// Gives the vector in `slot` another length.
fn relen(rng: &mut Rng, slot: &mut Option<Buf>) -> String {
    let b = the_mut(slot);
    let len = other_len(rng, b.layout.view);
    b.layout = vector_layout(rng, b.dt, len, false);
    format!("{} has {len} elements", b.name)
}

/// Makes the view of the rows in `slot` impossible to build.
fn fault(rng: &mut Rng, slot: &mut Option<Buf>) -> String {
    let b = the_mut(slot);
    let mut faults = vec![Fault::ZeroD, Fault::StrideBelowD];
    if b.layout.needed() > 0 {
        faults.push(Fault::Short);
    }
    let f = rng.pick(&faults);
    b.fault = Some(f);
    format!("{} view {f:?}", b.name)
}

/// Stores the operands in `slots` as `dt`.
fn retype(dt: Dt, slots: [&mut Option<Buf>; 2]) -> String {
    let mut names = vec![];
    for b in slots.into_iter().flatten() {
        b.dt = dt;
        names.push(b.name);
    }
    format!("{} in {}", names.join(" and "), dt.name())
}

/// Picks one of the slots that hold an operand.
fn some_of<'o>(rng: &mut Rng, slots: Vec<&'o mut Option<Buf>>) -> &'o mut Option<Buf> {
    let mut present: Vec<_> = slots.into_iter().filter(|s| s.is_some()).collect();
    let i = rng.below(present.len());
    present.swap_remove(i)
}

/// eps or the weight offset made invalid (mutations 0 and 1 of the norms).
fn bad_config(rng: &mut Rng, s: &mut Spec, which: usize) -> String {
    if which == 0 {
        s.eps = bad_eps(rng);
        format!("eps {:e}", s.eps)
    } else {
        s.weight_offset = rng.pick(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
        format!("weight_offset {}", s.weight_offset)
    }
}

/// The call of `s` on `o`: in a share of calls made invalid by one or two `mutate`s, on a drawn
/// executor.
fn finish_call(
    rng: &mut Rng,
    mut s: Spec,
    mut o: Operands,
    mutate: impl Fn(&mut Rng, &mut Spec, &mut Operands) -> String,
) -> Call {
    let mut mutations = vec![];
    if rng.chance(INVALID_SHARE) {
        for _ in 0..1 + usize::from(rng.chance(0.25)) {
            mutations.push(mutate(rng, &mut s, &mut o));
        }
    }
    let (exec, exec_desc) = draw_executor(rng);
    Call {
        spec: s,
        ops: o,
        exec,
        exec_desc,
        mutations,
    }
}

fn gen_norm_forward(rng: &mut Rng, op: Op) -> Call {
    let layer = op.layer();
    let t = rng.pick(&DTYPES);
    let aligned = rng.chance(0.5);
    let (rows, d) = (draw_rows(rng), draw_d(rng, aligned));
    let mut s = Spec::new(op, t, (rows, d));
    if rng.chance(0.3) {
        s.w = Dt::F32;
    }
    let residual = rng.chance(0.35);
    if residual {
        s.r = rng.pick(&[t, Dt::F32]);
        s.h = rng.pick(&[t, Dt::F32]);
    }
    s.eps = draw_eps(rng);
    let (weight_offset, weight_range) = draw_weight(rng);
    s.weight_offset = weight_offset;
    let scale = draw_scale(rng);

    let mut o = Operands {
        x: Buf::input(
            "x",
            t,
            row_layout(rng, t, (rows, d), aligned),
            (-scale, 3.0 * scale),
        ),
        y: Buf::output("y", t, row_layout(rng, t, (rows, d), aligned)),
        weight: Buf::input(
            "weight",
            s.w,
            vector_layout(rng, s.w, d, aligned),
            weight_range,
        ),
        ..Operands::default()
    };
    if layer && rng.chance(0.6) {
        o.bias = Buf::input(
            "bias",
            s.w,
            vector_layout(rng, s.w, d, aligned),
            (-0.5, 0.5),
        );
    }
    if layer && rng.chance(0.6) {
        o.mean = Buf::output("mean", Dt::F32, vector_layout(rng, Dt::F32, rows, aligned));
    }
    if rng.chance(0.7) {
        o.rstd = Buf::output("rstd", Dt::F32, vector_layout(rng, Dt::F32, rows, aligned));
    }
    if residual {
        let layout = row_layout(rng, s.r, (rows, d), aligned);
        o.residual = Buf::input("residual", s.r, layout, (-scale, 4.0 * scale));
        let layout = row_layout(rng, s.h, (rows, d), aligned);
        o.residual_out = Buf::output("residual_out", s.h, layout);
    }

    finish_call(rng, s, o, mutate_norm_forward)
}

fn mutate_norm_forward(rng: &mut Rng, s: &mut Spec, o: &mut Operands) -> String {
    let (rows, d) = (s.rows, s.d);
    let residual = o.residual.is_some();
    loop {
        match rng.below(11) {
            which @ (0 | 1) => return bad_config(rng, s, which),
            2 => return reshape(rng, &mut o.y),
            3 => return relen(rng, &mut o.weight),
            4 if o.bias.is_some() => return relen(rng, &mut o.bias),
            5 if o.mean.is_some() || o.rstd.is_some() => {
                let slot = some_of(rng, vec![&mut o.mean, &mut o.rstd]);
                return relen(rng, slot);
            }
            // What only LayerNorm takes, given to RMSNorm.
            6 if !s.op.layer() => {
                if rng.chance(0.5) && o.bias.is_none() {
                    let layout = vector_layout(rng, s.w, d, false);
                    o.bias = Buf::input("bias", s.w, layout, (-0.5, 0.5));
                    return "bias given to RMSNorm".into();
                }
                if o.mean.is_none() {
                    let layout = vector_layout(rng, Dt::F32, rows, false);
                    o.mean = Buf::output("mean", Dt::F32, layout);
                    return "mean given to RMSNorm".into();
                }
            }
            7 => {
                s.w = Dt::unsupported_next_to(s.t, rng);
                return retype(s.w, [&mut o.weight, &mut o.bias]);
            }
            8 if residual => {
                let slot = some_of(rng, vec![&mut o.residual, &mut o.residual_out]);
                return reshape(rng, slot);
            }
            9 if residual => {
                return if rng.chance(0.5) {
                    s.r = Dt::unsupported_next_to(s.t, rng);
                    retype(s.r, [&mut o.residual, &mut None])
                } else {
                    s.h = Dt::unsupported_next_to(s.t, rng);
                    retype(s.h, [&mut o.residual_out, &mut None])
                };
            }
            // A view that cannot be built never reaches the op: fewer of those.
            10 if rng.chance(0.3) => {
                let slots = vec![&mut o.x, &mut o.y, &mut o.residual, &mut o.residual_out];
                let slot = some_of(rng, slots);
                return fault(rng, slot);
            }
            _ => {}
        }
    }
}

fn gen_norm_backward(rng: &mut Rng, op: Op) -> Call {
    let layer = op.layer();
    let t = rng.pick(&DTYPES);
    let aligned = rng.chance(0.5);
    let (rows, d) = (draw_rows(rng), draw_d(rng, aligned));
    let mut s = Spec::new(op, t, (rows, d));
    if rng.chance(0.3) {
        s.w = Dt::F32;
    }
    s.g = if rng.chance(0.3) { Dt::F32 } else { s.w };
    let residual = rng.chance(0.35);
    // x in f32 is the fp32 residual stream, with or without dresidual.
    if residual || rng.chance(0.15) {
        s.h = rng.pick(&[t, Dt::F32]);
    }
    s.eps = draw_eps(rng);
    let (weight_offset, weight_range) = draw_weight(rng);
    s.weight_offset = weight_offset;
    let scale = draw_scale(rng);

    let needed = if layer {
        layer_norm::workspace_len(rows, d)
    } else {
        rms_norm::workspace_len(rows, d)
    }
    .expect("a small workspace");
    let mut o = Operands {
        dy: Buf::input("dy", t, row_layout(rng, t, (rows, d), aligned), (-1.0, 1.0)),
        x: Buf::input(
            "x",
            s.h,
            row_layout(rng, s.h, (rows, d), aligned),
            (-scale, 3.0 * scale),
        ),
        weight: Buf::input(
            "weight",
            s.w,
            vector_layout(rng, s.w, d, aligned),
            weight_range,
        ),
        dx: Buf::output("dx", t, row_layout(rng, t, (rows, d), aligned)),
        dweight: Buf::output("dweight", s.g, vector_layout(rng, s.g, d, aligned)),
        workspace: Some(Buf::new(
            "workspace",
            Role::Workspace,
            Dt::F32,
            workspace_layout(rng, needed),
            (0.0, 0.0),
        )),
        ..Operands::default()
    };
    // The saved statistics, or none (recomputed); filled from x once it exists.
    if rng.chance(0.7) {
        let stat = |rng: &mut Rng, name| {
            Buf::input(
                name,
                Dt::F32,
                vector_layout(rng, Dt::F32, rows, aligned),
                (0.5, 1.5),
            )
        };
        o.rstd = stat(rng, "rstd");
        if layer {
            o.mean = stat(rng, "mean");
        }
    }
    if layer && rng.chance(0.6) {
        o.dbias = Buf::output("dbias", s.g, vector_layout(rng, s.g, d, aligned));
    }
    if residual {
        let layout = row_layout(rng, s.h, (rows, d), aligned);
        o.dresidual = Buf::input("dresidual", s.h, layout, (-1.0, 1.0));
    }

    finish_call(rng, s, o, mutate_norm_backward)
}

fn mutate_norm_backward(rng: &mut Rng, s: &mut Spec, o: &mut Operands) -> String {
    let (rows, d) = (s.rows, s.d);
    loop {
        match rng.below(11) {
            which @ (0 | 1) => return bad_config(rng, s, which),
            2 => {
                let slots = vec![&mut o.dy, &mut o.dx, &mut o.dresidual];
                let slot = some_of(rng, slots);
                return reshape(rng, slot);
            }
            3 => {
                let slots = vec![
                    &mut o.weight,
                    &mut o.dweight,
                    &mut o.dbias,
                    &mut o.mean,
                    &mut o.rstd,
                ];
                let slot = some_of(rng, slots);
                return relen(rng, slot);
            }
            // What only LayerNorm takes, given to RMSNorm.
            4 if !s.op.layer() => {
                if rng.chance(0.5) && o.mean.is_none() {
                    let layout = vector_layout(rng, Dt::F32, rows, false);
                    o.mean = Buf::input("mean", Dt::F32, layout, (-1.0, 1.0));
                    return "mean given to RMSNorm".into();
                }
                if o.dbias.is_none() {
                    o.dbias = Buf::output("dbias", s.g, vector_layout(rng, s.g, d, false));
                    return "dbias given to RMSNorm".into();
                }
            }
            // LayerNorm's statistics: one without the other.
            5 if s.op.layer() => {
                if o.mean.is_some() && o.rstd.is_some() {
                    let dropped = if rng.chance(0.5) {
                        o.mean = None;
                        "mean"
                    } else {
                        o.rstd = None;
                        "rstd"
                    };
                    return format!("{dropped} left out of the saved statistics");
                }
                if o.mean.is_none() && o.rstd.is_none() {
                    let name = rng.pick(&["mean", "rstd"]);
                    let layout = vector_layout(rng, Dt::F32, rows, false);
                    let stat = Buf::input(name, Dt::F32, layout, (0.5, 1.5));
                    if name == "mean" {
                        o.mean = stat;
                    } else {
                        o.rstd = stat;
                    }
                    return format!("{name} given alone");
                }
            }
            6 if the(&o.workspace).layout.d > 0 => {
                let ws = the_mut(&mut o.workspace);
                ws.layout.view = rng.below(ws.layout.d);
                return format!("workspace of {} f32", ws.layout.view);
            }
            7 => {
                s.w = Dt::unsupported_next_to(s.t, rng);
                return retype(s.w, [&mut o.weight, &mut None]);
            }
            8 => {
                s.g = Dt::unsupported_next_to(s.w, rng);
                return retype(s.g, [&mut o.dweight, &mut o.dbias]);
            }
            9 => {
                s.h = Dt::unsupported_next_to(s.t, rng);
                return retype(s.h, [&mut o.x, &mut o.dresidual]);
            }
            // A view that cannot be built never reaches the op: fewer of those.
            10 if rng.chance(0.3) => {
                let slots = vec![&mut o.dy, &mut o.x, &mut o.dx, &mut o.dresidual];
                let slot = some_of(rng, slots);
                return fault(rng, slot);
            }
            _ => {}
        }
    }
}

fn gen_activation(rng: &mut Rng, op: Op) -> Call {
    let t = rng.pick(&DTYPES);
    let aligned = rng.chance(0.5);
    let (rows, d) = (draw_rows(rng), draw_d(rng, aligned));
    let mut s = Spec::new(op, t, (rows, d));
    s.act = rng.pick(&ALL);
    let shape = (rows, d);
    let mut o = Operands::default();
    match op {
        Op::ActForward => {
            o.x = Buf::input("x", t, row_layout(rng, t, shape, aligned), (-6.0, 6.0));
            o.y = Buf::output("y", t, row_layout(rng, t, shape, aligned));
        }
        Op::ActBackward => {
            let layout = row_layout(rng, t, shape, aligned);
            o.x = Buf::input("preact", t, layout, (-6.0, 6.0));
            s.in_place = rng.chance(0.35);
            let layout = row_layout(rng, t, shape, aligned);
            if s.in_place {
                o.dy = Some(Buf::new("dy", Role::InPlace, t, layout, (-1.0, 1.0)));
            } else {
                o.dy = Buf::input("dy", t, layout, (-1.0, 1.0));
                o.dx = Buf::output("dx", t, row_layout(rng, t, shape, aligned));
            }
            if rng.chance(0.4) {
                o.dbias = Buf::output("dbias", t, vector_layout(rng, t, d, aligned));
                let needed = activation::workspace_len(rows, d).expect("a small workspace");
                let layout = workspace_layout(rng, needed);
                o.workspace = Some(Buf::new(
                    "workspace",
                    Role::Workspace,
                    Dt::F32,
                    layout,
                    (0.0, 0.0),
                ));
            }
        }
        Op::GatedForward | Op::GatedBackward => {
            if rng.chance(0.4) {
                let layout = row_layout(rng, t, (rows, 2 * d), aligned);
                o.ab = Buf::input("ab", t, layout, (-4.0, 4.0));
            } else {
                o.a = Buf::input("a", t, row_layout(rng, t, shape, aligned), (-4.0, 4.0));
                o.b = Buf::input("b", t, row_layout(rng, t, shape, aligned), (-4.0, 4.0));
            }
            if op == Op::GatedForward {
                o.h = Buf::output("h", t, row_layout(rng, t, shape, aligned));
            } else {
                o.dy = Buf::input("dh", t, row_layout(rng, t, shape, aligned), (-1.0, 1.0));
                if rng.chance(0.4) {
                    let layout = row_layout(rng, t, (rows, 2 * d), aligned);
                    o.dab = Buf::output("dab", t, layout);
                } else {
                    o.da = Buf::output("da", t, row_layout(rng, t, shape, aligned));
                    o.db = Buf::output("db", t, row_layout(rng, t, shape, aligned));
                }
            }
        }
        _ => unreachable!("not an activation"),
    }

    finish_call(rng, s, o, |rng, _, o| mutate_activation(rng, o))
}

fn mutate_activation(rng: &mut Rng, o: &mut Operands) -> String {
    loop {
        match rng.below(4) {
            0 => {
                let slots = vec![
                    &mut o.y, &mut o.dy, &mut o.dx, &mut o.a, &mut o.b, &mut o.ab, &mut o.h,
                    &mut o.da, &mut o.db, &mut o.dab,
                ];
                let slot = some_of(rng, slots);
                return reshape(rng, slot);
            }
            1 if o.dbias.is_some() => return relen(rng, &mut o.dbias),
            2 if o.workspace.as_ref().is_some_and(|w| w.layout.d > 0) => {
                let ws = the_mut(&mut o.workspace);
                ws.layout.view = rng.below(ws.layout.d);
                return format!("workspace of {} f32", ws.layout.view);
            }
            // A view that cannot be built never reaches the op: fewer of those.
            3 if rng.chance(0.3) => {
                let slots = vec![
                    &mut o.x, &mut o.y, &mut o.dy, &mut o.dx, &mut o.a, &mut o.b, &mut o.ab,
                    &mut o.h, &mut o.da, &mut o.db, &mut o.dab,
                ];
                let slot = some_of(rng, slots);
                return fault(rng, slot);
            }
            _ => {}
        }
    }
}

/// `(mean, rstd)` of each row of dense `x` in f64 (the mean 0 for RMSNorm).
fn statistics(layer: bool, x: &[f64], rows: usize, d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let ones = vec![1.0; d];
    if layer {
        let (_, mean, rstd) = layer_reference::forward(x, &ones, None, rows, d, eps);
        (mean, rstd)
    } else {
        let (_, rstd) = rms_reference::forward(x, &ones, rows, d, eps);
        (vec![0.0; rows], rstd)
    }
}

/// Allocates the call's buffers; a backward's saved statistics are x's, rounded to f32.
fn materialize(rng: &mut Rng, call: &mut Call) {
    for b in call.ops.all_mut() {
        b.materialize(rng);
    }
    let s = &call.spec;
    let o = &mut call.ops;
    if matches!(s.op, Op::RmsBackward | Op::LayerBackward) {
        let x = the(&o.x);
        let (rows, d) = (x.layout.rows, x.layout.d);
        // An invalid eps gives no statistics: those of the default stand in.
        let eps = if s.eps.is_finite() && s.eps > 0.0 {
            s.eps
        } else {
            DEFAULT_EPS
        };
        let (mean, rstd) = statistics(s.op.layer(), &x.gather(), rows, d, eps as f64);
        for (slot, values) in [(&mut o.mean, mean), (&mut o.rstd, rstd)] {
            if let Some(b) = slot {
                for (k, v) in values.iter().enumerate().take(b.layout.view) {
                    let i = b.layout.offset + k;
                    b.set_bits(i, Dt::F32.round(*v));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running a call.

fn rows<T: TestDtype>(slot: &Option<Buf>) -> normkern::Result<Rows<&[T]>> {
    the(slot).rows()
}

fn rows_mut<T: TestDtype>(slot: &mut Option<Buf>) -> normkern::Result<Rows<&mut [T]>> {
    the_mut(slot).rows_mut()
}

fn run(exec: &Emulator, s: &Spec, o: &mut Operands) -> normkern::Result<()> {
    match s.op {
        Op::RmsForward | Op::LayerForward => with_dtype!(s.t, |T| with_dtype!(s.w, |W| {
            with_dtype!(s.r, |R| with_dtype!(s.h, |H| {
                norm_forward::<T, W, R, H>(exec, s, o)
            }))
        })),
        Op::RmsBackward | Op::LayerBackward => with_dtype!(s.t, |T| with_dtype!(s.h, |H| {
            with_dtype!(s.w, |W| with_dtype!(s.g, |G| {
                norm_backward::<T, H, W, G>(exec, s, o)
            }))
        })),
        Op::ActForward => with_dtype!(s.t, |T| act_forward::<T>(exec, s, o)),
        Op::ActBackward => with_dtype!(s.t, |T| act_backward::<T>(exec, s, o)),
        Op::GatedForward => with_dtype!(s.t, |T| gated_forward::<T>(exec, s, o)),
        Op::GatedBackward => with_dtype!(s.t, |T| gated_backward::<T>(exec, s, o)),
    }
}

fn norm_forward<T: TestDtype, W: TestDtype, R: TestDtype, H: TestDtype>(
    exec: &Emulator,
    s: &Spec,
    o: &mut Operands,
) -> normkern::Result<()> {
    let x = rows::<T>(&o.x)?;
    let y = rows_mut::<T>(&mut o.y)?;
    let mut args = NormForward::new(x, the(&o.weight).view::<W>(), y);
    // The defaults are left to the constructor when they are what the call wants.
    if s.eps.to_bits() != DEFAULT_EPS.to_bits() {
        args = args.eps(s.eps);
    }
    if s.weight_offset.to_bits() != 0 {
        args = args.weight_offset(s.weight_offset);
    }
    if let Some(b) = &o.bias {
        args = args.bias(b.view::<W>());
    }
    if let Some(m) = &mut o.mean {
        args = args.mean(m.view_mut::<f32>());
    }
    if let Some(r) = &mut o.rstd {
        args = args.rstd(r.view_mut::<f32>());
    }
    let layer = s.op.layer();
    match (&o.residual, &mut o.residual_out) {
        (Some(r), Some(h)) => {
            let args = args.residual(r.rows::<R>()?, h.rows_mut::<H>()?);
            norm_forward_of(layer, exec, args)
        }
        _ => norm_forward_of(layer, exec, args),
    }
}

fn norm_forward_of<T: TestDtype, W: TestDtype, R: TestDtype, H: TestDtype>(
    layer: bool,
    exec: &Emulator,
    args: NormForward<'_, Emulator, T, W, R, H>,
) -> normkern::Result<()> {
    if layer {
        layer_norm::forward(exec, args)
    } else {
        rms_norm::forward(exec, args)
    }
}

fn norm_backward<T: TestDtype, H: TestDtype, W: TestDtype, G: TestDtype>(
    exec: &Emulator,
    s: &Spec,
    o: &mut Operands,
) -> normkern::Result<()> {
    let mut args = NormBackward::new(
        rows::<T>(&o.dy)?,
        rows::<H>(&o.x)?,
        the(&o.weight).view::<W>(),
        rows_mut::<T>(&mut o.dx)?,
        the_mut(&mut o.dweight).view_mut::<G>(),
        the_mut(&mut o.workspace).view_mut::<f32>(),
    );
    if s.eps.to_bits() != DEFAULT_EPS.to_bits() {
        args = args.eps(s.eps);
    }
    if s.weight_offset.to_bits() != 0 {
        args = args.weight_offset(s.weight_offset);
    }
    args = match (&o.mean, &o.rstd) {
        (Some(m), Some(r)) => args.mean_rstd(m.view(), r.view()),
        (None, Some(r)) => args.rstd(r.view()),
        // No builder gives the mean alone: LayerNorm rejects it, as RMSNorm rejects any mean.
        (Some(m), None) => NormBackward {
            mean: Some(m.view()),
            ..args
        },
        (None, None) => args,
    };
    if let Some(db) = &mut o.dbias {
        args = args.dbias(db.view_mut::<G>());
    }
    if let Some(dr) = &o.dresidual {
        args = args.dresidual(dr.rows::<H>()?);
    }
    if s.op.layer() {
        layer_norm::backward(exec, args)
    } else {
        rms_norm::backward(exec, args)
    }
}

fn act_forward<T: TestDtype>(exec: &Emulator, s: &Spec, o: &mut Operands) -> normkern::Result<()> {
    let args = Forward::new(s.act, rows::<T>(&o.x)?, rows_mut::<T>(&mut o.y)?);
    activation::forward(exec, args)
}

fn act_backward<T: TestDtype>(exec: &Emulator, s: &Spec, o: &mut Operands) -> normkern::Result<()> {
    let preact = rows::<T>(&o.x)?;
    let mut args = if s.in_place {
        Backward::in_place(s.act, rows_mut::<T>(&mut o.dy)?, preact)
    } else {
        let dy = rows::<T>(&o.dy)?;
        Backward::new(s.act, dy, preact, rows_mut::<T>(&mut o.dx)?)
    };
    if let (Some(db), Some(ws)) = (&mut o.dbias, &mut o.workspace) {
        args = args.dbias(db.view_mut::<T>(), ws.view_mut::<f32>());
    }
    activation::backward(exec, args)
}

fn gated_input<'a, T: TestDtype>(
    a: &'a Option<Buf>,
    b: &'a Option<Buf>,
    ab: &'a Option<Buf>,
) -> normkern::Result<GatedInput<'a, Emulator, T>> {
    Ok(match ab {
        Some(ab) => GatedInput::Packed(ab.rows()?),
        None => GatedInput::Separate {
            a: rows(a)?,
            b: rows(b)?,
        },
    })
}

fn gated_forward<T: TestDtype>(
    exec: &Emulator,
    s: &Spec,
    o: &mut Operands,
) -> normkern::Result<()> {
    let args = GatedForward {
        activation: s.act,
        input: gated_input::<T>(&o.a, &o.b, &o.ab)?,
        h: rows_mut(&mut o.h)?,
    };
    activation::gated_forward(exec, args)
}

fn gated_backward<T: TestDtype>(
    exec: &Emulator,
    s: &Spec,
    o: &mut Operands,
) -> normkern::Result<()> {
    let input = gated_input::<T>(&o.a, &o.b, &o.ab)?;
    let grad = match &mut o.dab {
        Some(dab) => GatedGrad::Packed(dab.rows_mut()?),
        None => GatedGrad::Separate {
            da: rows_mut(&mut o.da)?,
            db: rows_mut(&mut o.db)?,
        },
    };
    let args = GatedBackward {
        activation: s.act,
        dh: rows(&o.dy)?,
        input,
        grad,
    };
    activation::gated_backward(exec, args)
}

// ---------------------------------------------------------------------------------------------
// The model of the documented rules: the errors a call may return.

/// An error a call may return.
#[derive(Clone, Debug)]
enum Expect {
    Eps(f32),
    WeightOffset(f32),
    /// `what` is `actual` where `expected` was due.
    Shape {
        what: &'static str,
        expected: (usize, usize),
        actual: (usize, usize),
    },
    /// Some operand of a gated call disagrees with the others (which one is named depends on
    /// which the op takes the shape from).
    AnyShape,
    Length {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    Argument(&'static str),
    Dtypes(&'static str),
    Workspace {
        needed: usize,
        actual: usize,
    },
    EmptyRow,
    StrideTooSmall {
        stride: usize,
        d: usize,
    },
}

fn matches(e: &Error, x: &Expect) -> bool {
    match (e, x) {
        (Error::Eps(a), Expect::Eps(b)) | (Error::WeightOffset(a), Expect::WeightOffset(b)) => {
            a.to_bits() == b.to_bits()
        }
        (
            Error::Shape {
                what,
                rows,
                d,
                actual_rows,
                actual_d,
            },
            Expect::Shape {
                what: w,
                expected,
                actual,
            },
        ) => what == w && (*rows, *d) == *expected && (*actual_rows, *actual_d) == *actual,
        (Error::Shape { .. }, Expect::AnyShape) => true,
        (
            Error::Length {
                what,
                expected,
                actual,
            },
            Expect::Length {
                what: w,
                expected: e,
                actual: a,
            },
        ) => what == w && expected == e && actual == a,
        (Error::Argument { what, .. }, Expect::Argument(w))
        | (Error::UnsupportedDtypes { what, .. }, Expect::Dtypes(w)) => what == w,
        (
            Error::WorkspaceTooSmall { needed, actual },
            Expect::Workspace {
                needed: n,
                actual: a,
            },
        ) => needed == n && actual == a,
        (Error::EmptyRow { .. }, Expect::EmptyRow) => true,
        (Error::StrideTooSmall { stride, d, .. }, Expect::StrideTooSmall { stride: s, d: e }) => {
            stride == s && d == e
        }
        _ => false,
    }
}

/// The error's variant, and what it names when it names an operand.
fn label(e: &Error) -> String {
    match e {
        Error::Shape { what, .. } => format!("Shape({what})"),
        Error::Length { what, .. } => format!("Length({what})"),
        Error::Argument { what, .. } => format!("Argument({what})"),
        Error::UnsupportedDtypes { what, .. } => format!("UnsupportedDtypes({what})"),
        Error::TooLarge { what, .. } => format!("TooLarge({what})"),
        other => {
            let debug = format!("{other:?}");
            debug
                .split(['(', ' ', '{'])
                .next()
                .unwrap_or_default()
                .to_string()
        }
    }
}

fn shape_of(b: &Buf) -> (usize, usize) {
    (b.layout.rows, b.layout.d)
}

/// The shape the op checks the others against: x's (preact's), or for gated calls h's (dh's).
fn anchor(s: &Spec, o: &Operands) -> (usize, usize) {
    shape_of(the(match s.op {
        Op::GatedForward => &o.h,
        Op::GatedBackward => &o.dy,
        _ => &o.x,
    }))
}

/// The errors `s` with operands `o` may return; none for a valid call.
fn expected(s: &Spec, o: &Operands) -> Vec<Expect> {
    // Views are built before the call: one that cannot be is the error.
    let faults: Vec<Expect> = o.all().iter().filter_map(|b| b.fault_error()).collect();
    if !faults.is_empty() {
        return faults;
    }
    let mut e = vec![];
    let shape = |e: &mut Vec<Expect>, what, expected, slot: &Option<Buf>| {
        if let Some(b) = slot
            && shape_of(b) != expected
        {
            e.push(Expect::Shape {
                what,
                expected,
                actual: shape_of(b),
            });
        }
    };
    let len = |e: &mut Vec<Expect>, what, expected, slot: &Option<Buf>| {
        if let Some(b) = slot
            && b.layout.view != expected
        {
            e.push(Expect::Length {
                what,
                expected,
                actual: b.layout.view,
            });
        }
    };
    let workspace = |e: &mut Vec<Expect>, needed: usize| {
        if let Some(ws) = &o.workspace
            && ws.layout.view < needed
        {
            e.push(Expect::Workspace {
                needed,
                actual: ws.layout.view,
            });
        }
    };
    let config = |e: &mut Vec<Expect>| {
        if !(s.eps.is_finite() && s.eps > 0.0) {
            e.push(Expect::Eps(s.eps));
        }
        if !s.weight_offset.is_finite() {
            e.push(Expect::WeightOffset(s.weight_offset));
        }
    };
    let layer = s.op.layer();
    match s.op {
        Op::RmsForward | Op::LayerForward => {
            let x = shape_of(the(&o.x));
            let (rows, d) = x;
            config(&mut e);
            shape(&mut e, "y", x, &o.y);
            len(&mut e, "weight", d, &o.weight);
            len(&mut e, "bias", d, &o.bias);
            len(&mut e, "mean", rows, &o.mean);
            len(&mut e, "rstd", rows, &o.rstd);
            if !layer && o.bias.is_some() {
                e.push(Expect::Argument("bias"));
            }
            if !layer && o.mean.is_some() {
                e.push(Expect::Argument("mean"));
            }
            if !s.w.fits(s.t) {
                e.push(Expect::Dtypes("weight/bias"));
            }
            if o.residual.is_some() {
                shape(&mut e, "residual", x, &o.residual);
                shape(&mut e, "residual_out", x, &o.residual_out);
                if !s.r.fits(s.t) {
                    e.push(Expect::Dtypes("residual"));
                }
                if !s.h.fits(s.t) {
                    e.push(Expect::Dtypes("residual_out"));
                }
            }
        }
        Op::RmsBackward | Op::LayerBackward => {
            let x = shape_of(the(&o.x));
            let (rows, d) = x;
            config(&mut e);
            shape(&mut e, "dy", x, &o.dy);
            shape(&mut e, "dx", x, &o.dx);
            shape(&mut e, "dresidual", x, &o.dresidual);
            len(&mut e, "weight", d, &o.weight);
            len(&mut e, "dweight", d, &o.dweight);
            len(&mut e, "dbias", d, &o.dbias);
            len(&mut e, "mean", rows, &o.mean);
            len(&mut e, "rstd", rows, &o.rstd);
            if !layer && o.mean.is_some() {
                e.push(Expect::Argument("mean"));
            }
            if !layer && o.dbias.is_some() {
                e.push(Expect::Argument("dbias"));
            }
            if layer && o.mean.is_some() != o.rstd.is_some() {
                e.push(Expect::Argument("mean/rstd"));
            }
            let needed = if layer {
                layer_norm::workspace_len(rows, d)
            } else {
                rms_norm::workspace_len(rows, d)
            };
            workspace(&mut e, needed.expect("a small workspace"));
            if !s.w.fits(s.t) {
                e.push(Expect::Dtypes("weight/bias"));
            }
            if !s.g.fits(s.w) {
                e.push(Expect::Dtypes("dweight/dbias"));
            }
            if !s.h.fits(s.t) {
                e.push(Expect::Dtypes("x (residual_out)"));
            }
        }
        Op::ActForward => shape(&mut e, "y", shape_of(the(&o.x)), &o.y),
        Op::ActBackward => {
            let x = shape_of(the(&o.x));
            shape(&mut e, "dy", x, &o.dy);
            shape(&mut e, "dx", x, &o.dx);
            len(&mut e, "dbias", x.1, &o.dbias);
            workspace(&mut e, activation::workspace_len(x.0, x.1).unwrap());
        }
        Op::GatedForward | Op::GatedBackward => {
            let (rows, d) = anchor(s, o);
            let halves = [&o.a, &o.b, &o.h, &o.dy, &o.da, &o.db];
            let packed = [&o.ab, &o.dab];
            let disagree = halves
                .into_iter()
                .flatten()
                .any(|b| shape_of(b) != (rows, d))
                || packed
                    .into_iter()
                    .flatten()
                    .any(|b| shape_of(b) != (rows, 2 * d));
            if disagree {
                e.push(Expect::AnyShape);
            }
        }
    }
    e
}

// ---------------------------------------------------------------------------------------------
// Checking a call.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Violation {
    Panic,
    /// A valid call that failed, an invalid one that was accepted, or the wrong error.
    WrongOutcome,
    /// An accepted call wrote outside its outputs' rows (or past a workspace's need).
    Canary,
    /// A rejected call wrote.
    RejectedWrite,
    /// A call changed an input.
    InputWrite,
    /// An accepted call left an output element unwritten.
    Unwritten,
    /// An output off the reference.
    Mismatch,
}

const VIOLATIONS: [(Violation, &str); 7] = [
    (Violation::Panic, "panics"),
    (Violation::WrongOutcome, "wrong outcomes"),
    (Violation::Canary, "canary violations"),
    (Violation::RejectedWrite, "rejected-call write violations"),
    (Violation::InputWrite, "input writes"),
    (Violation::Unwritten, "unwritten outputs"),
    (Violation::Mismatch, "reference mismatches"),
];

#[derive(Default)]
struct Findings(Vec<(Violation, String)>);

impl Findings {
    fn push(&mut self, v: Violation, message: String) {
        self.0.push((v, message));
    }
}

/// Checks the rows `l` of `buf` against `want` (dense): every element written (not poison) and
/// within `rel` relatively or `abs_at(i)` absolutely, as `assert_close_each` judges, where the
/// absolute bound also holds the store's rounding next to zero (a result of 3.38e-6 stored in f16 is
/// 3.40e-6, the nearest multiple of 2⁻²⁴). Reports the first element that is not.
fn compare(
    f: &mut Findings,
    what: &str,
    buf: &Buf,
    l: Layout,
    want: &[f64],
    rel: f64,
    abs_at: impl Fn(usize) -> f64,
) {
    let poison = buf.dt.poison();
    for r in 0..l.rows {
        for j in 0..l.d {
            let (k, bits) = (r * l.d + j, buf.bits(l.at(r, j)));
            if bits == poison {
                f.push(
                    Violation::Unwritten,
                    format!("{what} [{r}, {j}] left unwritten"),
                );
                return;
            }
            let (got, reference) = (buf.dt.value(bits), want[k]);
            let abs = abs_at(k) + buf.dt.spacing_at_zero();
            if !(got.is_finite()
                && approx::relative_eq!(got, reference, epsilon = abs, max_relative = rel))
            {
                f.push(
                    Violation::Mismatch,
                    format!(
                        "{what} [{r}, {j}] = {got}, reference {reference} (tolerance {rel:e} \
                         relative or {abs:e} absolute)"
                    ),
                );
                return;
            }
        }
    }
}

/// [`compare`] over the buffer's own rows.
fn compare_rows(
    f: &mut Findings,
    what: &str,
    slot: &Option<Buf>,
    want: &[f64],
    rel: f64,
    abs_at: impl Fn(usize) -> f64,
) {
    let buf = the(slot);
    compare(f, what, buf, buf.layout, want, rel, abs_at);
}

/// Inputs bitwise unchanged; outputs unchanged outside their rows (a workspace past what the op
/// needs) after an accepted call, everywhere after a rejected one.
fn check_buffers(accepted: bool, pre: &Operands, post: &Operands, f: &mut Findings) {
    for (before, after) in pre.all().into_iter().zip(post.all()) {
        let guarded = |i| after.role == Role::Input || !accepted || !after.layout.inside(i);
        let n = after.layout.total();
        let changed = (0..n).find(|&i| guarded(i) && before.bits(i) != after.bits(i));
        let padding =
            before.bytes()[n * after.dt.bytes()..] != after.bytes()[n * after.dt.bytes()..];
        let what = match (after.role, accepted) {
            (Role::Input, _) => Violation::InputWrite,
            (_, true) => Violation::Canary,
            (_, false) => Violation::RejectedWrite,
        };
        if let Some(i) = changed {
            f.push(
                what,
                format!(
                    "{} element {i} changed from {:#x} to {:#x} ({})",
                    after.name,
                    before.bits(i),
                    after.bits(i),
                    after.describe()
                ),
            );
        } else if padding {
            f.push(what, format!("{} written past its end", after.name));
        }
    }
}

fn check_norm_forward(s: &Spec, pre: &Operands, post: &Operands, f: &mut Findings) {
    let (rows, d) = (s.rows, s.d);
    let x = the(&pre.x).gather();
    // With a fused residual, h = x + residual is one f32 add rounded to residual_out's dtype, and
    // the row normalized is h as stored.
    let input = match (&pre.residual, &post.residual_out) {
        (Some(residual), Some(h)) => {
            let r = residual.gather();
            'rows: for row in 0..rows {
                for j in 0..d {
                    let k = row * d + j;
                    let sum = x[k] as f32 + r[k] as f32;
                    let (want, got) = (h.dt.round_f32(sum), h.bits(h.layout.at(row, j)));
                    if got != want {
                        f.push(
                            Violation::Mismatch,
                            format!(
                                "residual_out [{row}, {j}] = {} ({got:#x}), x + residual = {sum}",
                                h.dt.value(got)
                            ),
                        );
                        break 'rows;
                    }
                }
            }
            h.gather()
        }
        _ => x,
    };
    let weight: Vec<f64> = (the(&pre.weight).gather().iter())
        .map(|w| w + s.weight_offset as f64)
        .collect();
    let bias = pre.bias.as_ref().map(Buf::gather);
    let eps = s.eps as f64;
    let (y_ref, mean_ref, rstd_ref) = if s.op.layer() {
        let (y, mean, rstd) =
            layer_reference::forward(&input, &weight, bias.as_deref(), rows, d, eps);
        (y, Some(mean), rstd)
    } else {
        let (y, rstd) = rms_reference::forward(&input, &weight, rows, d, eps);
        (y, None, rstd)
    };
    // As `Case::check` (tests/norm/case.rs): x − μ loses the rounding of μ and rstd·γ amplifies
    // it.
    let (rel, abs) = s.t.tolerance();
    let y_scale = rms(&y_ref);
    let centre = |i: usize| mean_ref.as_ref().map_or(0.0, |m| m[i / d].abs());
    compare_rows(f, "y", &post.y, &y_ref, rel, |i| {
        abs * y_scale.max(rstd_ref[i / d] * weight[i % d].abs() * input[i].abs().max(centre(i)))
    });
    let (rel32, abs32) = f32::TOLERANCE;
    if let (Some(_), Some(mean_ref)) = (&post.mean, &mean_ref) {
        compare_rows(f, "mean", &post.mean, mean_ref, rel32, |_| {
            abs32 * rms(&input)
        });
    }
    if post.rstd.is_some() {
        compare_rows(f, "rstd", &post.rstd, &rstd_ref, rel32, |_| {
            abs32 * rms(&rstd_ref)
        });
    }
}

fn check_norm_backward(s: &Spec, pre: &Operands, post: &Operands, f: &mut Findings) {
    let (rows, d, eps) = (s.rows, s.d, s.eps as f64);
    let x = the(&pre.x).gather();
    let dy = the(&pre.dy).gather();
    let weight: Vec<f64> = (the(&pre.weight).gather().iter())
        .map(|w| w + s.weight_offset as f64)
        .collect();
    // The saved statistics, when given, are these rounded to f32.
    let (mean, rstd) = statistics(s.op.layer(), &x, rows, d, eps);
    let (mut dx_ref, dweight_ref, dbias_ref) = if s.op.layer() {
        layer_reference::backward(&dy, &x, &weight, rows, d, eps)
    } else {
        let (dx, dweight) = rms_reference::backward(&dy, &x, &weight, rows, d, eps);
        (dx, dweight, vec![])
    };
    let dresidual =
        (pre.dresidual.as_ref().map(Buf::gather)).unwrap_or_else(|| vec![0.0; rows * d]);
    for (dx, dr) in dx_ref.iter_mut().zip(&dresidual) {
        *dx += dr;
    }
    // As `Case::check` and the residual tests: dx judged on the scale of its terms, row by row.
    let term: Vec<f64> = (0..rows * d)
        .map(|i| rstd[i / d] * dy[i] * weight[i % d])
        .collect();
    let row_scale: Vec<f64> = term.chunks(d).map(rms).collect();
    // LayerNorm of a row whose values sit far from zero compared with their spread (c = max|x|·
    // rstd ≫ 1) centers with cancellation: x̂ carries an f32 error of about c ulps, which dx's
    // terms scale, and dx itself can be far smaller than them (d = 2: dx ∝ eps / spread²). Any
    // f32 implementation has that error; the f64 reference does not.
    let far_from_zero: Vec<f64> = (0..rows)
        .map(|r| {
            let c = x[r * d..(r + 1) * d]
                .iter()
                .fold(0.0f64, |m, v| m.max(v.abs()))
                * rstd[r];
            if s.op.layer() { c } else { 0.0 }
        })
        .collect();
    let conditioning: Vec<f64> = (far_from_zero.iter())
        .map(|c| 8.0 * f32::EPSILON as f64 * (c + c * c))
        .collect();
    let (rel, abs) = s.t.tolerance();
    compare_rows(f, "dx", &post.dx, &dx_ref, rel, |i| {
        let scale = row_scale[i / d].max(term[i].abs());
        (abs * scale + conditioning[i / d] * scale).max(abs * dresidual[i].abs())
    });
    // dweight and dbias sum `rows` products in f32 and round once to their own dtype.
    let (rel, abs) = s.g.tolerance();
    let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
    let sqrt_rows = (rows as f64).sqrt();
    let dy_xhat: Vec<f64> = (0..rows * d)
        .map(|i| dy[i] * (x[i] - mean[i / d]) * rstd[i / d])
        .collect();
    let scale = rms(&dweight_ref).max(rms(&term).max(rms(&dy_xhat)) * sqrt_rows);
    // The same cancellation in dγ = Σ dy·x̂: the row's μ in f32 is off by half an ulp of its
    // largest |x|, so its x̂ by about ε·c (the variance is two-pass: no c² here), times |dy|.
    let centering: Vec<f64> = (0..d)
        .map(|j| {
            (0..rows)
                .map(|r| 4.0 * f32::EPSILON as f64 * far_from_zero[r] * dy[r * d + j].abs())
                .sum()
        })
        .collect();
    compare_rows(
        f,
        "dweight",
        &post.dweight,
        &dweight_ref,
        rel * growth,
        |j| abs * growth * scale + centering[j],
    );
    if post.dbias.is_some() {
        let scale = rms(&dbias_ref).max(rms(&dy) * sqrt_rows);
        compare_rows(f, "dbias", &post.dbias, &dbias_ref, rel * growth, |_| {
            abs * growth * scale
        });
    }
}

fn check_activation(s: &Spec, pre: &Operands, post: &Operands, f: &mut Findings) {
    let (rows, d, act) = (s.rows, s.d, s.act);
    let (rel, abs) = s.t.tolerance();
    // As tests/activation.rs, plus the device functions' own absolute error times the factor
    // that multiplies them.
    let tolerance = |want: &[f64]| abs * rms(want).max(1e-3);
    match s.op {
        Op::ActForward => {
            let x = the(&pre.x).gather();
            let want: Vec<f64> = x.iter().map(|&v| act_reference::apply(act, v)).collect();
            let tol = tolerance(&want) + DEVICE_FN_ABS;
            compare_rows(f, "y", &post.y, &want, rel, |_| tol);
        }
        Op::ActBackward => {
            let x = the(&pre.x).gather();
            let dy = the(&pre.dy).gather();
            let want: Vec<f64> = (x.iter().zip(&dy))
                .map(|(&x, &dy)| dy * act_reference::grad(act, x))
                .collect();
            let tol = tolerance(&want);
            let dx = if s.in_place { &post.dy } else { &post.dx };
            compare_rows(f, "dx", dx, &want, rel, |i| {
                tol + DEVICE_FN_ABS * dy[i].abs()
            });
            if post.dbias.is_some() {
                let dbias: Vec<f64> = (0..d)
                    .map(|j| (0..rows).map(|r| want[r * d + j]).sum())
                    .collect();
                let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
                let tol = abs * growth * (rows as f64).sqrt();
                let dy_sum: Vec<f64> = (0..d)
                    .map(|j| (0..rows).map(|r| dy[r * d + j].abs()).sum())
                    .collect();
                compare_rows(f, "dbias", &post.dbias, &dbias, rel * growth, |j| {
                    tol + DEVICE_FN_ABS * dy_sum[j]
                });
            }
        }
        Op::GatedForward | Op::GatedBackward => {
            let (a, b) = match &pre.ab {
                Some(ab) => halves(ab, d),
                None => (the(&pre.a).gather(), the(&pre.b).gather()),
            };
            let f_a: Vec<f64> = a.iter().map(|&v| act_reference::apply(act, v)).collect();
            if s.op == Op::GatedForward {
                let want: Vec<f64> = f_a.iter().zip(&b).map(|(fa, b)| fa * b).collect();
                let tol = abs * rms(&want);
                compare_rows(f, "h", &post.h, &want, rel, |i| {
                    tol + DEVICE_FN_ABS * b[i].abs()
                });
                return;
            }
            let dh = the(&pre.dy).gather();
            let da: Vec<f64> = (0..rows * d)
                .map(|i| dh[i] * b[i] * act_reference::grad(act, a[i]))
                .collect();
            let db: Vec<f64> = (0..rows * d).map(|i| dh[i] * f_a[i]).collect();
            let (tol_a, tol_b) = (abs * rms(&da), abs * rms(&db));
            let abs_a = |i: usize| tol_a + DEVICE_FN_ABS * (dh[i] * b[i]).abs();
            let abs_b = |i: usize| tol_b + DEVICE_FN_ABS * dh[i].abs();
            match &post.dab {
                Some(dab) => {
                    let first = Layout { d, ..dab.layout };
                    let second = Layout {
                        offset: dab.layout.offset + d,
                        ..first
                    };
                    compare(f, "da (dab)", dab, first, &da, rel, abs_a);
                    compare(f, "db (dab)", dab, second, &db, rel, abs_b);
                }
                None => {
                    compare_rows(f, "da", &post.da, &da, rel, abs_a);
                    compare_rows(f, "db", &post.db, &db, rel, abs_b);
                }
            }
        }
        _ => unreachable!("not an activation"),
    }
}

/// The two halves of packed `[rows, 2·d]` rows, dense.
fn halves(ab: &Buf, d: usize) -> (Vec<f64>, Vec<f64>) {
    let first = Layout { d, ..ab.layout };
    let second = Layout {
        offset: ab.layout.offset + d,
        ..first
    };
    (ab.gather_at(first), ab.gather_at(second))
}

/// Runs `call` and checks everything about it. Returns whether it was valid.
fn run_and_check(call: &mut Call, f: &mut Findings, errors: &mut BTreeMap<String, u64>) -> bool {
    let expect = expected(&call.spec, &call.ops);
    let pre = call.ops.clone();
    let (exec, spec) = (call.exec, &call.spec);
    let ops = &mut call.ops;
    let result = match catch_unwind(AssertUnwindSafe(|| run(&exec, spec, ops))) {
        Ok(result) => result,
        Err(payload) => {
            f.push(Violation::Panic, panic_message(&*payload));
            return expect.is_empty();
        }
    };
    if let Err(e) = &result {
        *errors.entry(label(e)).or_default() += 1;
    }
    match (&result, expect.is_empty()) {
        (Ok(()), true) => match spec.op {
            Op::RmsForward | Op::LayerForward => check_norm_forward(spec, &pre, &call.ops, f),
            Op::RmsBackward | Op::LayerBackward => check_norm_backward(spec, &pre, &call.ops, f),
            _ => check_activation(spec, &pre, &call.ops, f),
        },
        (Err(e), true) => f.push(
            Violation::WrongOutcome,
            format!("a valid call failed: {e:?}"),
        ),
        (Ok(()), false) => f.push(
            Violation::WrongOutcome,
            format!("an invalid call was accepted; expected one of {expect:?}"),
        ),
        (Err(e), false) => {
            if !expect.iter().any(|x| matches(e, x)) {
                f.push(
                    Violation::WrongOutcome,
                    format!("returned {e:?}; expected one of {expect:?}"),
                );
            }
        }
    }
    check_buffers(result.is_ok(), &pre, &call.ops, f);
    expect.is_empty()
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

// ---------------------------------------------------------------------------------------------
// Calls of the sizing functions and of the emulator's configuration.

/// `workspace_len` of every op (and `group_layout` under it) on sizes up to overflow: the groups
/// times d (twice for LayerNorm), or `TooLarge`. Returns the call and whether it fits.
fn sizing_call(
    rng: &mut Rng,
    f: &mut Findings,
    errors: &mut BTreeMap<String, u64>,
) -> (String, bool) {
    let size = |rng: &mut Rng| match rng.below(4) {
        0 => rng.below(100),
        1 => rng.below(1 << 20),
        2 => 1usize << rng.between(20, 63),
        _ => usize::MAX - rng.below(3),
    };
    let (rows, d) = (size(rng), size(rng));
    let desc = format!("workspace_len({rows}, {d})");
    let result = catch_unwind(|| {
        let layouts = [
            group_layout(rows, d),
            activation::dbias_group_layout(rows, d),
        ];
        let lens = [
            (1, layouts[0], rms_norm::workspace_len(rows, d)),
            (2, layouts[0], layer_norm::workspace_len(rows, d)),
            (1, layouts[1], activation::workspace_len(rows, d)),
        ];
        (layouts, lens)
    });
    let Ok((layouts, lens)) = result else {
        f.push(Violation::Panic, format!("{desc} panicked"));
        return (desc, true);
    };
    for (name, (per_group, groups)) in ["group_layout", "dbias_group_layout"]
        .into_iter()
        .zip(layouts)
    {
        // Groups of consecutive rows that cover them all, none empty.
        let covers = per_group >= 1 && groups == rows.div_ceil(per_group);
        // dbias's groups are whole numbers of dγ's (one batch split serves both).
        let nested = per_group % layouts[0].0 == 0;
        if !covers || !nested {
            f.push(
                Violation::WrongOutcome,
                format!("{name}({rows}, {d}) = ({per_group}, {groups})"),
            );
        }
    }
    let mut fits = true;
    for (partials, (_, groups), got) in lens {
        // The single launch's barrier words, then the partial rows.
        let want = (groups.checked_mul(d).and_then(|n| n.checked_mul(partials)))
            .and_then(|n| n.checked_add(GROUP_SUMS_SYNC_WORDS));
        fits &= want.is_some();
        match (&got, want) {
            (Ok(n), Some(w)) if *n == w => {}
            (Err(e @ Error::TooLarge { .. }), None) => {
                *errors.entry(label(e)).or_default() += 1;
            }
            _ => f.push(
                Violation::WrongOutcome,
                format!("{desc}: {got:?}, expected {want:?} ({groups} groups)"),
            ),
        }
    }
    (desc, fits)
}

/// The emulator's configuration: invalid block limits, cluster sizes and grid limits are errors.
/// Returns the call and whether it is valid.
fn config_call(
    rng: &mut Rng,
    f: &mut Findings,
    errors: &mut BTreeMap<String, u64>,
) -> (String, bool) {
    let n = rng.pick(&[
        0,
        1,
        2,
        8,
        9,
        16,
        17,
        31,
        32,
        33,
        96,
        1000,
        1024,
        1056,
        2048,
        usize::MAX,
    ]);
    let which = rng.below(3);
    let (desc, result, valid) = match which {
        0 => (
            format!("with_block_limit({n})"),
            catch_unwind(|| Emulator::new().with_block_limit(n).map(drop)),
            n > 0 && n <= 1024 && n.is_multiple_of(32),
        ),
        1 => (
            format!("with_clusters({n})"),
            catch_unwind(|| Emulator::new().with_clusters(n).map(drop)),
            (1..=16).contains(&n),
        ),
        _ => (
            format!("with_grid_limit({n})"),
            catch_unwind(|| Emulator::new().with_grid_limit(n).map(drop)),
            n > 0,
        ),
    };
    match result {
        Err(_) => f.push(Violation::Panic, format!("{desc} panicked")),
        Ok(Ok(())) if valid => {}
        Ok(Err(e)) if !valid => {
            *errors.entry(label(&e)).or_default() += 1;
            let kind_ok = match which {
                2 => e == Error::ZeroGrid,
                _ => matches!(e, Error::Emulator(_)),
            };
            if !kind_ok {
                f.push(Violation::WrongOutcome, format!("{desc}: {e:?}"));
            }
        }
        Ok(r) => f.push(Violation::WrongOutcome, format!("{desc}: {r:?}")),
    }
    (desc, valid)
}

// ---------------------------------------------------------------------------------------------
// The run.

#[derive(Default)]
struct Stats {
    calls: u64,
    valid: u64,
    invalid: u64,
    /// `[valid, invalid]` calls per operation.
    per_op: BTreeMap<&'static str, [u64; 2]>,
    errors: BTreeMap<String, u64>,
    /// Calls with at least one violation of each kind.
    violations: BTreeMap<Violation, u64>,
    /// The first few failing calls, described.
    failures: Vec<String>,
}

impl Stats {
    fn violation_count(&self) -> u64 {
        self.violations.values().sum()
    }

    fn summary(&self, elapsed: Duration) -> String {
        let mut s = format!(
            "fuzz: {} calls in {:.1} s: {} valid, {} invalid\n  per op (valid/invalid):",
            self.calls,
            elapsed.as_secs_f64(),
            self.valid,
            self.invalid
        );
        for (op, [valid, invalid]) in &self.per_op {
            write!(s, " {op} {valid}/{invalid},").unwrap();
        }
        s.pop();
        s.push_str("\n  typed errors:");
        for (kind, n) in &self.errors {
            write!(s, " {kind} {n},").unwrap();
        }
        if self.errors.is_empty() {
            s.push_str(" none");
        } else {
            s.pop();
        }
        s.push_str("\n  violations:");
        for (v, name) in VIOLATIONS {
            write!(s, " {name} {},", self.violations.get(&v).unwrap_or(&0)).unwrap();
        }
        s.pop();
        s
    }
}

/// What one call gave.
struct Record {
    op: &'static str,
    desc: String,
    valid: bool,
    errors: BTreeMap<String, u64>,
    findings: Findings,
}

impl Stats {
    /// Counts call number `index`, of seed `seed`.
    fn add(&mut self, index: u64, seed: u64, r: Record) {
        self.calls += 1;
        let counts = self.per_op.entry(r.op).or_default();
        if r.valid {
            self.valid += 1;
            counts[0] += 1;
        } else {
            self.invalid += 1;
            counts[1] += 1;
        }
        for (kind, n) in r.errors {
            *self.errors.entry(kind).or_default() += n;
        }
        let mut kinds: Vec<Violation> = r.findings.0.iter().map(|(v, _)| *v).collect();
        kinds.sort();
        kinds.dedup();
        for v in kinds {
            *self.violations.entry(v).or_default() += 1;
        }
        if !r.findings.0.is_empty() {
            let mut s = format!("call {index} (NORMKERN_FUZZ_REPLAY={seed}): {}", r.desc);
            for (v, message) in &r.findings.0 {
                write!(s, "\n  {v:?}: {message}").unwrap();
            }
            // Printed as it happens too: a long run's end may be hours away.
            eprintln!("{s}");
            if self.failures.len() < 10 {
                self.failures.push(s);
            }
        }
    }
}

/// Generates, runs and checks the call of `seed`. With `verbose`, prints its description.
fn one_call(seed: u64, verbose: bool) -> Record {
    let mut rng = Rng::seeded(seed);
    let mut f = Findings::default();
    let mut errors = BTreeMap::new();
    // A panic of the fuzzer itself counts too.
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let op = match rng.below(100) {
            0 => {
                let (desc, valid) = sizing_call(&mut rng, &mut f, &mut errors);
                return ("workspace_len", desc, valid);
            }
            1 => {
                let (desc, valid) = config_call(&mut rng, &mut f, &mut errors);
                return ("Emulator config", desc, valid);
            }
            n => [
                Op::RmsForward,
                Op::LayerForward,
                Op::RmsBackward,
                Op::LayerBackward,
                Op::ActForward,
                Op::ActBackward,
                Op::GatedForward,
                Op::GatedBackward,
            ][n % 8],
        };
        let mut call = match op {
            Op::RmsForward | Op::LayerForward => gen_norm_forward(&mut rng, op),
            Op::RmsBackward | Op::LayerBackward => gen_norm_backward(&mut rng, op),
            _ => gen_activation(&mut rng, op),
        };
        // Two mutations can cancel out (h and ab both a column wider): the shape is the
        // operands' own.
        (call.spec.rows, call.spec.d) = anchor(&call.spec, &call.ops);
        materialize(&mut rng, &mut call);
        let desc = call.describe();
        if verbose {
            eprintln!("{desc}");
        }
        let valid = run_and_check(&mut call, &mut f, &mut errors);
        (op.name(), desc, valid)
    }));
    let (op, desc, valid) = outcome.unwrap_or_else(|payload| {
        let message = format!("the fuzzer panicked: {}", panic_message(&*payload));
        f.push(Violation::Panic, message);
        ("?", String::from("(not generated)"), false)
    });
    Record {
        op,
        desc,
        valid,
        errors,
        findings: f,
    }
}

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The run's state the workers share: the seeds handed out so far and the counts.
struct Shared {
    master: Rng,
    issued: u64,
    stats: Stats,
    last_report: Instant,
}

#[test]
fn fuzz_every_operation() {
    let start = Instant::now();
    if let Some(seed) = env::<u64>("NORMKERN_FUZZ_REPLAY") {
        let mut stats = Stats::default();
        stats.add(1, seed, one_call(seed, true));
        let summary = stats.summary(start.elapsed());
        assert!(stats.violation_count() == 0, "{summary}");
        return;
    }
    let calls = env::<u64>("NORMKERN_FUZZ_CALLS");
    let budget = Duration::from_secs_f64(env("NORMKERN_FUZZ_SECONDS").unwrap_or(50.0));
    // An emulated launch runs on one OS thread: one call in flight per core.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let shared = std::sync::Mutex::new(Shared {
        master: Rng::fresh("fuzz"),
        issued: 0,
        stats: Stats::default(),
        last_report: start,
    });
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let (index, seed) = {
                        let mut s = shared.lock().unwrap();
                        let more = match calls {
                            Some(n) => s.issued < n,
                            None => start.elapsed() < budget,
                        };
                        if !more {
                            break;
                        }
                        s.issued += 1;
                        (s.issued, s.master.next_u64())
                    };
                    let record = one_call(seed, false);
                    let mut s = shared.lock().unwrap();
                    s.stats.add(index, seed, record);
                    if s.last_report.elapsed() > Duration::from_secs(300) {
                        s.last_report = Instant::now();
                        eprintln!("{}", s.stats.summary(start.elapsed()));
                    }
                }
            });
        }
    });
    let stats = shared.into_inner().unwrap().stats;
    let summary = stats.summary(start.elapsed());
    eprintln!("{summary}");
    // For CI's log, which shows no output of passing tests.
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-summary.txt");
    if let Err(e) = std::fs::write(&file, &summary) {
        eprintln!("fuzz: could not write {}: {e}", file.display());
    }
    assert!(
        stats.violation_count() == 0,
        "{summary}\n{}",
        stats.failures.join("\n")
    );
}
