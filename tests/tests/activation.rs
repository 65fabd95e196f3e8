//! Activations against the f64 reference: the reference derivatives against finite differences,
//! the device functions' accuracy and special values, and every kernel entry point, each case
//! written once for both executors: in the CPU emulator, and on the GPU (skipped with a printed
//! reason when there is none).

use half::{bf16, f16};
use normkern::activation::{
    self, Activation, Backward, Forward, GatedBackward, GatedForward, GatedGrad, GatedInput,
};
use normkern::{Context, Emulator, Error, Executor, ParamGradients, Rows};
use normkern_gpu::activation as device;
use normkern_tests::backend::{Backend, Device, Host};
use normkern_tests::reference::activation::{self as reference, ALL};
use normkern_tests::{Rng, TestDtype, assert_close, gather_rows, gpu, rms, same_bits, to_f64};

/// A device function `f32 -> f32`.
type DeviceFn = fn(f32) -> f32;

/// `(f, f')` of the device functions.
fn device_fns(act: Activation) -> (DeviceFn, DeviceFn) {
    match act {
        Activation::Relu => (device::relu, device::relu_grad),
        Activation::Silu => (device::silu, device::silu_grad),
        Activation::GeluErf => (device::gelu_erf, device::gelu_erf_grad),
        Activation::GeluTanh => (device::gelu_tanh, device::gelu_tanh_grad),
    }
}

#[test]
fn reference_derivatives_match_finite_differences() {
    for act in ALL {
        let mut x = -6.0;
        while x < 6.0 {
            let h = 1e-6;
            let numeric = (reference::apply(act, x + h) - reference::apply(act, x - h)) / (2.0 * h);
            if !(act == Activation::Relu && x.abs() < 2.0 * h) {
                let analytic = reference::grad(act, x);
                assert!(
                    (numeric - analytic).abs() < 1e-7,
                    "{act:?}'({x}): {numeric} vs {analytic}"
                );
            }
            x += 0.0137;
        }
    }
}

/// Dense sweep of f32 inputs: every step of 1/256 over ±100, both zeros, subnormals and the
/// largest/smallest normals.
fn sweep() -> Vec<f32> {
    let mut xs: Vec<f32> = (-25600..=25600).map(|i| i as f32 / 256.0).collect();
    xs.extend([
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        1e-40,
        -1e-40,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        1e-20,
        -1e-20,
    ]);
    xs
}

/// Results below this are judged by absolute error only: f32 activations of inputs below about
/// −87 go through subnormal intermediates (e^x underflows) and keep only a few bits, which matters
/// nowhere but would dominate a relative-error column.
const REL_FLOOR: f64 = 1e-30;

/// `(max absolute error, max relative error over references ≥ REL_FLOOR)` of `got` against `want`.
fn errors(got: &[f64], want: &[f64]) -> (f64, f64) {
    let mut worst = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        let abs = (g - w).abs();
        worst.0 = worst.0.max(abs);
        if w.abs() >= REL_FLOOR {
            worst.1 = worst.1.max(abs / w.abs());
        }
    }
    worst
}

/// The device functions on the host (exp2 from the host's libm; the GPU table comes from
/// `gpu_accuracy_table`): close to f64 over the whole sweep.
#[test]
fn device_functions_are_accurate_on_the_host() {
    let xs = sweep();
    for act in ALL {
        let (f, df) = device_fns(act);
        for (what, fun, refn) in [
            ("f", f, reference::apply as fn(Activation, f64) -> f64),
            ("f'", df, reference::grad),
        ] {
            let got: Vec<f64> = xs.iter().map(|&x| fun(x) as f64).collect();
            let want: Vec<f64> = xs.iter().map(|&x| refn(act, x as f64)).collect();
            let (abs, rel) = errors(&got, &want);
            eprintln!("host {act:?} {what}: max abs {abs:.1e}, max rel {rel:.1e}");
            assert!(abs < 2e-6, "{act:?} {what}: abs error {abs:e}");
            // The relative error of values near a zero crossing of f' is not meaningful; bound the
            // error by relative or absolute, whichever is looser, per element.
            for ((x, g), w) in xs.iter().zip(&got).zip(&want) {
                assert!(
                    (g - w).abs() <= 2e-5 * w.abs() + 1e-7,
                    "{act:?} {what}({x}) = {g}, reference {w}"
                );
            }
        }
    }
}

