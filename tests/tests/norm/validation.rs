//! Validation: bad views and arguments are rejected before anything is written (on either
//! executor, which share it), and a machine without a GPU is an error, not a panic.

use half::bf16;
use normkern::cudarc::driver::CudaContext;
use normkern::{Context, Emulator, Error, NormBackward, NormForward, Rows, layer_norm, rms_norm};
use normkern_tests::Rng;
use normkern_tests::backend::{Backend, Device};

use crate::case::{Case, EPS, Kind, emulator};

#[test]
fn bad_views_are_rejected() {
    let buf = [bf16::ONE; 100];
    assert!(matches!(
        Rows::new(&buf[..], 10, 0),
        Err(Error::EmptyRow { .. })
    ));
    assert!(matches!(
        Rows::with_stride(&buf[..], 10, 10, 9),
        Err(Error::StrideTooSmall {
            stride: 9,
            d: 10,
            ..
        })
    ));
    assert!(matches!(
        Rows::new(&buf[..], 11, 10),
        Err(Error::Length {
            expected: 110,
            actual: 100,
            ..
        })
    ));
    assert!(matches!(
        Rows::with_stride(&buf[..], 10, 8, 11),
        Err(Error::Length { expected: 107, .. })
    ));
    assert!(
        Rows::with_stride(&buf[..], 10, 1, 11).is_ok(),
        "the last row needs only d elements"
    );
    assert!(
        Rows::new(&buf[..], 0, 10).is_ok(),
        "zero rows is a valid, empty view"
    );
    assert!(matches!(
        Emulator::new().with_grid_limit(0),
        Err(Error::ZeroGrid)
    ));
}

fn all_nan(v: &[f32]) -> bool {
    v.iter().all(|v| v.is_nan())
}

/// A workspace as `poisoned_workspace` made it: zero barrier words, NaN past them.
fn untouched_workspace(v: &[f32]) -> bool {
    normkern_tests::same_bits(v, &normkern_tests::poisoned_workspace(v.len()))
}

/// Panics unless a rejected call left its outputs NaN and its workspace, if any, as poisoned.
fn assert_wrote_nothing<B: Backend>(
    backend: &B,
    outputs: &[&B::Buf<f32>],
    workspace: Option<&B::Buf<f32>>,
) {
    assert!(
        outputs.iter().all(|o| all_nan(&backend.download(*o)))
            && workspace.is_none_or(|w| untouched_workspace(&backend.download(w))),
        "a rejected call wrote output"
    );
}

