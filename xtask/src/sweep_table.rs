//! `sweep-table`: one dtype of a sweep's CSV as a Markdown table, % of copy per d (rows) and op
//! and direction (columns), each bf16 cell beside the best peer of the same device call: the
//! tables bench-results and the README quote, written from the data instead of copied by hand.

use std::collections::BTreeSet;
use std::fmt::Write;

use crate::Result;
use crate::sweep_lines::{best_peers, measured_lines};

/// The dtype `tests/peers/peers.py` measures: the only one a peer stands beside.
const PEERS_DTYPE: &str = "bf16";

/// The letter that names a peer in a cell (`c` for torch.compile's `compile`).
fn initial(peer: &str) -> char {
    peer.chars().next().unwrap_or('?')
}

/// The table of `dtype`'s lines of the bench's `--sweep` CSV; with the peers' JSON, a cell reads
/// `normkern / best peer` with the peer's initial, normkern's figure in bold where it leads.
pub(crate) fn markdown(csv: &str, peers_json: Option<&str>, dtype: &str) -> Result<String> {
    let (lines, copy_gbs) = measured_lines(csv)?;
    let lines: Vec<_> = lines
        .iter()
        .filter(|l| l.dtype.as_deref() == Some(dtype))
        .collect();
    if lines.is_empty() {
        return Err(format!("the CSV has no {dtype} rows"));
    }
    let peers = match peers_json {
        Some(_) if dtype != PEERS_DTYPE => {
            return Err(format!(
                "the peers are measured in {PEERS_DTYPE} only, not {dtype}"
            ));
        }
        Some(json) => best_peers(json)?,
        None => Default::default(),
    };
    // Points are whole numbers of elements: d as an integer keys them.
    let ds: BTreeSet<u64> = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|&(d, _)| d as u64))
        .collect();
    let mut out = String::new();
    let mut winners = BTreeSet::new();
    let _ = write!(out, "| d |");
    for l in &lines {
        let _ = write!(out, " {} {} |", l.op_direction.0, l.op_direction.1);
    }
    let _ = write!(out, "\n|---:|");
    for _ in &lines {
        let _ = write!(out, "---|");
    }
    for d in ds {
        let _ = write!(out, "\n| {d} |");
        for l in &lines {
            let ours = l.points.iter().find(|&&(at, _)| at as u64 == d);
            let peer = peers.get(&l.op_direction).and_then(|by_d| by_d.get(&d));
            let cell = match (ours, peer) {
                (None, _) => "—".to_string(),
                (Some(&(_, pct)), None) => format!("{pct:.1}"),
                (Some(&(_, pct)), Some((best, name))) => {
                    winners.insert(name.as_str());
                    let ours = if pct > *best {
                        format!("**{pct:.1}**")
                    } else {
                        format!("{pct:.1}")
                    };
                    format!("{ours} / {best:.1} {}", initial(name))
                }
            };
            let _ = write!(out, " {cell} |");
        }
    }
    let _ = write!(
        out,
        "\n\n{dtype}, % of the copy bandwidth measured in the bench's run ({copy_gbs:.0} GB/s)"
    );
    if !winners.is_empty() {
        let names: Vec<String> = winners
            .iter()
            .map(|n| format!("{} = {n}", initial(n)))
            .collect();
        let _ = write!(
            out,
            "; a cell with two figures: normkern / the best peer at that d ({}), each against \
             its own process's copy; bold: normkern ahead",
            names.join(", ")
        );
    }
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CSV: &str = "op,direction,dtype,rows,d,us,gbs,pct_of_copy,copy_gbs\n\
        rms_norm,fwd,bf16,1024,128,1,1,93.23,3000\n\
        rms_norm,bwd,bf16,1024,128,1,1,88.02,3000\n\
        rms_norm,fwd,f32,1024,128,1,1,97.5,3000\n\
        rms_norm,fwd,bf16,128,1024,1,1,94.31,3000\n\
        rms_norm,bwd,bf16,128,1024,1,1,81.94,3000\n";

    const PEERS: &str = r#"[
        {"impl": "copy", "op": "copy", "gbs": 4000.0},
        {"impl": "liger", "op": "rms", "d": 128, "fwd_gbs": 3844.0, "bwd_gbs": 3000.0},
        {"impl": "compile", "op": "rms", "d": 128, "fwd_gbs": 3600.0, "bwd_gbs": 3268.0},
        {"impl": "compile", "op": "rms", "d": 1024, "fwd_gbs": 3836.0, "bwd_gbs": null,
         "bwd_host_bound": true}
    ]"#;

    #[test]
    fn cells_pair_each_figure_with_the_best_peer_at_its_d() {
        let table = markdown(CSV, Some(PEERS), "bf16").unwrap();
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows[0], "| d | rms_norm fwd | rms_norm bwd |");
        assert_eq!(rows[1], "|---:|---|---|");
        // Liger's forward (96.1) beats torch.compile's (90.0) at 128; normkern's backward leads.
        assert_eq!(rows[2], "| 128 | 93.2 / 96.1 l | **88.0** / 81.7 c |");
        // A host-bound peer has no figure: normkern's stands alone.
        assert_eq!(rows[3], "| 1024 | 94.3 / 95.9 c | 81.9 |");
        assert!(rows[5].contains("3000 GB/s") && rows[5].contains("c = compile, l = liger"));
    }

    /// The README's sweep tables are this function's output for the files in bench-results, so
    /// they cannot drift from the data they quote.
    #[test]
    fn the_readme_quotes_the_bench_results_tables() {
        let root = crate::root();
        let read = |path: &str| crate::read_text(root.join(path)).unwrap();
        let readme = read("README.md");
        for gpu in ["h100", "h200"] {
            let csv = read(&format!("bench-results/sweep-{gpu}.csv"));
            let peers = read(&format!("bench-results/peers-{gpu}.json"));
            let table = markdown(&csv, Some(&peers), "bf16").unwrap();
            assert!(
                readme.contains(&table),
                "README.md does not hold the {gpu} sweep's table (cargo xtask sweep-table \
                 --csv bench-results/sweep-{gpu}.csv --peers bench-results/peers-{gpu}.json)"
            );
        }
    }

    #[test]
    fn other_dtypes_stand_alone_and_never_beside_the_bf16_peers() {
        let table = markdown(CSV, None, "f32").unwrap();
        assert_eq!(table.lines().nth(2), Some("| 128 | 97.5 |"));
        assert!(markdown(CSV, Some(PEERS), "f32").is_err());
        assert!(markdown(CSV, None, "f16").is_err());
    }
}
