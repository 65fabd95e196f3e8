//! Bitwise reproducibility: the same bits on every run and on every grid (dweight and dbias go
//! through fixed groups of rows whose layout depends on the shape only), and no rows writing
//! nothing but zero parameter gradients.

use half::{bf16, f16};
use normkern::{Context, KernelImage, layer_norm, rms_norm};
use normkern_tests::backend::{Backend, Device};
use normkern_tests::{Rng, TestDtype, same_bits};

use crate::case::{Case, KINDS, Kind, emulator};

/// Runs `case` on `backend` and checks it against the reference; then `repeats` more runs, and
/// one on each of `grids` (the same executor with persistent grids capped at that many blocks),
/// must give the same bits, padding included.
pub fn check_bitwise_stable<T: TestDtype, B: Backend>(
    case: &Case<T>,
    backend: &B,
    repeats: usize,
    grids: &[(usize, B)],
    what: &str,
) {
    let first = case.run(backend);
    case.check(&first, what);
    let what = format!("{what} {}", case.describe());
    assert_same_bits_again(&first, |b| case.run(b), backend, repeats, &[], &what);
    for (blocks, limited) in grids {
        let out = case.run(limited);
        assert!(
            same_bits(&out.dweight, &first.dweight),
            "{what}: dweight changed on a grid of {blocks} blocks"
        );
        assert!(
            out == first,
            "{what}: outputs changed on a grid of {blocks} blocks"
        );
    }
}

/// `repeats` more runs of `run` on `backend`, and one on each of `grids`, give `first`'s bits
/// (outputs compare bitwise, padding included).
pub fn assert_same_bits_again<O: PartialEq, B: Backend>(
    first: &O,
    run: impl Fn(&B) -> O,
    backend: &B,
    repeats: usize,
    grids: &[(usize, B)],
    what: &str,
) {
    for repeat in 1..=repeats {
        assert!(
            run(backend) == *first,
            "{what}: run {repeat} differs bitwise from run 0"
        );
    }
    for (blocks, limited) in grids {
        assert!(
            run(limited) == *first,
            "{what}: outputs changed on a grid of {blocks} blocks"
        );
    }
}

/// Contexts on `gpu`'s device whose persistent grids are capped at 3 and 7 blocks.
pub fn capped_grid_contexts(gpu: &Device) -> [(usize, Context); 2] {
    [3, 7].map(|blocks| {
        let cuda = gpu.exec().context().cuda().clone();
        let ctx = Context::from_cuda(cuda).unwrap();
        (blocks, ctx.with_grid_limit(blocks).unwrap())
    })
}

/// `gpu`'s stream on each of `contexts` ([`capped_grid_contexts`]), with its grid cap.
pub fn on_capped_grids<'a>(
    gpu: &Device<'a>,
    contexts: &'a [(usize, Context)],
) -> Vec<(usize, Device<'a>)> {
    contexts
        .iter()
        .map(|(blocks, ctx)| (*blocks, Device::new(ctx, gpu.stream())))
        .collect()
}

#[test]
fn gpu_backward_is_bitwise_repeatable_and_grid_invariant() {
    let Some(gpu) = Device::shared() else { return };
    let contexts = capped_grid_contexts(&gpu);
    let grids = on_capped_grids(&gpu, &contexts);
    let mut rng = Rng::fresh("gpu_determinism");
    for kind in KINDS {
        // Block tiles, single-element access, clusters, and segment teams (a block per group
        // of 1024 rows of 128, of 100 by single-element access, of 512); rows of 1024 and 2048
        // take RMSNorm's staged block tile (a ring of rows filled by the copy engine); 140 rows of
        // 40000 the forward's clusters (and LayerNorm's at 32768); the plain backward's blocks of
        // 512 threads (rows of 8192, and RMSNorm's clusters of 8 at 32768).
        let shapes = [
            (20000, 1024),
            (7000, 2048),
            (16384, 4096),
            (3000, 8192),
            (500, 32768),
            (1000, 4097),
            (64, 65536),
            (140, 40000),
            (1 << 20, 128),
            (50000, 100),
            (30000, 512),
        ];
        for (rows, d) in shapes {
            let case = Case::<bf16>::dense(kind, &mut rng, rows, d);
            check_bitwise_stable(&case, &gpu, 2, &grids, "gpu determinism");
        }
        // f32 rows of 65536: RMSNorm's 2-access tile over clusters of 8, LayerNorm's over 16
        // (where the GPU keeps such a cluster resident; else streamed over 8).
        let case = Case::<f32>::dense(kind, &mut rng, 64, 65536);
        check_bitwise_stable(&case, &gpu, 2, &grids, "gpu determinism");
    }
}