#[test]
fn special_values_propagate_or_take_their_limits() {
    for act in ALL {
        let (f, df) = device_fns(act);
        assert!(
            f(f32::NAN).is_nan() && df(f32::NAN).is_nan(),
            "{act:?}: NaN must propagate"
        );
        assert_eq!(f(f32::INFINITY), f32::INFINITY, "{act:?}(+inf)");
        assert_eq!(f(f32::NEG_INFINITY), 0.0, "{act:?}(-inf)");
        assert_eq!(df(f32::INFINITY), 1.0, "{act:?}'(+inf)");
        assert_eq!(df(f32::NEG_INFINITY), 0.0, "{act:?}'(-inf)");
        assert_eq!(f(0.0), 0.0, "{act:?}(0)");
        assert_eq!(f(-0.0), 0.0, "{act:?}(-0)");
    }
}

/// A backend's input and output buffers.
type In<'a, B, T> = <<B as Backend>::Exec as Executor>::In<'a, T>;
type Out<'a, B, T> = <<B as Backend>::Exec as Executor>::Out<'a, T>;

/// `rows × d`, rows `stride` apart, from element `offset` of a backend's buffer.
fn rows_of<B: Backend, T: TestDtype>(
    buf: &B::Buf<T>,
    offset: usize,
    (rows, d, stride): (usize, usize, usize),
) -> Rows<In<'_, B, T>> {
    Rows::with_stride(B::input(buf, offset), rows, d, stride).unwrap()
}

/// [`rows_of`], writable.
fn rows_of_mut<B: Backend, T: TestDtype>(
    buf: &mut B::Buf<T>,
    offset: usize,
    (rows, d, stride): (usize, usize, usize),
) -> Rows<Out<'_, B, T>> {
    Rows::with_stride(B::output(buf, offset), rows, d, stride).unwrap()
}

/// A whole buffer as dense `rows × d`.
fn dense<B: Backend, T: TestDtype>(buf: &B::Buf<T>, rows: usize, d: usize) -> Rows<In<'_, B, T>> {
    rows_of::<B, T>(buf, 0, (rows, d, d))
}

/// [`dense`], writable.
fn dense_mut<B: Backend, T: TestDtype>(
    buf: &mut B::Buf<T>,
    rows: usize,
    d: usize,
) -> Rows<Out<'_, B, T>> {
    rows_of_mut::<B, T>(buf, 0, (rows, d, d))
}

/// Gated inputs of packed `[rows, 2·d]` rows: as two strided views, or as the packed rows.
fn gated_input<B: Backend, T: TestDtype>(
    ab: &B::Buf<T>,
    (rows, d): (usize, usize),
    packed: bool,
) -> GatedInput<'_, B::Exec, T> {
    if packed {
        GatedInput::Packed(dense::<B, T>(ab, rows, 2 * d))
    } else {
        GatedInput::Separate {
            a: rows_of::<B, T>(ab, 0, (rows, d, 2 * d)),
            b: rows_of::<B, T>(ab, d, (rows, d, 2 * d)),
        }
    }
}

/// One elementwise problem on strided rows.
struct Case<T> {
    rows: usize,
    d: usize,
    stride: usize,
    offset: usize,
    x: Vec<T>,
    dy: Vec<T>,
}

impl<T: TestDtype> Case<T> {
    fn new(rng: &mut Rng, rows: usize, d: usize, stride: usize, offset: usize) -> Self {
        let n = offset + rows.saturating_sub(1) * stride + d;
        Case {
            rows,
            d,
            stride,
            offset,
            x: rng.vec(n, -6.0, 6.0),
            dy: rng.vec(n, -1.0, 1.0),
        }
    }

