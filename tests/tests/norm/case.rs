//! One forward + backward problem ([`Case`]), run on either executor through a [`Backend`] and
//! checked against the f64 reference; and what every test of this target shares with it.

use normkern::{
    Dtype, Emulator, Executor, NormBackward, NormForward, ParamGradients, Result, Rows, layer_norm,
    rms_norm,
};
use normkern_gpu::column_sum::GROUP_SUMS_SYNC_WORDS;
use normkern_tests::backend::{Backend, Host};
use normkern_tests::reference::{layer_norm as layer_reference, rms_norm as rms_reference};
use normkern_tests::{
    Rng, TestDtype, assert_close, assert_close_each, gather_rows, rms, same_bits, to_f64,
};

pub const EPS: f32 = 1e-5;

/// The emulator as it comes: clusters of 2, a small persistent grid.
pub fn emulator() -> Host {
    Host(Emulator::new())
}

/// Which norm a case runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Rms,
    /// LayerNorm, with or without β (and so dβ).
    Layer {
        bias: bool,
    },
}

pub const KINDS: [Kind; 3] = [
    Kind::Rms,
    Kind::Layer { bias: true },
    Kind::Layer { bias: false },
];

impl Kind {
    /// This kind's forward.
    pub fn forward<E: Executor, T: Dtype, W: Dtype, R: Dtype, H: Dtype>(
        self,
        exec: &E,
        args: NormForward<'_, E, T, W, R, H>,
    ) -> Result<()> {
        match self {
            Kind::Rms => rms_norm::forward(exec, args),
            Kind::Layer { .. } => layer_norm::forward(exec, args),
        }
    }

    /// This kind's backward.
    pub fn backward<E: Executor, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
        self,
        exec: &E,
        args: NormBackward<'_, E, T, H, W, G>,
    ) -> Result<()> {
        match self {
            Kind::Rms => rms_norm::backward(exec, args),
            Kind::Layer { .. } => layer_norm::backward(exec, args),
        }
    }

    /// `args` with what this kind's forward saves and adds: rstd, and for LayerNorm the mean and
    /// the bias (when it has one).
    pub fn forward_args<'a, E: Executor, T: Dtype, W: Dtype, R: Dtype, H: Dtype>(
        self,
        args: NormForward<'a, E, T, W, R, H>,
        bias: E::In<'a, W>,
        mean: E::Out<'a, f32>,
        rstd: E::Out<'a, f32>,
    ) -> NormForward<'a, E, T, W, R, H> {
        let args = args.rstd(rstd);
        match self {
            Kind::Rms => args,
            Kind::Layer { bias: false } => args.mean(mean),
            Kind::Layer { bias: true } => args.mean(mean).bias(bias),
        }
    }

    /// `args` with the statistics the forward saved (none when `recompute`), and for LayerNorm
    /// with bias, dbias.
    pub fn backward_args<'a, E: Executor, T: Dtype, H: Dtype, W: Dtype, G: Dtype>(
        self,
        args: NormBackward<'a, E, T, H, W, G>,
        recompute: bool,
        (mean, rstd): (E::In<'a, f32>, E::In<'a, f32>),
        dbias: E::Out<'a, G>,
    ) -> NormBackward<'a, E, T, H, W, G> {
        let args = match (self, recompute) {
            (_, true) => args,
            (Kind::Rms, false) => args.rstd(rstd),
            (Kind::Layer { .. }, false) => args.mean_rstd(mean, rstd),
        };
        match self {
            Kind::Layer { bias: true } => args.dbias(dbias),
            _ => args,
        }
    }

    /// f32 elements of workspace this kind's backward needs.
    pub fn workspace_len(self, rows: usize, d: usize) -> usize {
        match self {
            Kind::Rms => rms_norm::workspace_len(rows, d),
            Kind::Layer { .. } => layer_norm::workspace_len(rows, d),
        }
        .unwrap()
    }
}

/// `rows × d` rows laid `stride` apart after `offset` leading elements of a buffer (an offset of
/// 1 breaks 16-byte alignment and forces single-element access).
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub rows: usize,
    pub d: usize,
    pub stride: usize,
    pub offset: usize,
}

/// `(rows, d, stride, offset)`.
pub type Shape = (usize, usize, usize, usize);

