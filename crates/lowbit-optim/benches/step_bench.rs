//! The data-parallel step at a real model's size (issue 16): from "all gradients ready" to
//! "weights ready for the next forward", per phase and whole, against bounds measured in the
//! same run, beside `benches/torch_step.py` (the PyTorch pipeline on the same GPUs).
//!
//! For each configuration (model × primary-weight precision × gradient dtype) the real buffers,
//! plan and distributed AdamW are built on every rank (one thread per GPU, NCCL; or rank threads
//! on the CPU); a device copy writes the gradients (the "backward"), then:
//!
//! - phases, each between a device synchronization and a barrier and a device synchronization:
//!   `reduce_scatter` (`finish_grad_sync`: Avg reduce-scatter of every buffer), `norm`
//!   (`protocol::global_grad_norm`), `optimizer` (`Optimizer::apply`: clipping and fused
//!   AdamW), `staging` (`Optimizer::stage`: casts, or fold + MAX-reduce + quantize of 2D
//!   formats), `gather` (`sync_params` minus the re-quantization) and `requantize` (the
//!   gather's completion replayed alone on the same views: `sync_params` does both);
//! - `total`: `finish_grad_sync` + `protocol::step`, no synchronization inside;
//! - bounds, before the buffers are allocated: a plain reduce-scatter and all-gather of the same
//!   bytes on a flat buffer, and per kernel phase a device copy that reads and writes that
//!   phase's bytes (byte model in `measure::Traffic::kernel_bytes`); ratio = bound / phase;
//! - wire bytes per collective (ring), peak allocation per rank at phase boundaries against
//!   live memory and the closed form (`estimate_memory`);
//! - with `--compute-us N`: the step with overlap on (a bucket per layer), interleaved with N µs
//!   of compute per layer in the forward and 2N in the backward (a repeated f32 product), and
//!   the same compute alone: exposed = the difference;
//! - with `--step-buckets layer` (or ELEMS), the step without compute in buckets (a layer
//!   each) instead of one per buffer: the reductions are launched when the step starts, the
//!   norm trails them group by group, and the optimizer updates, stages and gathers group by
//!   group (each gather beside the later groups' update); gathers after the step.
//!
//! `step_bench [--device cuda|cpu] [--ranks 2] [--model llama-3.2-1b|llama-3-8b-layers|tiny]
//! [--precision all|bf16,mxfp8,mxfp8-2d,nvfp4] [--grads fp32,bf16]
//! [--sharding optim,no_shard,optim_grads,optim_grads_params] [--comm grads,bf16,fp32]
//! [--nan-check off,grad]
//! [--also MODEL:PREC:GRADS]…
//! [--iters 10] [--warmup 2] [--compute-us N] [--bucket ELEMS] [--step-buckets one|layer|ELEMS]
//! [--comm-priority high|normal]
//! [--step-call one|two] [--kernel NAME=VERSION,…]
//! [--json OUT]`: the cross
//! product of the lists, plus each `--also`. Without GPUs:
//! `cargo bench -p lowbit-optim --bench step_bench -- --device cpu --model tiny`.
//! `--json` writes `{"impl", "card", "world", "runs": [...]}`, each run with the keys of
//! `torch_step.py`'s JSON plus `precision`, `bounds` and `ratios` (`xtask/gpu/compare_step.py`
//! puts the two side by side).

#[path = "step_bench/measure.rs"]
mod measure;
#[path = "step_bench/setup.rs"]
mod setup;

use std::fmt::Write as _;
use std::time::Duration;

use lowbit_buffers::layout::GradDType;
use lowbit_comm::{Communicator, GroupConfig, run_ranks};
use lowbit_device::Device;

use measure::{GATHER, OverlapRun, PHASES, REQUANT, RS, Settings, StepBuckets, StepRun};
use setup::{
    Config, Precision, Res, grads_name, parameter_set, parse_grads, parse_sharding, sharding_name,
};

const TIMEOUT: Duration = Duration::from_secs(300);