    /// The case's rows of a backend's buffer.
    fn view<'b, B: Backend>(&self, buf: &'b B::Buf<T>) -> Rows<In<'b, B, T>> {
        rows_of::<B, T>(buf, self.offset, (self.rows, self.d, self.stride))
    }

    /// [`Case::view`], writable.
    fn view_mut<'b, B: Backend>(&self, buf: &'b mut B::Buf<T>) -> Rows<Out<'b, B, T>> {
        rows_of_mut::<B, T>(buf, self.offset, (self.rows, self.d, self.stride))
    }

    /// Whether element `i` of the case's buffers lies in its rows.
    fn inside(&self, i: usize) -> bool {
        let Some(i) = i.checked_sub(self.offset) else {
            return false;
        };
        i % self.stride < self.d && i / self.stride < self.rows
    }

    fn gather(&self, v: &[T]) -> Vec<f64> {
        gather_rows(&v[self.offset..], self.rows, self.d, self.stride)
    }

    fn check(&self, what: &str, got: &[T], want: impl Fn(usize) -> f64) {
        let want: Vec<f64> = (0..self.rows * self.d).map(want).collect();
        let (rel, abs) = T::TOLERANCE;
        let what = format!(
            "{what} {}×{} stride {} offset {}",
            self.rows, self.d, self.stride, self.offset
        );
        assert_close::<T>(
            &what,
            &self.gather(got),
            &want,
            rel,
            abs * rms(&want).max(1e-3),
        );
    }

    /// Asserts `got` still holds `before` everywhere outside the case's rows.
    fn expect_untouched(&self, what: &str, got: &[T], before: &[T]) {
        for (i, (g, b)) in got.iter().zip(before).enumerate() {
            assert!(
                self.inside(i) || g.bits() == b.bits(),
                "{what}: written outside the rows at {i}"
            );
        }
    }

    fn expect_forward(&self, what: &str, act: Activation, y: &[T]) {
        let x = self.gather(&self.x);
        self.check(&format!("{what} forward"), y, |i| {
            reference::apply(act, x[i])
        });
    }

    fn expect_backward(&self, what: &str, act: Activation, dx: &[T]) {
        let (x, dy) = (self.gather(&self.x), self.gather(&self.dy));
        self.check(&format!("{what} backward"), dx, |i| {
            dy[i] * reference::grad(act, x[i])
        });
    }

    fn expect_dbias(&self, what: &str, act: Activation, dbias: &[T]) {
        let (x, dy) = (self.gather(&self.x), self.gather(&self.dy));
        let want: Vec<f64> = (0..self.d)
            .map(|j| {
                (0..self.rows)
                    .map(|r| dy[r * self.d + j] * reference::grad(act, x[r * self.d + j]))
                    .sum()
            })
            .collect();
        let (rel, abs) = T::TOLERANCE;
        let growth = 1.0 + (self.rows as f64).sqrt() * f32::EPSILON as f64 / rel;
        assert_close::<T>(
            &format!("{what} dbias"),
            &to_f64(dbias),
            &want,
            rel * growth,
            abs * growth * (self.rows as f64).sqrt(),
        );
    }
}

/// Forward, backward, in-place backward and backward with dbias of one case on `backend`, into
/// poisoned outputs: each against the reference, nothing written outside the rows, and the three
/// backwards' dx the same bits. Returns dbias.
fn elementwise<B: Backend, T: TestDtype>(backend: &B, case: &Case<T>, act: Activation) -> Vec<T> {
    let exec = backend.exec();
    let what = format!("{} {act:?}", backend.name());
    let (x, dy) = (backend.upload(&case.x), backend.upload(&case.dy));
    let poison = vec![T::poison(); case.x.len()];
    let mut y = backend.upload(&poison);
    let forward = Forward::new(act, case.view::<B>(&x), case.view_mut::<B>(&mut y));
    activation::forward(exec, forward).unwrap();
    let mut dx = backend.upload(&poison);
    let (dy_rows, x_rows) = (case.view::<B>(&dy), case.view::<B>(&x));
    let backward = Backward::new(act, dy_rows, x_rows, case.view_mut::<B>(&mut dx));
    activation::backward(exec, backward).unwrap();
    let mut in_place = backend.upload(&case.dy);
    let backward = Backward::in_place(act, case.view_mut::<B>(&mut in_place), case.view::<B>(&x));
    activation::backward(exec, backward).unwrap();
    let (dx2, dbias) = dbias_backward(backend, case, act, ParamGradients::TwoPass);
    // The single launch (and Auto) give the two-pass bits; atomics (f32 only) are within
    // tolerance.
    for strategy in [ParamGradients::SingleLaunch, ParamGradients::Auto] {
        let (dx3, sums) = dbias_backward(backend, case, act, strategy);
        assert!(
            same_bits(&dx3, &dx2) && same_bits(&sums, &dbias),
            "{what}: {strategy:?} differs from two-pass"
        );
    }
    if T::NAME == "f32" {
        let (_, atomic) = dbias_backward(backend, case, act, ParamGradients::Atomic);
        case.expect_dbias(&format!("{what} atomic"), act, &atomic);
    }
    let [y, dx, in_place] = [&y, &dx, &in_place].map(|buf| backend.download(buf));
    case.expect_forward(&what, act, &y);
    case.expect_backward(&what, act, &dx);
    case.expect_untouched(&format!("{what} forward"), &y, &poison);
    case.expect_untouched(&format!("{what} backward"), &dx, &poison);
    case.expect_untouched(&format!("{what} in-place backward"), &in_place, &case.dy);
    for i in (0..dx.len()).filter(|&i| case.inside(i)) {
        assert_eq!(
            in_place[i].bits(),
            dx[i].bits(),
            "{what}: in-place backward differs at {i}"
        );
    }
    assert!(
        same_bits(&dx2, &dx),
        "{what}: dx of the dbias backward differs from the plain backward"
    );
    case.expect_dbias(&what, act, &dbias);
    dbias
}

