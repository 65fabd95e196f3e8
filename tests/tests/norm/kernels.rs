//! The kernels against the reference over shapes and dtypes: packed and single-element access,
//! strided and unaligned rows, rows too wide for registers (the streaming instances), rows split
//! over clusters, and the weight offset with recomputed statistics.

use std::time::Instant;

use half::{bf16, f16};
use normkern::Emulator;
use normkern_tests::backend::{Backend, Device, Host};
use normkern_tests::{Rng, TestDtype, same_bits};

use crate::case::{Case, EPS, KINDS, Kind, Layout, Shape, emulator};
use crate::determinism::check_bitwise_stable;

/// Each shape against the reference on `backend`, and bitwise the same on each of `grids`.
fn matches_reference<T: TestDtype, B: Backend>(
    backend: &B,
    kind: Kind,
    shapes: &[Shape],
    grids: &[(usize, B)],
) {
    let mut rng = Rng::fresh(&format!("{}_{kind:?}_{}", backend.name(), T::NAME));
    for &shape in shapes {
        let start = Instant::now();
        let case = Case::<T>::new(kind, &mut rng, shape);
        check_bitwise_stable(&case, backend, 0, grids, backend.name());
        eprintln!(
            "{}: ok in {:.2} s",
            case.describe(),
            start.elapsed().as_secs_f64()
        );
    }
}

