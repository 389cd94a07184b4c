//! `lowbit plot FILE.jsonl... --out curves.svg`: the curves of `lowbit train --metrics` files
//! in one SVG picture, one colour per run, for comparing runs (precision A against B).
//!
//! Decisions:
//! - Drawn with `plotters`' SVG backend without its font features: text is written as SVG
//!   `<text>` elements that the viewer renders with its own fonts, and laid out with plotters'
//!   built-in size estimate, so nothing reads system fonts (a bare CI machine draws the same
//!   picture).
//! - A run is one file; its legend is the header's `name` (the file stem by default). A resumed
//!   run's file holds several runs' records: a step recorded twice keeps its last value.
//! - `--log-y` plots log10 of the values (labelled with the values), dropping values ≤ 0;
//!   non-finite values (written as `null`) are left out of every curve.
//! - Records of kinds this version does not know are skipped, so newer files still plot; a
//!   line that is not a JSON object with a `kind`, or a known record missing its fields, is
//!   refused, naming the file and the line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use lowbit_io::json::Json;
use plotters::prelude::*;

use crate::error::CliError;

/// Arguments of `lowbit plot`.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// Metrics files written by `lowbit train --metrics`, one curve (colour) each.
    #[arg(value_name = "FILE.jsonl", required = true)]
    pub files: Vec<PathBuf>,
    /// The SVG file to write.
    #[arg(long, value_name = "FILE.svg")]
    pub out: PathBuf,
    /// What to plot: loss (training loss, evals as circles), eval_loss, grad_norm, lr (every
    /// optimizer group) or tokens_per_s.
    #[arg(long, value_enum, default_value_t = Metric::Loss)]
    pub metric: Metric,
    /// The x axis: the step, or the training tokens seen.
    #[arg(long, value_enum, default_value_t = XAxis::Step)]
    pub x: XAxis,
    /// Smooth the lines with a trailing mean over N points (1: raw; markers stay raw).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub smooth: u32,
    /// A logarithmic y axis.
    #[arg(long)]
    pub log_y: bool,
    /// Picture size in pixels, WIDTHxHEIGHT.
    #[arg(long, value_name = "WxH", default_value = "960x600", value_parser = parse_size)]
    pub size: (u32, u32),
}

/// `--metric`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum Metric {
    /// Training loss, with the eval losses as markers.
    Loss,
    /// Eval loss.
    EvalLoss,
    /// Global gradient norm.
    GradNorm,
    /// Learning rate of every optimizer group.
    Lr,
    /// Tokens per second of each step.
    TokensPerS,
}

impl Metric {
    fn short(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::EvalLoss => "eval loss",
            Metric::GradNorm => "gradient norm",
            Metric::Lr => "learning rate",
            Metric::TokensPerS => "tokens/s",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Metric::Loss => "loss (lines: training, circles: eval)",
            Metric::EvalLoss => "eval loss",
            Metric::GradNorm => "gradient norm",
            Metric::Lr => "learning rate",
            Metric::TokensPerS => "tokens/s",
        }
    }
}

/// `--x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum XAxis {
    /// The step.
    Step,
    /// Training tokens seen.
    Tokens,
}

fn parse_size(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?}: expected WIDTHxHEIGHT, e.g. 960x600, each 100 to 10000");
    let (w, h) = s.split_once('x').ok_or_else(bad)?;
    let (w, h): (u32, u32) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    if !(100..=10_000).contains(&w) || !(100..=10_000).contains(&h) {
        return Err(bad());
    }
    Ok((w, h))
}

/// One step's values.
#[derive(Clone, Debug, Default)]
struct StepPoint {
    tokens: Option<f64>,
    loss: Option<f64>,
    grad_norm: Option<f64>,
    /// `(group, lr)` in the file's order.
    lr: Vec<(String, f64)>,
    tokens_per_s: Option<f64>,
}

/// One run's records.
#[derive(Debug, Default)]
struct Run {
    name: String,
    steps: BTreeMap<u64, StepPoint>,
    /// step → (eval loss, tokens).
    evals: BTreeMap<u64, (Option<f64>, Option<f64>)>,
}

/// A finite number (`null` and non-numbers: `None`).
fn num(j: Option<&Json>) -> Option<f64> {
    let v = match j? {
        Json::UInt(u) => *u as f64,
        Json::Int(i) => *i as f64,
        Json::Num(x) => *x,
        Json::F32(x) => f64::from(*x),
        _ => return None,
    };
    v.is_finite().then_some(v)
}

