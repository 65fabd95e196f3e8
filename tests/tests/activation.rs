//! Activations against the f64 reference: the reference derivatives against finite differences,
//! the device functions' accuracy and special values, the kernels in the CPU emulator, and the
//! kernels on the GPU (skipped with a printed reason when there is none).

use std::sync::Arc;

use half::{bf16, f16};
use normkern::activation::{self, Activation};
use normkern::cudarc::driver::CudaStream;
use normkern::{Context, Emulator, Error, Rows};
use normkern_gpu::activation as device;
use normkern_tests::reference::activation::{self as reference, ALL};
use normkern_tests::{
    Rng, TestDtype, aligned_f32, assert_close, floats_mut, gather_rows, gpu, rms, same_bits, to_f64,
};

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

    fn rows_of<'a>(&self, v: &'a [T]) -> Rows<&'a [T]> {
        Rows::with_stride(&v[self.offset..], self.rows, self.d, self.stride).unwrap()
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

    fn expect_forward(&self, act: Activation, y: &[T]) {
        let x = self.gather(&self.x);
        self.check(&format!("{act:?} forward"), y, |i| {
            reference::apply(act, x[i])
        });
    }

    fn expect_backward(&self, act: Activation, dx: &[T]) {
        let (x, dy) = (self.gather(&self.x), self.gather(&self.dy));
        self.check(&format!("{act:?} backward"), dx, |i| {
            dy[i] * reference::grad(act, x[i])
        });
    }

    fn expect_dbias(&self, act: Activation, dbias: &[T]) {
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
            &format!("{act:?} dbias"),
            &to_f64(dbias),
            &want,
            rel * growth,
            abs * growth * (self.rows as f64).sqrt(),
        );
    }
}

fn emulated<T: TestDtype>() {
    let mut rng = Rng::fresh(&format!("activation_emulator_{}", T::NAME));
    let emu = Emulator::new();
    for (rows, d, stride, offset) in [
        (3, 7, 7, 0),
        (17, 64, 72, 0),
        (5, 33, 40, 1),
        (40, 16, 16, 0),
    ] {
        let case = Case::<T>::new(&mut rng, rows, d, stride, offset);
        for act in ALL {
            let mut y = vec![T::poison(); case.x.len()];
            emu.activation_forward(
                act,
                &case.rows_of(&case.x),
                &mut Rows::with_stride(&mut y[offset..], rows, d, stride).unwrap(),
            )
            .unwrap();
            case.expect_forward(act, &y);
            let mut dx = vec![T::poison(); case.x.len()];
            emu.activation_backward(
                act,
                &case.rows_of(&case.dy),
                &case.rows_of(&case.x),
                &mut Rows::with_stride(&mut dx[offset..], rows, d, stride).unwrap(),
            )
            .unwrap();
            case.expect_backward(act, &dx);
            // dbias, on two grids: the same bits.
            let mut results = Vec::new();
            for emu in [Emulator::new(), Emulator::new().with_grid_limit(1).unwrap()] {
                let mut dx2 = vec![T::poison(); case.x.len()];
                let mut dbias = vec![T::poison(); d];
                let ws_len = activation::workspace_len(rows, d);
                let mut ws = aligned_f32(ws_len);
                emu.activation_backward_dbias(
                    act,
                    &case.rows_of(&case.dy),
                    &case.rows_of(&case.x),
                    &mut Rows::with_stride(&mut dx2[offset..], rows, d, stride).unwrap(),
                    &mut dbias,
                    floats_mut(&mut ws, ws_len),
                )
                .unwrap();
                assert!(
                    same_bits(&dx2, &dx),
                    "{act:?}: dx of the dbias variant differs from the plain backward"
                );
                case.expect_dbias(act, &dbias);
                results.push(dbias);
            }
            assert!(
                same_bits(&results[0], &results[1]),
                "{act:?}: dbias depends on the grid"
            );
        }
    }
}