impl Layout {
    pub fn new((rows, d, stride, offset): Shape) -> Self {
        Layout {
            rows,
            d,
            stride,
            offset,
        }
    }

    /// Elements of a buffer that holds these rows.
    pub fn len(&self) -> usize {
        self.offset + self.rows.saturating_sub(1) * self.stride + self.d
    }

    /// Whether element `i` of the buffer belongs to a row.
    pub fn inside(&self, i: usize) -> bool {
        let (o, s) = (self.offset, self.stride);
        i >= o && (i - o) % s < self.d && (i - o) / s < self.rows
    }

    /// The rows of `buf`, as f64.
    pub fn gather<T: TestDtype>(&self, buf: &[T]) -> Vec<f64> {
        gather_rows(&buf[self.offset..], self.rows, self.d, self.stride)
    }

    /// The rows of `buf` as an input of `B`'s executor.
    pub fn input<'a, B: Backend, T: TestDtype>(
        &self,
        buf: &'a B::Buf<T>,
    ) -> Rows<<B::Exec as Executor>::In<'a, T>> {
        Rows::with_stride(B::input(buf, self.offset), self.rows, self.d, self.stride).unwrap()
    }

    /// The rows of `buf` as an output of `B`'s executor.
    pub fn output<'a, B: Backend, T: TestDtype>(
        &self,
        buf: &'a mut B::Buf<T>,
    ) -> Rows<<B::Exec as Executor>::Out<'a, T>> {
        Rows::with_stride(B::output(buf, self.offset), self.rows, self.d, self.stride).unwrap()
    }
}

/// One forward + backward problem: activations (x, y, dy, dx) in `T`, the weight and bias and
/// their gradients in `W` (f32 for mixed precision), all activations in one [`Layout`].
pub struct Case<T, W = T> {
    pub kind: Kind,
    pub layout: Layout,
    pub x: Vec<T>,
    pub dy: Vec<T>,
    pub weight: Vec<W>,
    pub bias: Vec<W>,
    /// The weight is used as `weight + weight_offset`.
    pub weight_offset: f32,
    /// The backward recomputes the statistics instead of reading the forward's.
    pub recompute: bool,
    /// How the backward sums dweight and dbias over rows.
    pub param_grads: ParamGradients,
}

/// What a run produced, outputs in their padded buffers, which start as poison; what a norm does
/// not produce (mean and dβ of RMSNorm, dβ without bias) stays poison.
pub struct Outputs<T, W = T> {
    pub y: Vec<T>,
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
    pub dx: Vec<T>,
    pub dweight: Vec<W>,
    pub dbias: Vec<W>,
}

impl<T: TestDtype, W: TestDtype> PartialEq for Outputs<T, W> {
    /// Bitwise, padding included.
    fn eq(&self, other: &Self) -> bool {
        same_bits(&self.y, &other.y)
            && same_bits(&self.mean, &other.mean)
            && same_bits(&self.rstd, &other.rstd)
            && same_bits(&self.dx, &other.dx)
            && same_bits(&self.dweight, &other.dweight)
            && same_bits(&self.dbias, &other.dbias)
    }
}

impl<T: TestDtype, W: TestDtype> Case<T, W> {
    pub fn new(kind: Kind, rng: &mut Rng, shape: Shape) -> Self {
        let layout = Layout::new(shape);
        let (n, d) = (layout.len(), layout.d);
        Case {
            kind,
            layout,
            // Off-centre inputs, so LayerNorm's mean matters.
            x: rng.vec(n, -1.0, 3.0),
            dy: rng.vec(n, -1.0, 1.0),
            weight: rng.vec(d, 0.5, 1.5),
            bias: rng.vec(d, -0.5, 0.5),
            weight_offset: 0.0,
            recompute: false,
            param_grads: ParamGradients::Auto,
        }
    }

    pub fn dense(kind: Kind, rng: &mut Rng, rows: usize, d: usize) -> Self {
        Self::new(kind, rng, (rows, d, d, 0))
    }

    /// Gemma-style weight (small, used as `1 + weight`) and a backward that recomputes its
    /// statistics.
    pub fn offset_and_recompute(mut self, rng: &mut Rng) -> Self {
        self.weight = rng.vec(self.layout.d, -0.5, 0.5);
        self.weight_offset = 1.0;
        self.recompute = true;
        self
    }

