//! Residual fusion: h = x + residual written to residual_out and normalized as stored; the
//! backward takes residual_out as x and adds dresidual into dx.

use half::{bf16, f16};
use normkern::{Buffer, Emulator, Error, NormBackward, NormForward, Rows, layer_norm, rms_norm};
use normkern_tests::backend::{Backend, Device, Host};
use normkern_tests::{Rng, TestDtype, assert_close, assert_close_each, rms, same_bits, to_f64};

use crate::case::{EPS, KINDS, Kind, Layout, emulator, reference};
use crate::determinism::{assert_same_bits_again, capped_grid_contexts, on_capped_grids};

/// `(rows, d, strides)`, the strides of x/y/dy/dx, residual, residual_out and dresidual.
type ResidualShape = (usize, usize, [usize; 4]);

/// One fused-residual forward + backward: activations (x, y, dy, dx, weight, bias) in `T`,
/// `residual` in `R`, `residual_out` (and so the backward's x) and `dresidual` in `H`. Rows start
/// after `offset` elements; x/y/dy/dx, residual, residual_out and dresidual each have their own
/// stride.
struct ResidualCase<T, R, H> {
    kind: Kind,
    rows: usize,
    d: usize,
    offset: usize,
    /// x/y/dy/dx, residual, residual_out, dresidual.
    strides: [usize; 4],
    x: Vec<T>,
    dy: Vec<T>,
    residual: Vec<R>,
    dresidual: Vec<H>,
    weight: Vec<T>,
    bias: Vec<T>,
    /// The backward recomputes the statistics from residual_out instead of reading the forward's.
    recompute: bool,
}

/// What a residual run produced, in padded buffers that start as poison.
struct ResidualOutputs<T, H> {
    y: Vec<T>,
    h: Vec<H>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
    dx: Vec<T>,
    dweight: Vec<T>,
    dbias: Vec<T>,
}

impl<T: TestDtype, H: TestDtype> PartialEq for ResidualOutputs<T, H> {
    /// Bitwise, padding included.
    fn eq(&self, other: &Self) -> bool {
        same_bits(&self.y, &other.y)
            && same_bits(&self.h, &other.h)
            && same_bits(&self.mean, &other.mean)
            && same_bits(&self.rstd, &other.rstd)
            && same_bits(&self.dx, &other.dx)
            && same_bits(&self.dweight, &other.dweight)
            && same_bits(&self.dbias, &other.dbias)
    }
}

impl<T: TestDtype, R: TestDtype, H: TestDtype> ResidualCase<T, R, H> {
    fn new(kind: Kind, rng: &mut Rng, (rows, d, strides): ResidualShape, recompute: bool) -> Self {
        // Odd rows start one element in, off 16-byte alignment.
        let offset = usize::from(d % 2 == 1);
        let len = |stride| Layout::new((rows, d, stride, offset)).len();
        let [act, res, _, dres] = strides.map(len);
        ResidualCase {
            kind,
            rows,
            d,
            offset,
            strides,
            x: rng.vec(act, -1.0, 1.0),
            dy: rng.vec(act, -1.0, 1.0),
            // Off-centre, so LayerNorm's mean matters, and larger than x, as a residual stream is.
            residual: rng.vec(res, -1.0, 4.0),
            dresidual: rng.vec(dres, -1.0, 1.0),
            weight: rng.vec(d, 0.5, 1.5),
            bias: rng.vec(d, -0.5, 0.5),
            recompute,
        }
    }

    /// The layouts of x/y/dy/dx, residual, residual_out and dresidual.
    fn layouts(&self) -> [Layout; 4] {
        let (rows, d, offset) = (self.rows, self.d, self.offset);
        self.strides
            .map(|stride| Layout::new((rows, d, stride, offset)))
    }

    fn poisoned(&self) -> ResidualOutputs<T, H> {
        let [act, _, out, _] = self.layouts().map(|l| l.len());
        ResidualOutputs {
            y: vec![T::poison(); act],
            h: vec![H::poison(); out],
            mean: vec![f32::NAN; self.rows],
            rstd: vec![f32::NAN; self.rows],
            dx: vec![T::poison(); act],
            dweight: vec![T::poison(); self.d],
            dbias: vec![T::poison(); self.d],
        }
    }

