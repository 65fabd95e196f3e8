//! The sweep plot's lines, read from the bench's `--sweep` CSV and the peers' JSON
//! (`tests/peers/peers.py`): what `plot-sweep` (the `plot` feature) draws, compiled and tested
//! without the drawing crates.

use std::collections::BTreeMap;

use crate::Result;

/// How a line is drawn: the bench's own with a marker per dtype, a peer's dashed.
#[derive(Clone, Copy)]
pub(crate) enum Stroke {
    Solid(Marker),
    Dashed,
}

#[derive(Clone, Copy)]
pub(crate) enum Marker {
    Circle,
    Triangle,
    Cross,
}

impl Marker {
    /// bf16 circles, f32 triangles, f16 crosses: the dtypes of one op share its colour.
    pub(crate) fn of_dtype(dtype: &str) -> Self {
        if dtype.starts_with("f32") {
            Marker::Triangle
        } else if dtype.starts_with("f16") {
            Marker::Cross
        } else {
            Marker::Circle
        }
    }
}

/// One line of the plot: (d, % of copy) points.
pub(crate) struct Line {
    pub(crate) label: String,
    /// The op and direction the colour stands for.
    pub(crate) op_direction: (String, String),
    /// The bench's lines: their dtype; a peer's line: none (the best of any storage).
    pub(crate) dtype: Option<String>,
    pub(crate) stroke: Stroke,
    pub(crate) points: Vec<(f64, f64)>,
}

/// The fields of one CSV line; quoted fields may hold commas and doubled quotes.
fn csv_fields(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut field)),
            c => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// One line per (op, direction, dtype) of the bench's CSV, in the order they first appear, and
/// the copy bandwidth the percentages are of.
pub(crate) fn measured_lines(csv: &str) -> Result<(Vec<Line>, f64)> {
    let mut rows = csv.lines().filter(|l| !l.trim().is_empty()).map(csv_fields);
    let header = rows.next().ok_or("the CSV is empty")?;
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .ok_or(format!("the CSV has no {name} column"))
    };
    let [op, direction, dtype, d, pct, copy] =
        ["op", "direction", "dtype", "d", "pct_of_copy", "copy_gbs"].map(column);
    let (op, direction, dtype, d, pct, copy) = (op?, direction?, dtype?, d?, pct?, copy?);
    let mut lines: Vec<Line> = Vec::new();
    let mut copy_gbs = 0.0;
    for row in rows {
        let field = |i: usize| row.get(i).map_or("", String::as_str);
        let number = |i: usize| -> Result<f64> {
            (field(i).parse()).map_err(|_| format!("not a number: {:?} in {row:?}", field(i)))
        };
        let point = (number(d)?, number(pct)?);
        copy_gbs = number(copy)?;
        let label = format!("{} {}, {}", field(op), field(direction), field(dtype));
        match lines.iter_mut().find(|l| l.label == label) {
            Some(line) => line.points.push(point),
            None => lines.push(Line {
                label,
                op_direction: (field(op).into(), field(direction).into()),
                dtype: Some(field(dtype).into()),
                stroke: Stroke::Solid(Marker::of_dtype(field(dtype))),
                points: vec![point],
            }),
        }
    }
    if lines.is_empty() {
        return Err("the CSV has no rows".into());
    }
    Ok((lines, copy_gbs))
}

/// The best peer's % of copy and name at each d, per (op, direction).
pub(crate) type BestPeers = BTreeMap<(String, String), BTreeMap<u64, (f64, String)>>;