#[test]
fn emulator_matches_reference_f32() {
    emulated::<f32>();
}
#[test]
fn emulator_matches_reference_f16() {
    emulated::<f16>();
}
#[test]
fn emulator_matches_reference_bf16() {
    emulated::<bf16>();
}

fn emulated_gated<T: TestDtype>() {
    let mut rng = Rng::fresh(&format!("gated_emulator_{}", T::NAME));
    let emu = Emulator::new();
    let (rows, d) = (9, 24);
    let ab: Vec<T> = rng.vec(rows * 2 * d, -4.0, 4.0);
    let dh: Vec<T> = rng.vec(rows * d, -1.0, 1.0);
    let abv = Rows::new(&ab[..], rows, 2 * d).unwrap();
    let a = Rows::with_stride(&ab[..], rows, d, 2 * d).unwrap();
    let b = Rows::with_stride(&ab[d..], rows, d, 2 * d).unwrap();
    for act in ALL {
        let mut h = vec![T::poison(); rows * d];
        emu.gated_forward(act, &a, &b, &mut Rows::new(&mut h[..], rows, d).unwrap())
            .unwrap();
        let mut dab = vec![T::poison(); rows * 2 * d];
        emu.gated_backward_packed(
            act,
            &Rows::new(&dh[..], rows, d).unwrap(),
            &abv,
            &mut Rows::new(&mut dab[..], rows, 2 * d).unwrap(),
        )
        .unwrap();
        check_gated(
            act,
            &ab,
            &dh,
            rows,
            d,
            [
                &to_f64(&h),
                &gather_rows(&dab, rows, d, 2 * d),
                &gather_rows(&dab[d..], rows, d, 2 * d),
            ],
        );
    }
}

#[test]
fn emulator_gated_matches_reference_f32() {
    emulated_gated::<f32>();
}
#[test]
fn emulator_gated_matches_reference_f16() {
    emulated_gated::<f16>();
}
#[test]
fn emulator_gated_matches_reference_bf16() {
    emulated_gated::<bf16>();
}

#[test]
fn bad_arguments_are_rejected() {
    let emu = Emulator::new();
    let x = [1.0f32; 64];
    let mut y = [f32::NAN; 64];
    let r = emu.activation_forward(
        Activation::Silu,
        &Rows::new(&x[..], 4, 16).unwrap(),
        &mut Rows::new(&mut y[..], 4, 8).unwrap(),
    );
    assert!(matches!(r, Err(Error::Shape { what: "y", .. })), "{r:?}");
    let mut dbias = [f32::NAN; 15];
    let mut ws = [0.0f32; 1];
    let r = emu.activation_backward_dbias(
        Activation::Silu,
        &Rows::new(&x[..], 4, 16).unwrap(),
        &Rows::new(&x[..], 4, 16).unwrap(),
        &mut Rows::new(&mut y[..], 4, 16).unwrap(),
        &mut dbias,
        &mut ws,
    );
    assert!(
        matches!(r, Err(Error::Length { what: "dbias", .. })),
        "{r:?}"
    );
    let mut dbias = [f32::NAN; 16];
    let r = emu.activation_backward_dbias(
        Activation::Silu,
        &Rows::new(&x[..], 4, 16).unwrap(),
        &Rows::new(&x[..], 4, 16).unwrap(),
        &mut Rows::new(&mut y[..], 4, 16).unwrap(),
        &mut dbias,
        &mut ws,
    );
    assert!(matches!(r, Err(Error::WorkspaceTooSmall { .. })), "{r:?}");
    let mut dab = [f32::NAN; 64];
    let r = emu.gated_backward_packed(
        Activation::Silu,
        &Rows::new(&x[..], 4, 8).unwrap(),
        &Rows::new(&x[..], 4, 8).unwrap(),
        &mut Rows::new(&mut dab[..], 4, 16).unwrap(),
    );
    assert!(matches!(r, Err(Error::Shape { what: "ab", .. })), "{r:?}");
    assert!(
        y.iter().all(|v| v.is_nan())
            && dbias.iter().all(|v| v.is_nan())
            && dab.iter().all(|v| v.is_nan())
    );
}