    /// The fused forward (saving the statistics), then the backward on its residual_out with
    /// dresidual (reading the statistics unless `recompute`), on `backend`.
    fn run<B: Backend>(&self, backend: &B) -> ResidualOutputs<T, H> {
        let exec = backend.exec();
        let [act, res, out, dres] = self.layouts();
        let poison = self.poisoned();
        let (x, dy) = (backend.upload(&self.x), backend.upload(&self.dy));
        let residual = backend.upload(&self.residual);
        let dresidual = backend.upload(&self.dresidual);
        let (weight, bias) = (backend.upload(&self.weight), backend.upload(&self.bias));
        let mut y = backend.upload(&poison.y);
        let mut h = backend.upload(&poison.h);
        let mut mean = backend.upload(&poison.mean);
        let mut rstd = backend.upload(&poison.rstd);
        let mut dx = backend.upload(&poison.dx);
        let mut dweight = backend.upload(&poison.dweight);
        let mut dbias = backend.upload(&poison.dbias);
        let workspace_len = self.kind.workspace_len(self.rows, self.d);
        let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));

        let forward = NormForward::new(
            act.input::<B, _>(&x),
            B::input(&weight, 0),
            act.output::<B, _>(&mut y),
        )
        .eps(EPS)
        .residual(res.input::<B, _>(&residual), out.output::<B, _>(&mut h));
        let forward = self.kind.forward_args(
            forward,
            B::input(&bias, 0),
            B::output(&mut mean, 0),
            B::output(&mut rstd, 0),
        );
        self.kind.forward(exec, forward).unwrap();

        let backward = NormBackward::new(
            act.input::<B, _>(&dy),
            out.input::<B, _>(&h),
            B::input(&weight, 0),
            act.output::<B, _>(&mut dx),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        )
        .eps(EPS)
        .dresidual(dres.input::<B, _>(&dresidual));
        let backward = self.kind.backward_args(
            backward,
            self.recompute,
            (B::input(&mean, 0), B::input(&rstd, 0)),
            B::output(&mut dbias, 0),
        );
        self.kind.backward(exec, backward).unwrap();

        ResidualOutputs {
            y: backend.download(&y),
            h: backend.download(&h),
            mean: backend.download(&mean),
            rstd: backend.download(&rstd),
            dx: backend.download(&dx),
            dweight: backend.download(&dweight),
            dbias: backend.download(&dbias),
        }
    }

    /// residual_out bit for bit (one f32 add, one rounding to `H`), every other output against the
    /// f64 reference run on h as stored, and nothing written outside the rows.
    fn check(&self, out: &ResidualOutputs<T, H>, what: &str) {
        let (rows, d) = (self.rows, self.d);
        let [act, res, out_rows, dres] = self.layouts();
        let what = format!(
            "{what} {:?} {rows}×{d} strides {:?} offset {} x {} residual {} residual_out {}",
            self.kind,
            self.strides,
            self.offset,
            T::NAME,
            R::NAME,
            H::NAME
        );
        let at = |l: Layout, r: usize, j: usize| l.offset + r * l.stride + j;
        for r in 0..rows {
            for j in 0..d {
                let sum = self.x[at(act, r, j)].to_f64() as f32
                    + self.residual[at(res, r, j)].to_f64() as f32;
                let (expected, got) = (H::from_f32(sum), out.h[at(out_rows, r, j)]);
                assert_eq!(
                    got.bits(),
                    expected.bits(),
                    "{what}: residual_out [{r}, {j}] = {got:?}, x + residual = {sum}"
                );
            }
        }
        let h = out_rows.gather(&out.h);
        let dy = act.gather(&self.dy);
        let dresidual = dres.gather(&self.dresidual);
        let weight = to_f64(&self.weight);
        let (y_ref, _, rstd_ref, dx_norm, dweight_ref, dbias_ref) =
            reference(self.kind, (&h, &dy), &weight, &to_f64(&self.bias), rows);
        let (rel, abs) = T::TOLERANCE;
        assert_close::<T>(
            &format!("{what}: y"),
            &act.gather(&out.y),
            &y_ref,
            rel,
            abs * rms(&y_ref),
        );
        let (rel32, abs32) = f32::TOLERANCE;
        let rstd: Vec<f64> = out.rstd.iter().map(|&v| v as f64).collect();
        assert_close::<f32>(
            &format!("{what}: rstd"),
            &rstd,
            &rstd_ref,
            rel32,
            abs32 * rms(&rstd_ref),
        );
        // dx = (the norm's dx) + dresidual, judged on the scale of its terms as in `Case::check`.
        let term: Vec<f64> = (0..rows * d)
            .map(|i| rstd_ref[i / d] * dy[i] * weight[i % d])
            .collect();
        let row_scale: Vec<f64> = term.chunks(d).map(rms).collect();
        let dx_ref: Vec<f64> = dx_norm.iter().zip(&dresidual).map(|(a, b)| a + b).collect();
        assert_close_each::<T>(
            &format!("{what}: dx"),
            &act.gather(&out.dx),
            &dx_ref,
            rel,
            |i| abs * row_scale[i / d].max(term[i].abs()).max(dresidual[i].abs()),
        );
        let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
        let dweight_scale = rms(&dweight_ref).max(rms(&term) * (rows as f64).sqrt());
        assert_close::<T>(
            &format!("{what}: dweight"),
            &to_f64(&out.dweight),
            &dweight_ref,
            rel * growth,
            abs * growth * dweight_scale,
        );
        if let Some(dbias_ref) = dbias_ref {
            let scale = rms(&dbias_ref).max(rms(&dy) * (rows as f64).sqrt());
            assert_close::<T>(
                &format!("{what}: dbias"),
                &to_f64(&out.dbias),
                &dbias_ref,
                rel * growth,
                abs * growth * scale,
            );
        }
        for (i, v) in out.h.iter().enumerate() {
            if !out_rows.inside(i) {
                assert_eq!(v.bits(), H::poison().bits(), "{what}: residual_out [{i}]");
            }
        }
        for (i, (y, dx)) in out.y.iter().zip(&out.dx).enumerate() {
            if !act.inside(i) {
                assert_eq!(
                    y.bits(),
                    T::poison().bits(),
                    "{what}: y [{i}] outside the rows"
                );
                assert_eq!(
                    dx.bits(),
                    T::poison().bits(),
                    "{what}: dx [{i}] outside the rows"
                );
            }
        }
    }
}

