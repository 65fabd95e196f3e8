//! Mixed precision: bf16 activations with f32 weight and bias and f32 dweight and dbias (PyTorch's
//! CUDA path rejects it), and the dtype combinations the kernels do not implement.

use half::{bf16, f16};
use normkern::{Error, NormBackward, NormForward, Rows, rms_norm};
use normkern_tests::backend::{Backend, Device};
use normkern_tests::{Rng, TestDtype, assert_close, rms, same_bits, to_f64};

use crate::case::{Case, EPS, Kind, Outputs, emulator, reference};

/// Checks a mixed-precision run against the reference on the same inputs.
fn check<T: TestDtype>(case: &Case<T, f32>, out: &Outputs<T, f32>, what: &str) {
    let (kind, rows) = (case.kind, case.layout.rows);
    let (x, dy) = (to_f64(&case.x), to_f64(&case.dy));
    let (weight, bias) = (to_f64(&case.weight), to_f64(&case.bias));
    let (y_ref, _, _, dx_ref, dweight_ref, dbias_ref) =
        reference(kind, (&x, &dy), &weight, &bias, rows);
    let (rel, abs) = T::TOLERANCE;
    let (rel32, abs32) = f32::TOLERANCE;
    assert_close::<T>(
        &format!("{what} {kind:?}: y"),
        &to_f64(&out.y),
        &y_ref,
        rel,
        abs * rms(&y_ref),
    );
    assert_close::<T>(
        &format!("{what} {kind:?}: dx"),
        &to_f64(&out.dx),
        &dx_ref,
        rel,
        abs * rms(&dx_ref).max(rms(&dy)),
    );
    // f32 gradients: only f32 accumulation error, no final rounding to bf16.
    let slack = 1e-4 * (rows as f64).sqrt();
    assert_close::<f32>(
        &format!("{what} {kind:?}: dweight (f32)"),
        &to_f64(&out.dweight),
        &dweight_ref,
        rel32 + slack,
        (abs32 + slack) * rms(&dweight_ref),
    );
    if let Some(dbias_ref) = dbias_ref {
        assert_close::<f32>(
            &format!("{what} {kind:?}: dbias (f32)"),
            &to_f64(&out.dbias),
            &dbias_ref,
            rel32 + slack,
            (abs32 + slack) * rms(&dbias_ref),
        );
    }
}

fn mixed_precision_parameters<B: Backend>(backend: &B, shapes: &[(usize, usize)]) {
    let what = format!("{} mixed", backend.name());
    let mut rng = Rng::fresh(&what);
    for kind in [Kind::Rms, Kind::Layer { bias: true }] {
        for &(rows, d) in shapes {
            let mut case = Case::<bf16, f32>::dense(kind, &mut rng, rows, d);
            // A weight with more precision than bf16 holds.
            for w in &mut case.weight {
                *w += 1e-4;
            }
            check(&case, &case.run(backend), &what);
        }
    }
}

#[test]
fn emulator_mixed_precision_parameters() {
    mixed_precision_parameters(&emulator(), &[(19, 136), (3, 127)]);
}

#[test]
fn gpu_mixed_precision_parameters() {
    let Some(gpu) = Device::shared() else { return };
    mixed_precision_parameters(&gpu, &[(4096, 4096), (1000, 4097), (16, 65536)]);
}

/// f16 parameters next to bf16 activations, and bf16 gradients of f32 parameters: rejected,
/// nothing written.
fn unsupported_dtype_combinations_are_rejected<B: Backend>(backend: &B) {
    let exec = backend.exec();
    let (rows, d) = (2, 8);
    let x = backend.upload(&vec![bf16::ONE; rows * d]);
    let weight_f16 = backend.upload(&vec![f16::ONE; d]);
    let weight_f32 = backend.upload(&vec![1.0f32; d]);
    let mut y = backend.upload(&vec![bf16::poison(); rows * d]);
    let mut dx = backend.upload(&vec![bf16::poison(); rows * d]);
    let mut dweight_bf16 = backend.upload(&vec![bf16::poison(); d]);
    let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(
        rms_norm::workspace_len(rows, d).unwrap(),
    ));
    let x_rows = || Rows::new(B::input(&x, 0), rows, d).unwrap();
    let r = rms_norm::forward(
        exec,
        NormForward::new(
            x_rows(),
            B::input(&weight_f16, 0),
            Rows::new(B::output(&mut y, 0), rows, d).unwrap(),
        )
        .eps(EPS),
    );
    assert!(
        matches!(
            r,
            Err(Error::UnsupportedDtypes {
                what: "weight/bias",
                ..
            })
        ),
        "{r:?}"
    );
    let r = rms_norm::backward(
        exec,
        NormBackward::new(
            x_rows(),
            x_rows(),
            B::input(&weight_f32, 0),
            Rows::new(B::output(&mut dx, 0), rows, d).unwrap(),
            B::output(&mut dweight_bf16, 0),
            B::output(&mut workspace, 0),
        )
        .eps(EPS),
    );
    assert!(
        matches!(
            r,
            Err(Error::UnsupportedDtypes {
                what: "dweight/dbias",
                ..
            })
        ),
        "{r:?}"
    );
    let poison = vec![bf16::poison(); rows * d];
    assert!(
        same_bits(&backend.download(&y), &poison)
            && same_bits(&backend.download(&dx), &poison)
            && same_bits(&backend.download(&dweight_bf16), &poison[..d]),
        "a rejected call wrote output"
    );
}

#[test]
fn emulator_unsupported_dtype_combinations_are_rejected() {
    unsupported_dtype_combinations_are_rejected(&emulator());
}

#[test]
fn gpu_unsupported_dtype_combinations_are_rejected() {
    let Some(gpu) = Device::shared() else { return };
    unsupported_dtype_combinations_are_rejected(&gpu);
}
