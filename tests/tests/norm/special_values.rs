//! Special values, as the `rms_norm` and `layer_norm` module docs state them: NaN and ±∞ in one
//! element of x (or of h = x + residual), dy, γ or β go through the formulas as PyTorch's do,
//! only the rows (or columns) they reach change, and f16 outputs past f16's range are ±∞.
//!
//! Each case is first run clean (its outputs against the f64 reference), then with special
//! values, each alone in its row (or column), checked element by element against the reference
//! run on the same inputs, classified as NaN, +∞, −∞ or finite, and against the clean run: what
//! the special values do not reach must be the same bits.

use half::{bf16, f16};
use normkern::{Emulator, NormBackward, NormForward};
use normkern_tests::backend::{Backend, Device, Host};
use normkern_tests::{Rng, TestDtype, to_f64};

use crate::case::{Case, EPS, Kind, Layout, Outputs, Shape, emulator, reference};

/// The class of a value: what the rule specifies exactly (dx of a row it reaches aside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Nan,
    PosInf,
    NegInf,
    Finite,
}

fn class(v: f64) -> Class {
    if v.is_nan() {
        Class::Nan
    } else if v == f64::INFINITY {
        Class::PosInf
    } else if v == f64::NEG_INFINITY {
        Class::NegInf
    } else {
        Class::Finite
    }
}

/// Where a special value goes: one element of x, of the residual stream (h = x + residual
/// carries it), of dy, of γ or of β.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Site {
    X,
    Residual,
    Dy,
    Weight,
    Bias,
}

const VALUES: [f64; 3] = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY];

/// `(row, column)` of `VALUES[n]` in a shape of at least 5 rows: each value in a row and column
/// of its own, with clean rows before and after it (and in the second dγ group when there is one).
fn position((rows, d, _, _): Shape, n: usize) -> (usize, usize) {
    assert!(rows >= 5, "special values need rows of their own");
    [(1, 0), (rows - 2, d / 2), (rows / 2, d - 1)][n]
}

/// One run's special values: `VALUES[n]` for each `n`, in `site`, each at its [`position`].
type Injection = (Site, &'static [usize]);

/// In x, a NaN alone (it makes every dγ column NaN, which would hide the columns ±∞ reach), then
/// ±∞ in two rows; in dy, γ and β, all three at once (each reaches its own column of dγ, dβ, y).
const PLAIN: [Injection; 5] = [
    (Site::X, &[0]),
    (Site::X, &[1, 2]),
    (Site::Dy, &[0, 1, 2]),
    (Site::Weight, &[0, 1, 2]),
    (Site::Bias, &[0, 1, 2]),
];

/// The residual form: the value in x or in the residual stream, carried by h.
const RESIDUAL: [Injection; 3] = [
    (Site::X, &[0]),
    (Site::Residual, &[1, 2]),
    (Site::Dy, &[0, 1, 2]),
];

/// The kinds the rule is stated for: RMSNorm, and LayerNorm with β (and so dβ).
const KINDS: [Kind; 2] = [Kind::Rms, Kind::Layer { bias: true }];

/// A [`Case`] with the residual add optionally fused in: `residual` and `dresidual` in x's
/// layout and dtype.
struct Problem<T> {
    case: Case<T>,
    residual: Option<(Vec<T>, Vec<T>)>,
}

/// What a run produced; `h` (residual_out) is empty without the residual.
struct Run<T> {
    out: Outputs<T>,
    h: Vec<T>,
}

/// Element `(r, j)` of a buffer laid out as `l`.
fn at(l: &Layout, r: usize, j: usize) -> usize {
    l.offset + r * l.stride + j
}

/// Root mean square of the finite values (0 for none).
fn rms_finite(v: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = v
        .into_iter()
        .filter(|v| v.is_finite())
        .fold((0.0, 0usize), |(s, n), v| (s + v * v, n + 1));
    (sum / n.max(1) as f64).sqrt()
}

fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() { v } else { 0.0 }
}