/// RMSNorm's eps, weight offset, and every length and shape, forward and backward.
fn rms_norm_bad_arguments_are_rejected<B: Backend>(backend: &B) {
    let exec = backend.exec();
    let (rows, d) = (4, 16);
    let mut rng = Rng::fresh(&format!("{}_rms_norm_bad_arguments", backend.name()));
    let case = Case::<f32>::dense(Kind::Rms, &mut rng, rows, d);
    let (x, dy) = (backend.upload(&case.x), backend.upload(&case.dy));
    let weight = backend.upload(&case.weight);
    let mut y = backend.upload(&vec![f32::NAN; rows * d]);
    let mut rstd = backend.upload(&vec![f32::NAN; rows]);

    // Arguments that are valid but for the weight from element `weight_from` on, y of `y_rows`
    // rows, rstd from element `rstd_from` on (if given), and eps and the weight offset.
    let mut forward = |weight_from: usize,
                       y_rows: usize,
                       rstd_from: Option<usize>,
                       (eps, weight_offset): (f32, f32)| {
        let mut args = NormForward::new(
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            B::input(&weight, weight_from),
            Rows::new(B::output(&mut y, 0), y_rows, d).unwrap(),
        )
        .eps(eps)
        .weight_offset(weight_offset);
        args.rstd = rstd_from.map(|from| B::output(&mut rstd, from));
        rms_norm::forward(exec, args)
    };
    for eps in [0.0, -1e-5, f32::NAN, f32::INFINITY] {
        let r = forward(0, rows, None, (eps, 0.0));
        assert!(matches!(r, Err(Error::Eps(_))), "eps {eps}: {r:?}");
    }
    let r = forward(0, rows, None, (EPS, f32::NAN));
    assert!(matches!(r, Err(Error::WeightOffset(_))), "{r:?}");
    let r = forward(1, rows, None, (EPS, 0.0));
    assert!(
        matches!(r, Err(Error::Length { what: "weight", .. })),
        "{r:?}"
    );
    let r = forward(0, rows - 1, None, (EPS, 0.0));
    assert!(matches!(r, Err(Error::Shape { what: "y", .. })), "{r:?}");
    let r = forward(0, rows, Some(1), (EPS, 0.0));
    assert!(
        matches!(r, Err(Error::Length { what: "rstd", .. })),
        "{r:?}"
    );
    assert_wrote_nothing(backend, &[&y, &rstd], None);

    let rstd = backend.upload(&vec![0.5f32; rows]);
    let workspace_len = rms_norm::workspace_len(rows, d).unwrap();
    let mut dx = backend.upload(&vec![f32::NAN; rows * d]);
    let mut dweight = backend.upload(&vec![f32::NAN; d]);
    let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));
    // Valid arguments but for dy of `dy_rows` rows and the weight, rstd, dweight and workspace
    // from the given elements on.
    let mut backward =
        |dy_rows: usize, [weight_from, rstd_from, dweight_from, workspace_from]: [usize; 4]| {
            rms_norm::backward(
                exec,
                NormBackward::new(
                    Rows::new(B::input(&dy, 0), dy_rows, d).unwrap(),
                    Rows::new(B::input(&x, 0), rows, d).unwrap(),
                    B::input(&weight, weight_from),
                    Rows::new(B::output(&mut dx, 0), rows, d).unwrap(),
                    B::output(&mut dweight, dweight_from),
                    B::output(&mut workspace, workspace_from),
                )
                .eps(EPS)
                .rstd(B::input(&rstd, rstd_from)),
            )
        };
    let r = backward(rows - 1, [0; 4]);
    assert!(matches!(r, Err(Error::Shape { what: "dy", .. })), "{r:?}");
    let r = backward(rows, [1, 0, 0, 0]);
    assert!(
        matches!(r, Err(Error::Length { what: "weight", .. })),
        "{r:?}"
    );
    let r = backward(rows, [0, 1, 0, 0]);
    assert!(
        matches!(r, Err(Error::Length { what: "rstd", .. })),
        "{r:?}"
    );
    let r = backward(rows, [0, 0, 1, 0]);
    assert!(
        matches!(
            r,
            Err(Error::Length {
                what: "dweight",
                ..
            })
        ),
        "{r:?}"
    );
    let r = backward(rows, [0, 0, 0, 1]);
    assert!(matches!(r, Err(Error::WorkspaceTooSmall { .. })), "{r:?}");
    assert_wrote_nothing(backend, &[&dx, &dweight], Some(&workspace));
}

#[test]
fn emulator_rms_norm_bad_arguments_are_rejected_before_anything_is_written() {
    rms_norm_bad_arguments_are_rejected(&emulator());
}

#[test]
fn gpu_rms_norm_bad_arguments_are_rejected_before_anything_is_written() {
    let Some(gpu) = Device::shared() else { return };
    rms_norm_bad_arguments_are_rejected(&gpu);
}

