//! RMSNorm and LayerNorm against the f64 reference: the references against finite differences,
//! validation without a GPU, the kernels in the CPU emulator, and the kernels on the GPU (skipped
//! with a printed reason when there is none).

use std::sync::Arc;

use half::{bf16, f16};
use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{Context, Emulator, Error, NormConfig, Rows, layer_norm, rms_norm};
use normkern_tests::reference::{layer_norm as layer_reference, rms_norm as reference};
use normkern_tests::{
    Rng, TestDtype, aligned_f32, assert_close, assert_close_each, floats_mut, gather_rows, gpu,
    rms, same_bits, to_f64,
};

const EPS: f32 = 1e-5;

/// Which norm a case runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Rms,
    /// LayerNorm, with or without β (and so dβ).
    Layer {
        bias: bool,
    },
}

const KINDS: [Kind; 3] = [
    Kind::Rms,
    Kind::Layer { bias: true },
    Kind::Layer { bias: false },
];

/// One forward + backward problem: rows laid `stride` apart after `offset` leading elements (an
/// offset of 1 breaks 16-byte alignment and forces the scalar path).
struct Case<T> {
    kind: Kind,
    rows: usize,
    d: usize,
    stride: usize,
    offset: usize,
    x: Vec<T>,
    dy: Vec<T>,
    gamma: Vec<T>,
    beta: Vec<T>,
    /// γ is used as `γ + gamma_offset`.
    gamma_offset: f32,
    /// The backward recomputes the statistics instead of reading the forward's.
    recompute: bool,
}

/// What a run produced, outputs in their padded buffers; what a norm does not produce (mean and
/// dβ of RMSNorm, dβ without bias) stays poison.
struct Outputs<T> {
    y: Vec<T>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
    dx: Vec<T>,
    dgamma: Vec<T>,
    dbeta: Vec<T>,
}

impl<T: TestDtype> PartialEq for Outputs<T> {
    /// Bitwise, padding included.
    fn eq(&self, other: &Self) -> bool {
        same_bits(&self.y, &other.y)
            && same_bits(&self.mean, &other.mean)
            && same_bits(&self.rstd, &other.rstd)
            && same_bits(&self.dx, &other.dx)
            && same_bits(&self.dgamma, &other.dgamma)
            && same_bits(&self.dbeta, &other.dbeta)
    }
}

impl<T: TestDtype> Case<T> {
    fn new(kind: Kind, rng: &mut Rng, rows: usize, d: usize, stride: usize, offset: usize) -> Self {
        let n = offset + rows.saturating_sub(1) * stride + d;
        Case {
            kind,
            rows,
            d,
            stride,
            offset,
            // Off-centre inputs, so LayerNorm's mean matters.
            x: rng.vec(n, -1.0, 3.0),
            dy: rng.vec(n, -1.0, 1.0),
            gamma: rng.vec(d, 0.5, 1.5),
            beta: rng.vec(d, -0.5, 0.5),
            gamma_offset: 0.0,
            recompute: false,
        }
    }

    /// Gemma-style γ (small, used as `1 + γ`) and a backward that recomputes its statistics.
    fn offset_and_recompute(mut self, rng: &mut Rng) -> Self {
        self.gamma = rng.vec(self.d, -0.5, 0.5);
        self.gamma_offset = 1.0;
        self.recompute = true;
        self
    }

    fn cfg(&self) -> NormConfig {
        NormConfig::new(EPS).with_gamma_offset(self.gamma_offset)
    }

    fn dense(kind: Kind, rng: &mut Rng, rows: usize, d: usize) -> Self {
        Self::new(kind, rng, rows, d, d, 0)
    }

    fn len(&self) -> usize {
        self.x.len()
    }

    fn workspace_len(&self) -> usize {
        match self.kind {
            Kind::Rms => rms_norm::workspace_len(self.rows, self.d),
            Kind::Layer { .. } => layer_norm::workspace_len(self.rows, self.d),
        }
    }

    fn poisoned(&self) -> Outputs<T> {
        Outputs {
            y: vec![T::poison(); self.len()],
            mean: vec![f32::NAN; self.rows],
            rstd: vec![f32::NAN; self.rows],
            dx: vec![T::poison(); self.len()],
            dgamma: vec![T::poison(); self.d],
            dbeta: vec![T::poison(); self.d],
        }
    }

    fn run_emulator(&self, emu: &Emulator) -> Outputs<T> {
        let mut out = self.poisoned();
        let (o, s, rows, d) = (self.offset, self.stride, self.rows, self.d);
        let x = Rows::with_stride(&self.x[o..], rows, d, s).unwrap();
        let dy = Rows::with_stride(&self.dy[o..], rows, d, s).unwrap();
        let cfg = self.cfg();
        let ws_len = self.workspace_len();
        let mut ws = aligned_f32(ws_len);
        let ws = floats_mut(&mut ws, ws_len);
        let mut y = Rows::with_stride(&mut out.y[o..], rows, d, s).unwrap();
        let mut dx = Rows::with_stride(&mut out.dx[o..], rows, d, s).unwrap();
        match self.kind {
            Kind::Rms => {
                emu.rms_norm_forward(&cfg, &x, &self.gamma, &mut y, Some(&mut out.rstd))
                    .unwrap();
                let rstd = (!self.recompute).then_some(&out.rstd[..]);
                emu.rms_norm_backward(
                    &cfg,
                    &dy,
                    &x,
                    &self.gamma,
                    rstd,
                    &mut dx,
                    &mut out.dgamma,
                    ws,
                )
                .unwrap();
            }
            Kind::Layer { bias } => {
                let beta = bias.then_some(&self.beta[..]);
                emu.layer_norm_forward(
                    &cfg,
                    &x,
                    &self.gamma,
                    beta,
                    &mut y,
                    Some(&mut out.mean),
                    Some(&mut out.rstd),
                )
                .unwrap();
                let dbeta = bias.then_some(&mut out.dbeta[..]);
                let stats = (!self.recompute).then_some((&out.mean[..], &out.rstd[..]));
                emu.layer_norm_backward(
                    &cfg,
                    &dy,
                    &x,
                    &self.gamma,
                    stats,
                    &mut dx,
                    &mut out.dgamma,
                    dbeta,
                    ws,
                )
                .unwrap();
            }
        }
        out
    }

    fn run_gpu(&self, ctx: &Context, stream: &Arc<CudaStream>) -> Outputs<T> {
        let poison = self.poisoned();
        let (o, s, rows, d) = (self.offset, self.stride, self.rows, self.d);
        let up = |v: &[T]| stream.clone_htod(v).unwrap();
        let up32 = |v: &[f32]| stream.clone_htod(v).unwrap();
        let (x, dy, gamma, beta) = (up(&self.x), up(&self.dy), up(&self.gamma), up(&self.beta));
        let (mut y, mut dx, mut dgamma, mut dbeta) = (
            up(&poison.y),
            up(&poison.dx),
            up(&poison.dgamma),
            up(&poison.dbeta),
        );
        let (mut mean, mut rstd) = (up32(&poison.mean), up32(&poison.rstd));
        let cfg = self.cfg();
        let mut ws = stream
            .alloc_zeros::<f32>(self.workspace_len().max(1))
            .unwrap();
        let xv = Rows::with_stride(x.slice(o..), rows, d, s).unwrap();
        let dyv = Rows::with_stride(dy.slice(o..), rows, d, s).unwrap();
        let mut yv = Rows::with_stride(y.slice_mut(o..), rows, d, s).unwrap();
        let mut dxv = Rows::with_stride(dx.slice_mut(o..), rows, d, s).unwrap();
        match self.kind {
            Kind::Rms => {
                rms_norm::forward(
                    ctx,
                    stream,
                    &cfg,
                    &xv,
                    &gamma.as_view(),
                    &mut yv,
                    Some(&mut rstd.as_view_mut()),
                )
                .unwrap();
                let rstd_view = rstd.as_view();
                rms_norm::backward(
                    ctx,
                    stream,
                    &cfg,
                    &dyv,
                    &xv,
                    &gamma.as_view(),
                    (!self.recompute).then_some(&rstd_view),
                    &mut dxv,
                    &mut dgamma.as_view_mut(),
                    &mut ws.as_view_mut(),
                )
                .unwrap();
            }
            Kind::Layer { bias } => {
                let beta_view = beta.as_view();
                layer_norm::forward(
                    ctx,
                    stream,
                    &cfg,
                    &xv,
                    &gamma.as_view(),
                    bias.then_some(&beta_view),
                    &mut yv,
                    Some(&mut mean.as_view_mut()),
                    Some(&mut rstd.as_view_mut()),
                )
                .unwrap();
                let mut dbeta_view = dbeta.as_view_mut();
                let (mean_view, rstd_view) = (mean.as_view(), rstd.as_view());
                layer_norm::backward(
                    ctx,
                    stream,
                    &cfg,
                    &dyv,
                    &xv,
                    &gamma.as_view(),
                    (!self.recompute).then_some((&mean_view, &rstd_view)),
                    &mut dxv,
                    &mut dgamma.as_view_mut(),
                    bias.then_some(&mut dbeta_view),
                    &mut ws.as_view_mut(),
                )
                .unwrap();
            }
        }
        stream.synchronize().unwrap();
        let down = |v: &CudaSlice<T>| stream.clone_dtoh(v).unwrap();
        let down32 = |v: &CudaSlice<f32>| stream.clone_dtoh(v).unwrap();
        Outputs {
            y: down(&y),
            mean: down32(&mean),
            rstd: down32(&rstd),
            dx: down(&dx),
            dgamma: down(&dgamma),
            dbeta: down(&dbeta),
        }
    }