/// Asserts the class of `got` is the reference's, and a finite one is within `rel·|ref|` or `abs`.
/// `what` names the element (formatted only on failure: the GPU shapes have millions).
fn same_class_and_close(what: impl Fn() -> String, got: f64, reference: f64, rel: f64, abs: f64) {
    assert!(
        class(got) == class(reference),
        "{} = {got}, reference {reference}",
        what()
    );
    if reference.is_finite() {
        assert!(
            approx::relative_eq!(got, reference, epsilon = abs, max_relative = rel),
            "{} = {got}, reference {reference} (tolerance {rel:e} relative or {abs:e} absolute)",
            what()
        );
    }
}

impl<T: TestDtype> Problem<T> {
    fn new(kind: Kind, rng: &mut Rng, shape: Shape, residual: bool, recompute: bool) -> Self {
        let mut case = Case::<T>::new(kind, rng, shape);
        case.recompute = recompute;
        let len = case.layout.len();
        let residual = residual.then(|| (rng.vec(len, -1.0, 3.0), rng.vec(len, -1.0, 1.0)));
        Problem { case, residual }
    }

    /// A copy of this problem.
    fn copy(&self) -> Self {
        let c = &self.case;
        Problem {
            case: Case {
                kind: c.kind,
                layout: c.layout,
                x: c.x.clone(),
                dy: c.dy.clone(),
                weight: c.weight.clone(),
                bias: c.bias.clone(),
                weight_offset: c.weight_offset,
                recompute: c.recompute,
                param_grads: c.param_grads,
            },
            residual: self.residual.clone(),
        }
    }

    /// Sets `(r, j)` of `site` (`j` only for γ and β) to `value`.
    fn set(&mut self, site: Site, value: f64, (r, j): (usize, usize)) {
        let (i, v) = (at(&self.case.layout, r, j), T::from_f64(value));
        match site {
            Site::X => self.case.x[i] = v,
            Site::Residual => self.residual.as_mut().expect("a residual problem").0[i] = v,
            Site::Dy => self.case.dy[i] = v,
            Site::Weight => self.case.weight[j] = v,
            Site::Bias => self.case.bias[j] = v,
        }
    }

    /// This problem with the special values of `injection`, and where they are, in words.
    fn inject(&self, (site, values): Injection) -> (Self, String) {
        let l = self.case.layout;
        let mut p = self.copy();
        let mut place = Vec::new();
        for &n in values {
            let (r, j) = position((l.rows, l.d, l.stride, l.offset), n);
            p.set(site, VALUES[n], (r, j));
            place.push(match site {
                Site::Weight | Site::Bias => format!("{} at [{j}]", VALUES[n]),
                _ => format!("{} at [{r}, {j}]", VALUES[n]),
            });
        }
        (p, format!("{} in {site:?}", place.join(", ")))
    }

    fn describe(&self) -> String {
        let recompute = if self.case.recompute {
            ", statistics recomputed"
        } else {
            ", statistics saved"
        };
        let residual = if self.residual.is_some() {
            ", residual"
        } else {
            ""
        };
        format!("{}{recompute}{residual}", self.case.describe())
    }