/// Reads one metrics file.
fn read_run(path: &Path) -> Result<Run, CliError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Msg(format!("{}: cannot read: {e}", path.display())))?;
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let mut run = Run {
        name: stem,
        ..Run::default()
    };
    let mut named = false;
    let mut records = 0usize;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |what: String| CliError::Msg(format!("{}:{}: {what}", path.display(), i + 1));
        let j = Json::parse(line).map_err(|e| at(format!("not a JSON record: {e}")))?;
        let Json::Obj(o) = &j else {
            return Err(at("not a JSON object".into()));
        };
        let Some(Json::Str(kind)) = o.get("kind") else {
            return Err(at("a record without a string `kind`".into()));
        };
        let step = || match o.get("step") {
            Some(Json::UInt(s)) => Ok(*s),
            _ => Err(at(format!("a `{kind}` record without an integer `step`"))),
        };
        match kind.as_str() {
            "run" => {
                if let (false, Some(Json::Str(n))) = (named, o.get("name"))
                    && !n.is_empty()
                {
                    run.name = n.clone();
                }
                named = true;
            }
            "step" => {
                let s = step()?;
                if !o
                    .get("loss")
                    .is_some_and(|l| matches!(l, Json::Null) || num(Some(l)).is_some())
                {
                    return Err(at("a `step` record without a numeric `loss`".into()));
                }
                let lr = match o.get("lr") {
                    Some(Json::Obj(g)) => g
                        .iter()
                        .filter_map(|(k, v)| num(Some(v)).map(|v| (k.clone(), v)))
                        .collect(),
                    _ => Vec::new(),
                };
                run.steps.insert(
                    s,
                    StepPoint {
                        tokens: num(o.get("tokens")),
                        loss: num(o.get("loss")),
                        grad_norm: num(o.get("grad_norm")),
                        lr,
                        tokens_per_s: num(o.get("tokens_per_s")),
                    },
                );
            }
            "eval" => {
                let s = step()?;
                if o.get("eval_loss").is_none() {
                    return Err(at("an `eval` record without `eval_loss`".into()));
                }
                run.evals
                    .insert(s, (num(o.get("eval_loss")), num(o.get("tokens"))));
            }
            _ => {}
        }
        records += 1;
    }
    if records == 0 {
        return Err(CliError::Msg(format!(
            "{}: no records (expected the JSON lines of `lowbit train --metrics`)",
            path.display()
        )));
    }
    if run.steps.is_empty() && run.evals.is_empty() {
        return Err(CliError::Msg(format!(
            "{}: no step or eval records to plot",
            path.display()
        )));
    }
    Ok(run)
}

/// A curve: its legend (if any), points and whether it is drawn as markers.
struct Curve {
    label: Option<String>,
    points: Vec<(f64, f64)>,
    markers: bool,
    colour: usize,
}

/// The curves of `runs` for `args`.
fn curves(runs: &[Run], args: &PlotArgs) -> Vec<Curve> {
    let mut out: Vec<Curve> = Vec::new();
    for (c, run) in runs.iter().enumerate() {
        let x_of = |step: u64, tokens: Option<f64>| match args.x {
            XAxis::Step => Some(step as f64),
            XAxis::Tokens => tokens,
        };
        let line = |f: &dyn Fn(&StepPoint) -> Option<f64>| -> Vec<(f64, f64)> {
            run.steps
                .iter()
                .filter_map(|(&s, p)| Some((x_of(s, p.tokens)?, f(p)?)))
                .collect()
        };
        let evals: Vec<(f64, f64)> = run
            .evals
            .iter()
            .filter_map(|(&s, &(l, t))| {
                let t = t.or_else(|| run.steps.get(&s).and_then(|p| p.tokens));
                Some((x_of(s, t)?, l?))
            })
            .collect();
        let mut push = |label: Option<String>, points: Vec<(f64, f64)>, markers: bool| {
            out.push(Curve {
                label,
                points,
                markers,
                colour: c,
            });
        };
        match args.metric {
            Metric::Loss => {
                push(Some(run.name.clone()), line(&|p| p.loss), false);
                push(None, evals, true);
            }
            Metric::EvalLoss => {
                push(Some(run.name.clone()), evals.clone(), false);
                push(None, evals, true);
            }
            Metric::GradNorm => push(Some(run.name.clone()), line(&|p| p.grad_norm), false),
            Metric::TokensPerS => push(Some(run.name.clone()), line(&|p| p.tokens_per_s), false),
            Metric::Lr => {
                let mut groups: Vec<String> = Vec::new();
                for p in run.steps.values() {
                    for (g, _) in &p.lr {
                        if !groups.contains(g) {
                            groups.push(g.clone());
                        }
                    }
                }
                for g in groups {
                    let pts = line(&|p| p.lr.iter().find(|(k, _)| *k == g).map(|(_, v)| *v));
                    push(Some(format!("{} {g}", run.name)), pts, false);
                }
            }
        }
    }
    if args.metric == Metric::Lr {
        // A colour per run and optimizer group (every lr curve is a line of its own).
        for (i, c) in out.iter_mut().enumerate() {
            c.colour = i;
        }
    }
    for c in &mut out {
        if args.log_y {
            c.points = c
                .points
                .iter()
                .filter(|(_, y)| *y > 0.0)
                .map(|&(x, y)| (x, y.log10()))
                .collect();
        }
        if !c.markers && args.smooth > 1 {
            c.points = smooth(&c.points, args.smooth as usize);
        }
    }
    out
}

/// The trailing mean over `n` points (fewer at the start).
fn smooth(points: &[(f64, f64)], n: usize) -> Vec<(f64, f64)> {
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= n {
                sum -= points[i - n].1;
            }
            (x, sum / (i + 1).min(n) as f64)
        })
        .collect()
}