/// `(dx, dbias)` of a backward with dbias summed by `strategy`, into poisoned dx and dbias (zero
/// for atomics, which add into it) and a poisoned workspace, whose barrier arrivals it must
/// leave zero.
fn dbias_backward<B: Backend, T: TestDtype>(
    backend: &B,
    case: &Case<T>,
    act: Activation,
    strategy: ParamGradients,
) -> (Vec<T>, Vec<T>) {
    let exec = backend.exec();
    let (x, dy) = (backend.upload(&case.x), backend.upload(&case.dy));
    let mut dx = backend.upload(&vec![T::poison(); case.x.len()]);
    let start = if strategy == ParamGradients::Atomic {
        T::from_f64(0.0)
    } else {
        T::poison()
    };
    let mut dbias = backend.upload(&vec![start; case.d]);
    // NaN, so a partial the column sum reads before the backward wrote it shows in dbias.
    let workspace_len = activation::workspace_len(case.rows, case.d).unwrap();
    let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));
    let (dy_rows, x_rows) = (case.view::<B>(&dy), case.view::<B>(&x));
    let backward = Backward::new(act, dy_rows, x_rows, case.view_mut::<B>(&mut dx))
        .dbias(B::output(&mut dbias, 0), B::output(&mut workspace, 0))
        .param_gradients(strategy);
    activation::backward(exec, backward).unwrap();
    let arrivals = backend.download(&workspace)[0];
    assert_eq!(
        arrivals.to_bits(),
        0,
        "{strategy:?}: arrivals left at {arrivals:?}"
    );
    (backend.download(&dx), backend.download(&dbias))
}

/// `(rows, d, stride, offset)` of the cases a test runs.
type Shape = (usize, usize, usize, usize);

/// [`elementwise`] for each activation of `acts` on each shape, on every one of `backends`: dbias
/// is the same bits on all of them (they differ in grid, or are one run again).
fn matches_reference<B: Backend, T: TestDtype>(
    backends: &[B],
    shapes: &[Shape],
    acts: &[Activation],
) {
    let mut rng = Rng::fresh(&format!("activation_{}_{}", backends[0].name(), T::NAME));
    for &(rows, d, stride, offset) in shapes {
        let case = Case::<T>::new(&mut rng, rows, d, stride, offset);
        for &act in acts {
            let dbias: Vec<Vec<T>> = backends
                .iter()
                .map(|backend| elementwise(backend, &case, act))
                .collect();
            assert!(
                dbias.iter().all(|other| same_bits(other, &dbias[0])),
                "{act:?} {rows}×{d}: dbias differs from run to run or grid to grid"
            );
        }
    }
}

