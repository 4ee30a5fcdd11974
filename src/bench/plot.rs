//! The SVG plot of docs/benchmarks.md: pre-request latency (p50 and p99)
//! against session length, both backends, beside the naive fold of the
//! session's JSON-lines file, log-log,
//! with the p99 targets as horizontal lines. Drawn with plotters' SVG
//! backend, which writes text as SVG `<text>` and so needs no font files.

use std::path::Path;

use plotters::prelude::*;

use super::report::Report;

fn color(backend: &str) -> RGBColor {
    match backend {
        "sqlite" => RGBColor(31, 119, 180),
        _ => RGBColor(214, 39, 40),
    }
}

/// Draws the plot of `report` into `path`.
pub fn latency_svg(report: &Report, path: &Path) -> Result<(), String> {
    draw(report, path).map_err(|e| format!("cannot draw the plot {}: {e}", path.display()))
}

fn draw(report: &Report, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut xs: Vec<f64> = Vec::new();
    let mut ys: Vec<f64> = Vec::new();
    for b in &report.backends {
        for l in &b.latency {
            xs.push(l.events as f64);
            ys.extend([
                l.pre_request.p50_ms,
                l.pre_request.p99_ms,
                l.naive_fold.p50_ms,
            ]);
        }
        ys.push(b.latency_target.p99_ms);
    }
    let positive = |v: &&f64| **v > 0.0;
    let x_min = xs.iter().filter(positive).copied().fold(f64::MAX, f64::min);
    let x_max = xs.iter().copied().fold(0.0, f64::max);
    let y_min = ys.iter().filter(positive).copied().fold(f64::MAX, f64::min);
    let y_max = ys.iter().copied().fold(0.0, f64::max);
    let (x_min, x_max) = if x_min < x_max {
        (x_min / 1.5, x_max * 1.5)
    } else {
        (100.0, 10_000_000.0)
    };
    // The bottom just under a power of ten, so that the axis has a
    // labelled tick below the smallest reads (sub-millisecond on SQLite).
    let (y_min, y_max) = if y_min < y_max {
        (0.8 * 10f64.powf((y_min / 2.0).log10().floor()), y_max * 2.0)
    } else {
        (0.01, 100_000.0)
    };

    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Pre-request read (activations + context) vs naive fold",
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d((x_min..x_max).log_scale(), (y_min..y_max).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("events in the session")
        .y_desc("milliseconds")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| {
            if *v >= 1.0 {
                format!("{v:.0}")
            } else {
                format!("{v}")
            }
        })
        .draw()?;

    for b in &report.backends {
        let c = color(&b.backend);
        let p50: Vec<(f64, f64)> = b
            .latency
            .iter()
            .map(|l| (l.events as f64, l.pre_request.p50_ms))
            .collect();
        let p99: Vec<(f64, f64)> = b
            .latency
            .iter()
            .map(|l| (l.events as f64, l.pre_request.p99_ms))
            .collect();
        let fold: Vec<(f64, f64)> = b
            .latency
            .iter()
            .map(|l| (l.events as f64, l.naive_fold.p50_ms))
            .collect();
        chart
            .draw_series(LineSeries::new(p50.clone(), c.stroke_width(2)))?
            .label(format!("{}: read p50", b.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart.draw_series(p50.iter().map(|p| Circle::new(*p, 4, c.filled())))?;
        chart
            .draw_series(DashedLineSeries::new(p99.clone(), 8, 5, c.stroke_width(2)))?
            .label(format!("{}: read p99", b.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 8, y)], c.stroke_width(2)));
        chart.draw_series(p99.iter().map(|p| Circle::new(*p, 3, c.stroke_width(1))))?;
        let light = c.mix(0.45);
        chart
            .draw_series(LineSeries::new(fold.clone(), light.stroke_width(3)))?
            .label(format!("{}: naive fold of a JSONL file, median", b.name))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], light.stroke_width(3))
            });
        chart.draw_series(
            fold.iter()
                .map(|p| TriangleMarker::new(*p, 5, light.filled())),
        )?;
        let target = b.latency_target.p99_ms;
        chart
            .draw_series(DashedLineSeries::new(
                vec![(x_min, target), (x_max, target)],
                3,
                4,
                c.mix(0.6).stroke_width(1),
            ))?
            .label(format!("{}: p99 target {target} ms at 10^6", b.name))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 4, y)], c.mix(0.6).stroke_width(1))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()?;
    Ok(())
}