/// Gemma-style weights (used as `1 + weight`) and a backward that recomputes the statistics, for
/// every kind.
fn weight_offset_and_recomputed_statistics<T: TestDtype, B: Backend>(
    backend: &B,
    shapes: &[Shape],
) {
    let what = format!("{} offset+recompute", backend.name());
    let mut rng = Rng::fresh(&what);
    for kind in KINDS {
        for &shape in shapes {
            let case = Case::<T>::new(kind, &mut rng, shape).offset_and_recompute(&mut rng);
            case.check(&case.run(backend), &what);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The CPU emulator: the same kernel bodies that are compiled to PTX, on small shapes.

/// Odd d, rows not a multiple of the 16-row group, packed and single-element access, strided
/// rows, and a row too wide for registers (the streaming instance). Rows of up to 256 take
/// segment teams, several rows per warp: 4500 rows of 24 are groups of 16 rows
/// over a block's 32 teams of 8 lanes. Packed rows of 1024 take RMSNorm's staged backward block
/// tile (128 threads at 16 bits, 256 at f32), those of 512 the same tile's register prefetch (64
/// threads at 16 bits): 40 groups of one row and 150 of two, which the limited grids walk across
/// groups.
const EMULATED_SHAPES: [Shape; 11] = [
    (1, 1, 1, 0),
    (3, 7, 7, 0),
    (17, 64, 64, 0),
    (33, 64, 72, 0),
    (5, 127, 130, 1),
    (4500, 24, 32, 0),
    (20, 1000, 1000, 0),
    (2, 1024, 1024, 1),
    (2, 8200, 8200, 1),
    (40, 1024, 1024, 0),
    (300, 512, 512, 0),
];

/// `shapes` in the emulator, the same bits on grids of 1 and 3 blocks.
fn emulated<T: TestDtype>(kind: Kind, shapes: &[Shape]) {
    let grids = [1, 3].map(|blocks| {
        let limited = Emulator::new().with_grid_limit(blocks).unwrap();
        (blocks, Host(limited))
    });
    matches_reference::<T, _>(&emulator(), kind, shapes, &grids);
}

#[test]
fn emulator_rms_norm_matches_reference_f32() {
    emulated::<f32>(Kind::Rms, &EMULATED_SHAPES);
}

#[test]
fn emulator_rms_norm_matches_reference_f16() {
    emulated::<f16>(Kind::Rms, &EMULATED_SHAPES);
}

#[test]
fn emulator_rms_norm_matches_reference_bf16() {
    emulated::<bf16>(Kind::Rms, &EMULATED_SHAPES);
}

// The streaming instance (the last shape) is shared code: LayerNorm runs it in
// `emulator_weight_offset_and_recomputed_statistics`.

#[test]
fn emulator_layer_norm_matches_reference_f32() {
    emulated::<f32>(Kind::Layer { bias: true }, &EMULATED_SHAPES[..7]);
}

#[test]
fn emulator_layer_norm_matches_reference_f16() {
    emulated::<f16>(Kind::Layer { bias: true }, &EMULATED_SHAPES[..7]);
}

#[test]
fn emulator_layer_norm_matches_reference_bf16() {
    emulated::<bf16>(Kind::Layer { bias: true }, &EMULATED_SHAPES[..7]);
}

/// Plain LayerNorm's forward takes two accesses per thread where RMSNorm's block tile takes one:
/// strided packed rows of 2048 (128 threads at 16 bits) and single-element rows of 200.
#[test]
fn emulator_layer_norm_two_access_forward_tiles_match_reference() {
    let shapes = [(9, 2048, 2056, 0), (5, 200, 203, 1)];
    emulated::<bf16>(Kind::Layer { bias: true }, &shapes);
    emulated::<f32>(Kind::Layer { bias: true }, &shapes);
}

/// The ring instances (`NormKey::ring`): LayerNorm's one-access backward in blocks of four warps
/// or more (packed rows of 1024 on 40 groups of one row, strided rows of 2048 with an offset), and
/// either norm's in a small batch, whose dγ groups all have a resident block (the emulator's 4):
/// rows of 512 in blocks of two warps (bf16, f16) or four (f32), rows of 1000 and 2048.
#[test]
fn emulator_ring_block_tiles_match_reference() {
    let layer = [
        (40, 1024, 1024, 0),
        (7, 2048, 2056, 8),
        (3, 512, 512, 0),
        (4, 1000, 1000, 0),
    ];
    emulated::<bf16>(Kind::Layer { bias: true }, &layer);
    emulated::<f16>(Kind::Layer { bias: false }, &layer);
    emulated::<f32>(Kind::Layer { bias: true }, &layer);
    let rms = [(3, 512, 520, 8), (4, 1000, 1000, 0), (2, 2048, 2048, 0)];
    emulated::<bf16>(Kind::Rms, &rms);
    emulated::<f16>(Kind::Rms, &rms);
    emulated::<f32>(Kind::Rms, &rms);
}

/// The 16-bit one-access ring instances take rows two at a time within a dγ group
/// (`policy::pairs_rows`). RMSNorm's run small batches — every dγ group a resident block — so on
/// an emulated device of 192 resident blocks groups of several rows reach them (LayerNorm's run
/// rows of 1024–2048 at any batch): 129 groups of 2 rows of 1024 (the last of 1), 171 groups of 3
/// strided rows (a pair and a single), 150 groups of 2 rows of 1000; bitwise the same on grids of
/// 1 and 3 blocks (one block walks every group) and on the default device of 4 resident blocks
/// (where RMSNorm's block instance takes them one row at a time); and each row's dx has the bits
/// of that row run alone (a batch of one row: the one-row path). The recomputed-statistics rows
/// take the one-row path.
#[test]
fn emulator_row_pairs_match_reference() {
    let device = Emulator::new().with_resident_blocks(192).unwrap();
    let grids = [1, 3].map(|blocks| (blocks, Host(device.with_grid_limit(blocks).unwrap())));
    let [one, three] = grids;
    let grids = [one, three, (4, Host(Emulator::new()))];
    let shapes = [
        (257, 1024, 1024, 0),
        (513, 1024, 1032, 8),
        (300, 1000, 1000, 0),
    ];
    for kind in KINDS {
        matches_reference::<bf16, _>(&Host(device), kind, &shapes, &grids);
        matches_reference::<f16, _>(&Host(device), kind, &shapes[1..2], &grids);
        rows_alone_match_the_batch::<bf16>(&Host(device), kind, shapes[1]);
    }
    weight_offset_and_recomputed_statistics::<bf16, _>(&Host(device), &shapes[..1]);
}

/// Each of a few rows of a batch (`shape`) run alone, a batch of one row, gives that row's y and
/// dx the bits the batch gave it: a row's results depend on the row, not on the rows beside it.
fn rows_alone_match_the_batch<T: TestDtype>(backend: &Host, kind: Kind, shape: Shape) {
    let mut rng = Rng::fresh(&format!("rows alone {kind:?} {}", T::NAME));
    let batch = Case::<T>::new(kind, &mut rng, shape);
    let out = batch.run(backend);
    let (rows, d, stride, offset) = shape;
    for r in [0, 1, 2, rows / 2, rows - 2, rows - 1] {
        let at = offset + r * stride;
        let alone = Case {
            kind,
            layout: Layout::new((1, d, d, 0)),
            x: batch.x[at..at + d].to_vec(),
            dy: batch.dy[at..at + d].to_vec(),
            weight: batch.weight.clone(),
            bias: batch.bias.clone(),
            weight_offset: batch.weight_offset,
            recompute: batch.recompute,
            param_grads: batch.param_grads,
        };
        let one = alone.run(backend);
        for (what, got, want) in [("y", &one.y, &out.y), ("dx", &one.dx, &out.dx)] {
            assert!(
                same_bits(got, &want[at..at + d]),
                "{} row {r}: {what} alone differs from the batch's",
                batch.describe()
            );
        }
    }
}

/// LayerNorm's streaming instance (rows too wide for registers: packed rows of 40000 bf16 without
/// clusters, single-element rows of 8200) takes the variance from each thread's moments in the
/// same pass as the mean (`rows::Moments`). Against the reference, and off-centre: rows whose mean
/// is 1000 times their spread, where `Σx² − (Σx)²/n` in f32 would lose every digit.
#[test]
fn emulator_layer_norm_streamed_rows_match_reference() {
    let shapes = [(3, 40000, 40000, 0), (2, 8200, 8208, 1)];
    emulated::<bf16>(Kind::Layer { bias: true }, &shapes);
    emulated::<f32>(Kind::Layer { bias: true }, &shapes);
    off_centre_statistics_match_reference(
        "emulator off-centre streamed rows",
        &emulator(),
        &[(2, 20000, 20000, 0), (2, 8200, 8208, 1)],
    );
}

/// Off-centre rows (mean 1000 times the spread, where `Σx² − (Σx)²/n` in f32 would lose every
/// digit): LayerNorm's forward statistics against f64 (the backward's x − μ loses those digits in
/// any f32 LayerNorm, so dγ is not judged here).
fn off_centre_statistics_match_reference(what: &str, backend: &Host, shapes: &[Shape]) {
    let mut rng = Rng::fresh(what);
    for &shape in shapes {
        let mut case = Case::<f32>::new(Kind::Layer { bias: true }, &mut rng, shape);
        for x in &mut case.x {
            *x += 1000.0;
        }
        let out = case.run(backend);
        let (rows, d, stride, offset) = shape;
        for r in 0..rows {
            let row = &case.x[offset + r * stride..][..d];
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + EPS as f64).sqrt();
            let (got_mean, got_rstd) = (out.mean[r] as f64, out.rstd[r] as f64);
            assert!(
                (got_mean - mean).abs() <= 2e-5 * mean.abs(),
                "{what} {shape:?} row {r}: mean {got_mean}, reference {mean}"
            );
            assert!(
                (got_rstd - rstd).abs() <= 2e-5 * rstd,
                "{what} {shape:?} row {r}: rstd {got_rstd}, reference {rstd}"
            );
        }
    }
}

/// LayerNorm's cluster teams take their statistics in one exchange, merging the warps' and
/// blocks' parts (`RowReducer::mean_and_deviations`): off-centre rows over clusters of 2 and 8
/// blocks (register tiles, the emulated block capped as registers cap it on a GPU) and streamed
/// over 2, against f64.
#[test]
fn emulator_layer_norm_cluster_statistics_off_centre() {
    for (rows, d, block_limit, clusters) in [(3, 2048, 64, 2), (2, 4096, 32, 8), (3, 1100, 32, 2)] {
        let emulator = Emulator::new()
            .with_block_limit(block_limit)
            .unwrap()
            .with_clusters(clusters)
            .unwrap();
        off_centre_statistics_match_reference(
            "emulator off-centre cluster rows",
            &Host(emulator),
            &[(rows, d, d, 0)],
        );
    }
}

#[test]
fn emulator_layer_norm_without_bias_matches_reference() {
    emulated::<bf16>(
        Kind::Layer { bias: false },
        &[(17, 64, 64, 0), (5, 127, 130, 1)],
    );
}

#[test]
fn emulator_weight_offset_and_recomputed_statistics() {
    // Register tiles (packed and single-element) and the streaming instance.
    weight_offset_and_recomputed_statistics::<f32, _>(
        &emulator(),
        &[(17, 64, 64, 0), (5, 127, 130, 1), (2, 8200, 8200, 1)],
    );
}

/// Rows split over clusters of blocks (sm_90's tiles for rows too wide for one block), reached
/// with small rows by capping the emulated block as registers cap it on a GPU: register tiles
/// over 2 and 8 blocks, the streaming instance over 2, and recomputed statistics. Each against
/// the reference, and bitwise the same on a grid of a single cluster.
#[test]
fn emulator_rows_split_over_clusters_match_reference() {
    let mut rng = Rng::fresh("emulator_clusters");
    // (rows, d, block limit, clusters up to): 2 × 64 threads × 4 packs; 8 × 32 × 4; streaming;
    // 2 × 64 × 4 again over two dweight groups (16 + 4 rows), reusing every mailbox slot and
    // stage; RMSNorm's 8 × 64 × 2, whose f32 ring has three stages (`staged_stages`), wrapped
    // several times (LayerNorm's 4 × 64 × 4); LayerNorm's 16 × 32 × 4, a cluster past the
    // portable 8 (RMSNorm streams it over 8).
    let shapes = [
        (3, 2048, 64, 2),
        (2, 4096, 32, 8),
        (3, 1100, 32, 2),
        (20, 2048, 64, 2),
        (20, 4096, 64, 8),
        (5, 8192, 32, 16),
    ];
    for kind in [Kind::Rms, Kind::Layer { bias: true }] {
        for (i, &(rows, d, block_limit, clusters)) in shapes.iter().enumerate() {
            // A cluster of 16 is planned only where one is resident.
            let emulator = Emulator::new()
                .with_block_limit(block_limit)
                .unwrap()
                .with_clusters(clusters)
                .unwrap()
                .with_resident_blocks(clusters.max(4))
                .unwrap();
            let one_cluster = Host(emulator.with_grid_limit(1).unwrap());
            let mut case = Case::<f32>::dense(kind, &mut rng, rows, d);
            // Recomputed statistics: a second reduction per row, also over several groups.
            if i == 0 || i == 3 {
                case = case.offset_and_recompute(&mut rng);
            }
            check_bitwise_stable(
                &case,
                &Host(emulator),
                0,
                &[(1, one_cluster)],
                "emulator clusters",
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The GPU.

/// Small batches split over clusters (blocks of at most 64 threads force them): groups of one
/// row, which the staged ring walks across groups.
#[test]
fn emulated_small_batches_split_over_clusters() {
    let clustered = Host(Emulator::new().with_block_limit(64).unwrap());
    let shapes = [(6, 4096, 4096, 0), (40, 2048, 2048, 0)];
    for kind in [Kind::Rms, Kind::Layer { bias: true }] {
        matches_reference::<bf16, _>(&clustered, kind, &shapes, &[]);
    }
}

/// Every d of the acceptance list, each with a row count from its list so every count appears;
/// small batches of rows split over clusters (groups of one and of four rows); and narrow rows
/// over many groups of segment teams (QK-norm's 128; 100 by single-element access).
const GPU_SHAPES: [(usize, usize); 25] = [
    (65536, 128),
    (20000, 256),
    // The forward's rows past its segment teams' reach: a block per row of 64 (RMSNorm) or 32
    // (LayerNorm's 2-access tile) threads.
    (10000, 512),
    (9000, 100),
    (16384, 1),
    (1000, 2),
    (64, 3),
    (3, 7),
    (2, 8),
    (1, 64),
    (1000, 127),
    (64, 1000),
    (16384, 1024),
    (3000, 2048),
    (1000, 4096),
    (64, 4097),
    (3, 8192),
    (4096, 16384),
    (2, 65536),
    (64, 65536),
    (64, 16384),
    (1000, 16384),
    (200, 32768),
    // More rows than SMs, wider than 64 KiB at 16 bits: the forward on clusters.
    (140, 40000),
    // More rows than SMs of 256 KiB in f32: LayerNorm's forward on clusters too, its f32 tile
    // without the next row in flight.
    (140, 65536),
];

/// Strided rows, and views one element off 16-byte alignment (single-element access).
const GPU_STRIDED_SHAPES: [Shape; 4] = [
    (1000, 4096, 4104, 0),
    (257, 4096, 4096, 1),
    (64, 1000, 1003, 3),
    (16, 65536, 65540, 1),
];

fn on_gpu<T: TestDtype>(kind: Kind) {
    let Some(gpu) = Device::shared() else { return };
    let dense = GPU_SHAPES.map(|(rows, d)| (rows, d, d, 0));
    let shapes = [&dense[..], &GPU_STRIDED_SHAPES].concat();
    matches_reference::<T, _>(&gpu, kind, &shapes, &[]);
}

#[test]
fn gpu_rms_norm_matches_reference_f32() {
    on_gpu::<f32>(Kind::Rms);
}

#[test]
fn gpu_rms_norm_matches_reference_f16() {
    on_gpu::<f16>(Kind::Rms);
}

#[test]
fn gpu_rms_norm_matches_reference_bf16() {
    on_gpu::<bf16>(Kind::Rms);
}

#[test]
fn gpu_layer_norm_matches_reference_f32() {
    on_gpu::<f32>(Kind::Layer { bias: true });
}

#[test]
fn gpu_layer_norm_matches_reference_f16() {
    on_gpu::<f16>(Kind::Layer { bias: true });
}

#[test]
fn gpu_layer_norm_matches_reference_bf16() {
    on_gpu::<bf16>(Kind::Layer { bias: true });
}

/// Rows far too wide for registers (the streaming instances), up to 2²⁰ elements: exact, no limit.
#[test]
fn gpu_wide_rows_match_reference() {
    let Some(gpu) = Device::shared() else { return };
    for kind in KINDS {
        let shapes = [
            (64, 65537, 65537, 0),
            (8, 262144, 262144, 0),
            (64, 1 << 20, 1 << 20, 0),
            (3, 1 << 20, 1 << 20, 1),
        ];
        matches_reference::<bf16, _>(&gpu, kind, &shapes, &[]);
    }
}

#[test]
fn gpu_weight_offset_and_recomputed_statistics() {
    let Some(gpu) = Device::shared() else { return };
    weight_offset_and_recomputed_statistics::<bf16, _>(
        &gpu,
        &[
            (4096, 4096, 4096, 0),
            (257, 4097, 4100, 1),
            (16, 65536, 65536, 0),
        ],
    );
}
