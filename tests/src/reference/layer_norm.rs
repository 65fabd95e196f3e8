//! LayerNorm in f64, straight from the definition (two-pass mean and variance).

/// `(y, mean, rstd)` for `rows × d` dense `x`; `beta` optional.
pub fn forward(
    x: &[f64],
    gamma: &[f64],
    beta: Option<&[f64]>,
    rows: usize,
    d: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; rows * d];
    let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        mean[r] = row.iter().sum::<f64>() / d as f64;
        let var = row
            .iter()
            .map(|v| (v - mean[r]) * (v - mean[r]))
            .sum::<f64>()
            / d as f64;
        rstd[r] = 1.0 / (var + eps).sqrt();
        for j in 0..d {
            y[r * d + j] = (row[j] - mean[r]) * rstd[r] * gamma[j] + beta.map_or(0.0, |b| b[j]);
        }
    }
    (y, mean, rstd)
}

/// `(dx, dgamma, dbeta)` with the statistics recomputed exactly from `x`:
/// `dx = rstd·(dŷ − mean(dŷ) − x̂·mean(dŷ·x̂))`, `dγ = Σ dy·x̂`, `dβ = Σ dy`.
pub fn backward(
    dy: &[f64],
    x: &[f64],
    gamma: &[f64],
    rows: usize,
    d: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (_, mean, rstd) = forward(x, gamma, None, rows, d, eps);
    let mut dx = vec![0.0; rows * d];
    let (mut dgamma, mut dbeta) = (vec![0.0; d], vec![0.0; d]);
    for r in 0..rows {
        let x_hat: Vec<f64> = (0..d).map(|j| (x[r * d + j] - mean[r]) * rstd[r]).collect();
        let dy_hat: Vec<f64> = (0..d).map(|j| dy[r * d + j] * gamma[j]).collect();
        let mean_dy_hat = dy_hat.iter().sum::<f64>() / d as f64;
        let mean_dot = (0..d).map(|j| dy_hat[j] * x_hat[j]).sum::<f64>() / d as f64;
        for j in 0..d {
            dx[r * d + j] = rstd[r] * (dy_hat[j] - mean_dy_hat - x_hat[j] * mean_dot);
            dgamma[j] += dy[r * d + j] * x_hat[j];
            dbeta[j] += dy[r * d + j];
        }
    }
    (dx, dgamma, dbeta)
}