// ---------------------------------------------------------------------------------------------
// On the GPU.

struct Dev<T> {
    x: normkern::cudarc::driver::CudaSlice<T>,
    dy: normkern::cudarc::driver::CudaSlice<T>,
}

fn upload<T: TestDtype>(stream: &Arc<CudaStream>, case: &Case<T>) -> Dev<T> {
    Dev {
        x: stream.clone_htod(&case.x).unwrap(),
        dy: stream.clone_htod(&case.dy).unwrap(),
    }
}

/// Forward, backward, in-place backward and dbias backward of one case on the GPU; returns dbias.
fn gpu_case<T: TestDtype>(
    ctx: &Context,
    stream: &Arc<CudaStream>,
    case: &Case<T>,
    act: Activation,
) -> Vec<T> {
    let (rows, d, s, o) = (case.rows, case.d, case.stride, case.offset);
    let dev = upload(stream, case);
    let poison = vec![T::poison(); case.x.len()];
    let mut y = stream.clone_htod(&poison).unwrap();
    activation::forward(
        ctx,
        stream,
        act,
        &view(&dev.x, case),
        &mut Rows::with_stride(y.slice_mut(o..), rows, d, s).unwrap(),
    )
    .unwrap();
    let mut dx = stream.clone_htod(&poison).unwrap();
    activation::backward(
        ctx,
        stream,
        act,
        &view(&dev.dy, case),
        &view(&dev.x, case),
        &mut Rows::with_stride(dx.slice_mut(o..), rows, d, s).unwrap(),
    )
    .unwrap();
    let mut in_place = stream.clone_htod(&case.dy).unwrap();
    activation::backward_in_place(
        ctx,
        stream,
        act,
        &mut Rows::with_stride(in_place.slice_mut(o..), rows, d, s).unwrap(),
        &view(&dev.x, case),
    )
    .unwrap();
    let mut dx2 = stream.clone_htod(&poison).unwrap();
    let mut dbias = stream.clone_htod(&vec![T::poison(); d]).unwrap();
    let mut ws = stream
        .alloc_zeros::<f32>(activation::workspace_len(rows, d).max(1))
        .unwrap();
    activation::backward_dbias(
        ctx,
        stream,
        act,
        &view(&dev.dy, case),
        &view(&dev.x, case),
        &mut Rows::with_stride(dx2.slice_mut(o..), rows, d, s).unwrap(),
        &mut dbias.as_view_mut(),
        &mut ws.as_view_mut(),
    )
    .unwrap();
    stream.synchronize().unwrap();
    let (y, dx, in_place, dx2, dbias) = (
        stream.clone_dtoh(&y).unwrap(),
        stream.clone_dtoh(&dx).unwrap(),
        stream.clone_dtoh(&in_place).unwrap(),
        stream.clone_dtoh(&dx2).unwrap(),
        stream.clone_dtoh(&dbias).unwrap(),
    );
    case.expect_forward(act, &y);
    case.expect_backward(act, &dx);
    let inside = |i: usize| i >= o && (i - o) % s < d && (i - o) / s < rows;
    for i in 0..case.x.len() {
        if inside(i) {
            assert_eq!(
                in_place[i].bits(),
                dx[i].bits(),
                "{act:?}: in-place backward differs at {i}"
            );
        } else {
            assert_eq!(
                y[i].bits(),
                T::poison().bits(),
                "{act:?}: y written outside the rows at {i}"
            );
        }
    }
    assert!(
        same_bits(&dx2, &dx),
        "{act:?}: dx of the dbias variant differs"
    );
    case.expect_dbias(act, &dbias);
    dbias
}

fn gpu_shapes<T: TestDtype>() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh(&format!("activation_gpu_{}", T::NAME));
    for (rows, d, stride, offset) in [
        (4096, 4096, 4096, 0),
        (1000, 1000, 1000, 0),
        (333, 4100, 4104, 1),
        (64, 7, 9, 0),
        (1, 65536, 65536, 0),
    ] {
        let case = Case::<T>::new(&mut rng, rows, d, stride, offset);
        for act in ALL {
            gpu_case(ctx, stream, &case, act);
        }
    }
}