/// The best peer per op and direction at each d of `peers.py`'s JSON (a list of records: one
/// `{"impl": "copy", "gbs"}`, then `{impl, op: "rms"|"ln", rows, d, fwd_gbs, bwd_gbs, ...}`), as %
/// of the copy bandwidth measured in the same run, keyed by the bench's op names (`rms_norm`,
/// `layer_norm`). A record whose `fwd_host_bound` or `bwd_host_bound` is true
/// (`tests/peers/peers.py`: the call's host time outlasted the spin it was queued behind, so its
/// device time is unknown) leaves that direction's point at its d out: the best of the others
/// would not be the best peer.
pub(crate) fn best_peers(json: &str) -> Result<BestPeers> {
    let records: Vec<serde_json::Value> = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let copy_gbs = records
        .iter()
        .find(|r| r["impl"] == "copy")
        .and_then(|r| r["gbs"].as_f64())
        .ok_or("no copy record")?;
    let mut best = BestPeers::new();
    let mut unknown: Vec<(&str, &str, u64)> = Vec::new();
    for r in &records {
        let op = match r["op"].as_str() {
            Some("rms") => "rms_norm",
            Some("ln") => "layer_norm",
            _ => continue,
        };
        let (Some(d), Some(peer)) = (r["d"].as_u64(), r["impl"].as_str()) else {
            continue;
        };
        for direction in ["fwd", "bwd"] {
            if r[format!("{direction}_host_bound")] == true {
                unknown.push((op, direction, d));
                continue;
            }
            let Some(gbs) = r[format!("{direction}_gbs")].as_f64() else {
                continue;
            };
            let pct = 100.0 * gbs / copy_gbs;
            let by_d = best.entry((op.into(), direction.into())).or_default();
            let entry = by_d.entry(d).or_insert((pct, peer.into()));
            if pct > entry.0 {
                *entry = (pct, peer.into());
            }
        }
    }
    for (op, direction, d) in unknown {
        if let Some(by_d) = best.get_mut(&(op.into(), direction.into())) {
            by_d.remove(&d);
        }
    }
    best.retain(|_, by_d| !by_d.is_empty());
    Ok(best)
}

/// The best peers ([`best_peers`]) as one dashed line per op and direction.
pub(crate) fn peer_lines(json: &str) -> Result<Vec<Line>> {
    Ok(best_peers(json)?
        .into_iter()
        .map(|((op, direction), by_d)| {
            let mut winners: Vec<&str> = by_d.values().map(|(_, peer)| peer.as_str()).collect();
            winners.sort();
            winners.dedup();
            Line {
                label: format!("{op} {direction}, best peer ({})", winners.join(", ")),
                op_direction: (op, direction),
                dtype: None,
                stroke: Stroke::Dashed,
                points: by_d.iter().map(|(&d, &(pct, _))| (d as f64, pct)).collect(),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn points(lines: &[Line], op: &str, direction: &str) -> Vec<(f64, f64)> {
        lines
            .iter()
            .find(|l| l.op_direction == (op.into(), direction.into()))
            .map(|l| l.points.clone())
            .unwrap_or_default()
    }

    #[test]
    fn the_best_peer_is_taken_per_d_and_host_bound_points_are_left_out() {
        let json = r#"[
            {"impl": "copy", "op": "copy", "gbs": 4000.0},
            {"impl": "eager", "op": "rms", "d": 128, "fwd_gbs": 800.0, "bwd_gbs": 900.0},
            {"impl": "compile", "op": "rms", "d": 128, "fwd_gbs": 3600.0, "bwd_gbs": null,
             "bwd_host_bound": true},
            {"impl": "eager", "op": "rms", "d": 1024, "fwd_gbs": 2000.0, "bwd_gbs": 1000.0},
            {"impl": "liger", "op": "rms", "d": 1024, "fwd_gbs": 3000.0, "bwd_gbs": 1200.0}
        ]"#;
        let lines = peer_lines(json).unwrap();
        assert_eq!(
            points(&lines, "rms_norm", "fwd"),
            [(128.0, 90.0), (1024.0, 75.0)]
        );
        // At d = 128 torch.compile's backward is unknown: eager's 22.5 % is not the best peer.
        assert_eq!(points(&lines, "rms_norm", "bwd"), [(1024.0, 30.0)]);
        assert!(points(&lines, "layer_norm", "fwd").is_empty());
    }
}