    /// Compares every output with the f64 reference and checks that nothing outside the rows
    /// (leading offset, padding between rows) was written.
    fn check(&self, out: &Outputs<T>, what: &str) {
        let (rows, d, s, o) = (self.rows, self.d, self.stride, self.offset);
        let what = format!(
            "{what} {:?} {rows}×{d} stride {s} offset {o} {}",
            self.kind,
            T::NAME
        );
        let x = gather_rows(&self.x[o..], rows, d, s);
        let dy = gather_rows(&self.dy[o..], rows, d, s);
        // The kernels use γ + offset; dγ itself does not depend on γ.
        let gamma: Vec<f64> = to_f64(&self.gamma)
            .iter()
            .map(|g| g + self.gamma_offset as f64)
            .collect();
        let (y_ref, mean_ref, rstd_ref, dx_ref, dgamma_ref, dbeta_ref) = match self.kind {
            Kind::Rms => {
                let (y, rstd) = reference::forward(&x, &gamma, rows, d, EPS as f64);
                let (dx, dgamma) = reference::backward(&dy, &x, &gamma, rows, d, EPS as f64);
                (y, None, rstd, dx, dgamma, None)
            }
            Kind::Layer { bias } => {
                let beta = to_f64(&self.beta);
                let (y, mean, rstd) = layer_reference::forward(
                    &x,
                    &gamma,
                    bias.then_some(&beta[..]),
                    rows,
                    d,
                    EPS as f64,
                );
                let (dx, dgamma, dbeta) =
                    layer_reference::backward(&dy, &x, &gamma, rows, d, EPS as f64);
                (y, Some(mean), rstd, dx, dgamma, bias.then_some(dbeta))
            }
        };
        let (rel, abs) = T::TOLERANCE;
        let (rel32, abs32) = f32::TOLERANCE;
        // x − μ loses the rounding of μ (relative to |x| and |μ|), and rstd·γ amplifies it: a row
        // of nearly equal values (rstd near 1/sqrt(eps)) is ill-conditioned in any f32 LayerNorm.
        let y_scale = rms(&y_ref);
        let centre = |i: usize| mean_ref.as_ref().map_or(0.0, |m| m[i / d].abs());
        assert_close_each::<T>(
            &format!("{what}: y"),
            &gather_rows(&out.y[o..], rows, d, s),
            &y_ref,
            rel,
            |i| abs * y_scale.max(rstd_ref[i / d] * gamma[i % d].abs() * x[i].abs().max(centre(i))),
        );
        let as_f64 = |v: &[f32]| v.iter().map(|&r| r as f64).collect::<Vec<f64>>();
        assert_close::<f32>(
            &format!("{what}: rstd"),
            &as_f64(&out.rstd),
            &rstd_ref,
            rel32,
            abs32 * rms(&rstd_ref),
        );
        if let Some(mean_ref) = mean_ref {
            assert_close::<f32>(
                &format!("{what}: mean"),
                &as_f64(&out.mean),
                &mean_ref,
                rel32,
                abs32 * rms(&x),
            );
        }
        // dx = rstd·(dŷ − mean(dŷ) − x̂·mean(dŷ·x̂)) can cancel to far below its terms: judge it on
        // their scale, row by row. A row whose values nearly coincide has a huge rstd and (with
        // x̂² ≈ 1) cancels almost completely; the global scale would be far too strict there.
        let term: Vec<f64> = (0..rows * d)
            .map(|i| rstd_ref[i / d] * dy[i] * gamma[i % d])
            .collect();
        let row_scale: Vec<f64> = term.chunks(d).map(rms).collect();
        assert_close_each::<T>(
            &format!("{what}: dx"),
            &gather_rows(&out.dx[o..], rows, d, s),
            &dx_ref,
            rel,
            |i| abs * row_scale[i / d].max(term[i].abs()),
        );
        // dγ and dβ sum `rows` products in f32: rounding grows like sqrt(rows) before the store.
        let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
        let sqrt_rows = (rows as f64).sqrt();
        let dgamma_scale = rms(&dgamma_ref).max(rms(&term) * sqrt_rows);
        assert_close::<T>(
            &format!("{what}: dgamma"),
            &to_f64(&out.dgamma),
            &dgamma_ref,
            rel * growth,
            abs * growth * dgamma_scale,
        );
        match dbeta_ref {
            Some(dbeta_ref) => {
                let scale = rms(&dbeta_ref).max(rms(&dy) * sqrt_rows);
                assert_close::<T>(
                    &format!("{what}: dbeta"),
                    &to_f64(&out.dbeta),
                    &dbeta_ref,
                    rel * growth,
                    abs * growth * scale,
                );
            }
            None => assert!(
                out.dbeta.iter().all(|v| v.bits() == T::poison().bits()),
                "{what}: dbeta written without bias"
            ),
        }
        let poison = T::poison();
        for i in 0..self.len() {
            let inside = i >= o && (i - o) % s < d && (i - o) / s < rows;
            if !inside {
                assert_eq!(
                    out.y[i].bits(),
                    poison.bits(),
                    "{what}: y element {i} outside the rows was written"
                );
                assert_eq!(
                    out.dx[i].bits(),
                    poison.bits(),
                    "{what}: dx element {i} outside the rows was written"
                );
            }
        }
    }
}

#[test]
fn reference_matches_finite_differences() {
    let mut rng = Rng::fresh("reference_matches_finite_differences");
    let (rows, d, eps) = (3, 7, 1e-3);
    let x: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let gamma: Vec<f64> = (0..d).map(|_| rng.uniform(0.5, 1.5)).collect();
    let dy: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    // L = Σ dy ⊙ y, so ∂L/∂x and ∂L/∂γ are the backward's dx and dγ.
    let loss = |x: &[f64], gamma: &[f64]| {
        let (y, _) = reference::forward(x, gamma, rows, d, eps);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>()
    };
    let (dx, dgamma) = reference::backward(&dy, &x, &gamma, rows, d, eps);
    let h = 1e-6;
    for i in 0..rows * d {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp[i] += h;
        xm[i] -= h;
        let numeric = (loss(&xp, &gamma) - loss(&xm, &gamma)) / (2.0 * h);
        assert!(
            (numeric - dx[i]).abs() < 1e-6 * (1.0 + dx[i].abs()),
            "dx[{i}]: {numeric} vs {}",
            dx[i]
        );
    }
    for j in 0..d {
        let (mut gp, mut gm) = (gamma.clone(), gamma.clone());
        gp[j] += h;
        gm[j] -= h;
        let numeric = (loss(&x, &gp) - loss(&x, &gm)) / (2.0 * h);
        assert!(
            (numeric - dgamma[j]).abs() < 1e-6 * (1.0 + dgamma[j].abs()),
            "dgamma[{j}]: {numeric} vs {}",
            dgamma[j]
        );
    }
}