    /// The case in words, for messages.
    pub fn describe(&self) -> String {
        let Layout {
            rows,
            d,
            stride,
            offset,
        } = self.layout;
        format!(
            "{:?} {rows}×{d} stride {stride} offset {offset} {} (parameters {}) {:?}",
            self.kind,
            T::NAME,
            W::NAME,
            self.param_grads
        )
    }

    fn poisoned(&self) -> Outputs<T, W> {
        let (n, rows, d) = (self.layout.len(), self.layout.rows, self.layout.d);
        // Atomics add into the gradients: they start at zero (dβ only where there is one).
        let atomic = self.param_grads == ParamGradients::Atomic;
        let zero_or_poison = |zero| vec![if zero { W::from_f64(0.0) } else { W::poison() }; d];
        Outputs {
            y: vec![T::poison(); n],
            mean: vec![f32::NAN; rows],
            rstd: vec![f32::NAN; rows],
            dx: vec![T::poison(); n],
            dweight: zero_or_poison(atomic),
            dbias: zero_or_poison(atomic && self.kind == Kind::Layer { bias: true }),
        }
    }

    /// The forward (saving the statistics), then the backward (reading them unless `recompute`),
    /// on `backend`, every output poisoned first.
    pub fn run<B: Backend>(&self, backend: &B) -> Outputs<T, W> {
        self.try_run(backend).unwrap()
    }

    /// [`Self::run`], with the backward's error (the forward must succeed).
    pub fn try_run<B: Backend>(&self, backend: &B) -> Result<Outputs<T, W>> {
        let exec = backend.exec();
        let layout = self.layout;
        let poison = self.poisoned();
        let (x, dy) = (backend.upload(&self.x), backend.upload(&self.dy));
        let (weight, bias) = (backend.upload(&self.weight), backend.upload(&self.bias));
        let mut y = backend.upload(&poison.y);
        let mut mean = backend.upload(&poison.mean);
        let mut rstd = backend.upload(&poison.rstd);
        let mut dx = backend.upload(&poison.dx);
        let mut dweight = backend.upload(&poison.dweight);
        let mut dbias = backend.upload(&poison.dbias);
        let mut workspace_len = self.kind.workspace_len(layout.rows, layout.d);
        if self.param_grads == ParamGradients::LockedPartials {
            // Its locks and up to 16 partial rows per gradient.
            workspace_len += 16 + 32 * layout.d;
        }
        let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(workspace_len));

        let forward = NormForward::new(
            layout.input::<B, _>(&x),
            B::input(&weight, 0),
            layout.output::<B, _>(&mut y),
        )
        .eps(EPS)
        .weight_offset(self.weight_offset);
        let forward = self.kind.forward_args(
            forward,
            B::input(&bias, 0),
            B::output(&mut mean, 0),
            B::output(&mut rstd, 0),
        );
        self.kind.forward(exec, forward).unwrap();

        let backward = NormBackward::new(
            layout.input::<B, _>(&dy),
            layout.input::<B, _>(&x),
            B::input(&weight, 0),
            layout.output::<B, _>(&mut dx),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        )
        .eps(EPS)
        .weight_offset(self.weight_offset)
        .param_gradients(self.param_grads);
        let backward = self.kind.backward_args(
            backward,
            self.recompute,
            (B::input(&mean, 0), B::input(&rstd, 0)),
            B::output(&mut dbias, 0),
        );
        self.kind.backward(exec, backward)?;
        let sync = &backend.download(&workspace)[..GROUP_SUMS_SYNC_WORDS.min(workspace_len)];
        assert!(
            sync.iter().step_by(2).all(|c| c.to_bits() == 0),
            "{}: the backward left its barrier's arrivals at {sync:?}",
            self.describe()
        );

        Ok(Outputs {
            y: backend.download(&y),
            mean: backend.download(&mean),
            rstd: backend.download(&rstd),
            dx: backend.download(&dx),
            dweight: backend.download(&dweight),
            dbias: backend.download(&dbias),
        })
    }
}

/// `(y, mean, rstd, dx, dweight, dbias)` of `kind` in f64 on dense rows; the mean for LayerNorm
/// only, dβ for LayerNorm with bias only.
pub type Reference = (
    Vec<f64>,
    Option<Vec<f64>>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Option<Vec<f64>>,
);