/// Each case (kind, shape, whether the backward recomputes the statistics) on `backend`.
fn residual_matches_reference<T: TestDtype, R: TestDtype, H: TestDtype, B: Backend>(
    backend: &B,
    cases: &[(Kind, ResidualShape, bool)],
) {
    let what = format!("{} residual", backend.name());
    let mut rng = Rng::fresh(&format!("{what}_{}_{}_{}", T::NAME, R::NAME, H::NAME));
    for &(kind, shape, recompute) in cases {
        let case = ResidualCase::<T, R, H>::new(kind, &mut rng, shape, recompute);
        case.check(&case.run(backend), &what);
    }
}

// ---------------------------------------------------------------------------------------------
// The CPU emulator.

/// Single elements (odd d, so rows are shifted off 16-byte alignment: the residual families
/// stream then, every pass re-reading x + residual), and 16-byte packs in a register tile, every
/// operand on a stride of its own that keeps packs aligned (a multiple of 8 elements). Streaming
/// with packs needs rows wider than the emulator runs quickly: the GPU tests cover it.
const SCALAR: ResidualShape = (5, 127, [130, 129, 131, 133]);
const PACKED: ResidualShape = (3, 1000, [1000, 1016, 1008, 1024]);
/// Packed rows too wide for a warp: block tiles (LayerNorm's forward keeps γ and β in shared
/// memory there).
const PACKED_BLOCK: ResidualShape = (5, 2056, [2056, 2064, 2072, 2080]);
/// Rows a warp segment takes (25 packs: 32 lanes), 37 rows over a block's 8 teams.
const SEGMENT: ResidualShape = (37, 200, [208, 200, 216, 224]);

const LAYER: Kind = Kind::Layer { bias: true };

#[test]
fn emulator_residual_in_the_activations_dtype() {
    residual_matches_reference::<bf16, bf16, bf16, _>(
        &emulator(),
        &[
            (Kind::Rms, SCALAR, false),
            (Kind::Rms, PACKED, false),
            (LAYER, SCALAR, false),
            (LAYER, PACKED, false),
            (LAYER, PACKED_BLOCK, false),
            (Kind::Rms, SEGMENT, false),
            (LAYER, SEGMENT, true),
        ],
    );
    residual_matches_reference::<f32, f32, f32, _>(
        &emulator(),
        &[(Kind::Rms, SCALAR, false), (LAYER, SEGMENT, false)],
    );
}