/// The kernels load as machine code on the architectures normkern builds cubins for (sm_80 and
/// sm_90 families), so a cold start does not wait for the driver's JIT; the PTX the driver
/// compiles instead (newer GPUs, older drivers) gives the same bits here. Same bits needs the
/// driver's JIT to be the ptxas that made the cubins (CUDA 13.0 on the H200 host); a driver of
/// another version may schedule the math differently, and then only the reference check holds.
#[test]
fn gpu_cubin_and_ptx_give_the_same_bits() {
    let Some(gpu) = Device::shared() else { return };
    let cubin = gpu.exec().context();
    let (major, _) = cubin.cuda().compute_capability().unwrap();
    if major == 8 || major == 9 {
        assert_eq!(cubin.kernel_image(), KernelImage::Cubin, "{cubin:?}");
    }
    let ptx = Context::from_cuda_with_image(cubin.cuda().clone(), KernelImage::Ptx).unwrap();
    assert_eq!(ptx.kernel_image(), KernelImage::Ptx);
    let from_ptx = Device::new(&ptx, gpu.stream());
    let mut rng = Rng::fresh("gpu_cubin_ptx");
    for kind in KINDS {
        for (rows, d) in [(4096, 4096), (1000, 4097), (64, 65536), (300, 100)] {
            let case = Case::<bf16>::dense(kind, &mut rng, rows, d);
            let out = case.run(&gpu);
            case.check(&out, "gpu cubin");
            let again = case.run(&from_ptx);
            case.check(&again, "gpu ptx");
            assert!(
                out == again,
                "{kind:?} {rows}×{d}: the PTX build differs bitwise from the cubin"
            );
        }
    }
}

/// The forward and backward over no rows write no y and no dx (x's buffer holds one row's worth,
/// all outside the zero rows), and set dweight (and dbias) to zero, given a workspace of exactly
/// `workspace_len(0, d)` elements: only the single launch's barrier words.
fn zero_rows_write_nothing_and_zero_parameter_gradients<B: Backend>(backend: &B) {
    let mut rng = Rng::fresh(&format!("{}_zero_rows", backend.name()));
    for kind in [Kind::Rms, Kind::Layer { bias: true }] {
        let case = Case::<f16>::new(kind, &mut rng, (0, 64, 64, 0));
        let out = case.run(backend);
        case.check(&out, &format!("{} zero rows", backend.name()));
        let mut gradients = out.dweight.clone();
        if kind != Kind::Rms {
            gradients.extend(&out.dbias);
        }
        assert!(
            gradients.iter().all(|v| *v == f16::ZERO),
            "{kind:?}: {gradients:?}"
        );
    }
}

#[test]
fn emulator_zero_rows_write_nothing_and_zero_parameter_gradients() {
    zero_rows_write_nothing_and_zero_parameter_gradients(&emulator());
}

#[test]
fn gpu_zero_rows_write_nothing_and_zero_parameter_gradients() {
    let Some(gpu) = Device::shared() else { return };
    zero_rows_write_nothing_and_zero_parameter_gradients(&gpu);
}