/// LayerNorm's bias, mean and dbias lengths, eps and workspace.
fn layer_norm_bad_arguments_are_rejected<B: Backend>(backend: &B) {
    let exec = backend.exec();
    let (rows, d) = (4, 16);
    let x = backend.upload(&vec![1.5f32; rows * d]);
    let weight = backend.upload(&vec![1.0f32; d]);
    let mut y = backend.upload(&vec![f32::NAN; rows * d]);
    let mut mean = backend.upload(&vec![f32::NAN; rows]);
    let mut rstd = backend.upload(&vec![f32::NAN; rows]);
    let mut forward = |bias_from: Option<usize>, mean_from: usize, eps: f32| {
        let mut args = NormForward::new(
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            B::input(&weight, 0),
            Rows::new(B::output(&mut y, 0), rows, d).unwrap(),
        )
        .eps(eps)
        .mean(B::output(&mut mean, mean_from))
        .rstd(B::output(&mut rstd, 0));
        args.bias = bias_from.map(|from| B::input(&weight, from));
        layer_norm::forward(exec, args)
    };
    let r = forward(Some(1), 0, EPS);
    assert!(
        matches!(r, Err(Error::Length { what: "bias", .. })),
        "{r:?}"
    );
    let r = forward(None, 1, EPS);
    assert!(
        matches!(r, Err(Error::Length { what: "mean", .. })),
        "{r:?}"
    );
    let r = forward(None, 0, -1.0);
    assert!(matches!(r, Err(Error::Eps(_))), "{r:?}");
    assert_wrote_nothing(backend, &[&y, &mean, &rstd], None);

    let stats = backend.upload(&vec![0.5f32; rows]);
    let workspace_len = layer_norm::workspace_len(rows, d).unwrap();
    let mut dx = backend.upload(&vec![f32::NAN; rows * d]);
    let mut dweight = backend.upload(&vec![f32::NAN; d]);
    let mut dbias = backend.upload(&vec![f32::NAN; d]);
    let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));
    // Valid arguments (x as dy too) but for dbias (if given), the mean and the workspace from the
    // given elements on.
    let mut backward = |dbias_from: Option<usize>, mean_from: usize, workspace_from: usize| {
        let mut args = NormBackward::new(
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            B::input(&weight, 0),
            Rows::new(B::output(&mut dx, 0), rows, d).unwrap(),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, workspace_from),
        )
        .eps(EPS)
        .mean_rstd(B::input(&stats, mean_from), B::input(&stats, 0));
        args.dbias = dbias_from.map(|from| B::output(&mut dbias, from));
        layer_norm::backward(exec, args)
    };
    let r = backward(Some(1), 0, 0);
    assert!(
        matches!(r, Err(Error::Length { what: "dbias", .. })),
        "{r:?}"
    );
    let r = backward(None, 1, 0);
    assert!(
        matches!(r, Err(Error::Length { what: "mean", .. })),
        "{r:?}"
    );
    let r = backward(None, 0, 1);
    assert!(matches!(r, Err(Error::WorkspaceTooSmall { .. })), "{r:?}");
    assert_wrote_nothing(backend, &[&dx, &dweight, &dbias], Some(&workspace));
}

#[test]
fn emulator_layer_norm_bad_arguments_are_rejected_before_anything_is_written() {
    layer_norm_bad_arguments_are_rejected(&emulator());
}

#[test]
fn gpu_layer_norm_bad_arguments_are_rejected_before_anything_is_written() {
    let Some(gpu) = Device::shared() else { return };
    layer_norm_bad_arguments_are_rejected(&gpu);
}

/// What only LayerNorm has (bias, mean, dbias), given to RMSNorm: an argument error, nothing
/// written.
fn rms_norm_rejects_what_only_layer_norm_takes<B: Backend>(backend: &B) {
    let exec = backend.exec();
    let (rows, d) = (4, 16);
    let x = backend.upload(&vec![1.5f32; rows * d]);
    let weight = backend.upload(&vec![1.0f32; d]);
    let stats = backend.upload(&vec![0.5f32; rows]);
    let mut y = backend.upload(&vec![f32::NAN; rows * d]);
    let mut mean = backend.upload(&vec![f32::NAN; rows]);
    let mut rstd = backend.upload(&vec![f32::NAN; rows]);
    let mut forward = |bias: bool| {
        let args = NormForward::new(
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            B::input(&weight, 0),
            Rows::new(B::output(&mut y, 0), rows, d).unwrap(),
        )
        .rstd(B::output(&mut rstd, 0));
        let args = if bias {
            args.bias(B::input(&weight, 0))
        } else {
            args.mean(B::output(&mut mean, 0))
        };
        rms_norm::forward(exec, args)
    };
    let r = forward(true);
    assert!(
        matches!(r, Err(Error::Argument { what: "bias", .. })),
        "{r:?}"
    );
    let r = forward(false);
    assert!(
        matches!(r, Err(Error::Argument { what: "mean", .. })),
        "{r:?}"
    );
    assert_wrote_nothing(backend, &[&y, &mean, &rstd], None);

    let workspace_len = layer_norm::workspace_len(rows, d).unwrap();
    let mut dx = backend.upload(&vec![f32::NAN; rows * d]);
    let mut dweight = backend.upload(&vec![f32::NAN; d]);
    let mut dbias = backend.upload(&vec![f32::NAN; d]);
    let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));
    let mut backward = |dbias_given: bool| {
        let args = NormBackward::new(
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            B::input(&weight, 0),
            Rows::new(B::output(&mut dx, 0), rows, d).unwrap(),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        );
        let args = if dbias_given {
            args.rstd(B::input(&stats, 0))
                .dbias(B::output(&mut dbias, 0))
        } else {
            args.mean_rstd(B::input(&stats, 0), B::input(&stats, 0))
        };
        rms_norm::backward(exec, args)
    };
    let r = backward(true);
    assert!(
        matches!(r, Err(Error::Argument { what: "dbias", .. })),
        "{r:?}"
    );
    let r = backward(false);
    assert!(
        matches!(r, Err(Error::Argument { what: "mean", .. })),
        "{r:?}"
    );
    assert_wrote_nothing(backend, &[&dx, &dweight, &dbias], Some(&workspace));
}

