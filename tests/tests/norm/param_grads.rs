//! The parameter-gradient strategies ([`ParamGradients`]): the single launch gives the two-pass
//! bits on every grid, down to one block; the atomic strategy and the locked-buffers baseline
//! are within tolerance of the f64 reference, and atomics add into their outputs; every call leaves the barrier's arrival count at zero
//! ([`Case::run`] checks that after every backward).

use half::bf16;
use normkern::{Context, Emulator, NormBackward, ParamGradients, Rows, rms_norm};
use normkern_tests::backend::{Backend, Device, Host};
use normkern_tests::reference::rms_norm as reference;
use normkern_tests::{Rng, assert_close, rms};

use crate::case::{Case, KINDS, Kind, Shape, emulator};

/// For every kind and shape: two-pass and single-launch bf16 runs, each checked against the
/// reference, bitwise equal to each other, and the single launch on each of `grids` too; the same
/// bitwise comparisons with f32 gradients (which keep the bits bf16 rounds away), and f32 atomics
/// checked against the reference.
fn strategies_agree<B: Backend>(
    backend: &B,
    grids: &[(usize, B)],
    (kinds, shapes): (&[Kind], &[Shape]),
    seed: &str,
) {
    let mut rng = Rng::fresh(seed);
    let mut locked_runs = 0;
    for &kind in kinds {
        for &shape in shapes {
            let mut case = Case::<bf16>::new(kind, &mut rng, shape);
            case.param_grads = ParamGradients::TwoPass;
            let two_pass = case.run(backend);
            case.check(&two_pass, "two-pass");
            case.param_grads = ParamGradients::SingleLaunch;
            let single = case.run(backend);
            case.check(&single, "single launch");
            let what = case.describe();
            assert!(
                single == two_pass,
                "{what}: single launch ≠ two-pass bitwise"
            );
            for (blocks, limited) in grids {
                let out = case.run(limited);
                assert!(
                    out == two_pass,
                    "{what}: grid of {blocks} blocks ≠ two-pass bitwise"
                );
            }
            case.param_grads = ParamGradients::Auto;
            assert!(
                case.run(backend) == two_pass,
                "{what}: Auto ≠ two-pass bitwise"
            );

            // f32 gradients keep every bit of the sums, which bf16 would round away.
            let mut f32_case = Case::<f32>::new(kind, &mut rng, shape);
            f32_case.param_grads = ParamGradients::TwoPass;
            let two_pass = f32_case.run(backend);
            f32_case.param_grads = ParamGradients::SingleLaunch;
            assert!(
                f32_case.run(backend) == two_pass,
                "{what}, f32: single launch ≠ two-pass bitwise"
            );
            for (blocks, limited) in grids {
                assert!(
                    f32_case.run(limited) == two_pass,
                    "{what}, f32: grid of {blocks} blocks ≠ two-pass bitwise"
                );
            }
            f32_case.param_grads = ParamGradients::Atomic;
            let out = f32_case.run(backend);
            f32_case.check(&out, "atomic");

            // The locked-buffers baseline, where the row kernel is one block's register tile.
            case.param_grads = ParamGradients::LockedPartials;
            match case.try_run(backend) {
                Ok(out) => {
                    case.check(&out, "locked partials");
                    locked_runs += 1;
                }
                Err(normkern::Error::Argument { what, .. }) => {
                    assert_eq!(what, "ParamGradients::LockedPartials", "{what}")
                }
                Err(e) => panic!("{what}: locked partials: {e}"),
            }
        }
    }
    assert!(locked_runs > 0, "no shape ran the locked baseline");
}

/// Small batches (groups of one row), odd and unaligned rows (one element per access), strided
/// rows with an offset, rows not a multiple of the groups, and more groups than the sums' 16
/// slices and than one round of the column sum's loads, so two-pass takes the chained sum (the
/// emulator is slow per row: few rows, many groups; 525 groups of 16 rows of 4).
const EMULATOR_SHAPES: [Shape; 7] = [
    (8400, 4, 4, 0),
    (1, 64, 64, 0),
    (8, 256, 256, 0),
    (17, 130, 133, 3),
    (40, 96, 100, 4),
    (9, 1001, 1001, 0),
    (70, 8, 8, 0),
];

#[test]
fn emulator_single_launch_matches_two_pass_and_atomics_match_the_reference() {
    let grids = [1].map(|blocks| {
        let limited = Emulator::new().with_grid_limit(blocks).unwrap();
        (blocks, Host(limited))
    });
    // LayerNorm without β is LayerNorm with β less one sum: the GPU test covers it.
    let kinds = [Kind::Rms, Kind::Layer { bias: true }];
    strategies_agree(
        &emulator(),
        &grids,
        (&kinds, &EMULATOR_SHAPES),
        "emulator strategies",
    );
}