    /// The forward (fused with the residual add when there is one, saving the statistics), then
    /// the backward on x (on h, adding dresidual), every output poisoned first.
    fn run<B: Backend>(&self, backend: &B) -> Run<T> {
        let Some((residual, dresidual)) = &self.residual else {
            return Run {
                out: self.case.run(backend),
                h: Vec::new(),
            };
        };
        let (case, exec) = (&self.case, backend.exec());
        let (layout, kind) = (case.layout, case.kind);
        let (n, rows, d) = (layout.len(), layout.rows, layout.d);
        let (x, dy) = (backend.upload(&case.x), backend.upload(&case.dy));
        let (weight, bias) = (backend.upload(&case.weight), backend.upload(&case.bias));
        let residual = backend.upload(residual);
        let dresidual = backend.upload(dresidual);
        let [mut y, mut h, mut dx] = [0; 3].map(|_| backend.upload(&vec![T::poison(); n]));
        let [mut mean, mut rstd] = [0; 2].map(|_| backend.upload(&vec![f32::NAN; rows]));
        let [mut dweight, mut dbias] = [0; 2].map(|_| backend.upload(&vec![T::poison(); d]));
        let mut workspace = backend.upload(&normkern_tests::poisoned_workspace(
            kind.workspace_len(rows, d),
        ));

        let forward = NormForward::new(
            layout.input::<B, _>(&x),
            B::input(&weight, 0),
            layout.output::<B, _>(&mut y),
        )
        .eps(EPS)
        .residual(
            layout.input::<B, _>(&residual),
            layout.output::<B, _>(&mut h),
        );
        let forward = kind.forward_args(
            forward,
            B::input(&bias, 0),
            B::output(&mut mean, 0),
            B::output(&mut rstd, 0),
        );
        kind.forward(exec, forward).unwrap();

        let backward = NormBackward::new(
            layout.input::<B, _>(&dy),
            layout.input::<B, _>(&h),
            B::input(&weight, 0),
            layout.output::<B, _>(&mut dx),
            B::output(&mut dweight, 0),
            B::output(&mut workspace, 0),
        )
        .eps(EPS)
        .dresidual(layout.input::<B, _>(&dresidual));
        let backward = kind.backward_args(
            backward,
            case.recompute,
            (B::input(&mean, 0), B::input(&rstd, 0)),
            B::output(&mut dbias, 0),
        );
        kind.backward(exec, backward).unwrap();

        Run {
            out: Outputs {
                y: backend.download(&y),
                mean: backend.download(&mean),
                rstd: backend.download(&rstd),
                dx: backend.download(&dx),
                dweight: backend.download(&dweight),
                dbias: backend.download(&dbias),
            },
            h: backend.download(&h),
        }
    }

