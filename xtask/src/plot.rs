//! `plot-sweep`: the bench sweep's CSV as a PNG, % of copy against d, one line per op, direction
//! and dtype; with the peers' JSON (`tests/peers/peers.py`), the best peer per op and direction
//! as dashed lines in the same colour.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::register_font;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use resvg::{tiny_skia, usvg};

use crate::Result;
use crate::sweep_lines::{Line, Marker, Stroke, measured_lines, peer_lines};

const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (1500, 850);
/// Width of the legend beside the chart: its fourteen entries inside the chart would hide lines.
const LEGEND_WIDTH: u32 = 400;
/// Tableau's ten colours: distinct, and readable on white.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// `plot-sweep --csv FILE [--peers FILE] [--out FILE]` (by default the CSV's path as .png).
pub fn plot_sweep(args: &[String]) -> Result {
    let flag = |name: &str| crate::flag(args, name).map(PathBuf::from);
    let csv = flag("--csv").ok_or("plot-sweep needs --csv FILE (the bench's --sweep output)")?;
    let out = flag("--out").unwrap_or_else(|| csv.with_extension("png"));
    let (mut lines, copy_gbs) = measured_lines(&crate::read_text(&csv)?)?;
    if let Some(path) = flag("--peers") {
        let mut peers = peer_lines(&crate::read_text(&path)?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // In the legend, in the order of the bench's own lines of the same op and direction.
        peers.sort_by_key(|p| lines.iter().position(|l| l.op_direction == p.op_direction));
        lines.extend(peers);
    }
    draw(&lines, copy_gbs, &out)?;
    println!("wrote {} ({} lines)", out.display(), lines.len());
    Ok(())
}

fn draw_error(e: impl std::fmt::Display) -> String {
    format!("drawing the plot: {e}")
}

/// Draws `lines` as SVG and writes it to `out` as PNG.
fn draw(lines: &[Line], copy_gbs: f64, out: &Path) -> Result {
    // plotters lays out labels with the glyph advances of what is registered here.
    register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR)
        .map_err(|_| "the embedded font does not load")?;
    let mut svg = String::new();
    draw_svg(lines, copy_gbs, &mut svg)?;
    let mut fonts = usvg::fontdb::Database::new();
    fonts.load_font_data(ttf_noto_sans::REGULAR.to_vec());
    fonts.set_sans_serif_family("Noto Sans");
    let options = usvg::Options {
        fontdb: Arc::new(fonts),
        ..Default::default()
    };
    let tree = usvg::Tree::from_str(&svg, &options).map_err(draw_error)?;
    let mut pixmap = tiny_skia::Pixmap::new(SIZE.0, SIZE.1).ok_or("no pixmap of that size")?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap
        .save_png(out)
        .map_err(|e| format!("{}: {e}", out.display()))
}

fn draw_svg(lines: &[Line], copy_gbs: f64, svg: &mut String) -> Result {
    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error)?;
    let (chart_area, legend_area) = root.split_horizontally(SIZE.0 - LEGEND_WIDTH);

    // One colour per op and direction, in the order they first appear.
    let mut op_directions: Vec<&(String, String)> = Vec::new();
    for line in lines {
        if !op_directions.contains(&&line.op_direction) {
            op_directions.push(&line.op_direction);
        }
    }
    let colour = |line: &Line| {
        let i = op_directions.iter().position(|k| **k == line.op_direction);
        PALETTE[i.unwrap_or(0) % PALETTE.len()]
    };

    let mut ds: Vec<f64> = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .collect();
    ds.sort_by(f64::total_cmp);
    ds.dedup();
    let (d_min, d_max) = (ds[0], ds[ds.len() - 1]);
    // 0–100 %, higher only where a point would otherwise be cut off.
    let pct_max = lines.iter().flat_map(|l| &l.points).map(|p| p.1);
    let y_max = (pct_max.fold(100.0, f64::max) / 10.0).ceil() * 10.0;
    let x = (d_min / 1.3..d_max * 1.3)
        .log_scale()
        .base(2.0)
        .with_key_points(ds.clone());
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(
            format!("Norms: % of device copy bandwidth ({copy_gbs:.0} GB/s) against d"),
            (FONT, 28),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d(x, 0.0..y_max)
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc("d (log2 scale)")
        .y_desc("% of copy")
        .x_label_formatter(&|d| format!("{d:.0}"))
        .y_label_formatter(&|p| format!("{p:.0}"))
        .y_labels(11)
        .label_style((FONT, 18))
        .axis_desc_style((FONT, 20))
        .light_line_style(WHITE)
        .bold_line_style(BLACK.mix(0.12))
        .draw()
        .map_err(draw_error)?;
    for line in lines {
        let style = colour(line).stroke_width(2);
        match line.stroke {
            Stroke::Solid(marker) => {
                chart
                    .draw_series(LineSeries::new(line.points.clone(), style))
                    .map_err(draw_error)?;
                for &point in &line.points {
                    draw_marker(chart.plotting_area(), point, marker, style)?;
                }
            }
            Stroke::Dashed => {
                let dashes = DashedLineSeries::new(line.points.clone(), 10, 6, style);
                chart.draw_series(dashes).map_err(draw_error)?;
                // Open circles where the peers were measured: a peer line may skip a d
                // (`peer_lines`), and the dashes between two circles are not measurements.
                for &point in &line.points {
                    let circle = Circle::new(point, 5, style);
                    chart.plotting_area().draw(&circle).map_err(draw_error)?;
                }
            }
        }
    }
    draw_legend(&legend_area, lines, colour)?;
    root.present().map_err(draw_error)
}

/// A marker at `at` (a point of the chart, or a pixel of the legend).
fn draw_marker<DB: DrawingBackend, CT: CoordTranslate>(
    area: &DrawingArea<DB, CT>,
    at: CT::From,
    marker: Marker,
    style: ShapeStyle,
) -> Result {
    match marker {
        Marker::Circle => area.draw(&Circle::new(at, 4, style.filled())),
        Marker::Triangle => area.draw(&TriangleMarker::new(at, 6, style.filled())),
        Marker::Cross => area.draw(&Cross::new(at, 5, style)),
    }
    .map_err(draw_error)
}

/// The legend, one entry per line, in the area beside the chart.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    lines: &[Line],
    colour: impl Fn(&Line) -> RGBColor,
) -> Result {
    let text = TextStyle::from((FONT, 17)).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, line) in lines.iter().enumerate() {
        let y = 90 + 28 * i as i32;
        let (x0, x1) = (0, 44);
        let style = colour(line).stroke_width(2);
        let stroke = vec![(x0, y), (x1, y)];
        match line.stroke {
            Stroke::Solid(marker) => {
                area.draw(&PathElement::new(stroke, style))
                    .map_err(draw_error)?;
                draw_marker(area, ((x0 + x1) / 2, y), marker, style)?;
            }
            Stroke::Dashed => area
                .draw(&DashedPathElement::new(stroke, 8, 5, style))
                .map_err(draw_error)?,
        }
        area.draw(&Text::new(line.label.clone(), (x1 + 10, y), &text))
            .map_err(draw_error)?;
    }
    Ok(())
}