/// Small enough for the emulator: a ragged row, padded rows, an offset of one element (single
/// element access), 40 rows (3 dbias groups, more row slices than a group has rows), 600
/// padded rows of 256 (dbias groups of 16 rows taken by 4 or 8 row slices, the last group short),
/// 2900 single-element rows of 200 (groups of 12 rows, one slice each: a full batch of rows
/// in flight, then a short one; the last group 8 rows), and a small batch of wide rows (150 rows
/// of 2304 in groups of one row, one slice of 256 packs and one of 32).
const EMULATOR_SHAPES: [Shape; 7] = [
    (3, 7, 7, 0),
    (17, 64, 72, 0),
    (5, 33, 40, 1),
    (40, 16, 16, 0),
    (600, 256, 260, 0),
    (2900, 200, 200, 1),
    (150, 2304, 2304, 0),
];

fn emulator_matches_reference<T: TestDtype>() {
    // The default grid, and one block walking every tile and group.
    let backends = [
        Host(Emulator::new()),
        Host(Emulator::new().with_grid_limit(1).unwrap()),
    ];
    matches_reference::<_, T>(&backends, &EMULATOR_SHAPES, &ALL);
}

#[test]
fn emulator_matches_reference_f32() {
    emulator_matches_reference::<f32>();
}

/// Wide rows in dbias's own groups (four of dγ's 16 rows: four row slices of 64 accesses each
/// walking 16 rows, the last group 4 rows): 4100 rows of 2304 in packs (288 a row, so the fifth
/// item of a group has 32 columns) and of 2048 single elements, one activation (the emulator
/// takes a while over 9 Mi elements).
#[test]
fn emulator_dbias_wide_groups_match_reference() {
    let backends = [
        Host(Emulator::new()),
        Host(Emulator::new().with_grid_limit(3).unwrap()),
    ];
    let shapes = [(4100, 2304, 2304, 0), (4100, 2048, 2056, 1)];
    matches_reference::<_, bf16>(&backends, &shapes, &[Activation::GeluErf]);
}
#[test]
fn emulator_matches_reference_f16() {
    emulator_matches_reference::<f16>();
}
#[test]
fn emulator_matches_reference_bf16() {
    emulator_matches_reference::<bf16>();
}

const GPU_SHAPES: [Shape; 9] = [
    (4096, 4096, 4096, 0),
    // dbias groups of 12 rows, one row slice each: a full batch of rows in flight, then a short one.
    (2900, 2048, 2048, 0),
    // dbias's own groups of 64 rows (four row slices of 16 rows), the last of 4.
    (4100, 4096, 4096, 0),
    // Narrow rows: dbias groups of 64 rows over 16 (bf16) or 32 (f32) row slices of a block.
    (65536, 128, 128, 0),
    (30000, 100, 104, 0),
    (1000, 1000, 1000, 0),
    (333, 4100, 4104, 1),
    (64, 7, 9, 0),
    (1, 65536, 65536, 0),
];

fn gpu_matches_reference<T: TestDtype>() {
    let Some(gpu) = Device::shared() else { return };
    matches_reference::<_, T>(&[gpu], &GPU_SHAPES, &ALL);
}

#[test]
fn gpu_matches_reference_f32() {
    gpu_matches_reference::<f32>();
}
#[test]
fn gpu_matches_reference_f16() {
    gpu_matches_reference::<f16>();
}
#[test]
fn gpu_matches_reference_bf16() {
    gpu_matches_reference::<bf16>();
}

#[test]
fn gpu_dbias_is_bitwise_repeatable_and_grid_invariant() {
    let Some((ctx, stream)) = gpu() else { return };
    let small = Context::from_cuda(ctx.cuda().clone())
        .unwrap()
        .with_grid_limit(5)
        .unwrap();
    // Three runs on the full grid, then one on 5 blocks.
    let backends = [
        Device::new(ctx, stream),
        Device::new(ctx, stream),
        Device::new(ctx, stream),
        Device::new(&small, stream),
    ];
    // A row a block's threads cover, narrow rows summed by 16 row slices of a block, and padded
    // wide rows in dbias's own groups (64 rows, four row slices; the last group 4 rows).
    let shapes = [
        (16384, 1024, 1024, 0),
        (262144, 128, 128, 0),
        (4100, 4096, 4104, 0),
    ];
    matches_reference::<_, bf16>(&backends, &shapes, &[Activation::GeluTanh]);
}