#[test]
fn gpu_matches_reference_f32() {
    gpu_shapes::<f32>();
}
#[test]
fn gpu_matches_reference_f16() {
    gpu_shapes::<f16>();
}
#[test]
fn gpu_matches_reference_bf16() {
    gpu_shapes::<bf16>();
}

#[test]
fn gpu_dbias_is_bitwise_repeatable_and_grid_invariant() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh("activation_gpu_determinism");
    let small = Context::from_cuda(ctx.cuda().clone())
        .unwrap()
        .with_grid_limit(5)
        .unwrap();
    let case = Case::<bf16>::new(&mut rng, 16384, 1024, 1024, 0);
    let first = gpu_case(ctx, stream, &case, Activation::GeluTanh);
    for run in 1..3 {
        assert!(
            same_bits(&gpu_case(ctx, stream, &case, Activation::GeluTanh), &first),
            "dbias run {run} differs"
        );
    }
    assert!(
        same_bits(
            &gpu_case(&small, stream, &case, Activation::GeluTanh),
            &first
        ),
        "dbias depends on the grid"
    );
}

#[test]
fn gpu_gated_packed_and_separate_agree_with_reference() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh("gated_gpu");
    let (rows, d) = (2048, 2816);
    let ab: Vec<bf16> = rng.vec(rows * 2 * d, -4.0, 4.0);
    let dh: Vec<bf16> = rng.vec(rows * d, -1.0, 1.0);
    let (abd, dhd) = (
        stream.clone_htod(&ab).unwrap(),
        stream.clone_htod(&dh).unwrap(),
    );
    for act in ALL {
        let mut h = stream.clone_htod(&vec![bf16::poison(); rows * d]).unwrap();
        let mut h2 = stream.clone_htod(&vec![bf16::poison(); rows * d]).unwrap();
        let a = Rows::with_stride(abd.slice(..), rows, d, 2 * d).unwrap();
        let b = Rows::with_stride(abd.slice(d..), rows, d, 2 * d).unwrap();
        activation::gated_forward(
            ctx,
            stream,
            act,
            &a,
            &b,
            &mut Rows::new(h.as_view_mut(), rows, d).unwrap(),
        )
        .unwrap();
        let abv = Rows::new(abd.as_view(), rows, 2 * d).unwrap();
        activation::gated_forward_packed(
            ctx,
            stream,
            act,
            &abv,
            &mut Rows::new(h2.as_view_mut(), rows, d).unwrap(),
        )
        .unwrap();
        let mut dab = stream
            .clone_htod(&vec![bf16::poison(); rows * 2 * d])
            .unwrap();
        let dhv = Rows::new(dhd.as_view(), rows, d).unwrap();
        activation::gated_backward_packed(
            ctx,
            stream,
            act,
            &dhv,
            &abv,
            &mut Rows::new(dab.as_view_mut(), rows, 2 * d).unwrap(),
        )
        .unwrap();
        let mut da = stream.clone_htod(&vec![bf16::poison(); rows * d]).unwrap();
        let mut db = stream.clone_htod(&vec![bf16::poison(); rows * d]).unwrap();
        activation::gated_backward(
            ctx,
            stream,
            act,
            &dhv,
            &a,
            &b,
            &mut Rows::new(da.as_view_mut(), rows, d).unwrap(),
            &mut Rows::new(db.as_view_mut(), rows, d).unwrap(),
        )
        .unwrap();
        stream.synchronize().unwrap();
        let (h, h2, dab, da, db) = (
            stream.clone_dtoh(&h).unwrap(),
            stream.clone_dtoh(&h2).unwrap(),
            stream.clone_dtoh(&dab).unwrap(),
            stream.clone_dtoh(&da).unwrap(),
            stream.clone_dtoh(&db).unwrap(),
        );
        assert!(
            same_bits(&h, &h2),
            "{act:?}: packed and separate forward differ"
        );
        assert!(
            same_bits(&gather_bits(&dab, rows, d, 2 * d, 0), &da)
                && same_bits(&gather_bits(&dab, rows, d, 2 * d, d), &db),
            "{act:?}: packed and separate backward differ"
        );
        check_gated(
            act,
            &ab,
            &dh,
            rows,
            d,
            [&to_f64(&h), &to_f64(&da), &to_f64(&db)],
        );
    }
}