/// Runs `f` on `ranks` ranks of `device` and returns each rank's result in rank order.
fn run_world<T: Send>(
    device: &str,
    ranks: usize,
    comm_high_priority: bool,
    f: impl Fn(&mut dyn Communicator, &mut Device) -> Res<T> + Sync,
) -> Res<Vec<T>> {
    // Only NCCL streams have a priority.
    #[cfg(not(feature = "cuda"))]
    let _ = comm_high_priority;
    let per_rank = |r: Result<Res<T>, String>| r.and_then(|x| x.map_err(|e| e.to_string()));
    let results: Vec<Result<T, String>> = match device {
        "cpu" => run_ranks(
            ranks,
            GroupConfig::default().with_timeout(TIMEOUT),
            |mut c, mut d| f(&mut c, &mut d),
        )
        .into_iter()
        .map(|r| per_rank(r.map_err(|e| e.to_string())))
        .collect(),
        #[cfg(feature = "cuda")]
        "cuda" => {
            use lowbit_comm::nccl::{NcclConfig, run_local_ranks_with};
            let cfg = NcclConfig::default()
                .with_timeout(TIMEOUT)
                .with_high_priority(comm_high_priority);
            run_local_ranks_with(ranks, cfg, |mut c, mut d| f(&mut c, &mut d))?
                .into_iter()
                .map(|r| per_rank(r.map_err(|e| e.to_string())))
                .collect()
        }
        other => {
            let cuda = if cfg!(feature = "cuda") {
                "cuda"
            } else {
                "cuda (build with --features cuda)"
            };
            return Err(format!("--device {other}: cpu or {cuda}").into());
        }
    };
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.map_err(|e| format!("rank {r}: {e}").into()))
        .collect()
}

/// The median over iterations of the slowest rank's time, in ms.
fn worst_median(per_rank: &[Vec<f64>]) -> f64 {
    let iters = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    let mut worst: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|r| r[i]).fold(0.0, f64::max))
        .collect();
    if worst.is_empty() {
        return f64::NAN;
    }
    worst.sort_by(f64::total_cmp);
    1e3 * worst[worst.len() / 2]
}