/// A small batch stages its rows through a ring instance (every dγ group a resident block: at
/// most 4 in the emulator), a larger one prefetches them in registers (rows of 512 in 16-bit
/// elements, blocks of two warps; wider blocks stage either way on sm_90); both run the same
/// arithmetic on a row, so which instance a GPU picks by its size changes no bits. Five rows are
/// five groups of one row, the block instance; their first four alone are four groups, the ring
/// instance. The fifth row's dy is zero, so it adds exactly nothing to the f32 dγ and dβ (the
/// mixed-precision parameters, where bf16's rounding cannot hide a one-ulp difference): the
/// gradients must match bit for bit too.
#[test]
fn emulator_ring_and_register_tiles_give_the_same_bits() {
    let mut rng = Rng::fresh("emulator_ring_and_register_tiles");
    let d = 512;
    for kind in KINDS {
        let mut five = Case::<bf16, f32>::dense(kind, &mut rng, 5, d);
        five.dy[4 * d..].fill(bf16::ZERO);
        let mut four = Case::<bf16, f32>::dense(kind, &mut rng, 4, d);
        four.x = five.x[..4 * d].to_vec();
        four.dy = five.dy[..4 * d].to_vec();
        (four.weight, four.bias) = (five.weight.clone(), five.bias.clone());
        let (five, four) = (five.run(&emulator()), four.run(&emulator()));
        assert!(same_bits(&five.dx[..4 * d], &four.dx), "{kind:?}: dx");
        assert!(same_bits(&five.dweight, &four.dweight), "{kind:?}: dweight");
        assert!(same_bits(&five.dbias, &four.dbias), "{kind:?}: dbias");
        assert!(four.dweight.iter().all(|v| v.is_finite() && *v != 0.0));
    }
}

#[test]
fn workspace_and_groups_depend_on_the_shape_only() {
    // Rows split over clusters of 8 (wider than 32768) walk fewer, better balanced groups.
    let busiest_of_15 = |(per_group, groups): (usize, usize)| groups.div_ceil(15) * per_group;
    for rows in [1, 15, 16, 17, 64, 1000, 1024, 16384, 1 << 20] {
        for d in [3, 32768, 32769, 1 << 20] {
            let (per_group, groups) = normkern::group_layout(rows, d);
            assert!(
                per_group * groups >= rows && per_group * (groups - 1) < rows,
                "rows {rows}, d {d}"
            );
            // Rows of at most 256 may take up to 1024 groups, of at most 512 up to 2²¹ / d.
            let most = match d {
                ..=256 => 1024,
                257..=512 => (1 << 21) / d,
                _ => 512,
            };
            assert!(groups <= most, "rows {rows}, d {d}: {groups} groups");
            // The single launch's barrier words, then the partial rows.
            let sync = normkern_gpu::column_sum::GROUP_SUMS_SYNC_WORDS;
            assert_eq!(rms_norm::workspace_len(rows, d), Ok(sync + groups * d));
            assert_eq!(
                layer_norm::workspace_len(rows, d),
                Ok(sync + 2 * groups * d)
            );
            if d > 32768 {
                // Against groups of at least 16 rows (the layout of narrower rows past small
                // batches).
                let p = rows.div_ceil(512).max(16);
                let plain = (p, rows.div_ceil(p));
                assert!(
                    busiest_of_15((per_group, groups)) <= busiest_of_15(plain),
                    "rows {rows}, d {d}: {per_group} × {groups} balances worse than {plain:?}"
                );
            }
        }
    }
    // 64 groups of 16 took 5 rounds of 15 clusters (80 rows for the busiest) at 1024 rows; 4
    // groups of 16 left 11 of 15 idle at 64 rows.
    assert!(busiest_of_15(normkern::group_layout(1024, 65536)) <= 72);
    assert!(normkern::group_layout(64, 1 << 20).1 >= 12);
    assert_eq!(normkern::group_layout(0, 65536).1, 0);
    assert_eq!(normkern::group_layout(0, 3).1, 0);
}