/// Gated forward and backward of `rows × d` on `backend`, with a and b as two strided views of
/// packed rows and as the packed rows themselves, into poisoned outputs: both forms give the same
/// bits, which match the reference.
fn gated_matches_reference<B: Backend, T: TestDtype>(backend: &B, (rows, d): (usize, usize)) {
    let exec = backend.exec();
    let mut rng = Rng::fresh(&format!("gated_{}_{}", backend.name(), T::NAME));
    let ab: Vec<T> = rng.vec(rows * 2 * d, -4.0, 4.0);
    let dh: Vec<T> = rng.vec(rows * d, -1.0, 1.0);
    let (ab_buf, dh_buf) = (backend.upload(&ab), backend.upload(&dh));
    for act in ALL {
        let what = format!("{} {act:?}", backend.name());
        let poison = vec![T::poison(); rows * d];
        let [mut h, mut h2, mut da, mut db] = [(); 4].map(|()| backend.upload(&poison));
        let mut dab = backend.upload(&vec![T::poison(); rows * 2 * d]);
        for (packed, h) in [(false, &mut h), (true, &mut h2)] {
            let forward = GatedForward {
                activation: act,
                input: gated_input::<B, T>(&ab_buf, (rows, d), packed),
                h: dense_mut::<B, T>(h, rows, d),
            };
            activation::gated_forward(exec, forward).unwrap();
        }
        let separate = GatedGrad::Separate {
            da: dense_mut::<B, T>(&mut da, rows, d),
            db: dense_mut::<B, T>(&mut db, rows, d),
        };
        let packed = GatedGrad::Packed(dense_mut::<B, T>(&mut dab, rows, 2 * d));
        for (packed, grad) in [(false, separate), (true, packed)] {
            let backward = GatedBackward {
                activation: act,
                dh: dense::<B, T>(&dh_buf, rows, d),
                input: gated_input::<B, T>(&ab_buf, (rows, d), packed),
                grad,
            };
            activation::gated_backward(exec, backward).unwrap();
        }
        let [h, h2, da, db, dab] = [&h, &h2, &da, &db, &dab].map(|buf| backend.download(buf));
        assert!(
            same_bits(&h, &h2),
            "{what}: packed and separate gated forward differ"
        );
        assert!(
            same_bits(&gather_bits(&dab, rows, d, 2 * d, 0), &da)
                && same_bits(&gather_bits(&dab, rows, d, 2 * d, d), &db),
            "{what}: packed and separate gated backward differ"
        );
        check_gated(
            &what,
            act,
            (&ab, &dh),
            (rows, d),
            [&to_f64(&h), &to_f64(&da), &to_f64(&db)],
        );
    }
}

#[test]
fn emulator_gated_matches_reference_f32() {
    gated_matches_reference::<_, f32>(&Host(Emulator::new()), (9, 24));
}
#[test]
fn emulator_gated_matches_reference_f16() {
    gated_matches_reference::<_, f16>(&Host(Emulator::new()), (9, 24));
}
#[test]
fn emulator_gated_matches_reference_bf16() {
    gated_matches_reference::<_, bf16>(&Host(Emulator::new()), (9, 24));
}

fn gpu_gated_matches_reference<T: TestDtype>() {
    let Some(gpu) = Device::shared() else { return };
    gated_matches_reference::<_, T>(&gpu, (2048, 2816));
}

#[test]
fn gpu_gated_matches_reference_f32() {
    gpu_gated_matches_reference::<f32>();
}
#[test]
fn gpu_gated_matches_reference_f16() {
    gpu_gated_matches_reference::<f16>();
}
#[test]
fn gpu_gated_matches_reference_bf16() {
    gpu_gated_matches_reference::<bf16>();
}