    /// The rule, element by element, on `got`; `clean` is the run of the same problem without
    /// the special value (or `got` itself for a clean problem).
    ///
    /// - h (residual): `T(x + residual)`, bit for bit; special values included.
    /// - y, μ, rstd, dγ, dβ: the reference's class, and close to it where finite.
    /// - dx: every element non-finite in a row holding a special value in x (h) or dy, and in
    ///   every row when γ holds one; finite and close to the reference elsewhere.
    /// - Whatever the special value does not reach (other rows; other columns of y for γ and β;
    ///   the whole backward for β, dγ and dβ for γ): the clean run's bits.
    /// - Every element of the rows written (no poison left), nothing outside them.
    fn check(&self, got: &Run<T>, clean: &Run<T>, what: &str) {
        let case = &self.case;
        let (l, kind) = (case.layout, case.kind);
        let (rows, d) = (l.rows, l.d);
        let what = format!("{what} {}", self.describe());
        let inside = |i: usize| l.inside(i);
        for (name, buf) in [("y", &got.out.y), ("dx", &got.out.dx), ("h", &got.h)] {
            for (i, v) in buf.iter().enumerate() {
                let poison = v.bits() == T::poison().bits();
                assert_eq!(
                    poison,
                    !inside(i),
                    "{what}: {name} element {i} {} the rows is {v:?}",
                    if inside(i) { "inside" } else { "outside" }
                );
            }
        }
        let has_bias = kind == Kind::Layer { bias: true };
        for (name, buf, written) in [
            ("dweight", &got.out.dweight, true),
            ("dbias", &got.out.dbias, has_bias),
        ] {
            for (j, v) in buf.iter().enumerate() {
                assert_eq!(
                    v.bits() != T::poison().bits(),
                    written,
                    "{what}: {name} [{j}] = {v:?}"
                );
            }
        }

        // The row the norm sees: x, or h as stored.
        let x = match &self.residual {
            Some((residual, _)) => {
                for r in 0..rows {
                    for j in 0..d {
                        let i = at(&l, r, j);
                        let sum = case.x[i].to_f64() as f32 + residual[i].to_f64() as f32;
                        // A NaN's payload is not specified (the GPU's adds give 0x7fffffff, the
                        // host's 0x7fc00000): NaN must stay NaN, anything else keeps its bits.
                        let same = if sum.is_nan() {
                            got.h[i].to_f64().is_nan()
                        } else {
                            got.h[i].bits() == T::from_f32(sum).bits()
                        };
                        assert!(
                            same,
                            "{what}: h [{r}, {j}] = {:?}, x + residual = {sum}",
                            got.h[i]
                        );
                    }
                }
                l.gather(&got.h)
            }
            None => l.gather(&case.x),
        };
        let dy = l.gather(&case.dy);
        let dresidual = self.residual.as_ref().map(|(_, dr)| l.gather(dr));
        let (weight, bias) = (to_f64(&case.weight), to_f64(&case.bias));
        let (y_ref, mean_ref, rstd_ref, dx_ref, dweight_ref, dbias_ref) =
            reference(kind, (&x, &dy), &weight, &bias, rows);
        let mean_of = |r: usize| mean_ref.as_ref().map_or(0.0, |m| m[r]);

        let non_finite = |v: &[f64]| v.iter().any(|v| !v.is_finite());
        let x_special: Vec<bool> = x.chunks(d).map(non_finite).collect();
        let dy_special: Vec<bool> = dy.chunks(d).map(non_finite).collect();
        let weight_special: Vec<bool> = weight.iter().map(|w| !w.is_finite()).collect();
        let bias_special: Vec<bool> = bias.iter().map(|b| has_bias && !b.is_finite()).collect();
        let any_weight_special = weight_special.contains(&true);
        let any_row_special = x_special.contains(&true) || dy_special.contains(&true);

        let (rel, abs) = T::TOLERANCE;
        let (rel32, abs32) = f32::TOLERANCE;
        let same_bits = |name: &str, r: usize, j: usize, a: &[T], b: &[T]| {
            let i = at(&l, r, j);
            assert_eq!(
                a[i].bits(),
                b[i].bits(),
                "{what}: {name} [{r}, {j}] = {:?} differs from the run without the special value ({:?})",
                a[i],
                b[i]
            );
        };

        // y: the reference's class everywhere, as in Case::check where finite.
        let y_scale = rms_finite(y_ref.iter().copied());
        for r in 0..rows {
            for j in 0..d {
                let k = r * d + j;
                let got_y = got.out.y[at(&l, r, j)].to_f64();
                let term = finite_or_zero(rstd_ref[r])
                    * finite_or_zero(weight[j]).abs()
                    * finite_or_zero(x[k])
                        .abs()
                        .max(finite_or_zero(mean_of(r)).abs());
                let tolerance = abs * y_scale.max(term);
                same_class_and_close(
                    || format!("{what}: y [{r}, {j}]"),
                    got_y,
                    y_ref[k],
                    rel,
                    tolerance,
                );
                if x_special[r] && y_ref[k] == 0.0 {
                    // RMSNorm's finite elements of a row holding ±∞: x·0·γ.
                    assert_eq!(got_y, 0.0, "{what}: y [{r}, {j}] of a row holding ±∞");
                }
                if !x_special[r] && !weight_special[j] && !bias_special[j] {
                    same_bits("y", r, j, &got.out.y, &clean.out.y);
                }
            }
        }

        // The saved statistics: the reference's class; other rows untouched.
        let stats = [
            ("rstd", &got.out.rstd, &clean.out.rstd, Some(&rstd_ref)),
            ("mean", &got.out.mean, &clean.out.mean, mean_ref.as_ref()),
        ];
        for (name, out, clean_out, reference) in stats {
            let Some(reference) = reference else { continue };
            let scale = if name == "rstd" {
                rms_finite(reference.iter().copied())
            } else {
                rms_finite(x.iter().copied())
            };
            for r in 0..rows {
                let (g, c) = (out[r], clean_out[r]);
                same_class_and_close(
                    || format!("{what}: {name} [{r}]"),
                    g as f64,
                    reference[r],
                    rel32,
                    abs32 * scale,
                );
                if !x_special[r] {
                    assert_eq!(
                        g.to_bits(),
                        c.to_bits(),
                        "{what}: {name} [{r}] = {g}, clean {c}"
                    );
                }
            }
        }

        // dx: non-finite (of any class) throughout a row the special value reaches; elsewhere
        // finite, as in Case::check, and the clean run's bits.
        let term: Vec<f64> = (0..rows * d)
            .map(|k| {
                finite_or_zero(rstd_ref[k / d] * dy[k] * weight[k % d])
                    .abs()
                    .max(dresidual.as_ref().map_or(0.0, |dr| dr[k].abs()))
            })
            .collect();
        for r in 0..rows {
            let row_scale = rms_finite(term[r * d..(r + 1) * d].iter().copied());
            for j in 0..d {
                let k = r * d + j;
                let got_dx = got.out.dx[at(&l, r, j)].to_f64();
                let dx_ref = dx_ref[k] + dresidual.as_ref().map_or(0.0, |dr| dr[k]);
                if x_special[r] || dy_special[r] || any_weight_special {
                    assert!(
                        !got_dx.is_finite(),
                        "{what}: dx [{r}, {j}] = {got_dx} in a row a special value reaches (reference {dx_ref})"
                    );
                } else {
                    let tolerance = abs * row_scale.max(term[k]);
                    same_class_and_close(
                        || format!("{what}: dx [{r}, {j}]"),
                        got_dx,
                        dx_ref,
                        rel,
                        tolerance,
                    );
                    same_bits("dx", r, j, &got.out.dx, &clean.out.dx);
                }
            }
        }

        // dγ and dβ: the reference's class column by column (the columns the special value
        // reaches), close where finite; γ and β do not enter them.
        let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
        let sqrt_rows = (rows as f64).sqrt();
        let x_hat_dy = (0..rows * d).map(|k| {
            let r = k / d;
            dy[k] * (x[k] - mean_of(r)) * rstd_ref[r]
        });
        let sums = [
            (
                "dweight",
                &got.out.dweight,
                &clean.out.dweight,
                Some(&dweight_ref),
                rms_finite(x_hat_dy),
            ),
            (
                "dbias",
                &got.out.dbias,
                &clean.out.dbias,
                dbias_ref.as_ref(),
                rms_finite(dy.iter().copied()),
            ),
        ];
        for (name, out, clean_out, reference, term_scale) in sums {
            let Some(reference) = reference else { continue };
            let scale = rms_finite(reference.iter().copied()).max(term_scale * sqrt_rows);
            for j in 0..d {
                same_class_and_close(
                    || format!("{what}: {name} [{j}]"),
                    out[j].to_f64(),
                    reference[j],
                    rel * growth,
                    abs * growth * scale,
                );
                if !any_row_special {
                    assert_eq!(
                        out[j].bits(),
                        clean_out[j].bits(),
                        "{what}: {name} [{j}] = {:?} differs from the run without the special value ({:?})",
                        out[j],
                        clean_out[j]
                    );
                }
            }
        }
    }
}