#[test]
fn emulator_rms_norm_rejects_what_only_layer_norm_takes() {
    rms_norm_rejects_what_only_layer_norm_takes(&emulator());
}

#[test]
fn gpu_rms_norm_rejects_what_only_layer_norm_takes() {
    let Some(gpu) = Device::shared() else { return };
    rms_norm_rejects_what_only_layer_norm_takes(&gpu);
}

/// A LayerNorm backward given the saved mean without the rstd, or the rstd without the mean: an
/// argument error (not a silent recompute), nothing written.
fn layer_norm_backward_takes_both_statistics_or_neither<B: Backend>(backend: &B) {
    let exec = backend.exec();
    let (rows, d) = (4, 16);
    let x = backend.upload(&vec![1.5f32; rows * d]);
    let weight = backend.upload(&vec![1.0f32; d]);
    let stats = backend.upload(&vec![0.5f32; rows]);
    let workspace_len = layer_norm::workspace_len(rows, d).unwrap();
    let mut dx = backend.upload(&vec![f32::NAN; rows * d]);
    let mut dweight = backend.upload(&vec![f32::NAN; d]);
    let mut dbias = backend.upload(&vec![f32::NAN; d]);
    let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));
    for mean_given in [true, false] {
        let mut args = NormBackward::new(
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            Rows::new(B::input(&x, 0), rows, d).unwrap(),
            B::input(&weight, 0),
            Rows::new(B::output(&mut dx, 0), rows, d).unwrap(),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        )
        .dbias(B::output(&mut dbias, 0));
        if mean_given {
            args.mean = Some(B::input(&stats, 0));
        } else {
            args.rstd = Some(B::input(&stats, 0));
        }
        let r = layer_norm::backward(exec, args);
        assert!(
            matches!(
                r,
                Err(Error::Argument {
                    what: "mean/rstd",
                    ..
                })
            ),
            "mean given: {mean_given}: {r:?}"
        );
    }
    assert_wrote_nothing(backend, &[&dx, &dweight, &dbias], Some(&workspace));
}

#[test]
fn emulator_layer_norm_backward_takes_both_statistics_or_neither() {
    layer_norm_backward_takes_both_statistics_or_neither(&emulator());
}

#[test]
fn gpu_layer_norm_backward_takes_both_statistics_or_neither() {
    let Some(gpu) = Device::shared() else { return };
    layer_norm_backward_takes_both_statistics_or_neither(&gpu);
}

#[test]
fn no_driver_or_device_is_an_error_not_a_panic() {
    match Context::new(0) {
        Ok(ctx) => {
            eprintln!("a GPU is present ({ctx:?}); trying a device ordinal that cannot exist")
        }
        Err(e) => {
            eprintln!("no GPU here: {e}");
            assert!(
                matches!(e, Error::NoDriver | Error::NoDevice { .. }),
                "{e:?}"
            );
            return;
        }
    }
    assert!(matches!(
        Context::new(4096),
        Err(Error::NoDevice { ordinal: 4096, .. })
    ));
}

#[test]
fn gpu_rejects_buffers_of_another_context() {
    let Some(gpu) = Device::shared() else { return };
    // A second, non-primary context on the same device: its buffers are not ours.
    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let (rows, d) = (2, 8);
    let x = other.default_stream().alloc_zeros::<f32>(rows * d).unwrap();
    let weight = gpu.upload(&vec![0.0f32; d]);
    let mut y = gpu.upload(&vec![f32::NAN; rows * d]);
    let r = rms_norm::forward(
        gpu.exec(),
        NormForward::new(
            Rows::new(x.as_view(), rows, d).unwrap(),
            weight.as_view(),
            Rows::new(y.as_view_mut(), rows, d).unwrap(),
        )
        .eps(EPS),
    );
    assert!(matches!(r, Err(Error::WrongContext { what: "x" })), "{r:?}");
    assert!(all_nan(&gpu.download(&y)));
}
