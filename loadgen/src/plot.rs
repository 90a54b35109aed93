//! What every loadgen plot shares: SVG output of one size (no fonts needed: the viewer
//! renders the text), a palette, the chart frame (caption, margins, axis areas) and the
//! legend box, so the compare and soak reports look alike.

use std::ops::Range;
use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// Width and height of every plot, in pixels.
pub const SIZE: (u32, u32) = (900, 540);

/// A chart with f64 axes drawn on an SVG file.
pub type Chart<'a> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// plotters' errors as anyhow errors.
pub fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// The `i`th colour of the palette (cycles).
pub fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 5] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
    ];
    COLORS[i % COLORS.len()]
}

/// A white SVG canvas at `path`.
pub fn canvas(path: &Path) -> anyhow::Result<DrawingArea<SVGBackend<'_>, Shift>> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    Ok(root)
}

/// A captioned chart over `x` × `y` with room for axis labels `y_label_width` wide.
pub fn frame<'a>(
    root: &DrawingArea<SVGBackend<'a>, Shift>,
    caption: &str,
    x: Range<f64>,
    y: Range<f64>,
    y_label_width: u32,
) -> anyhow::Result<Chart<'a>> {
    ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(y_label_width)
        .build_cartesian_2d(x, y)
        .map_err(err)
}

/// Draws one labelled line.
pub fn line(
    chart: &mut Chart<'_>,
    points: impl IntoIterator<Item = (f64, f64)>,
    color: RGBColor,
    label: &str,
) -> anyhow::Result<()> {
    chart
        .draw_series(LineSeries::new(points, color.stroke_width(2)))
        .map_err(err)?
        .label(label)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    Ok(())
}

/// Draws the legend at `position` and writes the file.
pub fn finish(
    mut chart: Chart<'_>,
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}