/// Every kind, shape, saved and recomputed statistics and injection on `backend`: a clean run
/// against the reference, then a run per injection against the rule and the clean run. γ and β
/// take their special values with saved statistics only (the statistics do not see them).
fn special_values<T: TestDtype, B: Backend>(
    backend: &B,
    shapes: &[Shape],
    residual: bool,
    injections: &[Injection],
) {
    let what = format!("{} special values", backend.name());
    let mut rng = Rng::fresh(&format!("{what} {} residual {residual}", T::NAME));
    for kind in KINDS {
        for &shape in shapes {
            for recompute in [false, true] {
                let clean = Problem::<T>::new(kind, &mut rng, shape, residual, recompute);
                let clean_run = clean.run(backend);
                clean.check(&clean_run, &clean_run, &format!("{what}: clean"));
                for &(site, values) in injections {
                    let parameter = matches!(site, Site::Weight | Site::Bias);
                    if (site == Site::Bias && kind == Kind::Rms) || (parameter && recompute) {
                        continue;
                    }
                    let (special, place) = clean.inject((site, values));
                    special.check(
                        &special.run(backend),
                        &clean_run,
                        &format!("{what}: {place}"),
                    );
                }
            }
        }
    }
}

/// One f16 output against its f64 reference: ±∞ of the reference's sign where the reference
/// rounds past f16's range even at the far edge of the tolerance, finite and close where it stays
/// inside even at the near edge, either in between; never NaN. Returns whether it is infinite.
fn judge_f16(what: impl Fn() -> String, got: f64, reference: f64, rel: f64, abs: f64) -> bool {
    // f16::MAX, and halfway from it to 2¹⁶: from there a value rounds (to even) to ∞.
    const MAX: f64 = 65504.0;
    const ROUNDS_TO_INFINITY: f64 = 65520.0;
    let tolerance = abs.max(rel * reference.abs());
    let infinite = got.is_infinite() && got.signum() == reference.signum();
    let close = got.is_finite() && (got - reference).abs() <= tolerance;
    let ok = if reference.abs() - tolerance >= ROUNDS_TO_INFINITY {
        infinite
    } else if reference.abs() + tolerance < MAX {
        close
    } else {
        infinite || close
    };
    assert!(
        ok,
        "{} = {got}, reference {reference} (tolerance {tolerance:e}; past {ROUNDS_TO_INFINITY} it must be ±∞)",
        what()
    );
    got.is_infinite()
}

