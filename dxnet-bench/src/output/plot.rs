//! Plots like the papers' figures, drawn with plotters to SVG and PNG:
//! throughput (GB/s) and message rate (million msg/s) against message size
//! on a log2 axis, one line per binding configuration; latency percentiles
//! against size. Every value is the median over the repetitions.
//!
//! PNG text is rendered with ab_glyph and the DejaVu Sans font embedded by
//! the `dejavu` crate, so no system font libraries are needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::{anyhow, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::config::{fmt_size, Mode, Operation};
use crate::metrics::{summarize, Record};

const W: u32 = 1000;
const H: u32 = 620;

/// One line of a chart: (log2 size, value) points.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// Legend text.
    pub label: String,
    /// Drawn dashed (raw baselines, tail percentiles).
    pub dashed: bool,
    /// Points in ascending x.
    pub points: Vec<(f64, f64)>,
}

/// What a chart's x axis shows.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum XAxis {
    /// Message size, x = log2 of the size in bytes.
    #[default]
    Log2Size,
    /// Whole numbers (node counts, thread counts, ...) on a linear axis,
    /// with this description.
    Count(String),
}

/// A chart to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// The x axis.
    pub x: XAxis,
    /// File name without extension.
    pub stem: String,
    /// Caption.
    pub title: String,
    /// Y axis description.
    pub y_desc: String,
    /// Logarithmic y axis (latency charts).
    pub log_y: bool,
    /// The lines.
    pub lines: Vec<Line>,
}

/// Legend label of a record's binding configuration.
pub fn series_label(r: &Record) -> String {
    let label = if r.handlers > 0 {
        format!("{} t{} h{}", r.binding, r.threads, r.handlers)
    } else {
        format!("{} t{}", r.binding, r.threads)
    };
    if r.rate > 0 {
        format!(
            "{label} @{}/s",
            crate::output::table::fmt_rate(r.rate as f64).trim_end()
        )
    } else {
        label
    }
}

fn is_raw(r: &Record) -> bool {
    crate::binding::is_baseline(&r.binding)
}

type ChartKey = (Operation, Mode, usize);

/// Median of `f` per (series, size) for the records of one chart.
fn medians(recs: &[&Record], f: impl Fn(&Record) -> Option<f64>) -> Vec<Line> {
    let mut by: BTreeMap<(bool, String), BTreeMap<usize, Vec<f64>>> = BTreeMap::new();
    for r in recs {
        if let Some(v) = f(r) {
            by.entry((is_raw(r), series_label(r)))
                .or_default()
                .entry(r.size)
                .or_default()
                .push(v);
        }
    }
    by.into_iter()
        .map(|((raw, label), sizes)| Line {
            label,
            dashed: raw,
            points: sizes
                .into_iter()
                .filter_map(|(s, v)| Some(((s as f64).log2(), summarize(&v)?.median)))
                .collect(),
        })
        .collect()
}