/// One configuration's figures.
struct Summary {
    cfg: Config,
    card: String,
    world: usize,
    params: usize,
    phases_ms: [f64; 6],
    gather_requantize_ms: f64,
    /// Zeroing the gradient buffer (not a phase; a local kernel of every iteration).
    zero_ms: f64,
    /// The norm as the one-call step runs it: `finish_grad_sync_and_norm` less
    /// `finish_grad_sync` alone, timed in alternate iterations of one loop (what the norm adds
    /// where each group's share runs beside the later reductions).
    norm_stepped_ms: f64,
    /// Whether the totals (and the overlap mode) use the one-call step.
    one_call: bool,
    /// The buckets of the step without compute (`--step-buckets`).
    step_buckets: StepBuckets,
    total_ms: f64,
    bound_ms: [Option<f64>; 6],
    /// Bus bandwidth of the plain reduce-scatter and all-gather; copy bandwidth per phase.
    bus_gbs: [f64; 2],
    copy_gbs: [Option<f64>; 6],
    kernel_bytes: [f64; 6],
    wire: [(&'static str, f64); 4],
    peak: usize,
    live: usize,
    closed: usize,
    fallbacks: Vec<String>,
    /// Whether the measured steps clipped (AdamW then scales the gradient as it reads it).
    clipped: bool,
    /// (step with compute, compute alone, per-call µs of the compute kernel), ms.
    overlap: Option<(f64, f64, f64)>,
    /// Transient bytes of the overlapped iterations: the device's peak (largest rank) and the
    /// closed form.
    transient: Option<(usize, usize)>,
    /// Where the stream spent the step with compute (slowest rank's medians, ms, per
    /// `measure::SEGMENTS` entry).
    segments: Option<Vec<f64>>,
}

impl Summary {
    fn new(
        cfg: Config,
        params: usize,
        runs: &[StepRun],
        overlap: Option<&[OverlapRun]>,
        one_call: bool,
        step_buckets: StepBuckets,
    ) -> Self {
        let r0 = &runs[0];
        let world = runs.len();
        let phase = |k: usize| -> Vec<Vec<f64>> {
            runs.iter()
                .map(|r| r.phases.iter().map(|t| t[k]).collect())
                .collect()
        };
        let mut phases_ms = [0.0; 6];
        for (k, v) in phases_ms.iter_mut().enumerate() {
            *v = worst_median(&phase(k));
        }
        let gather_requantize_ms = phases_ms[GATHER];
        // The gather alone: `sync_params` less its completion, per rank and iteration.
        let gather_only: Vec<Vec<f64>> = runs
            .iter()
            .map(|r| {
                let g = r.phases.iter().map(|t| (t[GATHER] - t[REQUANT]).max(0.0));
                g.collect()
            })
            .collect();
        phases_ms[GATHER] = worst_median(&gather_only);
        let rs: Vec<_> = runs
            .iter()
            .map(|r| r.bounds.reduce_scatter.clone())
            .collect();
        let ag: Vec<_> = runs.iter().map(|r| r.bounds.gather.clone()).collect();
        let (rs_ms, ag_ms) = (worst_median(&rs), worst_median(&ag));
        let t = &r0.traffic;
        let kernel_bytes = t.kernel_bytes();
        let mut bound_ms = [None; 6];
        let mut copy_gbs = [None; 6];
        for k in 0..6 {
            let copies: Vec<(f64, Vec<f64>)> = runs
                .iter()
                .filter_map(|r| r.bounds.copy.get(k).cloned().flatten())
                .collect();
            if let Some((bytes, _)) = copies.first() {
                let times: Vec<Vec<f64>> = copies.iter().map(|(_, t)| t.clone()).collect();
                let gbs = bytes / worst_median(&times) / 1e6;
                copy_gbs[k] = Some(gbs);
                bound_ms[k] = Some(kernel_bytes[k] / gbs / 1e6);
            }
        }
        bound_ms[RS] = Some(rs_ms);
        bound_ms[GATHER] = Some(ag_ms);
        let ring = (world - 1) as f64 / world as f64;
        let bus = |bytes: usize, ms: f64| bytes as f64 * ring / ms / 1e6;
        let transient = overlap.map(|o| {
            let peak = o.iter().map(|r| r.transient_peak).max().unwrap_or(0);
            (peak, o[0].transient_closed)
        });
        let segments = overlap.and_then(|o| {
            let per_rank: Option<Vec<Vec<Vec<f64>>>> = o
                .iter()
                .map(|r| r.segments.iter().cloned().collect::<Option<Vec<_>>>())
                .collect();
            let per_rank = per_rank?;
            let n = per_rank.first()?.first()?.len();
            Some(
                (0..n)
                    .map(|k| {
                        let v: Vec<Vec<f64>> = per_rank
                            .iter()
                            .map(|its| its.iter().map(|seg| seg[k] * 1e-3).collect())
                            .collect();
                        worst_median(&v)
                    })
                    .collect(),
            )
        });
        let overlap = overlap.map(|o| {
            let with: Vec<_> = o.iter().map(|r| r.with_dp.clone()).collect();
            let alone: Vec<_> = o.iter().map(|r| r.compute.clone()).collect();
            (worst_median(&with), worst_median(&alone), o[0].per_call_us)
        });
        Summary {
            card: r0.card.clone(),
            world,
            params,
            phases_ms,
            gather_requantize_ms,
            zero_ms: worst_median(&runs.iter().map(|r| r.zero.clone()).collect::<Vec<_>>()),
            norm_stepped_ms: (worst_median(
                &runs.iter().map(|r| r.rs_norm.clone()).collect::<Vec<_>>(),
            ) - worst_median(
                &runs.iter().map(|r| r.rs_alone.clone()).collect::<Vec<_>>(),
            ))
            .max(0.0),
            one_call,
            step_buckets,
            total_ms: worst_median(&runs.iter().map(|r| r.totals.clone()).collect::<Vec<_>>()),
            bound_ms,
            bus_gbs: [bus(t.grad_bytes, rs_ms), bus(t.region_bytes, ag_ms)],
            copy_gbs,
            kernel_bytes,
            wire: t.wire(world),
            peak: runs.iter().map(|r| r.peak).max().unwrap_or(0),
            live: r0.live,
            closed: r0.closed,
            fallbacks: runs.iter().flat_map(|r| r.fallbacks.clone()).collect(),
            clipped: r0.clipped,
            overlap,
            transient,
            segments,
            cfg,
        }
    }

    fn ratio(&self, k: usize) -> Option<f64> {
        let b = self.bound_ms[k]?;
        (self.phases_ms[k] > 0.0).then(|| b / self.phases_ms[k])
    }

    /// The norm's bound over the norm as the one-call step runs it.
    fn norm_stepped_ratio(&self) -> Option<f64> {
        let b = self.bound_ms[measure::NORM]?;
        (self.norm_stepped_ms > 0.0).then(|| b / self.norm_stepped_ms)
    }

    fn table(&self) -> String {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "\nlowbit step, {} ({:.1}M params), {} weights, {} grads, {}, comm {}, nan check {}, buckets {}, {}x {}: total {:.2} ms (phases {:.2} ms)",
            self.cfg.model,
            self.params as f64 / 1e6,
            self.cfg.precision.name(),
            grads_name(self.cfg.grads),
            sharding_name(self.cfg.sharding),
            self.cfg.comm.map_or("as grads", grads_name),
            if self.cfg.nan_check { "on" } else { "off" },
            self.step_buckets.name(),
            self.world,
            self.card,
            self.total_ms,
            self.phases_ms.iter().sum::<f64>()
        );
        let _ = writeln!(
            t,
            "{:<16} {:>9} {:>9} {:>7} {:>12} {:>11}",
            "phase", "ms", "bound ms", "ratio", "kernel MB", "wire MB"
        );
        for (k, name) in PHASES.iter().enumerate() {
            let opt = |v: Option<f64>, p: usize| v.map_or("-".into(), |x| format!("{x:.p$}"));
            let wire = self
                .wire
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, b)| b / 1e6);
            let kernel = (self.kernel_bytes[k] > 0.0).then(|| self.kernel_bytes[k] / 1e6);
            let _ = writeln!(
                t,
                "{name:<16} {:>9.3} {:>9} {:>7} {:>12} {:>11}",
                self.phases_ms[k],
                opt(self.bound_ms[k], 3),
                opt(self.ratio(k), 2),
                opt(kernel, 1),
                opt(wire, 1),
            );
        }
        let _ = writeln!(
            t,
            "norm as the one-call step runs it (reduce-scatter + norm, less the reduce-scatter alone, alternate iterations) {:.3} ms ({} of the norm's bound)",
            self.norm_stepped_ms,
            self.norm_stepped_ratio()
                .map_or("-".into(), |r| format!("{r:.2}x"))
        );
        let _ = writeln!(
            t,
            "gather + requantize as measured {:.3} ms; zeroing the gradient buffer {:.3} ms; bus bandwidth of the plain collectives: reduce-scatter {:.1} GB/s, all-gather {:.1} GB/s",
            self.gather_requantize_ms, self.zero_ms, self.bus_gbs[0], self.bus_gbs[1]
        );
        let _ = writeln!(
            t,
            "peak memory {:.3} GiB per rank (live {:.3} GiB, closed form {:.3} GiB)",
            gib(self.peak),
            gib(self.live),
            gib(self.closed)
        );
        if let Some((with, alone, call)) = self.overlap {
            let comm = with - alone - self.local_ms();
            let _ = writeln!(
                t,
                "overlap: step with compute {with:.2} ms, compute alone {alone:.2} ms, exposed {:.2} ms ({:.1}% of the step; compute kernel {call:.1} us a call); exposed communication {comm:.2} ms ({:.1}%: the exposed time less the iteration's local kernels, {:.2} ms of norm, optimizer, staging, re-quantization and zeroing the gradient buffer measured above)",
                with - alone,
                100.0 * (with - alone) / with,
                100.0 * comm / with,
                self.local_ms()
            );
        }
        if let Some(seg) = &self.segments {
            let items: Vec<String> = measure::SEGMENTS
                .iter()
                .zip(seg)
                .map(|(n, ms)| format!("{n} {ms:.2}"))
                .collect();
            let _ = writeln!(t, "overlap, the device's stream (ms): {}", items.join(", "));
        }
        if let Some((peak, closed)) = self.transient {
            let _ = writeln!(
                t,
                "transient memory of the overlapped iterations: peak {:.2} MiB per rank, closed form {:.2} MiB",
                peak as f64 / (1 << 20) as f64,
                closed as f64 / (1 << 20) as f64
            );
        }
        for f in &self.fallbacks {
            let _ = writeln!(t, "HOST FALLBACK: {f}");
        }
        t
    }

    /// The iteration's local kernels that no overlap can hide (they run between the last
    /// gradient's reduction and the first gather): norm (as the step runs it), optimizer,
    /// staging, re-quantization and zeroing the gradient buffer, as measured without compute.
    fn local_ms(&self) -> f64 {
        let norm = if self.one_call {
            self.norm_stepped_ms
        } else {
            self.phases_ms[measure::NORM]
        };
        (0..PHASES.len())
            .filter(|&k| k != RS && k != GATHER && k != measure::NORM)
            .map(|k| self.phases_ms[k])
            .sum::<f64>()
            + norm
            + self.zero_ms
    }

    fn json(&self) -> String {
        let num = |x: f64| {
            if x.is_finite() {
                format!("{x:.6}")
            } else {
                "null".into()
            }
        };
        let opt = |x: Option<f64>| x.map_or("null".into(), num);
        let per_phase = |f: &dyn Fn(usize) -> String| {
            let items: Vec<String> = (0..6)
                .map(|k| format!("\"{}\": {}", PHASES[k], f(k)))
                .collect();
            format!("{{{}}}", items.join(", "))
        };
        let wire: Vec<String> = self
            .wire
            .iter()
            .map(|(n, b)| format!("\"{n}\": {}", *b as u64))
            .collect();
        let (tp, tc) = self.transient.unwrap_or((0, 0));
        let segments = self.segments.as_ref().map_or("null".into(), |v| {
            let items: Vec<String> = measure::SEGMENTS
                .iter()
                .zip(v)
                .map(|(n, x)| format!("\"{n}\": {}", num(*x)))
                .collect();
            format!("{{{}}}", items.join(", "))
        });
        let overlap = self.overlap.map_or("null".into(), |(w, a, c)| {
            format!(
                "{{\"step_with_compute_ms\": {}, \"compute_ms\": {}, \"exposed_ms\": {}, \"exposed_fraction\": {}, \"exposed_comm_ms\": {}, \"exposed_comm_fraction\": {}, \"compute_call_us\": {}, \"transient_peak_bytes\": {tp}, \"transient_closed_form_bytes\": {tc}, \"stream_segments_ms\": {segments}}}",
                num(w),
                num(a),
                num(w - a),
                num((w - a) / w),
                num(w - a - self.local_ms()),
                num((w - a - self.local_ms()) / w),
                num(c)
            )
        });
        let fallbacks: Vec<String> = self.fallbacks.iter().map(|f| format!("\"{f}\"")).collect();
        format!(
            "{{\"card\": \"{}\", \"world\": {}, \"model\": \"{}\", \"params\": {}, \"grad_dtype\": \"{}\", \"sharding\": \"{}\", \"comm_dtype\": \"{}\", \"nan_check\": {}, \"step_buckets\": \"{}\", \"clipped\": {}, \"precision\": \"{}\", \"phases_ms\": {}, \"total_ms\": {}, \"gather_requantize_ms\": {}, \"zero_grad_ms\": {}, \"norm_stepped_ms\": {}, \"norm_stepped_ratio\": {}, \"wire_bytes\": {{{}}}, \"peak_bytes\": {}, \"memory\": {{\"live_bytes\": {}, \"closed_form_bytes\": {}}}, \"bounds\": {}, \"ratios\": {}, \"kernel_bytes\": {}, \"bandwidth_gbs\": {{\"reduce_scatter_bus\": {}, \"gather_bus\": {}, \"copy\": {}}}, \"overlap\": {overlap}, \"host_fallbacks\": [{}]}}",
            self.card.replace('"', "'"),
            self.world,
            self.cfg.model,
            self.params,
            grads_name(self.cfg.grads),
            sharding_name(self.cfg.sharding),
            self.cfg.comm.map_or("grads", grads_name),
            self.cfg.nan_check,
            self.step_buckets.name(),
            self.clipped,
            self.cfg.precision.name(),
            per_phase(&|k| num(self.phases_ms[k])),
            num(self.total_ms),
            num(self.gather_requantize_ms),
            num(self.zero_ms),
            num(self.norm_stepped_ms),
            opt(self.norm_stepped_ratio()),
            wire.join(", "),
            self.peak,
            self.live,
            self.closed,
            per_phase(&|k| opt(self.bound_ms[k])),
            per_phase(&|k| opt(self.ratio(k))),
            per_phase(&|k| num(self.kernel_bytes[k])),
            num(self.bus_gbs[0]),
            num(self.bus_gbs[1]),
            per_phase(&|k| opt(self.copy_gbs[k])),
            fallbacks.join(", ")
        )
    }
}

