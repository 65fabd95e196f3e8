//! f64 CPU references, one module per op family, each checked against central finite differences
//! in its test file.

pub mod activation;
pub mod layer_norm;
pub mod rms_norm;