/// Builds every chart for `records`.
pub fn charts(records: &[Record]) -> Vec<Chart> {
    let mut groups: BTreeMap<ChartKey, Vec<&Record>> = BTreeMap::new();
    for r in records {
        groups
            .entry((r.operation, r.mode, r.nodes))
            .or_default()
            .push(r);
    }
    let mut out = Vec::new();
    for ((op, mode, nodes), recs) in groups {
        let base = if op.is_latency() {
            format!("{op}_n{nodes}")
        } else {
            format!("{op}_{mode}_n{nodes}")
        };
        let what = if op.is_latency() {
            format!("{op}, {nodes} nodes")
        } else {
            format!("{op} {mode}, {nodes} nodes")
        };
        if op.is_latency() {
            let kind = if op == Operation::Latency {
                "one-way latency (RTT/2)"
            } else {
                "round-trip time"
            };
            // Comparison: median and p99 of every binding configuration.
            let mut lines = Vec::new();
            for (pct, dashed) in [("p50", false), ("p99", true)] {
                for mut l in medians(&recs, |r| r.lat_us.and_then(|l| l.get(pct))) {
                    l.label = format!("{} {pct}", l.label);
                    l.dashed = dashed;
                    lines.push(l);
                }
            }
            out.push(Chart {
                x: XAxis::Log2Size,
                stem: format!("{base}_latency"),
                title: format!("{what}: {kind}"),
                y_desc: "latency [µs]".into(),
                log_y: true,
                lines,
            });
            // Percentile fan of each binding configuration.
            let mut by_series: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
            for r in &recs {
                by_series.entry(series_label(r)).or_default().push(r);
            }
            for (label, rs) in by_series {
                let lines = ["avg", "p50", "p95", "p99", "p999", "p9999"]
                    .iter()
                    .filter_map(|pct| {
                        let mut l = medians(&rs, |r| r.lat_us.and_then(|l| l.get(pct)))
                            .into_iter()
                            .next()?;
                        l.label = pct.to_string();
                        l.dashed = *pct == "avg";
                        Some(l)
                    })
                    .collect();
                out.push(Chart {
                    x: XAxis::Log2Size,
                    stem: format!("{base}_{}_percentiles", label.replace(' ', "_")),
                    title: format!("{what}: {label} {kind} percentiles"),
                    y_desc: "latency [µs]".into(),
                    log_y: true,
                    lines,
                });
            }
        } else {
            out.push(Chart {
                x: XAxis::Log2Size,
                stem: format!("{base}_throughput"),
                title: format!("{what}: payload throughput"),
                y_desc: "throughput [GB/s]".into(),
                log_y: false,
                lines: medians(&recs, |r| Some(r.bytes_per_sec / 1e9)),
            });
            out.push(Chart {
                x: XAxis::Log2Size,
                stem: format!("{base}_msgrate"),
                title: format!("{what}: message rate"),
                y_desc: "message rate [million msg/s]".into(),
                log_y: false,
                lines: medians(&recs, |r| Some(r.msgs_per_sec / 1e6)),
            });
        }
    }
    out
}

fn register_fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
        let _ = plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold());
    });
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting failed: {e:?}")
}

fn x_label(axis: &XAxis, v: f64) -> String {
    let whole = (v - v.round()).abs() < 1e-6;
    match axis {
        XAxis::Log2Size if whole && (0.0..63.0).contains(&v) => {
            fmt_size(1usize << v.round() as u32)
        }
        XAxis::Count(_) if whole => format!("{v:.0}"),
        _ => String::new(),
    }
}

fn x_desc(axis: &XAxis) -> &str {
    match axis {
        XAxis::Log2Size => "message size (log scale)",
        XAxis::Count(desc) => desc,
    }
}

/// Tick label with as many decimals as the axis range needs, the same for
/// every tick.
fn y_label(v: f64, ymax: f64) -> String {
    let decimals = if ymax >= 100.0 {
        0
    } else if ymax >= 10.0 {
        1
    } else if ymax >= 1.0 {
        2
    } else {
        3
    };
    format!("{v:.decimals$}")
}