/// Checks `[h, da, db]` of a gated op on packed `ab` (`rows × 2d`) and `dh` against the reference.
fn check_gated<T: TestDtype>(
    what: &str,
    act: Activation,
    (ab, dh): (&[T], &[T]),
    (rows, d): (usize, usize),
    got: [&[f64]; 3],
) {
    let mut want = [vec![], vec![], vec![]];
    for r in 0..rows {
        for j in 0..d {
            let (a, b, g) = (
                ab[r * 2 * d + j].to_f64(),
                ab[r * 2 * d + d + j].to_f64(),
                dh[r * d + j].to_f64(),
            );
            want[0].push(reference::apply(act, a) * b);
            want[1].push(g * b * reference::grad(act, a));
            want[2].push(g * reference::apply(act, a));
        }
    }
    let (rel, abs) = T::TOLERANCE;
    for ((name, got), want) in ["h", "da", "db"].iter().zip(got).zip(&want) {
        assert_close::<T>(
            &format!("{what} gated {name}"),
            got,
            want,
            rel,
            abs * rms(want),
        );
    }
}

fn gather_bits<T: TestDtype>(
    v: &[T],
    rows: usize,
    d: usize,
    stride: usize,
    offset: usize,
) -> Vec<T> {
    (0..rows)
        .flat_map(|r| {
            v[offset + r * stride..offset + r * stride + d]
                .iter()
                .copied()
        })
        .collect()
}

/// Wrong shapes, lengths and workspaces are errors, and a call that fails writes nothing.
fn rejects_bad_arguments<B: Backend>(backend: &B) {
    let exec = backend.exec();
    let act = Activation::Silu;
    let x = backend.upload(&[1.0f32; 64]);
    let [mut y, mut h, mut da, mut db, mut dab] = [(); 5].map(|()| backend.upload(&[f32::NAN; 64]));
    let [mut dbias15, mut dbias16] = [15, 16].map(|n| backend.upload(&vec![f32::NAN; n]));
    let mut workspace = backend.upload(&[0.0f32; 1]);

    let r = activation::forward(
        exec,
        Forward::new(
            act,
            dense::<B, f32>(&x, 4, 16),
            dense_mut::<B, f32>(&mut y, 4, 8),
        ),
    );
    assert!(matches!(r, Err(Error::Shape { what: "y", .. })), "{r:?}");
    let backward = Backward::new(
        act,
        dense::<B, f32>(&x, 4, 16),
        dense::<B, f32>(&x, 4, 16),
        dense_mut::<B, f32>(&mut y, 4, 16),
    );
    let backward = backward.dbias(B::output(&mut dbias15, 0), B::output(&mut workspace, 0));
    let r = activation::backward(exec, backward);
    assert!(
        matches!(r, Err(Error::Length { what: "dbias", .. })),
        "{r:?}"
    );
    let backward = Backward::new(
        act,
        dense::<B, f32>(&x, 4, 16),
        dense::<B, f32>(&x, 4, 16),
        dense_mut::<B, f32>(&mut y, 4, 16),
    );
    let backward = backward.dbias(B::output(&mut dbias16, 0), B::output(&mut workspace, 0));
    let r = activation::backward(exec, backward);
    assert!(matches!(r, Err(Error::WorkspaceTooSmall { .. })), "{r:?}");
    let backward = Backward::in_place(
        act,
        dense_mut::<B, f32>(&mut y, 4, 8),
        dense::<B, f32>(&x, 4, 16),
    );
    let r = activation::backward(exec, backward);
    assert!(matches!(r, Err(Error::Shape { what: "dy", .. })), "{r:?}");
    let forward = GatedForward {
        activation: act,
        input: GatedInput::Separate {
            a: dense::<B, f32>(&x, 4, 16),
            b: dense::<B, f32>(&x, 4, 8),
        },
        h: dense_mut::<B, f32>(&mut h, 4, 16),
    };
    let r = activation::gated_forward(exec, forward);
    assert!(matches!(r, Err(Error::Shape { what: "b", .. })), "{r:?}");
    let backward = GatedBackward {
        activation: act,
        dh: dense::<B, f32>(&x, 4, 8),
        input: GatedInput::Packed(dense::<B, f32>(&x, 4, 8)),
        grad: GatedGrad::Packed(dense_mut::<B, f32>(&mut dab, 4, 16)),
    };
    let r = activation::gated_backward(exec, backward);
    assert!(matches!(r, Err(Error::Shape { what: "ab", .. })), "{r:?}");
    let backward = GatedBackward {
        activation: act,
        dh: dense::<B, f32>(&x, 4, 8),
        input: GatedInput::Packed(dense::<B, f32>(&x, 4, 16)),
        grad: GatedGrad::Separate {
            da: dense_mut::<B, f32>(&mut da, 4, 8),
            db: dense_mut::<B, f32>(&mut db, 4, 16),
        },
    };
    let r = activation::gated_backward(exec, backward);
    assert!(matches!(r, Err(Error::Shape { what: "db", .. })), "{r:?}");

    for buf in [&y, &h, &da, &db, &dab, &dbias15, &dbias16] {
        let got = backend.download(buf);
        assert!(
            got.iter().all(|v| v.is_nan()),
            "{}: a call that failed wrote an output",
            backend.name()
        );
    }
}

