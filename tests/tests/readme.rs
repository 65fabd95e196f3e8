//! The README's walk-through compiles: every code line of its block is a line of
//! `host/examples/tour.rs` (which CI builds), in the same order. Comment lines and the spacing
//! within a line do not count; the example may have more lines (those that make the buffers).

use std::path::Path;

#[test]
fn readme_walk_through_is_the_tour_example() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace");
    let read = |path: &str| std::fs::read_to_string(root.join(path)).expect(path);
    let (readme, tour) = (read("README.md"), read("host/examples/tour.rs"));
    let opening = "```rust\nuse half::bf16;\n";
    let start = readme
        .find(opening)
        .expect("the README's walk-through block")
        + "```rust\n".len();
    let block = &readme[start..];
    let block = &block[..block.find("```").expect("the block's end")];
    let normalize = |line: &str| line.split_whitespace().collect::<Vec<_>>().join(" ");
    let tour: Vec<String> = tour.lines().map(normalize).collect();
    let (mut at, mut matched) = (0, 0);
    for line in block.lines().map(normalize) {
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        match tour[at..].iter().position(|t| *t == line) {
            Some(i) => {
                at += i + 1;
                matched += 1;
            }
            None => panic!("a README line is not in host/examples/tour.rs (in order): {line}"),
        }
    }
    assert!(
        matched >= 20,
        "only {matched} code lines in the README's block"
    );
}