/// The f64 reference of `kind` over dense `x` and `dy` (`bias` used by LayerNorm with bias).
pub fn reference(
    kind: Kind,
    (x, dy): (&[f64], &[f64]),
    weight: &[f64],
    bias: &[f64],
    rows: usize,
) -> Reference {
    let (d, eps) = (weight.len(), EPS as f64);
    match kind {
        Kind::Rms => {
            let (y, rstd) = rms_reference::forward(x, weight, rows, d, eps);
            let (dx, dweight) = rms_reference::backward(dy, x, weight, rows, d, eps);
            (y, None, rstd, dx, dweight, None)
        }
        Kind::Layer { bias: with_bias } => {
            let bias = with_bias.then_some(bias);
            let (y, mean, rstd) = layer_reference::forward(x, weight, bias, rows, d, eps);
            let (dx, dweight, dbias) = layer_reference::backward(dy, x, weight, rows, d, eps);
            (y, Some(mean), rstd, dx, dweight, with_bias.then_some(dbias))
        }
    }
}

impl<T: TestDtype> Case<T> {
    /// Compares every output with the f64 reference and checks that nothing outside the rows
    /// (leading offset, padding between rows) was written.
    pub fn check(&self, out: &Outputs<T>, what: &str) {
        let (rows, d) = (self.layout.rows, self.layout.d);
        let what = format!("{what} {}", self.describe());
        let x = self.layout.gather(&self.x);
        let dy = self.layout.gather(&self.dy);
        // The kernels use weight + offset; dweight itself does not depend on the weight.
        let weight: Vec<f64> = to_f64(&self.weight)
            .iter()
            .map(|g| g + self.weight_offset as f64)
            .collect();
        let (y_ref, mean_ref, rstd_ref, dx_ref, dweight_ref, dbias_ref) =
            reference(self.kind, (&x, &dy), &weight, &to_f64(&self.bias), rows);
        let (rel, abs) = T::TOLERANCE;
        let (rel32, abs32) = f32::TOLERANCE;
        // x − μ loses the rounding of μ (relative to |x| and |μ|), and rstd·γ amplifies it: a row
        // of nearly equal values (rstd near 1/sqrt(eps)) is ill-conditioned in any f32 LayerNorm.
        let y_scale = rms(&y_ref);
        let centre = |i: usize| mean_ref.as_ref().map_or(0.0, |m| m[i / d].abs());
        assert_close_each::<T>(
            &format!("{what}: y"),
            &self.layout.gather(&out.y),
            &y_ref,
            rel,
            |i| {
                abs * y_scale.max(rstd_ref[i / d] * weight[i % d].abs() * x[i].abs().max(centre(i)))
            },
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
            .map(|i| rstd_ref[i / d] * dy[i] * weight[i % d])
            .collect();
        let row_scale: Vec<f64> = term.chunks(d).map(rms).collect();
        assert_close_each::<T>(
            &format!("{what}: dx"),
            &self.layout.gather(&out.dx),
            &dx_ref,
            rel,
            |i| abs * row_scale[i / d].max(term[i].abs()),
        );
        // dweight and dbias sum `rows` products in f32: rounding grows like sqrt(rows) before the
        // store.
        let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
        let sqrt_rows = (rows as f64).sqrt();
        let dweight_scale = rms(&dweight_ref).max(rms(&term) * sqrt_rows);
        assert_close::<T>(
            &format!("{what}: dweight"),
            &to_f64(&out.dweight),
            &dweight_ref,
            rel * growth,
            abs * growth * dweight_scale,
        );
        match dbias_ref {
            Some(dbias_ref) => {
                let scale = rms(&dbias_ref).max(rms(&dy) * sqrt_rows);
                assert_close::<T>(
                    &format!("{what}: dbias"),
                    &to_f64(&out.dbias),
                    &dbias_ref,
                    rel * growth,
                    abs * growth * scale,
                );
            }
            None => assert!(
                out.dbias.iter().all(|v| v.bits() == T::poison().bits()),
                "{what}: dbias written without bias"
            ),
        }
        for i in (0..self.layout.len()).filter(|&i| !self.layout.inside(i)) {
            assert_eq!(
                out.y[i].bits(),
                T::poison().bits(),
                "{what}: y element {i} outside the rows was written"
            );
            assert_eq!(
                out.dx[i].bits(),
                T::poison().bits(),
                "{what}: dx element {i} outside the rows was written"
            );
        }
    }
}