#[test]
fn emulator_residual_stream_in_f32() {
    // The fp32 residual stream next to bf16 (or f16) activations, and the two mixed cases.
    residual_matches_reference::<bf16, f32, f32, _>(
        &emulator(),
        &[
            (Kind::Rms, SCALAR, false),
            (Kind::Rms, PACKED, false),
            (Kind::Layer { bias: false }, PACKED, false),
        ],
    );
    residual_matches_reference::<f16, f16, f32, _>(&emulator(), &[(Kind::Rms, SCALAR, false)]);
    residual_matches_reference::<bf16, f32, bf16, _>(
        &emulator(),
        &[(LAYER, PACKED, false), (LAYER, PACKED_BLOCK, false)],
    );
}

/// Rows split over clusters (blocks of at most 64 threads force them at d = 4096). A dresidual in
/// the activations' dtype takes the plain cluster tiles, whose staged rows are read again for
/// pass 2 while dresidual arrives in its slots (bf16 on clusters of 2, f32 on clusters of 4); f32
/// rows on clusters of 2 are too wide for them and take the `_res` streaming instance, and an f32
/// stream next to bf16 activations the `_res` cluster tiles.
#[test]
fn emulator_residual_on_cluster_tiles() {
    let shape = (20, 4096, [4096, 4104, 4112, 4120]);
    let cases = [
        (Kind::Rms, shape, false),
        (LAYER, shape, false),
        (Kind::Layer { bias: false }, shape, true),
    ];
    // Clusters of up to `blocks`, on persistent grids of at most `grid` blocks.
    let clustered = |blocks, grid| {
        let emulator = Emulator::new().with_block_limit(64);
        let emulator = emulator.and_then(|e| e.with_clusters(blocks));
        Host(emulator.and_then(|e| e.with_grid_limit(grid)).unwrap())
    };
    residual_matches_reference::<bf16, bf16, bf16, _>(&clustered(2, 4), &cases);
    residual_matches_reference::<f32, f32, f32, _>(&clustered(4, 4), &cases);
    residual_matches_reference::<f32, f32, f32, _>(&clustered(2, 4), &cases);
    residual_matches_reference::<bf16, f32, f32, _>(&clustered(2, 4), &cases);
    // The same bits again, and on grids of one cluster and of three.
    let mut rng = Rng::fresh("emulator_residual_on_cluster_tiles_bits");
    let grids = [(2, clustered(2, 2)), (6, clustered(2, 6))];
    for (kind, shape, recompute) in cases {
        let case = ResidualCase::<bf16, bf16, bf16>::new(kind, &mut rng, shape, recompute);
        let first = case.run(&clustered(2, 4));
        let what = format!("emulator residual on clusters, {kind:?}");
        assert_same_bits_again(&first, |b| case.run(b), &clustered(2, 4), 1, &grids, &what);
    }
}

#[test]
fn emulator_residual_recomputed_statistics() {
    residual_matches_reference::<bf16, f32, f32, _>(
        &emulator(),
        &[(Kind::Rms, SCALAR, true), (LAYER, PACKED, true)],
    );
}

#[test]
fn emulator_residual_normalizes_what_it_stores() {
    // With packs and a register tile, the plain forward on residual_out runs the same reduction
    // order: y and rstd agree bit for bit with the fused forward's. (Only the emulator promises
    // that tile: a GPU may give the fused kernel another.)
    let host = emulator();
    let mut rng = Rng::fresh("emulator_residual_normalizes_what_it_stores");
    let (rows, d) = (3, 1000);
    let case = ResidualCase::<bf16, f32, bf16>::new(Kind::Rms, &mut rng, (rows, d, [d; 4]), false);
    let fused = case.run(&host);
    let (mut y, mut rstd) = (vec![bf16::poison(); rows * d], vec![f32::NAN; rows]);
    rms_norm::forward(
        host.exec(),
        NormForward::new(
            Rows::new(&fused.h[..], rows, d).unwrap(),
            &case.weight[..],
            Rows::new(&mut y[..], rows, d).unwrap(),
        )
        .eps(EPS)
        .rstd(&mut rstd[..]),
    )
    .unwrap();
    assert!(same_bits(&y, &fused.y) && same_bits(&rstd, &fused.rstd));
}

// ---------------------------------------------------------------------------------------------
// The GPU.