/// f16 outputs whose values lie past f16's range: ±∞, not NaN and not clamped to ±65504. Counts
/// the infinite y, dx, dγ and dβ into `overflowed`.
fn check_f16_overflow(p: &Problem<f16>, got: &Run<f16>, overflowed: &mut [usize; 4], what: &str) {
    let case = &p.case;
    let (l, kind) = (case.layout, case.kind);
    let (rows, d) = (l.rows, l.d);
    let what = format!("{what} {}", p.describe());
    let (x, dy) = (l.gather(&case.x), l.gather(&case.dy));
    let (weight, bias) = (to_f64(&case.weight), to_f64(&case.bias));
    let (y_ref, mean_ref, rstd_ref, dx_ref, dweight_ref, dbias_ref) =
        reference(kind, (&x, &dy), &weight, &bias, rows);
    let mean_of = |r: usize| mean_ref.as_ref().map_or(0.0, |m| m[r]);
    let (rel, abs) = f16::TOLERANCE;
    let y_scale = rms_finite(y_ref.iter().copied());
    let term: Vec<f64> = (0..rows * d)
        .map(|k| (rstd_ref[k / d] * dy[k] * weight[k % d]).abs())
        .collect();
    for r in 0..rows {
        let row_scale = rms_finite(term[r * d..(r + 1) * d].iter().copied());
        for (j, w) in weight.iter().enumerate() {
            let (k, i) = (r * d + j, at(&l, r, j));
            let y_term = rstd_ref[r] * w.abs() * x[k].abs().max(mean_of(r).abs());
            let y = got.out.y[i].to_f64();
            let y_tolerance = abs * y_scale.max(y_term);
            let infinite = judge_f16(
                || format!("{what}: y [{r}, {j}]"),
                y,
                y_ref[k],
                rel,
                y_tolerance,
            );
            overflowed[0] += infinite as usize;
            let dx = got.out.dx[i].to_f64();
            let dx_tolerance = abs * row_scale.max(term[k]);
            let infinite = judge_f16(
                || format!("{what}: dx [{r}, {j}]"),
                dx,
                dx_ref[k],
                rel,
                dx_tolerance,
            );
            overflowed[1] += infinite as usize;
        }
    }
    let growth = 1.0 + (rows as f64).sqrt() * f32::EPSILON as f64 / rel;
    let sqrt_rows = (rows as f64).sqrt();
    let x_hat_dy = (0..rows * d).map(|k| dy[k] * (x[k] - mean_of(k / d)) * rstd_ref[k / d]);
    let sums = [
        (
            2,
            "dweight",
            &got.out.dweight,
            Some(&dweight_ref),
            rms_finite(x_hat_dy),
        ),
        (
            3,
            "dbias",
            &got.out.dbias,
            dbias_ref.as_ref(),
            rms_finite(dy.iter().copied()),
        ),
    ];
    for (slot, name, out, reference, term_scale) in sums {
        let Some(reference) = reference else { continue };
        let scale = rms_finite(reference.iter().copied()).max(term_scale * sqrt_rows);
        for j in 0..d {
            let infinite = judge_f16(
                || format!("{what}: {name} [{j}]"),
                out[j].to_f64(),
                reference[j],
                rel * growth,
                abs * growth * scale,
            );
            overflowed[slot] += infinite as usize;
        }
    }
}