/// Tick label of a log axis: no more decimals than the magnitude needs.
fn log_label(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Strong, distinguishable line colors (the "tab10" palette).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, c: &Chart) -> Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let xs = c.lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let (xmin, xmax) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (xmin, xmax) = if xmin > xmax {
        (0.0, 1.0)
    } else {
        (xmin - 0.5, xmax + 0.5)
    };
    let ys: Vec<f64> = c
        .lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .collect();
    let ymax = ys.iter().copied().fold(0.0f64, f64::max);
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(&c.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80);
    if c.log_y {
        // Latencies span microseconds to milliseconds: a log axis keeps the
        // medians readable next to the tails.
        let ymin = ys
            .iter()
            .copied()
            .filter(|y| *y > 0.0)
            .fold(f64::MAX, f64::min);
        let (ymin, ymax) = if ymin > ymax {
            (0.1, 10.0)
        } else {
            (ymin / 1.5, ymax * 1.5)
        };
        let (lo, span) = (ymin.ln(), (ymax / ymin).ln());
        let corner = legend_corner(c, |(x, y)| {
            ((x - xmin) / (xmax - xmin), (y.max(ymin).ln() - lo) / span)
        });
        let mut chart = builder
            .build_cartesian_2d(xmin..xmax, (ymin..ymax).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(x_desc(&c.x))
            .y_desc(format!("{} (log scale)", c.y_desc))
            .x_labels(12)
            .y_labels(12)
            .x_label_formatter(&|v| x_label(&c.x, *v))
            .y_label_formatter(&|v| log_label(*v))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .draw()
            .map_err(err)?;
        draw_lines(&mut chart, c, corner)?;
    } else {
        let ymax = if ymax > 0.0 { ymax * 1.12 } else { 1.0 };
        let corner = legend_corner(c, |(x, y)| ((x - xmin) / (xmax - xmin), y / ymax));
        let mut chart = builder
            .build_cartesian_2d(xmin..xmax, 0.0..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(x_desc(&c.x))
            .y_desc(c.y_desc.as_str())
            .x_labels(12)
            .y_labels(10)
            .x_label_formatter(&|v| x_label(&c.x, *v))
            .y_label_formatter(&|v| y_label(*v, ymax))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .draw()
            .map_err(err)?;
        draw_lines(&mut chart, c, corner)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// The upper corner for the legend: the right one if its box would hide
/// fewer data points there than on the left (a series measured at one size
/// only, e.g. another thread count, is a single point at the left edge).
/// `unit` maps a point to the plotting area as (0..1, 0..1), y upwards.
fn legend_corner(c: &Chart, unit: impl Fn((f64, f64)) -> (f64, f64)) -> SeriesLabelPosition {
    // The legend's size as a share of the plotting area (about 880 x 500
    // pixels): a 15 px font, ~20 px per row, the label ~8 px per character
    // after a 24 px line sample.
    let chars = c.lines.iter().map(|l| l.label.chars().count()).max();
    let w = (50.0 + 8.0 * chars.unwrap_or(0) as f64) / 880.0;
    let h = (12.0 + 20.0 * c.lines.len() as f64) / 500.0;
    let (mut left, mut right) = (0, 0);
    for p in c.lines.iter().flat_map(|l| l.points.iter()) {
        let (x, y) = unit(*p);
        if y >= 1.0 - h {
            left += usize::from(x <= w);
            right += usize::from(x >= 1.0 - w);
        }
    }
    if right < left {
        SeriesLabelPosition::UpperRight
    } else {
        SeriesLabelPosition::UpperLeft
    }
}

fn draw_lines<'a, DB: DrawingBackend + 'a, Y: Ranged<ValueType = f64>>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
    c: &Chart,
    corner: SeriesLabelPosition,
) -> Result<()> {
    for (i, l) in c.lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()].to_rgba();
        let style = color.stroke_width(2);
        let pts = l.points.clone();
        let anno = if l.dashed {
            chart
                .draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))
                .map_err(err)?
        } else {
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(err)?
        };
        anno.label(l.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(corner)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Draws `c` as `dir/{stem}.svg` and `dir/{stem}.png`.
pub fn render(c: &Chart, dir: &Path) -> Result<Vec<PathBuf>> {
    register_fonts();
    let svg = dir.join(format!("{}.svg", c.stem));
    let png = dir.join(format!("{}.png", c.stem));
    draw(SVGBackend::new(&svg, (W, H)).into_drawing_area(), c)?;
    draw(BitMapBackend::new(&png, (W, H)).into_drawing_area(), c)?;
    Ok(vec![svg, png])
}

/// Draws every chart of `records` into `dir`; returns the files written.
pub fn write_all(records: &[Record], dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for c in charts(records) {
        files.extend(render(&c, dir)?);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::LatencyStats;

    fn rec(op: Operation, binding: &str, handlers: usize, size: usize, rate: f64) -> Record {
        Record {
            operation: op,
            mode: Mode::Uni,
            binding: binding.into(),
            size,
            threads: 1,
            handlers,
            nodes: 2,
            repetition: 0,
            count: 1,
            messages: 1,
            elapsed_s: 1.0,
            msgs_per_sec: rate,
            bytes_per_sec: rate * size as f64,
            lat_us: op.is_latency().then_some(LatencyStats {
                avg: 2.0,
                min: 1.0,
                max: 9.0,
                p50: 2.0,
                p95: 3.0,
                p99: 4.0,
                p999: 5.0,
                p9999: 6.0,
            }),
            cpu_s: 0.0,
            proc_cpu_s: Vec::new(),
            cpu_us_per_op: 0.0,
            rate: 0,
            late_us: None,
            wire_bytes: None,
            wire_overhead: None,
            connections: Vec::new(),
            breakdown: None,
        }
    }

    #[test]
    fn charts_per_operation_with_median_points() {
        let mut recs = vec![];
        for (size, rate) in [(64, 1e6), (64, 3e6), (64, 2e6), (4096, 5e5)] {
            recs.push(rec(Operation::Throughput, "dxnet-tcp", 2, size, rate));
        }
        recs.push(rec(Operation::Throughput, "raw-tcp", 0, 64, 1e6));
        recs.push(rec(Operation::Pingpong, "raw-tcp", 0, 64, 1e5));
        let cs = charts(&recs);
        let stems: Vec<&str> = cs.iter().map(|c| c.stem.as_str()).collect();
        assert_eq!(
            stems,
            vec![
                "throughput_uni_n2_throughput",
                "throughput_uni_n2_msgrate",
                "pingpong_n2_latency",
                "pingpong_n2_raw-tcp_t1_percentiles",
            ]
        );
        let rate = &cs[1];
        assert_eq!(rate.lines.len(), 2);
        let dx = rate
            .lines
            .iter()
            .find(|l| l.label == "dxnet-tcp t1 h2")
            .unwrap();
        assert!(!dx.dashed);
        // Median of 1, 3, 2 million msg/s at log2(64) = 6.
        assert_eq!(dx.points, vec![(6.0, 2.0), (12.0, 0.5)]);
        assert!(rate
            .lines
            .iter()
            .any(|l| l.label == "raw-tcp t1" && l.dashed));
        assert_eq!(cs[2].lines.len(), 2, "p50 and p99");
        assert_eq!(cs[3].lines.len(), 6, "avg + five percentiles");
        assert_eq!(x_label(&XAxis::Log2Size, 10.0), "1 KiB");
        assert_eq!(x_label(&XAxis::Log2Size, 10.5), "");
        assert_eq!(x_label(&XAxis::Count("nodes".into()), 4.0), "4");
        assert_eq!(y_label(0.5, 2.0), "0.50");
    }

    #[test]
    fn legend_avoids_the_points() {
        let line = |points: Vec<(f64, f64)>| Line {
            label: "raw-tcp-batched t16".into(),
            dashed: false,
            points,
        };
        let mut c = Chart {
            x: XAxis::Log2Size,
            stem: "s".into(),
            title: "t".into(),
            y_desc: "y".into(),
            log_y: false,
            // Falling message rate; a 16-thread point at the top left.
            lines: vec![line(vec![(0.0, 0.9), (1.0, 0.1)]), line(vec![(0.0, 1.0)])],
        };
        let unit = |p: (f64, f64)| p;
        assert!(matches!(
            legend_corner(&c, unit),
            SeriesLabelPosition::UpperRight
        ));
        // Rising throughput: the top right is taken.
        c.lines = vec![line(vec![(0.0, 0.1), (1.0, 0.95)])];
        assert!(matches!(
            legend_corner(&c, unit),
            SeriesLabelPosition::UpperLeft
        ));
    }
}