#[test]
fn emulator_rejects_bad_arguments() {
    rejects_bad_arguments(&Host(Emulator::new()));
}

#[test]
fn gpu_rejects_bad_arguments() {
    let Some(gpu) = Device::shared() else { return };
    rejects_bad_arguments(&gpu);
}

#[test]
fn workspace_len_reports_overflow() {
    let r = activation::workspace_len(1 << 20, 1 << 62);
    assert!(matches!(r, Err(Error::TooLarge { .. })), "{r:?}");
}

/// The accuracy table of the docs: every function and derivative run by the GPU kernels over the
/// dense sweep, per storage dtype, against f64 of the same (dtype-rounded) inputs.
#[test]
fn gpu_accuracy_table() {
    let Some(gpu) = Device::shared() else { return };
    let xs = sweep();
    println!("| function | dtype | max abs error | max rel error (|result| ≥ 1e-30) |");
    println!("|---|---|---:|---:|");
    accuracy_rows::<_, f32>(&gpu, &xs);
    accuracy_rows::<_, f16>(&gpu, &xs);
    accuracy_rows::<_, bf16>(&gpu, &xs);
}

/// The rows of the accuracy table for dtype `T`: f and f' (a backward of dy = 1) of `xs` as one
/// row, each element within the dtype's tolerance.
fn accuracy_rows<B: Backend, T: TestDtype>(backend: &B, xs: &[f32]) {
    let exec = backend.exec();
    let x: Vec<T> = xs.iter().map(|&v| T::from_f64(v as f64)).collect();
    let n = x.len();
    let (x_buf, ones) = (
        backend.upload(&x),
        backend.upload(&vec![T::from_f64(1.0); n]),
    );
    let xin = to_f64(&x);
    for act in ALL {
        let [mut y, mut dx] = [(); 2].map(|()| backend.upload(&vec![T::poison(); n]));
        let x_rows = dense::<B, T>(&x_buf, 1, n);
        let forward = Forward::new(act, x_rows, dense_mut::<B, T>(&mut y, 1, n));
        activation::forward(exec, forward).unwrap();
        let (ones_rows, x_rows) = (dense::<B, T>(&ones, 1, n), dense::<B, T>(&x_buf, 1, n));
        let backward = Backward::new(act, ones_rows, x_rows, dense_mut::<B, T>(&mut dx, 1, n));
        activation::backward(exec, backward).unwrap();
        let (y, dx) = (
            to_f64(&backend.download(&y)),
            to_f64(&backend.download(&dx)),
        );
        let f_ref: Vec<f64> = xin.iter().map(|&v| reference::apply(act, v)).collect();
        let g_ref: Vec<f64> = xin.iter().map(|&v| reference::grad(act, v)).collect();
        let (fa, fr) = errors(&y, &f_ref);
        let (ga, gr) = errors(&dx, &g_ref);
        println!("| {act:?} | {} | {fa:.1e} | {fr:.1e} |", T::NAME);
        println!("| {act:?}' | {} | {ga:.1e} | {gr:.1e} |", T::NAME);
        let (rel, _) = T::TOLERANCE;
        for (i, ((g, w), (gg, gw))) in y.iter().zip(&f_ref).zip(dx.iter().zip(&g_ref)).enumerate() {
            assert!(
                (g - w).abs() <= rel * w.abs() + 1e-6,
                "{act:?}({}) [{}] = {g}, reference {w}",
                xin[i],
                T::NAME
            );
            assert!(
                (gg - gw).abs() <= rel * gw.abs() + 1e-6,
                "{act:?}'({}) [{}] = {gg}, reference {gw}",
                xin[i],
                T::NAME
            );
        }
    }
}