/// f16 y and dx past f16's range (γ = 60000 in every other column), and dx, dγ and dβ past it
/// (dy up to ±30000): each overflows somewhere, to ±∞.
fn f16_overflow<B: Backend>(backend: &B, shapes: &[Shape]) {
    let what = format!("{} f16 overflow", backend.name());
    let mut rng = Rng::fresh(&what);
    let mut overflowed = [0usize; 4];
    for kind in KINDS {
        for &shape in shapes {
            let mut large_weight = Problem::<f16>::new(kind, &mut rng, shape, false, false);
            for w in large_weight.case.weight.iter_mut().step_by(2) {
                *w = f16::from_f64(60000.0);
            }
            let len = large_weight.case.layout.len();
            large_weight.case.dy = rng.vec(len, -2.0, 2.0);
            let got = large_weight.run(backend);
            check_f16_overflow(
                &large_weight,
                &got,
                &mut overflowed,
                &format!("{what}: γ = 60000"),
            );

            let mut large_dy = Problem::<f16>::new(kind, &mut rng, shape, false, true);
            large_dy.case.dy = rng.vec(len, -30000.0, 30000.0);
            let got = large_dy.run(backend);
            check_f16_overflow(
                &large_dy,
                &got,
                &mut overflowed,
                &format!("{what}: dy up to 30000"),
            );
        }
    }
    let [y, dx, dweight, dbias] = overflowed;
    assert!(
        y > 0 && dx > 0 && dweight > 0 && dbias > 0,
        "{what}: the inputs did not overflow every output (infinite y {y}, dx {dx}, dweight {dweight}, dbias {dbias})"
    );
}