#[test]
fn layer_norm_reference_matches_finite_differences() {
    let mut rng = Rng::fresh("layer_norm_reference_matches_finite_differences");
    let (rows, d, eps) = (3, 7, 1e-3);
    let x: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-1.0, 3.0)).collect();
    let gamma: Vec<f64> = (0..d).map(|_| rng.uniform(0.5, 1.5)).collect();
    let beta: Vec<f64> = (0..d).map(|_| rng.uniform(-0.5, 0.5)).collect();
    let dy: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    // L = Σ dy ⊙ y, so ∂L/∂x, ∂L/∂γ and ∂L/∂β are the backward's dx, dγ and dβ.
    let loss = |x: &[f64], gamma: &[f64], beta: &[f64]| {
        let (y, _, _) = layer_reference::forward(x, gamma, Some(beta), rows, d, eps);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>()
    };
    let (dx, dgamma, dbeta) = layer_reference::backward(&dy, &x, &gamma, rows, d, eps);
    let h = 1e-6;
    let numeric = |which: usize, i: usize| {
        let mut args = [x.clone(), gamma.clone(), beta.clone()];
        args[which][i] += h;
        let plus = loss(&args[0], &args[1], &args[2]);
        args[which][i] -= 2.0 * h;
        (plus - loss(&args[0], &args[1], &args[2])) / (2.0 * h)
    };
    for (which, analytic) in [(0, &dx), (1, &dgamma), (2, &dbeta)] {
        for (i, a) in analytic.iter().enumerate() {
            let n = numeric(which, i);
            assert!(
                (n - a).abs() < 1e-6 * (1.0 + a.abs()),
                "gradient {which}[{i}]: {n} vs {a}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Validation: shared by the GPU and the emulator, so these run everywhere.

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

#[test]
fn bad_arguments_are_rejected_before_anything_is_written() {
    let mut rng = Rng::fresh("bad_arguments");
    let (rows, d) = (4, 16);
    let case = Case::<f32>::dense(Kind::Rms, &mut rng, rows, d);
    let emu = Emulator::new();
    let mut out = case.poisoned();
    let x = Rows::new(&case.x[..], rows, d).unwrap();
    let gamma = &case.gamma[..];
    let mut rstd = vec![f32::NAN; rows];

    let forward =
        |gamma: &[f32], eps: f32, y: &mut [f32], y_rows: usize, rstd: Option<&mut [f32]>| {
            let mut y = Rows::new(y, y_rows, d).unwrap();
            emu.rms_norm_forward(&NormConfig::new(eps), &x, gamma, &mut y, rstd)
        };
    for eps in [0.0, -1e-5, f32::NAN, f32::INFINITY] {
        assert!(
            matches!(
                forward(gamma, eps, &mut out.y, rows, None),
                Err(Error::Eps(_))
            ),
            "eps {eps}"
        );
    }
    let r = emu.rms_norm_forward(
        &NormConfig::new(EPS).with_gamma_offset(f32::NAN),
        &x,
        gamma,
        &mut Rows::new(&mut out.y[..], rows, d).unwrap(),
        None,
    );
    assert!(matches!(r, Err(Error::GammaOffset(_))), "{r:?}");
    assert!(matches!(
        forward(&gamma[1..], EPS, &mut out.y, rows, None),
        Err(Error::Length { what: "gamma", .. })
    ));
    assert!(matches!(
        forward(gamma, EPS, &mut out.y, rows - 1, None),
        Err(Error::Shape { what: "y", .. })
    ));
    assert!(matches!(
        forward(gamma, EPS, &mut out.y, rows, Some(&mut rstd[1..])),
        Err(Error::Length { what: "rstd", .. })
    ));
    assert!(
        out.y.iter().all(|v| v.is_nan()) && rstd.iter().all(|v| v.is_nan()),
        "a rejected call wrote output"
    );

    let dy = Rows::new(&case.dy[..], rows, d).unwrap();
    let ws_len = rms_norm::workspace_len(rows, d);
    let mut ws = aligned_f32(ws_len);
    let rstd = vec![0.5f32; rows];
    let mut backward =
        |dy_rows: usize, gamma: &[f32], rstd: &[f32], dgamma_len: usize, ws_len: usize| {
            let dy = Rows::new(&case.dy[..dy_rows * d], dy_rows, d).unwrap();
            let mut dx = Rows::new(&mut out.dx[..], rows, d).unwrap();
            emu.rms_norm_backward(
                &NormConfig::new(EPS),
                &dy,
                &x,
                gamma,
                Some(rstd),
                &mut dx,
                &mut out.dgamma[..dgamma_len],
                floats_mut(&mut ws, ws_len),
            )
        };
    assert!(matches!(
        backward(rows - 1, gamma, &rstd, d, ws_len),
        Err(Error::Shape { what: "dy", .. })
    ));
    assert!(matches!(
        backward(rows, &gamma[1..], &rstd, d, ws_len),
        Err(Error::Length { what: "gamma", .. })
    ));
    assert!(matches!(
        backward(rows, gamma, &rstd[1..], d, ws_len),
        Err(Error::Length { what: "rstd", .. })
    ));
    assert!(matches!(
        backward(rows, gamma, &rstd, d - 1, ws_len),
        Err(Error::Length { what: "dgamma", .. })
    ));
    assert!(matches!(
        backward(rows, gamma, &rstd, d, ws_len - 1),
        Err(Error::WorkspaceTooSmall { .. })
    ));
    assert!(
        out.dx.iter().all(|v| v.is_nan()) && out.dgamma.iter().all(|v| v.is_nan()),
        "a rejected call wrote output"
    );
    let _ = dy;
}

#[test]
fn layer_norm_bad_arguments_are_rejected_before_anything_is_written() {
    let (rows, d) = (4, 16);
    let x = vec![1.5f32; rows * d];
    let gamma = vec![1.0f32; d];
    let emu = Emulator::new();
    let xv = Rows::new(&x[..], rows, d).unwrap();
    let mut y = vec![f32::NAN; rows * d];
    let (mut mean, mut rstd) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
    let mut yv = Rows::new(&mut y[..], rows, d).unwrap();
    let cfg = NormConfig::new(EPS);
    let r = emu.layer_norm_forward(&cfg, &xv, &gamma, Some(&gamma[1..]), &mut yv, None, None);
    assert!(
        matches!(r, Err(Error::Length { what: "beta", .. })),
        "{r:?}"
    );
    let r = emu.layer_norm_forward(
        &cfg,
        &xv,
        &gamma,
        None,
        &mut yv,
        Some(&mut mean[1..]),
        Some(&mut rstd),
    );
    assert!(
        matches!(r, Err(Error::Length { what: "mean", .. })),
        "{r:?}"
    );
    let r = emu.layer_norm_forward(
        &NormConfig::new(-1.0),
        &xv,
        &gamma,
        None,
        &mut yv,
        Some(&mut mean),
        Some(&mut rstd),
    );
    assert!(matches!(r, Err(Error::Eps(_))), "{r:?}");
    assert!(
        y.iter().chain(&mean).chain(&rstd).all(|v| v.is_nan()),
        "a rejected forward wrote output"
    );

    let stats = vec![0.5f32; rows];
    let mut dx = vec![f32::NAN; rows * d];
    let (mut dgamma, mut dbeta) = (vec![f32::NAN; d], vec![f32::NAN; d]);
    let ws_len = layer_norm::workspace_len(rows, d);
    let mut ws = aligned_f32(ws_len);
    let mut dxv = Rows::new(&mut dx[..], rows, d).unwrap();
    let r = emu.layer_norm_backward(
        &cfg,
        &xv,
        &xv,
        &gamma,
        Some((&stats, &stats)),
        &mut dxv,
        &mut dgamma,
        Some(&mut dbeta[1..]),
        floats_mut(&mut ws, ws_len),
    );
    assert!(
        matches!(r, Err(Error::Length { what: "dbeta", .. })),
        "{r:?}"
    );
    let r = emu.layer_norm_backward(
        &cfg,
        &xv,
        &xv,
        &gamma,
        Some((&stats[1..], &stats)),
        &mut dxv,
        &mut dgamma,
        None,
        floats_mut(&mut ws, ws_len),
    );
    assert!(
        matches!(r, Err(Error::Length { what: "mean", .. })),
        "{r:?}"
    );
    let r = emu.layer_norm_backward(
        &cfg,
        &xv,
        &xv,
        &gamma,
        Some((&stats, &stats)),
        &mut dxv,
        &mut dgamma,
        None,
        floats_mut(&mut ws, ws_len - 1),
    );
    assert!(matches!(r, Err(Error::WorkspaceTooSmall { .. })), "{r:?}");
    assert!(
        dx.iter().chain(&dgamma).chain(&dbeta).all(|v| v.is_nan()),
        "a rejected backward wrote output"
    );
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
            assert!(groups <= 512, "rows {rows}, d {d}: {groups} groups");
            assert_eq!(rms_norm::workspace_len(rows, d), groups * d);
            assert_eq!(layer_norm::workspace_len(rows, d), 2 * groups * d);
            if d > 32768 {
                let narrow = normkern::group_layout(rows, 3);
                assert!(
                    busiest_of_15((per_group, groups)) <= busiest_of_15(narrow),
                    "rows {rows}, d {d}: {per_group} × {groups} balances worse than {narrow:?}"
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

// ---------------------------------------------------------------------------------------------
// The kernels in the CPU emulator: the same bodies that are compiled to PTX.

fn emulated_case<T: TestDtype>(
    kind: Kind,
    rng: &mut Rng,
    rows: usize,
    d: usize,
    stride: usize,
    offset: usize,
) {
    let case = Case::<T>::new(kind, rng, rows, d, stride, offset);
    let reference_run = case.run_emulator(&Emulator::new());
    case.check(&reference_run, "emulator");
    // Grid invariance: any number of blocks gives the same bits, dγ and dβ included.
    for blocks in [1, 3] {
        let out = case.run_emulator(&Emulator::new().with_grid_limit(blocks).unwrap());
        assert!(
            out == reference_run,
            "emulator {kind:?} {rows}×{d} {}: grid of {blocks} blocks changed the result",
            T::NAME
        );
    }
}

/// (rows, d, stride, offset): odd d, rows not a multiple of the 16-row group, packed and scalar
/// access, strided rows, and a row too wide for registers (the streaming instance).
const EMULATED_SHAPES: [(usize, usize, usize, usize); 8] = [
    (1, 1, 1, 0),
    (3, 7, 7, 0),
    (17, 64, 64, 0),
    (33, 64, 72, 0),
    (5, 127, 130, 1),
    (20, 1000, 1000, 0),
    (2, 1024, 1024, 1),
    (2, 8200, 8200, 1),
];

fn emulated_shapes<T: TestDtype>(kind: Kind, shapes: &[(usize, usize, usize, usize)]) {
    let mut rng = Rng::fresh(&format!("emulator_{kind:?}_{}", T::NAME));
    for &(rows, d, stride, offset) in shapes {
        emulated_case::<T>(kind, &mut rng, rows, d, stride, offset);
    }
}

#[test]
fn emulator_rms_norm_matches_reference_f32() {
    emulated_shapes::<f32>(Kind::Rms, &EMULATED_SHAPES);
}

#[test]
fn emulator_rms_norm_matches_reference_f16() {
    emulated_shapes::<f16>(Kind::Rms, &EMULATED_SHAPES);
}

#[test]
fn emulator_rms_norm_matches_reference_bf16() {
    emulated_shapes::<bf16>(Kind::Rms, &EMULATED_SHAPES);
}

#[test]
fn emulator_layer_norm_matches_reference_f32() {
    // The streaming instance (the last shape) is shared code: once, below, is enough for LayerNorm.
    emulated_shapes::<f32>(Kind::Layer { bias: true }, &EMULATED_SHAPES[..7]);
}

#[test]
fn emulator_layer_norm_matches_reference_f16() {
    // The streaming instance (the last shape) is shared code: once, below, is enough for LayerNorm.
    emulated_shapes::<f16>(Kind::Layer { bias: true }, &EMULATED_SHAPES[..7]);
}

#[test]
fn emulator_layer_norm_matches_reference_bf16() {
    // The streaming instance (the last shape) is shared code: once, below, is enough for LayerNorm.
    emulated_shapes::<bf16>(Kind::Layer { bias: true }, &EMULATED_SHAPES[..7]);
}

#[test]
fn emulator_gamma_offset_and_recomputed_statistics() {
    let mut rng = Rng::fresh("emulator_gamma_offset_and_recomputed_statistics");
    for kind in KINDS {
        // Register tiles (packed and scalar) and the streaming instance.
        for (rows, d, stride, offset) in [(17, 64, 64, 0), (5, 127, 130, 1), (2, 8200, 8200, 1)] {
            let case = Case::<f32>::new(kind, &mut rng, rows, d, stride, offset)
                .offset_and_recompute(&mut rng);
            case.check(
                &case.run_emulator(&Emulator::new()),
                "emulator offset+recompute",
            );
        }
    }
}

#[test]
fn emulator_layer_norm_without_bias_and_streaming_matches_reference() {
    let mut rng = Rng::fresh("emulator_layer_norm_without_bias");
    for (rows, d, stride, offset) in [(17, 64, 64, 0), (5, 127, 130, 1)] {
        emulated_case::<bf16>(
            Kind::Layer { bias: false },
            &mut rng,
            rows,
            d,
            stride,
            offset,
        );
    }
}

/// Rows split over clusters of blocks (sm_90's tiles for rows too wide for one block), reached
/// with small rows by capping the emulated block as registers cap it on a GPU: register tiles
/// over 2 and 8 blocks, the streaming instance over 2, and recomputed statistics. Each against
/// the reference, and bitwise the same on a grid of a single cluster.
#[test]
fn emulator_rows_split_over_clusters_match_reference() {
    let mut rng = Rng::fresh("emulator_clusters");
    // (rows, d, block limit, clusters up to): 2 × 64 threads × 4 packs; 8 × 32 × 4; streaming;
    // 2 × 64 × 4 again over two dγ groups (16 + 4 rows), reusing every mailbox slot and stage.
    let shapes = [
        (3, 2048, 64, 2),
        (2, 4096, 32, 8),
        (3, 1100, 32, 2),
        (20, 2048, 64, 2),
    ];
    for kind in [Kind::Rms, Kind::Layer { bias: true }] {
        for (i, &(rows, d, block_limit, clusters)) in shapes.iter().enumerate() {
            let emulator = |grid: Option<usize>| {
                let e = Emulator::new()
                    .with_block_limit(block_limit)
                    .unwrap()
                    .with_clusters(clusters)
                    .unwrap();
                grid.map_or(e, |blocks| e.with_grid_limit(blocks).unwrap())
            };
            let mut case = Case::<f32>::new(kind, &mut rng, rows, d, d, 0);
            // Recomputed statistics: a second reduction per row, also over several groups.
            if i == 0 || i == 3 {
                case = case.offset_and_recompute(&mut rng);
            }
            let out = case.run_emulator(&emulator(None));
            case.check(&out, "emulator clusters");
            assert!(
                case.run_emulator(&emulator(Some(1))) == out,
                "{kind:?} {rows}×{d}: one cluster at a time changed the result"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kernels on the GPU.

/// Every d of the acceptance list, each with a row count from its list so every count appears.
const GPU_SHAPES: [(usize, usize); 15] = [
    (16384, 1),
    (1000, 2),
    (64, 3),
    (3, 7),
    (2, 8),
    (1, 64),
    (1000, 127),
    (64, 1000),
    (16384, 1024),
    (1000, 4096),
    (64, 4097),
    (3, 8192),
    (4096, 16384),
    (2, 65536),
    (64, 65536),
];

fn gpu_shapes<T: TestDtype>(kind: Kind) {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh(&format!("gpu_{kind:?}_{}", T::NAME));
    for (rows, d) in GPU_SHAPES {
        let start = std::time::Instant::now();
        let case = Case::<T>::dense(kind, &mut rng, rows, d);
        case.check(&case.run_gpu(ctx, stream), "gpu");
        eprintln!(
            "gpu {kind:?} {} {rows}×{d}: ok in {:.2} s",
            T::NAME,
            start.elapsed().as_secs_f64()
        );
    }
    // Strided rows, and views one element off 16-byte alignment (the scalar path).
    for (rows, d, stride, offset) in [
        (1000, 4096, 4104, 0),
        (257, 4096, 4096, 1),
        (64, 1000, 1003, 3),
        (16, 65536, 65540, 1),
    ] {
        let case = Case::<T>::new(kind, &mut rng, rows, d, stride, offset);
        case.check(&case.run_gpu(ctx, stream), "gpu");
    }
}

/// Rows far too wide for registers (the streaming instances), up to 2²⁰ elements: exact, no limit.
#[test]
fn gpu_wide_rows_match_reference() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh("gpu_wide_rows");
    for kind in KINDS {
        for (rows, d, offset) in [
            (64, 65537, 0),
            (8, 262144, 0),
            (64, 1 << 20, 0),
            (3, 1 << 20, 1),
        ] {
            let case = Case::<bf16>::new(kind, &mut rng, rows, d, d, offset);
            case.check(&case.run_gpu(ctx, stream), "gpu wide");
        }
    }
}

#[test]
fn gpu_gamma_offset_and_recomputed_statistics() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh("gpu_gamma_offset_and_recomputed_statistics");
    for kind in KINDS {
        for (rows, d, stride, offset) in [
            (4096, 4096, 4096, 0),
            (257, 4097, 4100, 1),
            (16, 65536, 65536, 0),
        ] {
            let case = Case::<bf16>::new(kind, &mut rng, rows, d, stride, offset)
                .offset_and_recompute(&mut rng);
            case.check(&case.run_gpu(ctx, stream), "gpu offset+recompute");
        }
    }
}

#[test]
fn gpu_rms_norm_matches_reference_f32() {
    gpu_shapes::<f32>(Kind::Rms);
}

#[test]
fn gpu_rms_norm_matches_reference_f16() {
    gpu_shapes::<f16>(Kind::Rms);
}

#[test]
fn gpu_rms_norm_matches_reference_bf16() {
    gpu_shapes::<bf16>(Kind::Rms);
}

#[test]
fn gpu_layer_norm_matches_reference_f32() {
    gpu_shapes::<f32>(Kind::Layer { bias: true });
}

#[test]
fn gpu_layer_norm_matches_reference_f16() {
    gpu_shapes::<f16>(Kind::Layer { bias: true });
}

#[test]
fn gpu_layer_norm_matches_reference_bf16() {
    gpu_shapes::<bf16>(Kind::Layer { bias: true });
}

#[test]
fn gpu_backward_is_bitwise_repeatable_and_grid_invariant() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh("gpu_determinism");
    let limited = [3, 7].map(|blocks| {
        Context::from_cuda(ctx.cuda().clone())
            .unwrap()
            .with_grid_limit(blocks)
            .unwrap()
    });
    for (kind, rows, d) in KINDS
        .iter()
        .flat_map(|&k| [(k, 16384, 4096), (k, 1000, 4097), (k, 64, 65536)])
    {
        let case = Case::<bf16>::dense(kind, &mut rng, rows, d);
        let first = case.run_gpu(ctx, stream);
        case.check(&first, "gpu determinism");
        for run in 1..3 {
            assert!(
                case.run_gpu(ctx, stream) == first,
                "{rows}×{d}: run {run} differs bitwise from run 0"
            );
        }
        for small in &limited {
            let out = case.run_gpu(small, stream);
            assert!(
                same_bits(&out.dgamma, &first.dgamma),
                "{rows}×{d}: dgamma changed with a grid limit of {small:?}"
            );
            assert!(
                out == first,
                "{rows}×{d}: outputs changed with a grid limit of {small:?}"
            );
        }
    }
}

#[test]
fn gpu_zero_rows_is_a_no_op_and_dgamma_is_zero() {
    let Some((ctx, stream)) = gpu() else { return };
    let d = 64;
    let x = stream.alloc_zeros::<f16>(0).unwrap();
    let gamma = stream.clone_htod(&vec![f16::ONE; d]).unwrap();
    let mut y = stream.alloc_zeros::<f16>(0).unwrap();
    let xv = Rows::new(x.as_view(), 0, d).unwrap();
    let cfg = NormConfig::new(EPS);
    rms_norm::forward(
        ctx,
        stream,
        &cfg,
        &xv,
        &gamma.as_view(),
        &mut Rows::new(y.as_view_mut(), 0, d).unwrap(),
        None,
    )
    .unwrap();
    let rstd = stream.alloc_zeros::<f32>(0).unwrap();
    let mut dgamma = stream.clone_htod(&vec![f16::poison(); d]).unwrap();
    let mut ws = rms_norm::alloc_workspace(stream, 0, d).unwrap();
    rms_norm::backward(
        ctx,
        stream,
        &cfg,
        &xv,
        &xv,
        &gamma.as_view(),
        Some(&rstd.as_view()),
        &mut Rows::new(y.as_view_mut(), 0, d).unwrap(),
        &mut dgamma.as_view_mut(),
        &mut ws.as_view_mut(),
    )
    .unwrap();
    let dgamma = stream.clone_dtoh(&dgamma).unwrap();
    assert!(dgamma.iter().all(|v| *v == f16::ZERO), "{dgamma:?}");
}

#[test]
fn gpu_rejects_buffers_of_another_context() {
    let Some((ctx, stream)) = gpu() else { return };
    // A second, non-primary context on the same device: its buffers are not ours.
    let other = normkern::cudarc::driver::CudaContext::new_non_primary(0, 0).unwrap();
    let other_stream = other.default_stream();
    let (rows, d) = (2, 8);
    let x = other_stream.alloc_zeros::<f32>(rows * d).unwrap();
    let gamma = stream.alloc_zeros::<f32>(d).unwrap();
    let mut y = stream.clone_htod(&vec![f32::NAN; rows * d]).unwrap();
    let err = rms_norm::forward(
        ctx,
        stream,
        &NormConfig::new(EPS),
        &Rows::new(x.as_view(), rows, d).unwrap(),
        &gamma.as_view(),
        &mut Rows::new(y.as_view_mut(), rows, d).unwrap(),
        None,
    );
    assert!(
        matches!(err, Err(Error::WrongContext { what: "x" })),
        "{err:?}"
    );
    assert!(stream.clone_dtoh(&y).unwrap().iter().all(|v| v.is_nan()));
}

// ---------------------------------------------------------------------------------------------
// Mixed precision: bf16 activations with f32 γ/β and f32 dγ/dβ (PyTorch's CUDA path rejects it).

/// Outputs of one mixed-precision forward + backward: `(y, dx, dgamma, dbeta)`.
type MixedOutputs = (Vec<bf16>, Vec<bf16>, Vec<f32>, Vec<f32>);

/// Checks a mixed-precision run of `kind` against the reference on the same inputs.
#[allow(clippy::too_many_arguments)]
fn check_mixed(
    kind: Kind,
    rows: usize,
    d: usize,
    x: &[bf16],
    dy: &[bf16],
    gamma: &[f32],
    beta: &[f32],
    out: &MixedOutputs,
    what: &str,
) {
    let (xs, dys) = (to_f64(x), to_f64(dy));
    let (g, b): (Vec<f64>, Vec<f64>) = (
        gamma.iter().map(|&v| v as f64).collect(),
        beta.iter().map(|&v| v as f64).collect(),
    );
    let eps = EPS as f64;
    let (y_ref, dx_ref, dgamma_ref, dbeta_ref) = match kind {
        Kind::Rms => {
            let (y, _) = reference::forward(&xs, &g, rows, d, eps);
            let (dx, dgamma) = reference::backward(&dys, &xs, &g, rows, d, eps);
            (y, dx, dgamma, None)
        }
        Kind::Layer { .. } => {
            let (y, _, _) = layer_reference::forward(&xs, &g, Some(&b), rows, d, eps);
            let (dx, dgamma, dbeta) = layer_reference::backward(&dys, &xs, &g, rows, d, eps);
            (y, dx, dgamma, Some(dbeta))
        }
    };
    let (rel, abs) = bf16::TOLERANCE;
    let (rel32, abs32) = f32::TOLERANCE;
    assert_close::<bf16>(
        &format!("{what} {kind:?}: y"),
        &to_f64(&out.0),
        &y_ref,
        rel,
        abs * rms(&y_ref),
    );
    assert_close::<bf16>(
        &format!("{what} {kind:?}: dx"),
        &to_f64(&out.1),
        &dx_ref,
        rel,
        abs * rms(&dx_ref).max(rms(&dys)),
    );
    // f32 gradients: only f32 accumulation error, no final rounding to bf16.
    let slack = 1e-4 * (rows as f64).sqrt();
    assert_close::<f32>(
        &format!("{what} {kind:?}: dgamma (f32)"),
        &to_f64(&out.2),
        &dgamma_ref,
        rel32 + slack,
        (abs32 + slack) * rms(&dgamma_ref),
    );
    if let Some(dbeta_ref) = dbeta_ref {
        assert_close::<f32>(
            &format!("{what} {kind:?}: dbeta (f32)"),
            &to_f64(&out.3),
            &dbeta_ref,
            rel32 + slack,
            (abs32 + slack) * rms(&dbeta_ref),
        );
    }
}

fn mixed_inputs(
    rng: &mut Rng,
    rows: usize,
    d: usize,
) -> (Vec<bf16>, Vec<bf16>, Vec<f32>, Vec<f32>) {
    // γ with more precision than bf16 holds.
    let gamma: Vec<f32> = (0..d)
        .map(|_| rng.uniform(0.5, 1.5) as f32 + 1e-4)
        .collect();
    let beta: Vec<f32> = (0..d).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
    (
        rng.vec(rows * d, -1.0, 3.0),
        rng.vec(rows * d, -1.0, 1.0),
        gamma,
        beta,
    )
}

#[test]
fn emulator_mixed_precision_parameters() {
    let mut rng = Rng::fresh("emulator_mixed_precision");
    let emu = Emulator::new();
    let cfg = NormConfig::new(EPS);
    for kind in [Kind::Rms, Kind::Layer { bias: true }] {
        for (rows, d) in [(19, 136), (3, 127)] {
            let (x, dy, gamma, beta) = mixed_inputs(&mut rng, rows, d);
            let (mut y, mut dx) = (
                vec![bf16::poison(); rows * d],
                vec![bf16::poison(); rows * d],
            );
            let (mut dgamma, mut dbeta) = (vec![f32::NAN; d], vec![f32::NAN; d]);
            let (mut mean, mut rstd) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            let ws_len = layer_norm::workspace_len(rows, d);
            let mut ws = aligned_f32(ws_len);
            let (xv, dyv) = (
                Rows::new(&x[..], rows, d).unwrap(),
                Rows::new(&dy[..], rows, d).unwrap(),
            );
            let mut yv = Rows::new(&mut y[..], rows, d).unwrap();
            let mut dxv = Rows::new(&mut dx[..], rows, d).unwrap();
            let ws = floats_mut(&mut ws, ws_len);
            match kind {
                Kind::Rms => {
                    emu.rms_norm_forward(&cfg, &xv, &gamma, &mut yv, Some(&mut rstd))
                        .unwrap();
                    emu.rms_norm_backward(
                        &cfg,
                        &dyv,
                        &xv,
                        &gamma,
                        Some(&rstd),
                        &mut dxv,
                        &mut dgamma,
                        ws,
                    )
                    .unwrap();
                }
                Kind::Layer { .. } => {
                    emu.layer_norm_forward(
                        &cfg,
                        &xv,
                        &gamma,
                        Some(&beta),
                        &mut yv,
                        Some(&mut mean),
                        Some(&mut rstd),
                    )
                    .unwrap();
                    emu.layer_norm_backward(
                        &cfg,
                        &dyv,
                        &xv,
                        &gamma,
                        Some((&mean, &rstd)),
                        &mut dxv,
                        &mut dgamma,
                        Some(&mut dbeta),
                        ws,
                    )
                    .unwrap();
                }
            }
            check_mixed(
                kind,
                rows,
                d,
                &x,
                &dy,
                &gamma,
                &beta,
                &(y, dx, dgamma, dbeta),
                "emulator mixed",
            );
        }
    }
}

#[test]
fn unsupported_dtype_combinations_are_rejected() {
    let emu = Emulator::new();
    let cfg = NormConfig::new(EPS);
    let (rows, d) = (2, 8);
    let x = vec![bf16::ONE; rows * d];
    let mut y = vec![bf16::poison(); rows * d];
    let gamma_f16 = vec![f16::ONE; d];
    let r = emu.rms_norm_forward(
        &cfg,
        &Rows::new(&x[..], rows, d).unwrap(),
        &gamma_f16,
        &mut Rows::new(&mut y[..], rows, d).unwrap(),
        None,
    );
    assert!(
        matches!(
            r,
            Err(Error::UnsupportedDtypes {
                what: "gamma/beta",
                ..
            })
        ),
        "{r:?}"
    );
    let gamma_f32 = vec![1.0f32; d];
    let mut dgamma_bf16 = vec![bf16::poison(); d];
    let mut dx = vec![bf16::poison(); rows * d];
    let ws_len = rms_norm::workspace_len(rows, d);
    let mut ws = aligned_f32(ws_len);
    let r = emu.rms_norm_backward(
        &cfg,
        &Rows::new(&x[..], rows, d).unwrap(),
        &Rows::new(&x[..], rows, d).unwrap(),
        &gamma_f32,
        None,
        &mut Rows::new(&mut dx[..], rows, d).unwrap(),
        &mut dgamma_bf16,
        floats_mut(&mut ws, ws_len),
    );
    assert!(
        matches!(
            r,
            Err(Error::UnsupportedDtypes {
                what: "dgamma/dbeta",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(
        same_bits(&y, &vec![bf16::poison(); rows * d])
            && same_bits(&dx, &vec![bf16::poison(); rows * d])
    );
}

#[test]
fn gpu_mixed_precision_parameters() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh("gpu_mixed_precision");
    let cfg = NormConfig::new(EPS);
    for kind in [Kind::Rms, Kind::Layer { bias: true }] {
        for (rows, d) in [(4096, 4096), (1000, 4097), (16, 65536)] {
            let (x, dy, gamma, beta) = mixed_inputs(&mut rng, rows, d);
            let up = |v: &[bf16]| stream.clone_htod(v).unwrap();
            let (xd, dyd) = (up(&x), up(&dy));
            let (gd, bd) = (
                stream.clone_htod(&gamma).unwrap(),
                stream.clone_htod(&beta).unwrap(),
            );
            let (mut yd, mut dxd) = (
                up(&vec![bf16::poison(); rows * d]),
                up(&vec![bf16::poison(); rows * d]),
            );
            let mut dgamma = stream.clone_htod(&vec![f32::NAN; d]).unwrap();
            let mut dbeta = stream.clone_htod(&vec![f32::NAN; d]).unwrap();
            let mut mean = stream.alloc_zeros::<f32>(rows).unwrap();
            let mut rstd = stream.alloc_zeros::<f32>(rows).unwrap();
            let mut ws = layer_norm::alloc_workspace(stream, rows, d).unwrap();
            let (xv, dyv) = (
                Rows::new(xd.as_view(), rows, d).unwrap(),
                Rows::new(dyd.as_view(), rows, d).unwrap(),
            );
            let mut yv = Rows::new(yd.as_view_mut(), rows, d).unwrap();
            let mut dxv = Rows::new(dxd.as_view_mut(), rows, d).unwrap();
            match kind {
                Kind::Rms => {
                    rms_norm::forward(
                        ctx,
                        stream,
                        &cfg,
                        &xv,
                        &gd.as_view(),
                        &mut yv,
                        Some(&mut rstd.as_view_mut()),
                    )
                    .unwrap();
                    let rstd_view = rstd.as_view();
                    rms_norm::backward(
                        ctx,
                        stream,
                        &cfg,
                        &dyv,
                        &xv,
                        &gd.as_view(),
                        Some(&rstd_view),
                        &mut dxv,
                        &mut dgamma.as_view_mut(),
                        &mut ws.as_view_mut(),
                    )
                    .unwrap();
                }
                Kind::Layer { .. } => {
                    let beta_view = bd.as_view();
                    layer_norm::forward(
                        ctx,
                        stream,
                        &cfg,
                        &xv,
                        &gd.as_view(),
                        Some(&beta_view),
                        &mut yv,
                        Some(&mut mean.as_view_mut()),
                        Some(&mut rstd.as_view_mut()),
                    )
                    .unwrap();
                    let (mean_view, rstd_view) = (mean.as_view(), rstd.as_view());
                    let mut dbeta_view = dbeta.as_view_mut();
                    layer_norm::backward(
                        ctx,
                        stream,
                        &cfg,
                        &dyv,
                        &xv,
                        &gd.as_view(),
                        Some((&mean_view, &rstd_view)),
                        &mut dxv,
                        &mut dgamma.as_view_mut(),
                        Some(&mut dbeta_view),
                        &mut ws.as_view_mut(),
                    )
                    .unwrap();
                }
            }
            stream.synchronize().unwrap();
            let out = (
                stream.clone_dtoh(&yd).unwrap(),
                stream.clone_dtoh(&dxd).unwrap(),
                stream.clone_dtoh(&dgamma).unwrap(),
                stream.clone_dtoh(&dbeta).unwrap(),
            );
            check_mixed(kind, rows, d, &x, &dy, &gamma, &beta, &out, "gpu mixed");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Residual fusion: h = x + residual written to residual_out and normalized as stored; the
// backward takes residual_out as x and adds dresidual into dx.

/// One fused-residual forward + backward: activations (x, y, dy, dx, γ, β) in `T`, `residual` in
/// `R`, `residual_out` — and so the backward's x and `dresidual` — in `H`. Rows start after
/// `offset` elements; x/y/dy/dx, residual, residual_out and dresidual each have their own stride.
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
    gamma: Vec<T>,
    beta: Vec<T>,
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
    dgamma: Vec<T>,
    dbeta: Vec<T>,
}

impl<T: TestDtype, R: TestDtype, H: TestDtype> ResidualCase<T, R, H> {
    fn new(kind: Kind, rng: &mut Rng, rows: usize, d: usize, strides: [usize; 4]) -> Self {
        let offset = usize::from(d % 2 == 1);
        let n = |s: usize| offset + rows.saturating_sub(1) * s + d;
        ResidualCase {
            kind,
            rows,
            d,
            offset,
            strides,
            x: rng.vec(n(strides[0]), -1.0, 1.0),
            dy: rng.vec(n(strides[0]), -1.0, 1.0),
            // Off-centre, so LayerNorm's mean matters, and larger than x, as a residual stream is.
            residual: rng.vec(n(strides[1]), -1.0, 4.0),
            dresidual: rng.vec(n(strides[3]), -1.0, 1.0),
            gamma: rng.vec(d, 0.5, 1.5),
            beta: rng.vec(d, -0.5, 0.5),
            recompute: false,
        }
    }

    fn len(&self, which: usize) -> usize {
        self.offset + self.rows.saturating_sub(1) * self.strides[which] + self.d
    }

    fn poisoned(&self) -> ResidualOutputs<T, H> {
        ResidualOutputs {
            y: vec![T::poison(); self.len(0)],
            h: vec![H::poison(); self.len(2)],
            mean: vec![f32::NAN; self.rows],
            rstd: vec![f32::NAN; self.rows],
            dx: vec![T::poison(); self.len(0)],
            dgamma: vec![T::poison(); self.d],
            dbeta: vec![T::poison(); self.d],
        }
    }

    fn workspace_len(&self) -> usize {
        layer_norm::workspace_len(self.rows, self.d)
    }

    fn run_emulator(&self, emu: &Emulator) -> ResidualOutputs<T, H> {
        let mut out = self.poisoned();
        let (o, [s, sr, sh, sdr], rows, d) = (self.offset, self.strides, self.rows, self.d);
        let cfg = NormConfig::new(EPS);
        let x = Rows::with_stride(&self.x[o..], rows, d, s).unwrap();
        let dy = Rows::with_stride(&self.dy[o..], rows, d, s).unwrap();
        let residual = Rows::with_stride(&self.residual[o..], rows, d, sr).unwrap();
        let dresidual = Rows::with_stride(&self.dresidual[o..], rows, d, sdr).unwrap();
        let ws_len = self.workspace_len();
        let mut ws = aligned_f32(ws_len);
        let ws = floats_mut(&mut ws, ws_len);
        let mut y = Rows::with_stride(&mut out.y[o..], rows, d, s).unwrap();
        let mut h = Rows::with_stride(&mut out.h[o..], rows, d, sh).unwrap();
        let mut dx = Rows::with_stride(&mut out.dx[o..], rows, d, s).unwrap();
        match self.kind {
            Kind::Rms => {
                emu.rms_norm_forward_residual(
                    &cfg,
                    &x,
                    &residual,
                    &self.gamma,
                    &mut y,
                    &mut h,
                    Some(&mut out.rstd),
                )
                .unwrap();
                let h = Rows::with_stride(&h.into_inner()[..], rows, d, sh).unwrap();
                emu.rms_norm_backward_residual(
                    &cfg,
                    &dy,
                    &h,
                    &self.gamma,
                    (!self.recompute).then_some(&out.rstd[..]),
                    Some(&dresidual),
                    &mut dx,
                    &mut out.dgamma,
                    ws,
                )
                .unwrap();
            }
            Kind::Layer { bias } => {
                emu.layer_norm_forward_residual(
                    &cfg,
                    &x,
                    &residual,
                    &self.gamma,
                    bias.then_some(&self.beta[..]),
                    &mut y,
                    &mut h,
                    Some(&mut out.mean),
                    Some(&mut out.rstd),
                )
                .unwrap();
                let h = Rows::with_stride(&h.into_inner()[..], rows, d, sh).unwrap();
                emu.layer_norm_backward_residual(
                    &cfg,
                    &dy,
                    &h,
                    &self.gamma,
                    (!self.recompute).then_some((&out.mean[..], &out.rstd[..])),
                    Some(&dresidual),
                    &mut dx,
                    &mut out.dgamma,
                    bias.then_some(&mut out.dbeta[..]),
                    ws,
                )
                .unwrap();
            }
        }
        out
    }

    fn run_gpu(&self, ctx: &Context, stream: &Arc<CudaStream>) -> ResidualOutputs<T, H> {
        let poison = self.poisoned();
        let (o, [s, sr, sh, sdr], rows, d) = (self.offset, self.strides, self.rows, self.d);
        let cfg = NormConfig::new(EPS);
        let (x, dy, gamma, beta) = (
            stream.clone_htod(&self.x).unwrap(),
            stream.clone_htod(&self.dy).unwrap(),
            stream.clone_htod(&self.gamma).unwrap(),
            stream.clone_htod(&self.beta).unwrap(),
        );
        let residual = stream.clone_htod(&self.residual).unwrap();
        let dresidual = stream.clone_htod(&self.dresidual).unwrap();
        let mut y = stream.clone_htod(&poison.y).unwrap();
        let mut h = stream.clone_htod(&poison.h).unwrap();
        let mut dx = stream.clone_htod(&poison.dx).unwrap();
        let mut dgamma = stream.clone_htod(&poison.dgamma).unwrap();
        let mut dbeta = stream.clone_htod(&poison.dbeta).unwrap();
        let mut mean = stream.clone_htod(&poison.mean).unwrap();
        let mut rstd = stream.clone_htod(&poison.rstd).unwrap();
        let mut ws = stream.alloc_zeros::<f32>(self.workspace_len()).unwrap();
        let xv = Rows::with_stride(x.slice(o..), rows, d, s).unwrap();
        let dyv = Rows::with_stride(dy.slice(o..), rows, d, s).unwrap();
        let rv = Rows::with_stride(residual.slice(o..), rows, d, sr).unwrap();
        let drv = Rows::with_stride(dresidual.slice(o..), rows, d, sdr).unwrap();
        {
            let mut yv = Rows::with_stride(y.slice_mut(o..), rows, d, s).unwrap();
            let mut hv = Rows::with_stride(h.slice_mut(o..), rows, d, sh).unwrap();
            match self.kind {
                Kind::Rms => rms_norm::forward_residual(
                    ctx,
                    stream,
                    &cfg,
                    &xv,
                    &rv,
                    &gamma.as_view(),
                    &mut yv,
                    &mut hv,
                    Some(&mut rstd.as_view_mut()),
                ),
                Kind::Layer { bias } => layer_norm::forward_residual(
                    ctx,
                    stream,
                    &cfg,
                    &xv,
                    &rv,
                    &gamma.as_view(),
                    bias.then_some(&beta.as_view()),
                    &mut yv,
                    &mut hv,
                    Some(&mut mean.as_view_mut()),
                    Some(&mut rstd.as_view_mut()),
                ),
            }
            .unwrap();
        }
        let hv = Rows::with_stride(h.slice(o..), rows, d, sh).unwrap();
        let mut dxv = Rows::with_stride(dx.slice_mut(o..), rows, d, s).unwrap();
        let (mean_view, rstd_view) = (mean.as_view(), rstd.as_view());
        match self.kind {
            Kind::Rms => rms_norm::backward_residual(
                ctx,
                stream,
                &cfg,
                &dyv,
                &hv,
                &gamma.as_view(),
                (!self.recompute).then_some(&rstd_view),
                Some(&drv),
                &mut dxv,
                &mut dgamma.as_view_mut(),
                &mut ws.as_view_mut(),
            ),
            Kind::Layer { bias } => {
                let mut dbeta_view = dbeta.as_view_mut();
                layer_norm::backward_residual(
                    ctx,
                    stream,
                    &cfg,
                    &dyv,
                    &hv,
                    &gamma.as_view(),
                    (!self.recompute).then_some((&mean_view, &rstd_view)),
                    Some(&drv),
                    &mut dxv,
                    &mut dgamma.as_view_mut(),
                    bias.then_some(&mut dbeta_view),
                    &mut ws.as_view_mut(),
                )
            }
        }
        .unwrap();
        stream.synchronize().unwrap();
        ResidualOutputs {
            y: stream.clone_dtoh(&y).unwrap(),
            h: stream.clone_dtoh(&h).unwrap(),
            mean: stream.clone_dtoh(&mean).unwrap(),
            rstd: stream.clone_dtoh(&rstd).unwrap(),
            dx: stream.clone_dtoh(&dx).unwrap(),
            dgamma: stream.clone_dtoh(&dgamma).unwrap(),
            dbeta: stream.clone_dtoh(&dbeta).unwrap(),
        }
    }

    /// residual_out bit for bit (one f32 add, one rounding to `H`), every other output against the
    /// f64 reference run on h as stored, and nothing written outside the rows.
    fn check(&self, out: &ResidualOutputs<T, H>, what: &str) {
        let (o, [s, sr, sh, sdr], rows, d) = (self.offset, self.strides, self.rows, self.d);
        let what = format!(
            "{what} {:?} {rows}×{d} strides {:?} offset {o} x {} residual {} residual_out {}",
            self.kind,
            self.strides,
            T::NAME,
            R::NAME,
            H::NAME
        );
        for r in 0..rows {
            for j in 0..d {
                let sum = self.x[o + r * s + j].to_f64() as f32
                    + self.residual[o + r * sr + j].to_f64() as f32;
                let (expected, got) = (H::from_f32(sum), out.h[o + r * sh + j]);
                assert_eq!(
                    got.bits(),
                    expected.bits(),
                    "{what}: residual_out [{r}, {j}] = {got:?}, x + residual = {sum}"
                );
            }
        }
        let h = gather_rows(&out.h[o..], rows, d, sh);
        let dy = gather_rows(&self.dy[o..], rows, d, s);
        let dresidual = gather_rows(&self.dresidual[o..], rows, d, sdr);
        let gamma = to_f64(&self.gamma);
        let eps = EPS as f64;
        let (y_ref, rstd_ref, dx_norm, dgamma_ref, dbeta_ref) = match self.kind {
            Kind::Rms => {
                let (y, rstd) = reference::forward(&h, &gamma, rows, d, eps);
                let (dx, dgamma) = reference::backward(&dy, &h, &gamma, rows, d, eps);
                (y, rstd, dx, dgamma, None)
            }
            Kind::Layer { bias } => {
                let beta = to_f64(&self.beta);
                let beta = bias.then_some(&beta[..]);
                let (y, _, rstd) = layer_reference::forward(&h, &gamma, beta, rows, d, eps);
                let (dx, dgamma, dbeta) = layer_reference::backward(&dy, &h, &gamma, rows, d, eps);
                (y, rstd, dx, dgamma, bias.then_some(dbeta))
            }
        };
        let (rel, abs) = T::TOLERANCE;
        assert_close::<T>(
            &format!("{what}: y"),
            &gather_rows(&out.y[o..], rows, d, s),
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
            .map(|i| rstd_ref[i / d] * dy[i] * gamma[i % d])
            .collect();
        let row_scale: Vec<f64> = term.chunks(d).map(rms).collect();
        let dx_ref: Vec<f64> = dx_norm.iter().zip(&dresidual).map(|(a, b)| a + b).collect();
        assert_close_each::<T>(
            &format!("{what}: dx"),
            &gather_rows(&out.dx[o..], rows, d, s),
            &dx_ref,
            rel,
            |i| abs * row_scale[i / d].max(term[i].abs()).max(dresidual[i].abs()),
        );
        let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
        let dgamma_scale = rms(&dgamma_ref).max(rms(&term) * (rows as f64).sqrt());
        assert_close::<T>(
            &format!("{what}: dgamma"),
            &to_f64(&out.dgamma),
            &dgamma_ref,
            rel * growth,
            abs * growth * dgamma_scale,
        );
        if let Some(dbeta_ref) = dbeta_ref {
            let scale = rms(&dbeta_ref).max(rms(&dy) * (rows as f64).sqrt());
            assert_close::<T>(
                &format!("{what}: dbeta"),
                &to_f64(&out.dbeta),
                &dbeta_ref,
                rel * growth,
                abs * growth * scale,
            );
        }
        let inside = |i: usize, s: usize| i >= o && (i - o) % s < d && (i - o) / s < rows;
        for (i, v) in out.h.iter().enumerate() {
            if !inside(i, sh) {
                assert_eq!(v.bits(), H::poison().bits(), "{what}: residual_out [{i}]");
            }
        }
        for (i, (y, dx)) in out.y.iter().zip(&out.dx).enumerate() {
            if !inside(i, s) {
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

/// (rows, d, strides): single elements (odd d, so rows are shifted off 16-byte alignment: the
/// residual families stream then, every pass re-reading x + residual), and 16-byte packs in a
/// register tile, every operand on a stride of its own that keeps packs aligned (a multiple of 8
/// elements). Streaming with packs needs rows wider than the emulator runs quickly: the GPU tests
/// cover it.
type ResidualShape = (usize, usize, [usize; 4]);
const SCALAR: ResidualShape = (5, 127, [130, 129, 131, 133]);
const PACKED: ResidualShape = (3, 1000, [1000, 1016, 1008, 1024]);

fn emulated_residual<T: TestDtype, R: TestDtype, H: TestDtype>(cases: &[(Kind, ResidualShape)]) {
    let mut rng = Rng::fresh(&format!(
        "emulator_residual_{}_{}_{}",
        T::NAME,
        R::NAME,
        H::NAME
    ));
    for &(kind, (rows, d, strides)) in cases {
        let case = ResidualCase::<T, R, H>::new(kind, &mut rng, rows, d, strides);
        case.check(&case.run_emulator(&Emulator::new()), "emulator residual");
    }
}

const LAYER: Kind = Kind::Layer { bias: true };

#[test]
fn emulator_residual_in_the_activations_dtype() {
    emulated_residual::<bf16, bf16, bf16>(&[
        (Kind::Rms, SCALAR),
        (Kind::Rms, PACKED),
        (LAYER, SCALAR),
        (LAYER, PACKED),
    ]);
    emulated_residual::<f32, f32, f32>(&[(Kind::Rms, SCALAR)]);
}

#[test]
fn emulator_residual_stream_in_f32() {
    // The fp32 residual stream next to bf16 (or f16) activations, and the two mixed cases.
    emulated_residual::<bf16, f32, f32>(&[
        (Kind::Rms, SCALAR),
        (Kind::Rms, PACKED),
        (Kind::Layer { bias: false }, PACKED),
    ]);
    emulated_residual::<f16, f16, f32>(&[(Kind::Rms, SCALAR)]);
    emulated_residual::<bf16, f32, bf16>(&[(LAYER, PACKED)]);
}

#[test]
fn emulator_residual_recomputed_statistics() {
    let mut rng = Rng::fresh("emulator_residual_recomputed_statistics");
    for (kind, (rows, d, strides)) in [(Kind::Rms, SCALAR), (LAYER, PACKED)] {
        let mut case = ResidualCase::<bf16, f32, f32>::new(kind, &mut rng, rows, d, strides);
        case.recompute = true;
        case.check(
            &case.run_emulator(&Emulator::new()),
            "emulator residual recompute",
        );
    }
}

#[test]
fn emulator_residual_normalizes_what_it_stores() {
    // With packs and a register tile, the plain forward on residual_out runs the same reduction
    // order: y and rstd agree bit for bit with the fused forward's.
    let mut rng = Rng::fresh("emulator_residual_normalizes_what_it_stores");
    let (rows, d) = (3, 1000);
    let case = ResidualCase::<bf16, f32, bf16>::new(Kind::Rms, &mut rng, rows, d, [d; 4]);
    let fused = case.run_emulator(&Emulator::new());
    let (mut y, mut rstd) = (vec![bf16::poison(); rows * d], vec![f32::NAN; rows]);
    Emulator::new()
        .rms_norm_forward(
            &NormConfig::new(EPS),
            &Rows::new(&fused.h[..], rows, d).unwrap(),
            &case.gamma,
            &mut Rows::new(&mut y[..], rows, d).unwrap(),
            Some(&mut rstd),
        )
        .unwrap();
    assert!(same_bits(&y, &fused.y) && same_bits(&rstd, &fused.rstd));
}

/// Which argument a validation error names: `"shape of …"` or `"dtype D of …"`.
fn rejected(r: normkern::Result<()>) -> String {
    match r {
        Err(Error::Shape { what, .. }) => format!("shape of {what}"),
        Err(Error::UnsupportedDtypes { what, dtype, .. }) => format!("dtype {dtype} of {what}"),
        other => panic!("expected a shape or dtype error, got {other:?}"),
    }
}

#[test]
fn residual_bad_arguments_are_rejected_before_anything_is_written() {
    let (rows, d) = (4, 16);
    let emu = Emulator::new();
    let cfg = NormConfig::new(EPS);
    let x = vec![bf16::ONE; rows * d];
    let gamma = vec![bf16::ONE; d];
    let (r16, r32) = (vec![f16::ONE; rows * d], vec![1.0f32; rows * d]);
    let mut y = vec![bf16::poison(); rows * d];
    let mut h32 = vec![f32::NAN; rows * d];
    let mut h16 = vec![f16::poison(); rows * d];
    let xv = Rows::new(&x[..], rows, d).unwrap();
    let mut yv = Rows::new(&mut y[..], rows, d).unwrap();
    let r = emu.rms_norm_forward_residual(
        &cfg,
        &xv,
        &Rows::new(&r32[..d * (rows - 1)], rows - 1, d).unwrap(),
        &gamma,
        &mut yv,
        &mut Rows::new(&mut h32[..], rows, d).unwrap(),
        None,
    );
    assert_eq!(rejected(r), "shape of residual");
    let r = emu.layer_norm_forward_residual(
        &cfg,
        &xv,
        &Rows::new(&r32[..], rows, d).unwrap(),
        &gamma,
        None,
        &mut yv,
        &mut Rows::with_stride(&mut h32[..], rows, d - 1, d).unwrap(),
        None,
        None,
    );
    assert_eq!(rejected(r), "shape of residual_out");
    let r = emu.rms_norm_forward_residual(
        &cfg,
        &xv,
        &Rows::new(&r16[..], rows, d).unwrap(),
        &gamma,
        &mut yv,
        &mut Rows::new(&mut h32[..], rows, d).unwrap(),
        None,
    );
    assert_eq!(rejected(r), "dtype f16 of residual");
    let r = emu.rms_norm_forward_residual(
        &cfg,
        &xv,
        &Rows::new(&r32[..], rows, d).unwrap(),
        &gamma,
        &mut yv,
        &mut Rows::new(&mut h16[..], rows, d).unwrap(),
        None,
    );
    assert_eq!(rejected(r), "dtype f16 of residual_out");
    assert!(same_bits(&y, &vec![bf16::poison(); rows * d]));
    assert!(h32.iter().all(|v| v.is_nan()) && same_bits(&h16, &vec![f16::poison(); rows * d]));

    let mut dx = vec![bf16::poison(); rows * d];
    let mut dgamma = vec![bf16::poison(); d];
    let ws_len = layer_norm::workspace_len(rows, d);
    let mut ws = aligned_f32(ws_len);
    let hv = Rows::new(&r32[..], rows, d).unwrap();
    let r = emu.rms_norm_backward_residual(
        &cfg,
        &xv,
        &hv,
        &gamma,
        None,
        Some(&Rows::new(&r32[..], rows, d - 1).unwrap()),
        &mut Rows::new(&mut dx[..], rows, d).unwrap(),
        &mut dgamma,
        floats_mut(&mut ws, ws_len),
    );
    assert_eq!(rejected(r), "shape of dresidual");
    let r = emu.layer_norm_backward_residual(
        &cfg,
        &xv,
        &Rows::new(&r16[..], rows, d).unwrap(),
        &gamma,
        None,
        None,
        &mut Rows::new(&mut dx[..], rows, d).unwrap(),
        &mut dgamma,
        None,
        floats_mut(&mut ws, ws_len),
    );
    assert_eq!(rejected(r), "dtype f16 of x (residual_out)");
    let r = emu.rms_norm_backward_residual(
        &cfg,
        &xv,
        &Rows::new(&r32[..d * (rows - 1)], rows - 1, d).unwrap(),
        &gamma,
        None,
        None,
        &mut Rows::new(&mut dx[..], rows, d).unwrap(),
        &mut dgamma,
        floats_mut(&mut ws, ws_len),
    );
    assert_eq!(rejected(r), "shape of dy");
    assert!(
        same_bits(&dx, &vec![bf16::poison(); rows * d])
            && same_bits(&dgamma, &vec![bf16::poison(); d]),
        "a rejected backward wrote output"
    );
}

/// (rows, d, strides) on the GPU: the 4096-wide register tile, the widest register tile, rows
/// too wide for registers, and unaligned rows.
const GPU_RESIDUAL_SHAPES: [ResidualShape; 4] = [
    (4096, 4096, [4096, 4096, 4096, 4096]),
    (64, 8192, [8192, 8200, 8208, 8192]),
    (16, 65536, [65536; 4]),
    (1000, 4097, [4099, 4101, 4103, 4097]),
];

fn gpu_residual<T: TestDtype, R: TestDtype, H: TestDtype>() {
    let Some((ctx, stream)) = gpu() else { return };
    let mut rng = Rng::fresh(&format!("gpu_residual_{}_{}_{}", T::NAME, R::NAME, H::NAME));
    for kind in KINDS {
        for (rows, d, strides) in GPU_RESIDUAL_SHAPES {
            let mut case = ResidualCase::<T, R, H>::new(kind, &mut rng, rows, d, strides);
            case.recompute = kind == Kind::Layer { bias: false };
            case.check(&case.run_gpu(ctx, stream), "gpu residual");
        }
    }
}

#[test]
fn gpu_residual_matches_reference_bf16() {
    gpu_residual::<bf16, bf16, bf16>();
}

#[test]
fn gpu_residual_f32_stream_matches_reference_bf16() {
    gpu_residual::<bf16, f32, f32>();
}

#[test]
fn gpu_residual_matches_reference_mixed() {
    gpu_residual::<f16, f16, f32>();
    gpu_residual::<bf16, f32, bf16>();
    gpu_residual::<f32, f32, f32>();
}