/// The README's promise across GPUs: dγ and dβ from saved statistics are the same bits whichever
/// tile a device runs a row on. The emulator stands in for devices of different sizes: without
/// clusters (a GPU before sm_90: wide rows stream), with clusters of up to 2 or 8 blocks, and with
/// blocks capped at 256 threads (narrower register tiles). The statistics come from one forward
/// and are fed to every backward, whose f32 dγ and dβ must then match bit for bit (dx may differ
/// in the last bit: its row sums are split differently).
#[test]
fn emulator_parameter_gradients_from_saved_statistics_are_the_same_on_every_device() {
    use normkern::{Emulator, NormBackward, NormForward, Rows};
    let devices = [
        ("clusters of 2", Emulator::new()),
        ("no clusters", Emulator::new().with_clusters(1).unwrap()),
        ("clusters of 8", Emulator::new().with_clusters(8).unwrap()),
        (
            "256-thread blocks",
            Emulator::new().with_block_limit(256).unwrap(),
        ),
    ];
    let mut rng = Rng::fresh("emulator_gradients_every_device");
    for (rows, d) in [(5, 65536), (7, 16384), (40, 4096)] {
        let x: Vec<bf16> = rng.vec(rows * d, -1.0, 3.0);
        let dy: Vec<bf16> = rng.vec(rows * d, -1.0, 1.0);
        let weight: Vec<f32> = rng.vec(d, 0.5, 1.5);
        let bias: Vec<f32> = rng.vec(d, -0.5, 0.5);
        let (mut y, mut mean, mut rstd) = (
            vec![bf16::ZERO; rows * d],
            vec![0f32; rows],
            vec![0f32; rows],
        );
        let emu = &devices[0].1;
        let forward = NormForward::new(
            Rows::new(&x[..], rows, d).unwrap(),
            &weight[..],
            Rows::new(&mut y[..], rows, d).unwrap(),
        );
        layer_norm::forward(
            emu,
            forward
                .bias(&bias[..])
                .mean(&mut mean[..])
                .rstd(&mut rstd[..]),
        )
        .unwrap();
        for layer in [false, true] {
            let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
            for (device, emu) in &devices {
                let mut dx = vec![bf16::ZERO; rows * d];
                let (mut dweight, mut dbias) = (vec![f32::NAN; d], vec![f32::NAN; d]);
                let kind = if layer {
                    Kind::Layer { bias: true }
                } else {
                    Kind::Rms
                };
                let mut workspace = vec![0f32; kind.workspace_len(rows, d)];
                let backward = NormBackward::new(
                    Rows::new(&dy[..], rows, d).unwrap(),
                    Rows::new(&x[..], rows, d).unwrap(),
                    &weight[..],
                    Rows::new(&mut dx[..], rows, d).unwrap(),
                    &mut dweight[..],
                    &mut workspace[..],
                );
                if layer {
                    let backward = backward
                        .mean_rstd(&mean[..], &rstd[..])
                        .dbias(&mut dbias[..]);
                    layer_norm::backward(emu, backward).unwrap();
                } else {
                    rms_norm::backward(emu, backward.rstd(&rstd[..])).unwrap();
                    dbias.fill(0.0);
                }
                assert!(
                    dweight.iter().all(|v| v.is_finite() && *v != 0.0),
                    "{device}: dweight"
                );
                match &first {
                    None => first = Some((dweight, dbias)),
                    Some((dw, db)) => {
                        let norm = if layer { "LayerNorm" } else { "RMSNorm" };
                        assert!(
                            same_bits(dw, &dweight),
                            "{norm} {rows}×{d}: dγ differs on {device}"
                        );
                        assert!(
                            same_bits(db, &dbias),
                            "{norm} {rows}×{d}: dβ differs on {device}"
                        );
                    }
                }
            }
        }
    }
}