/// h = x + residual past f16's range (40000 + 40000, and the negatives, in two rows) is ±∞ in
/// f16's residual_out, and the rows it lands in are rows holding ±∞: the rule above, checked the
/// same way.
fn f16_residual_sum_overflow<B: Backend>(backend: &B, shapes: &[Shape]) {
    let what = format!("{} f16 residual sum overflow", backend.name());
    let mut rng = Rng::fresh(&what);
    for kind in KINDS {
        for &shape in shapes {
            for recompute in [false, true] {
                let clean = Problem::<f16>::new(kind, &mut rng, shape, true, recompute);
                let clean_run = clean.run(backend);
                let mut special = clean.copy();
                let sums = [
                    (40000.0, position(shape, 1)),
                    (-40000.0, position(shape, 2)),
                ];
                for (value, place) in sums {
                    special.set(Site::X, value, place);
                    special.set(Site::Residual, value, place);
                }
                let got = special.run(backend);
                for (value, (r, j)) in sums {
                    let h = got.h[at(&special.case.layout, r, j)];
                    assert!(
                        h.is_infinite() && h == f16::from_f64(2.0 * value),
                        "{what}: h [{r}, {j}] = {h}, x + residual = {value} + {value}"
                    );
                }
                special.check(&got, &clean_run, &format!("{what}: ±40000 twice"));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The CPU emulator.

/// A packed register tile over two dγ groups (16 + 4 rows), and single-element access on strided,
/// unaligned rows.
const EMULATED_SHAPES: [Shape; 2] = [(20, 64, 64, 0), (5, 127, 130, 1)];

#[test]
fn emulator_special_values_f32() {
    special_values::<f32, _>(&emulator(), &EMULATED_SHAPES, false, &PLAIN);
}

#[test]
fn emulator_special_values_f16() {
    special_values::<f16, _>(&emulator(), &EMULATED_SHAPES, false, &PLAIN);
}

#[test]
fn emulator_special_values_bf16() {
    special_values::<bf16, _>(&emulator(), &EMULATED_SHAPES, false, &PLAIN);
}

/// Register tiles (f32, bf16) and, on unaligned rows, the residual kernels' streaming (f16).
#[test]
fn emulator_special_values_residual() {
    special_values::<f32, _>(&emulator(), &EMULATED_SHAPES[..1], true, &RESIDUAL);
    special_values::<f16, _>(&emulator(), &EMULATED_SHAPES[1..], true, &RESIDUAL);
    special_values::<bf16, _>(&emulator(), &EMULATED_SHAPES[..1], true, &RESIDUAL);
}

/// Rows split over a cluster of 2 blocks (register tiles, staged backward, two dγ groups), and
/// streamed over a cluster and by one block (single elements), reached with small rows by capping
/// the emulated block as in `kernels::emulator_rows_split_over_clusters_match_reference`.
#[test]
fn emulator_special_values_clusters_and_streaming() {
    let limited = |block_limit, clusters| {
        let emulator = Emulator::new()
            .with_block_limit(block_limit)
            .unwrap()
            .with_clusters(clusters)
            .unwrap();
        Host(emulator)
    };
    let sites = &PLAIN[..3];
    special_values::<f32, _>(&limited(64, 2), &[(20, 2048, 2048, 0)], false, sites);
    special_values::<f32, _>(&limited(32, 2), &[(5, 1100, 1100, 0)], false, sites);
    special_values::<bf16, _>(&limited(32, 1), &[(5, 300, 301, 1)], false, sites);
}

#[test]
fn emulator_f16_overflow_is_infinite() {
    f16_overflow(&emulator(), &EMULATED_SHAPES);
}

#[test]
fn emulator_f16_residual_sum_overflow_is_infinite() {
    f16_residual_sum_overflow(&emulator(), &EMULATED_SHAPES);
}

// ---------------------------------------------------------------------------------------------
// The GPU.

/// A packed register tile, a single-element one (strided, unaligned rows), rows split over
/// clusters (register tiles of every dtype, staged backward) and rows streamed: each with clean
/// rows around the special ones, over several dγ groups where there are enough rows.
const GPU_SHAPES: [Shape; 4] = [
    (256, 4096, 4096, 0),
    (64, 1001, 1003, 1),
    (16, 32768, 32768, 0),
    (5, 131072, 131072, 0),
];

fn on_gpu<T: TestDtype>() {
    let Some(gpu) = Device::shared() else { return };
    special_values::<T, _>(&gpu, &GPU_SHAPES, false, &PLAIN);
}

#[test]
fn gpu_special_values_f32() {
    on_gpu::<f32>();
}

#[test]
fn gpu_special_values_f16() {
    on_gpu::<f16>();
}

#[test]
fn gpu_special_values_bf16() {
    on_gpu::<bf16>();
}

#[test]
fn gpu_special_values_residual() {
    let Some(gpu) = Device::shared() else { return };
    let shapes = &GPU_SHAPES[..3];
    special_values::<f32, _>(&gpu, shapes, true, &RESIDUAL);
    special_values::<f16, _>(&gpu, shapes, true, &RESIDUAL);
    special_values::<bf16, _>(&gpu, shapes, true, &RESIDUAL);
}

#[test]
fn gpu_f16_overflow_is_infinite() {
    let Some(gpu) = Device::shared() else { return };
    f16_overflow(&gpu, &GPU_SHAPES[..3]);
}

#[test]
fn gpu_f16_residual_sum_overflow_is_infinite() {
    let Some(gpu) = Device::shared() else { return };
    f16_residual_sum_overflow(&gpu, &GPU_SHAPES[..3]);
}