/// Checks `[h, da, db]` of a gated op on packed `ab` (`rows × 2d`) and `dh` against the reference.
fn check_gated<T: TestDtype>(
    act: Activation,
    ab: &[T],
    dh: &[T],
    rows: usize,
    d: usize,
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
            &format!("{act:?} gated {name} [{}]", T::NAME),
            got,
            want,
            rel,
            abs * rms(want),
        );
    }
}

fn view<'a, T: TestDtype>(
    v: &'a normkern::cudarc::driver::CudaSlice<T>,
    c: &Case<T>,
) -> Rows<normkern::cudarc::driver::CudaView<'a, T>> {
    Rows::with_stride(v.slice(c.offset..), c.rows, c.d, c.stride).unwrap()
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

/// The accuracy table of the docs: every function and derivative run by the GPU kernels over the
/// dense sweep, per storage dtype, against f64 of the same (dtype-rounded) inputs.
#[test]
fn gpu_accuracy_table() {
    let Some((ctx, stream)) = gpu() else { return };
    let xs = sweep();
    println!("| function | dtype | max abs error | max rel error (|result| ≥ 1e-30) |");
    println!("|---|---|---:|---:|");
    fn table<T: TestDtype>(ctx: &Context, stream: &Arc<CudaStream>, xs: &[f32]) {
        let x: Vec<T> = xs.iter().map(|&v| T::from_f64(v as f64)).collect();
        let ones = vec![T::from_f64(1.0); x.len()];
        let n = x.len();
        let (xd, onesd) = (
            stream.clone_htod(&x).unwrap(),
            stream.clone_htod(&ones).unwrap(),
        );
        for act in ALL {
            let mut y = stream.clone_htod(&vec![T::poison(); n]).unwrap();
            let mut dx = stream.clone_htod(&vec![T::poison(); n]).unwrap();
            activation::forward(
                ctx,
                stream,
                act,
                &Rows::new(xd.as_view(), 1, n).unwrap(),
                &mut Rows::new(y.as_view_mut(), 1, n).unwrap(),
            )
            .unwrap();
            activation::backward(
                ctx,
                stream,
                act,
                &Rows::new(onesd.as_view(), 1, n).unwrap(),
                &Rows::new(xd.as_view(), 1, n).unwrap(),
                &mut Rows::new(dx.as_view_mut(), 1, n).unwrap(),
            )
            .unwrap();
            let (y, dx) = (
                stream.clone_dtoh(&y).unwrap(),
                stream.clone_dtoh(&dx).unwrap(),
            );
            let xin = to_f64(&x);
            let f_ref: Vec<f64> = xin.iter().map(|&v| reference::apply(act, v)).collect();
            let g_ref: Vec<f64> = xin.iter().map(|&v| reference::grad(act, v)).collect();
            let (fa, fr) = errors(&to_f64(&y), &f_ref);
            let (ga, gr) = errors(&to_f64(&dx), &g_ref);
            println!("| {act:?} | {} | {fa:.1e} | {fr:.1e} |", T::NAME);
            println!("| {act:?}' | {} | {ga:.1e} | {gr:.1e} |", T::NAME);
            let (rel, _) = T::TOLERANCE;
            for (i, ((g, w), (gg, gw))) in to_f64(&y)
                .iter()
                .zip(&f_ref)
                .zip(to_f64(&dx).iter().zip(&g_ref))
                .enumerate()
            {
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
    table::<f32>(ctx, stream, &xs);
    table::<f16>(ctx, stream, &xs);
    table::<bf16>(ctx, stream, &xs);
}