/// Segment teams, the 4096-wide register tile, the widest block tile, cluster tiles (of 2 and 8
/// blocks at 16 bits; with a dresidual in the activations' dtype, segment teams, the widest block
/// tile and the cluster tiles are the plain ones, the clusters' rows staged), rows too wide for
/// registers, unaligned rows, and more rows than SMs wider than 16384 elements (the forward on
/// clusters: both norms since the forty-eighth session, 40 KiB rows of 20000 at 16 bits too).
const GPU_RESIDUAL_SHAPES: [ResidualShape; 8] = [
    (30000, 128, [128, 136, 144, 128]),
    (4096, 4096, [4096, 4096, 4096, 4096]),
    (64, 8192, [8192, 8200, 8208, 8192]),
    (300, 16384, [16384, 16392, 16384, 16400]),
    (16, 65536, [65536; 4]),
    (1000, 4097, [4099, 4101, 4103, 4097]),
    (140, 40000, [40000, 40008, 40000, 40016]),
    (150, 20000, [20000, 20008, 20000, 20016]),
];

/// Every kind on every GPU shape; LayerNorm without bias recomputes its statistics.
fn on_gpu<T: TestDtype, R: TestDtype, H: TestDtype>() {
    let Some(gpu) = Device::shared() else { return };
    let cases: Vec<_> = KINDS
        .iter()
        .flat_map(|&kind| {
            let recompute = kind == Kind::Layer { bias: false };
            GPU_RESIDUAL_SHAPES.map(|shape| (kind, shape, recompute))
        })
        .collect();
    residual_matches_reference::<T, R, H, _>(&gpu, &cases);
}

/// The same bits on repeats and on grids capped at 3 and 7 blocks, with a bf16 stream: the plain
/// segment teams, widest block tile and cluster tiles (2 and 8 blocks) that add dresidual, and
/// both norms' forward clusters of many wide rows.
#[test]
fn gpu_residual_is_bitwise_repeatable_and_grid_invariant() {
    let Some(gpu) = Device::shared() else { return };
    let contexts = capped_grid_contexts(&gpu);
    let grids = on_capped_grids(&gpu, &contexts);
    let mut rng = Rng::fresh("gpu_residual_determinism");
    for kind in KINDS {
        let recompute = kind == Kind::Layer { bias: false };
        for shape in [0, 2, 3, 4, 6, 7].map(|i| GPU_RESIDUAL_SHAPES[i]) {
            let case = ResidualCase::<bf16, bf16, bf16>::new(kind, &mut rng, shape, recompute);
            let first = case.run(&gpu);
            case.check(&first, "gpu residual determinism");
            let what = format!("gpu residual determinism {kind:?} {}×{}", shape.0, shape.1);
            assert_same_bits_again(&first, |b| case.run(b), &gpu, 2, &grids, &what);
        }
    }
}

#[test]
fn gpu_residual_matches_reference_bf16() {
    on_gpu::<bf16, bf16, bf16>();
}

#[test]
fn gpu_residual_f32_stream_matches_reference_bf16() {
    on_gpu::<bf16, f32, f32>();
}

#[test]
fn gpu_residual_matches_reference_mixed() {
    on_gpu::<f16, f16, f32>();
    on_gpu::<bf16, f32, bf16>();
    on_gpu::<f32, f32, f32>();
}

// ---------------------------------------------------------------------------------------------
// Validation.

/// Which argument a validation error names: `"shape of …"` or `"dtype D of …"`.
fn rejected(r: normkern::Result<()>) -> String {
    match r {
        Err(Error::Shape { what, .. }) => format!("shape of {what}"),
        Err(Error::UnsupportedDtypes { what, dtype, .. }) => format!("dtype {dtype} of {what}"),
        other => panic!("expected a shape or dtype error, got {other:?}"),
    }
}

/// `rows × d` dense rows over `buf`.
fn dense<Buf: Buffer>(buf: Buf, rows: usize, d: usize) -> Rows<Buf> {
    Rows::new(buf, rows, d).unwrap()
}

