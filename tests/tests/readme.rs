//! The README's walk-through compiles: every code line of its block is a line of
//! `host/examples/tour.rs` (which CI builds), in the same order. Comment lines and the spacing
//! within a line do not count; the example may have more lines (those that make the buffers).
//! Both files are compiled into the test, so a bundled test executable (`cargo xtask bundle`) runs
//! anywhere, without the source tree.

/// The README and the example, as they were when this test was built.
const README: &str = include_str!("../../README.md");
const TOUR: &str = include_str!("../../host/examples/tour.rs");

#[test]
fn readme_walk_through_is_the_tour_example() {
    let opening = "```rust\nuse half::bf16;\n";
    let start = README
        .find(opening)
        .expect("the README's walk-through block")
        + "```rust\n".len();
    let block = &README[start..];
    let block = &block[..block.find("```").expect("the block's end")];
    let normalize = |line: &str| line.split_whitespace().collect::<Vec<_>>().join(" ");
    let tour: Vec<String> = TOUR.lines().map(normalize).collect();
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