/// The command line: flags with a value; `--also` may repeat.
struct Args(Vec<String>);

impl Args {
    fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .windows(2)
            .filter(|w| w[0] == name)
            .map(|w| w[1].as_str())
            .collect()
    }
    fn get(&self, name: &str) -> Option<&str> {
        self.all(name).last().copied()
    }
    /// A whole number in `range` (`lowbit_dev_support::cli::bounded`), else `default`.
    fn bounded(
        &self,
        name: &str,
        default: usize,
        range: std::ops::RangeInclusive<usize>,
    ) -> Res<usize> {
        self.get(name).map_or(Ok(default), |v| {
            Ok(lowbit_dev_support::cli::bounded(name, v, range)?)
        })
    }
}

fn configs(args: &Args) -> Res<Vec<Config>> {
    let precisions: Vec<Precision> = match args.get("--precision").unwrap_or("all") {
        "all" => Precision::ALL.to_vec(),
        list => list.split(',').map(Precision::parse).collect::<Res<_>>()?,
    };
    let grads: Vec<GradDType> = args
        .get("--grads")
        .unwrap_or("fp32,bf16")
        .split(',')
        .map(parse_grads)
        .collect::<Res<_>>()?;
    let model = args.get("--model").unwrap_or("llama-3.2-1b");
    let shardings: Vec<_> = args
        .get("--sharding")
        .unwrap_or("optim")
        .split(',')
        .map(parse_sharding)
        .collect::<Res<_>>()?;
    let comms: Vec<Option<GradDType>> = args
        .get("--comm")
        .unwrap_or("grads")
        .split(',')
        .map(|c| match c {
            "grads" => Ok(None),
            c => parse_grads(c).map(Some),
        })
        .collect::<Res<_>>()?;
    let nan_checks: Vec<bool> = args
        .get("--nan-check")
        .unwrap_or("off")
        .split(',')
        .map(|c| match c {
            "off" => Ok(false),
            "grad" => Ok(true),
            c => Err(format!("--nan-check {c}: off or grad")),
        })
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for &precision in &precisions {
        for &g in &grads {
            for &sharding in &shardings {
                for &comm in &comms {
                    for &nan_check in &nan_checks {
                        out.push(Config {
                            model: model.to_string(),
                            precision,
                            grads: g,
                            sharding,
                            comm,
                            nan_check,
                        });
                    }
                }
            }
        }
    }
    for also in args.all("--also") {
        let parts: Vec<&str> = also.split(':').collect();
        let [model, precision, grads] = parts[..] else {
            return Err(format!("--also {also}: MODEL:PRECISION:GRADS").into());
        };
        out.push(Config {
            model: model.to_string(),
            precision: Precision::parse(precision)?,
            grads: parse_grads(grads)?,
            sharding: lowbit_buffers::layout::ShardingStrategy::Distributed,
            comm: None,
            nan_check: false,
        });
    }
    Ok(out)
}