/// Residual rows of the wrong shape or dtype: rejected before anything is written.
fn residual_bad_arguments_are_rejected<B: Backend>(backend: &B) {
    let exec = backend.exec();
    let (rows, d) = (4, 16);
    let x = backend.upload(&vec![bf16::ONE; rows * d]);
    let weight = backend.upload(&vec![bf16::ONE; d]);
    let r16 = backend.upload(&vec![f16::ONE; rows * d]);
    let r32 = backend.upload(&vec![1.0f32; rows * d]);
    let mut y = backend.upload(&vec![bf16::poison(); rows * d]);
    let mut h32 = backend.upload(&vec![f32::NAN; rows * d]);
    let mut h16 = backend.upload(&vec![f16::poison(); rows * d]);
    let mut dx = backend.upload(&vec![bf16::poison(); rows * d]);
    let mut dweight = backend.upload(&vec![bf16::poison(); d]);
    let workspace_len = layer_norm::workspace_len(rows, d).unwrap();
    let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));

    let r = rms_norm::forward(
        exec,
        NormForward::new(
            dense(B::input(&x, 0), rows, d),
            B::input(&weight, 0),
            dense(B::output(&mut y, 0), rows, d),
        )
        .residual(
            dense(B::input(&r32, 0), rows - 1, d),
            dense(B::output(&mut h32, 0), rows, d),
        ),
    );
    assert_eq!(rejected(r), "shape of residual");
    let r = layer_norm::forward(
        exec,
        NormForward::new(
            dense(B::input(&x, 0), rows, d),
            B::input(&weight, 0),
            dense(B::output(&mut y, 0), rows, d),
        )
        .residual(
            dense(B::input(&r32, 0), rows, d),
            Rows::with_stride(B::output(&mut h32, 0), rows, d - 1, d).unwrap(),
        ),
    );
    assert_eq!(rejected(r), "shape of residual_out");
    let r = rms_norm::forward(
        exec,
        NormForward::new(
            dense(B::input(&x, 0), rows, d),
            B::input(&weight, 0),
            dense(B::output(&mut y, 0), rows, d),
        )
        .residual(
            dense(B::input(&r16, 0), rows, d),
            dense(B::output(&mut h32, 0), rows, d),
        ),
    );
    assert_eq!(rejected(r), "dtype f16 of residual");
    let r = rms_norm::forward(
        exec,
        NormForward::new(
            dense(B::input(&x, 0), rows, d),
            B::input(&weight, 0),
            dense(B::output(&mut y, 0), rows, d),
        )
        .residual(
            dense(B::input(&r32, 0), rows, d),
            dense(B::output(&mut h16, 0), rows, d),
        ),
    );
    assert_eq!(rejected(r), "dtype f16 of residual_out");
    assert!(same_bits(
        &backend.download(&y),
        &vec![bf16::poison(); rows * d]
    ));
    assert!(
        backend.download(&h32).iter().all(|v| v.is_nan())
            && same_bits(&backend.download(&h16), &vec![f16::poison(); rows * d])
    );

    let r = rms_norm::backward(
        exec,
        NormBackward::new(
            dense(B::input(&x, 0), rows, d),
            dense(B::input(&r32, 0), rows, d),
            B::input(&weight, 0),
            dense(B::output(&mut dx, 0), rows, d),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        )
        .dresidual(dense(B::input(&r32, 0), rows, d - 1)),
    );
    assert_eq!(rejected(r), "shape of dresidual");
    let r = layer_norm::backward(
        exec,
        NormBackward::new(
            dense(B::input(&x, 0), rows, d),
            dense(B::input(&r16, 0), rows, d),
            B::input(&weight, 0),
            dense(B::output(&mut dx, 0), rows, d),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        ),
    );
    assert_eq!(rejected(r), "dtype f16 of x (residual_out)");
    let r = rms_norm::backward(
        exec,
        NormBackward::new(
            dense(B::input(&x, 0), rows, d),
            dense(B::input(&r32, 0), rows - 1, d),
            B::input(&weight, 0),
            dense(B::output(&mut dx, 0), rows, d),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        ),
    );
    assert_eq!(rejected(r), "shape of dy");
    assert!(
        same_bits(&backend.download(&dx), &vec![bf16::poison(); rows * d])
            && same_bits(&backend.download(&dweight), &vec![bf16::poison(); d]),
        "a rejected backward wrote output"
    );
}

#[test]
fn emulator_residual_bad_arguments_are_rejected_before_anything_is_written() {
    residual_bad_arguments_are_rejected(&emulator());
}

#[test]
fn gpu_residual_bad_arguments_are_rejected_before_anything_is_written() {
    let Some(gpu) = Device::shared() else { return };
    residual_bad_arguments_are_rejected(&gpu);
}