#[test]
fn gpu_single_launch_matches_two_pass_and_atomics_match_the_reference() {
    let Some(gpu) = Device::shared() else { return };
    let contexts = [1, 7].map(|blocks| {
        let cuda = gpu.exec().context().cuda().clone();
        (
            blocks,
            Context::from_cuda(cuda)
                .unwrap()
                .with_grid_limit(blocks)
                .unwrap(),
        )
    });
    let grids: Vec<_> = contexts
        .iter()
        .map(|(blocks, ctx)| (*blocks, Device::new(ctx, gpu.stream())))
        .collect();
    // Small batches at the latency targets' widths, a register tile with many groups, a staged
    // cluster tile with small groups (f32 rows of 8192 need a cluster), wide rows over clusters,
    // unaligned ones, and narrow rows of more groups than one round of the column sum's loads
    // (two-pass takes the chained sum: 1024 groups of segment teams, 2500 of 16 rows of 300).
    let shapes = [
        (131072, 128, 128, 0),
        (40000, 300, 300, 0),
        (1, 4096, 4096, 0),
        (64, 4096, 4096, 0),
        (256, 8192, 8192, 0),
        (1000, 2048, 2048, 0),
        (16384, 4096, 4096, 0),
        (100, 8192, 8192, 0),
        (64, 65536, 65536, 0),
        (333, 4097, 4100, 1),
    ];
    strategies_agree(&gpu, &grids, (&KINDS, &shapes), "gpu strategies");
}

/// The atomic strategy adds into dweight: starting from `c`, one call leaves `c + dγ`.
#[test]
fn emulator_atomics_add_into_the_gradients() {
    let mut rng = Rng::fresh("atomics add");
    let (rows, d) = (50, 72);
    let (x, dy) = (
        rng.vec::<f32>(rows * d, -1.0, 3.0),
        rng.vec::<f32>(rows * d, -1.0, 1.0),
    );
    let weight = rng.vec::<f32>(d, 0.5, 1.5);
    let start = rng.vec::<f32>(d, -2.0, 2.0);
    let mut dx = vec![f32::NAN; rows * d];
    let mut dweight = start.clone();
    let exec = Emulator::new();
    let args = NormBackward::new(
        Rows::new(&dy[..], rows, d).unwrap(),
        Rows::new(&x[..], rows, d).unwrap(),
        &weight[..],
        Rows::new(&mut dx[..], rows, d).unwrap(),
        &mut dweight[..],
        &mut [][..],
    )
    .param_gradients(ParamGradients::Atomic);
    rms_norm::backward(&exec, args).unwrap();
    let f64s = |v: &[f32]| v.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    let (_, dweight_ref) = reference::backward(
        &f64s(&dy),
        &f64s(&x),
        &f64s(&weight),
        rows,
        d,
        normkern::DEFAULT_EPS as f64,
    );
    let expected: Vec<f64> = (start.iter().zip(&dweight_ref))
        .map(|(&s, r)| s as f64 + r)
        .collect();
    assert_close::<f32>(
        "dweight",
        &f64s(&dweight),
        &expected,
        1e-5,
        1e-5 * rms(&expected),
    );
}

/// Atomics need f32 gradients (nothing written otherwise); the deterministic strategies need
/// the workspace.
#[test]
fn strategies_check_their_arguments() {
    let (rows, d) = (4, 8);
    let (x, dy) = (vec![bf16::ONE; rows * d], vec![bf16::ONE; rows * d]);
    let weight = vec![bf16::ONE; d];
    let exec = Emulator::new();
    let mut dx = vec![bf16::from_f32(7.0); rows * d];
    let mut dweight = vec![bf16::from_f32(7.0); d];
    let mut workspace = vec![0.0f32; rms_norm::workspace_len(rows, d).unwrap()];
    for (strategy, len) in [
        (ParamGradients::Atomic, workspace.len()),
        (ParamGradients::SingleLaunch, workspace.len() - 1),
        (ParamGradients::TwoPass, workspace.len() - 1),
    ] {
        let args = NormBackward::new(
            Rows::new(&dy[..], rows, d).unwrap(),
            Rows::new(&x[..], rows, d).unwrap(),
            &weight[..],
            Rows::new(&mut dx[..], rows, d).unwrap(),
            &mut dweight[..],
            &mut workspace[..len],
        )
        .param_gradients(strategy);
        let err = rms_norm::backward(&exec, args).unwrap_err();
        let expected = match strategy {
            ParamGradients::Atomic => matches!(err, normkern::Error::UnsupportedDtypes { .. }),
            _ => matches!(err, normkern::Error::WorkspaceTooSmall { .. }),
        };
        assert!(expected, "{strategy:?}: {err}");
    }
    assert!(dx.iter().chain(&dweight).all(|v| *v == bf16::from_f32(7.0)));
}