/// `--kernel NAME=VERSION[,NAME=VERSION…]`: CUDA kernel versions to run the step with (an A/B
/// of kernel alternatives in the whole step; the same bytes by contract).
fn parse_variants(list: &str) -> Res<Vec<(String, u32)>> {
    list.split(',')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("--kernel {kv}: NAME=VERSION"))?;
            Ok((
                k.to_string(),
                v.parse().map_err(|e| format!("--kernel {kv}: {e}"))?,
            ))
        })
        .collect()
}

/// Selects the `--kernel` versions on a rank's device (nothing to select on the CPU).
fn set_variants(dev: &mut Device, variants: &[(String, u32)]) -> Res<()> {
    #[cfg(feature = "cuda")]
    for (k, v) in variants {
        dev.set_cuda_kernel_variant(k, *v)?;
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (dev, variants);
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("step_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    // `cargo bench` appends `--bench` to every bench target's arguments; it is not a flag here.
    let args = Args(
        std::env::args()
            .skip(1)
            .filter(|a| a != "--bench")
            .collect(),
    );
    let device = args
        .get("--device")
        .unwrap_or(if cfg!(feature = "cuda") {
            "cuda"
        } else {
            "cpu"
        })
        .to_string();
    // Absurd sizes are refused here rather than left to exhaust the machine (a thread and a
    // model's buffers per CPU rank) or run for days; the same rank limit as `lowbit train`.
    let ranks = args.bounded("--ranks", 2, 1..=64)?;
    let settings = Settings {
        reps: (
            args.bounded("--warmup", 2, 0..=100_000)?,
            args.bounded("--iters", 10, 1..=100_000)?,
        ),
        gpu: device == "cuda",
        compute_us: args.get("--compute-us").map(str::parse).transpose()?,
        bucket: args
            .get("--bucket")
            .map(|v| lowbit_dev_support::cli::bounded("--bucket", v, 1..=usize::MAX))
            .transpose()?,
        step_buckets: match args.get("--step-buckets").unwrap_or("one") {
            "one" => StepBuckets::One,
            "layer" => StepBuckets::Layer,
            n => match n.parse() {
                Ok(n @ 1..) => StepBuckets::Elems(n),
                _ => {
                    return Err(format!(
                        "--step-buckets {n}: one, layer or a positive element count"
                    )
                    .into());
                }
            },
        },
        one_call_step: match args.get("--step-call").unwrap_or("one") {
            "one" => true,
            "two" => false,
            other => return Err(format!("--step-call {other}: one or two").into()),
        },
    };
    if let Some(us) = settings.compute_us
        && !(us > 0.0 && us <= 1e6)
    {
        return Err(format!("--compute-us {us}: a duration in (0, 1e6] microseconds").into());
    }
    let high = match args.get("--comm-priority").unwrap_or("high") {
        "high" => true,
        "normal" => false,
        other => return Err(format!("--comm-priority {other}: high or normal").into()),
    };
    let variants = parse_variants(args.get("--kernel").unwrap_or(""))?;
    let mut summaries = Vec::new();
    for cfg in configs(&args)? {
        let params = parameter_set(&cfg.model)?;
        let numel = params
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        let (c, p, s) = (&cfg, &params, &settings);
        let runs = run_world(&device, ranks, high, |comm, dev| {
            set_variants(dev, &variants)?;
            measure::step_rank(comm, dev, c, p, s)
        })?;
        let overlap = match settings.compute_us {
            Some(us) => Some(run_world(&device, ranks, high, |comm, dev| {
                set_variants(dev, &variants)?;
                measure::overlap_rank(comm, dev, c, p, s, us)
            })?),
            None => None,
        };
        let summary = Summary::new(
            cfg,
            numel,
            &runs,
            overlap.as_deref(),
            settings.one_call_step,
            settings.step_buckets,
        );
        print!("{}", summary.table());
        summaries.push(summary);
    }
    if let Some(path) = args.get("--json") {
        let card = summaries.first().map_or(String::new(), |s| s.card.clone());
        let runs: Vec<String> = summaries.iter().map(Summary::json).collect();
        let text = format!(
            "{{\"impl\": \"lowbit\", \"card\": \"{}\", \"world\": {ranks}, \"runs\": [\n{}\n]}}\n",
            card.replace('"', "'"),
            runs.join(",\n")
        );
        std::fs::write(path, text).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}
