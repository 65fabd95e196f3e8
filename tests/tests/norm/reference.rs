//! The f64 references against central finite differences: with `L = Σ dy ⊙ y`, ∂L/∂x, ∂L/∂γ and
//! ∂L/∂β are the backward's dx, dweight and dbias.

use normkern_tests::Rng;
use normkern_tests::reference::{layer_norm, rms_norm};

#[test]
fn rms_norm_matches_finite_differences() {
    let mut rng = Rng::fresh("rms_norm_matches_finite_differences");
    let (rows, d, eps) = (3, 7, 1e-3);
    let x: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let weight: Vec<f64> = (0..d).map(|_| rng.uniform(0.5, 1.5)).collect();
    let dy: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let loss = |x: &[f64], weight: &[f64]| {
        let (y, _) = rms_norm::forward(x, weight, rows, d, eps);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>()
    };
    let (dx, dweight) = rms_norm::backward(&dy, &x, &weight, rows, d, eps);
    let h = 1e-6;
    for i in 0..rows * d {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp[i] += h;
        xm[i] -= h;
        let numeric = (loss(&xp, &weight) - loss(&xm, &weight)) / (2.0 * h);
        assert!(
            (numeric - dx[i]).abs() < 1e-6 * (1.0 + dx[i].abs()),
            "dx[{i}]: {numeric} vs {}",
            dx[i]
        );
    }
    for j in 0..d {
        let (mut wp, mut wm) = (weight.clone(), weight.clone());
        wp[j] += h;
        wm[j] -= h;
        let numeric = (loss(&x, &wp) - loss(&x, &wm)) / (2.0 * h);
        assert!(
            (numeric - dweight[j]).abs() < 1e-6 * (1.0 + dweight[j].abs()),
            "dweight[{j}]: {numeric} vs {}",
            dweight[j]
        );
    }
}

#[test]
fn layer_norm_matches_finite_differences() {
    let mut rng = Rng::fresh("layer_norm_matches_finite_differences");
    let (rows, d, eps) = (3, 7, 1e-3);
    let x: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-1.0, 3.0)).collect();
    let weight: Vec<f64> = (0..d).map(|_| rng.uniform(0.5, 1.5)).collect();
    let bias: Vec<f64> = (0..d).map(|_| rng.uniform(-0.5, 0.5)).collect();
    let dy: Vec<f64> = (0..rows * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let loss = |x: &[f64], weight: &[f64], bias: &[f64]| {
        let (y, _, _) = layer_norm::forward(x, weight, Some(bias), rows, d, eps);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>()
    };
    let (dx, dweight, dbias) = layer_norm::backward(&dy, &x, &weight, rows, d, eps);
    let h = 1e-6;
    let numeric = |which: usize, i: usize| {
        let mut args = [x.clone(), weight.clone(), bias.clone()];
        args[which][i] += h;
        let plus = loss(&args[0], &args[1], &args[2]);
        args[which][i] -= 2.0 * h;
        (plus - loss(&args[0], &args[1], &args[2])) / (2.0 * h)
    };
    for (which, analytic) in [(0, &dx), (1, &dweight), (2, &dbias)] {
        for (i, a) in analytic.iter().enumerate() {
            let n = numeric(which, i);
            assert!(
                (n - a).abs() < 1e-6 * (1.0 + a.abs()),
                "gradient {which}[{i}]: {n} vs {a}"
            );
        }
    }
}
