//! RMSNorm in f64, straight from the definition.

/// `(y, rstd)` for `rows × d` dense `x`.
pub fn forward(x: &[f64], gamma: &[f64], rows: usize, d: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; rows * d];
    let mut rstd = vec![0.0; rows];
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        rstd[r] = 1.0 / (mean_sq + eps).sqrt();
        for j in 0..d {
            y[r * d + j] = row[j] * rstd[r] * gamma[j];
        }
    }
    (y, rstd)
}

/// `(dx, dgamma)`: `dx = rstd·(dŷ − x̂·mean(dŷ·x̂))`, `dγ = Σ_rows dy·x̂`, with rstd recomputed
/// exactly from `x`.
pub fn backward(
    dy: &[f64],
    x: &[f64],
    gamma: &[f64],
    rows: usize,
    d: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (_, rstd) = forward(x, gamma, rows, d, eps);
    let mut dx = vec![0.0; rows * d];
    let mut dgamma = vec![0.0; d];
    for r in 0..rows {
        let x_hat: Vec<f64> = (0..d).map(|j| x[r * d + j] * rstd[r]).collect();
        let dy_hat: Vec<f64> = (0..d).map(|j| dy[r * d + j] * gamma[j]).collect();
        let mean_dot = (0..d).map(|j| dy_hat[j] * x_hat[j]).sum::<f64>() / d as f64;
        for j in 0..d {
            dx[r * d + j] = rstd[r] * (dy_hat[j] - x_hat[j] * mean_dot);
            dgamma[j] += dy[r * d + j] * x_hat[j];
        }
    }
    (dx, dgamma)
}