/// The range of `values`, widened a little (and to a unit around a single value).
fn range(values: impl Iterator<Item = f64>) -> Option<std::ops::Range<f64>> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !(lo.is_finite() && hi.is_finite()) {
        return None;
    }
    let pad = if hi > lo { (hi - lo) * 0.04 } else { 0.5 };
    Some(lo - pad..hi + pad)
}

/// Curve colours, in order: the Tableau 10 palette (matplotlib's default cycle), distinct on
/// white and familiar to readers of PyTorch-world plots.
const PALETTE: [(u8, u8, u8); 10] = [
    (0x1f, 0x77, 0xb4),
    (0xff, 0x7f, 0x0e),
    (0x2c, 0xa0, 0x2c),
    (0xd6, 0x27, 0x28),
    (0x94, 0x67, 0xbd),
    (0x8c, 0x56, 0x4b),
    (0xe3, 0x77, 0xc2),
    (0x7f, 0x7f, 0x7f),
    (0xbc, 0xbd, 0x22),
    (0x17, 0xbe, 0xcf),
];

/// A y tick label: the shortest of four significant decimals in the usual ranges, scientific
/// notation outside them.
fn tick(v: f64) -> String {
    if v != 0.0 && !(1e-2..1e5).contains(&v.abs()) {
        return format!("{v:.2e}");
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

/// An x tick label: steps as integers (a fractional tick keeps one decimal), token counts in
/// thousands (k) or millions (M).
fn xtick(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{}M", tick(v / 1e6))
    } else if a >= 1e4 {
        format!("{}k", tick(v / 1e3))
    } else if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Draws `curves` into an SVG document.
fn render(curves: &[Curve], args: &PlotArgs) -> Result<String, String> {
    let all = || curves.iter().flat_map(|c| c.points.iter());
    let xr = range(all().map(|p| p.0)).ok_or("no finite values to plot")?;
    let yr = range(all().map(|p| p.1)).ok_or("no finite values to plot")?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, args.size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .caption(args.metric.label(), ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(72)
            .build_cartesian_2d(xr, yr)
            .map_err(|e| e.to_string())?;
        let log_y = args.log_y;
        let y_fmt = move |v: &f64| tick(if log_y { 10f64.powf(*v) } else { *v });
        chart
            .configure_mesh()
            .x_desc(match args.x {
                XAxis::Step => "step",
                XAxis::Tokens => "training tokens",
            })
            .y_desc(if log_y {
                format!("{} (log scale)", args.metric.short())
            } else {
                args.metric.short().to_string()
            })
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .y_label_formatter(&y_fmt)
            .x_label_formatter(&|v| xtick(*v))
            .draw()
            .map_err(|e| e.to_string())?;
        for c in curves {
            let (r, g, b) = PALETTE[c.colour % PALETTE.len()];
            let colour = RGBColor(r, g, b).to_rgba();
            if c.markers {
                chart
                    .draw_series(
                        c.points
                            .iter()
                            .map(|&p| Circle::new(p, 4, colour.stroke_width(2))),
                    )
                    .map_err(|e| e.to_string())?;
                continue;
            }
            let series = chart
                .draw_series(LineSeries::new(
                    c.points.iter().copied(),
                    colour.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?;
            if let Some(label) = &c.label {
                series.label(label.clone()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .label_font(("sans-serif", 15))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// Runs `lowbit plot`.
pub fn run(args: &PlotArgs) -> Result<(), CliError> {
    let runs = args
        .files
        .iter()
        .map(|f| read_run(f))
        .collect::<Result<Vec<_>, _>>()?;
    let curves = curves(&runs, args);
    let svg = render(&curves, args)
        .map_err(|e| CliError::Msg(format!("lowbit plot --metric {:?}: {e}", args.metric)))?;
    std::fs::write(&args.out, svg)
        .map_err(|e| CliError::Msg(format!("--out {}: cannot write: {e}", args.out.display())))?;
    println!(
        "{}: {} of {} run(s)",
        args.out.display(),
        args.metric.label(),
        runs.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_a_trailing_mean() {
        let p = [(1.0, 1.0), (2.0, 3.0), (3.0, 5.0), (4.0, 7.0)];
        let s = smooth(&p, 2);
        assert_eq!(s, vec![(1.0, 1.0), (2.0, 2.0), (3.0, 4.0), (4.0, 6.0)]);
        assert_eq!(smooth(&p, 1), p.to_vec());
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick(5.6), "5.6");
        assert_eq!(tick(0.003), "3.00e-3");
        assert_eq!(tick(-0.0), "0");
        assert_eq!(xtick(3.0), "3");
        assert_eq!(xtick(2.5), "2.5");
        assert_eq!(xtick(204_800.0), "204.8k");
        assert_eq!(xtick(2_500_000.0), "2.5M");
    }

    #[test]
    fn sizes_parse_and_absurd_ones_are_refused() {
        assert_eq!(parse_size("960x600"), Ok((960, 600)));
        for bad in ["960", "0x600", "960x", "99999x600", "axb"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
