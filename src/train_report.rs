//! `lowbit train`'s report: the closing table ([`render`]) and the `--json` object
//! ([`to_json`]).

use lowbit::comm::CommStats;
use lowbit::optim::RankMemory;
use lowbit::train::json::Json;
use lowbit::train::{ModelChoice, OptimizerChoice, ParamOwner, TrainConfig, TrainReport};

use crate::report;

fn mib(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

fn memory_rows(m: &RankMemory) -> [(&'static str, usize); 6] {
    [
        ("weights", m.weights()),
        ("staging (aliases grads)", m.staging()),
        ("grads", m.grads()),
        ("fp32 masters", m.masters),
        ("optimizer state", m.optimizer_state + m.grad_scratch),
        ("total", m.total()),
    ]
}

fn comm_rows(c: &CommStats) -> [(&'static str, u64, u64); 4] {
    [
        ("all-gather", c.all_gather.calls, c.all_gather.bytes),
        (
            "reduce-scatter",
            c.reduce_scatter.calls,
            c.reduce_scatter.bytes,
        ),
        ("all-reduce", c.all_reduce.calls, c.all_reduce.bytes),
        ("broadcast", c.broadcast.calls, c.broadcast.bytes),
    ]
}

/// The optimizers in words.
fn describe_optimizer(cfg: &TrainConfig) -> String {
    match &cfg.optimizer {
        OptimizerChoice::AdamW => "distributed AdamW".into(),
        OptimizerChoice::Muon(m) => format!(
            "Muon layer-wise (lr {}, {} scale, momentum {} Nesterov, {} NS steps {}, weight \
             decay {}) + distributed AdamW",
            m.lr,
            m.lr_scale.name(),
            m.momentum,
            m.ns_steps,
            m.ns_dtype.name(),
            m.weight_decay
        ),
    }
}

/// A decoder's activation and scratch bytes per rank (the closed form); null for the reference
/// model.
pub(crate) fn activations_json(cfg: &TrainConfig) -> Json {
    match &cfg.model {
        ModelChoice::Llama(run) => run.activation_bytes(cfg).map_or(Json::Null, Json::uint),
        ModelChoice::Reference => Json::Null,
    }
}

pub(crate) fn describe(cfg: &TrainConfig) -> String {
    let on = |b: bool| if b { "on" } else { "off" };
    let mp = &cfg.mixed_precision;
    format!(
        "{} ranks on {}, sharding {}, {} weights (primary low-precision gather {}), main params \
         {}, grads {}, grad comm {}, overlap grad reduce {} / param gather {}, recompute {}, \
         nan check {}, {}, compute {}",
        cfg.ranks,
        cfg.device.name(),
        cfg.sharding,
        cfg.precision.name(),
        on(cfg.param_gather),
        mp.main_params_dtype.name(),
        mp.main_grads_dtype.name(),
        cfg.comm_dtype_name(),
        on(cfg.overlap_grad_reduce),
        on(cfg.overlap_param_gather),
        cfg.recompute.name(),
        cfg.nan_check.name(),
        describe_optimizer(cfg),
        cfg.compute.name(),
    )
}

/// The model as the `--json` object's `"model"`: its name, and a decoder's shape and sequence
/// length.
pub(crate) fn model_json(c: &TrainConfig) -> Json {
    match &c.model {
        ModelChoice::Reference => Json::obj([("name", Json::str("reference"))]),
        ModelChoice::Llama(run) => {
            let m = &run.config;
            Json::obj([
                ("name", Json::str(run.preset.clone())),
                ("seq", Json::uint(run.seq)),
                ("vocab", Json::uint(m.vocab)),
                ("dim", Json::uint(m.dim)),
                ("layers", Json::uint(m.layers)),
                ("heads", Json::uint(m.heads)),
                ("kv_heads", Json::uint(m.kv_heads)),
                ("head_dim", Json::uint(m.head_dim)),
                ("ffn", Json::uint(m.ffn)),
                ("tied", Json::Bool(m.tied)),
            ])
        }
    }
}

/// The sharding strategy and precision policy as the `--json` object's `"fsdp"`.
pub(crate) fn fsdp_json(cfg: &TrainConfig) -> Json {
    let mp = &cfg.mixed_precision;
    Json::obj([
        ("sharding", Json::str(cfg.sharding.as_str())),
        ("main_params_dtype", Json::str(mp.main_params_dtype.name())),
        ("main_grads_dtype", Json::str(mp.main_grads_dtype.name())),
        ("grad_comm_dtype", Json::str(mp.grad_comm_dtype.name())),
        // `auto` resolved: the dtype the reduction rounds to.
        (
            "grad_comm_dtype_effective",
            Json::str(cfg.comm_dtype_name()),
        ),
        ("nan_check", Json::str(cfg.nan_check.name())),
        (
            "fine_grained_param_gather",
            Json::str(cfg.fine_grained.name()),
        ),
        (
            "fine_grained_effective",
            Json::Bool(cfg.fine_grained_on().0),
        ),
        ("outer_dp", Json::uint(cfg.outer_dp)),
        (
            "outer_sharding",
            cfg.outer_sharding
                .map_or(Json::Null, |s| Json::str(s.name())),
        ),
        ("recompute", Json::Bool(cfg.recompute.is_on())),
        ("recompute_level", Json::str(cfg.recompute.name())),
    ])
}

/// Ranks as text: `0-3`, `0,2`, `2`.
fn ranks_text(ranks: &[usize]) -> String {
    match ranks {
        [] => "-".into(),
        [r] => r.to_string(),
        [first, .., last] if last - first + 1 == ranks.len() => format!("{first}-{last}"),
        _ => ranks
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// A shape as text: `8x64`.
pub fn shape_text<T: ToString>(shape: &[T]) -> String {
    shape
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("x")
}

/// Who updates which parameter: one line each, then Muon's work per rank.
fn render_owners(r: &TrainReport) -> String {
    let mut o = format!(
        "{:<28}{:>10}  {:<10}{:>7}  {}\n",
        "optimizer per parameter", "shape", "optimizer", "decay", "ranks (fp32 master and state)"
    );
    for p in &r.owners {
        let ranks = if p.optimizer == "muon" {
            format!("{} (layer-wise: whole)", ranks_text(&p.ranks))
        } else {
            format!("{} (distributed)", ranks_text(&p.ranks))
        };
        o += &format!(
            "  {:<26}{:>10}  {:<10}{:>7}  {ranks}\n",
            p.name,
            shape_text(&p.shape),
            p.optimizer,
            p.weight_decay
        );
    }
    if !r.muon_ranks.is_empty() {
        o += &format!(
            "\n{:<28}{:>10}{:>10}{:>10}\n",
            "muon work per rank", "params", "matrices", "elements"
        );
        for l in &r.muon_ranks {
            let name = format!("rank {}", l.rank);
            if l.params == 0 {
                o += &format!("  {name:<26}  idle: owns no Muon matrix\n");
            } else {
                o += &format!(
                    "  {name:<26}{:>10}{:>10}{:>10}\n",
                    l.params, l.matrices, l.elements
                );
            }
        }
    }
    o
}

/// The closing table.
pub fn render(r: &TrainReport) -> String {
    let c = &r.config;
    let s = &c.shape;
    let mut o = String::new();
    o += &format!("lowbit train: {}\n", describe(c));
    if let ModelChoice::Llama(run) = &c.model {
        let m = &run.config;
        o += &format!(
            "model: {} ({} parameters; vocab {}, dim {}, {} layers, {} heads / {} kv heads of \
             {}, ffn {}, {} head); batch {} x {} tokens x {} steps\n\n",
            run.preset,
            r.params,
            m.vocab,
            m.dim,
            m.layers,
            m.heads,
            m.kv_heads,
            m.head_dim,
            m.ffn,
            if m.tied { "tied" } else { "untied" },
            c.batch,
            run.seq,
            c.steps
        );
    } else {
        o += &format!(
            "model: {} parameters; vocab {}, context {}, {} dense blocks, MoE {} experts top-{} \
         ({}); batch {} x {} steps\n\n",
            r.params,
            s.vocab,
            s.context,
            s.blocks,
            s.experts,
            s.top_k,
            if s.grouped {
                "grouped weights"
            } else {
                "per-expert weights"
            },
            c.batch,
            c.steps
        );
    }
    if let Some(dir) = &r.resumed_from {
        o += &format!(
            "resumed from {} (step {}): {} steps run\n",
            report::escape(&dir.display().to_string()),
            r.first_step,
            r.losses.len()
        );
    }
    if let Some(last) = r.saved.last() {
        o += &format!(
            "checkpoints saved: {}, the last {}\n",
            r.saved.len(),
            report::escape(&last.display().to_string())
        );
    }
    if r.resumed_from.is_some() || !r.saved.is_empty() {
        o += "\n";
    }
    // A resume at the final step runs nothing: no loss, only the saved masters' checksum.
    let final_loss = r.losses.last().map_or("-".into(), |l| format!("{l:.4}"));
    let final_eval = r.evals.last().map(|e| e.1);
    let eval_text = final_eval.map_or("-".into(), |v| format!("{v:.4}"));
    o += &format!("{:<28}{:>12}\n", "final train loss", final_loss);
    o += &format!("{:<28}{:>12}", "final eval loss", eval_text);
    o += &if r.eval_set.1 {
        format!(
            "  (expected cross-entropy over all {} contexts)\n",
            r.eval_set.0
        )
    } else {
        format!("  ({} held-out samples)\n", r.eval_set.0)
    };
    match r.floor {
        Some(f) => {
            o += &format!("{:<28}{:>12}\n", "entropy floor", format!("{f:.4}"));
            let gap = final_eval.map_or("-".into(), |v| format!("{:+.4}", f64::from(v) - f));
            o += &format!("{:<28}{:>12}\n", "eval - floor", gap);
        }
        None => o += &format!("{:<28}{:>12}\n", "entropy floor", "unknown"),
    }
    o += &format!(
        "{:<28}{:>12}\n\n",
        "wall time",
        format!("{:.1} s", r.wall.as_secs_f64())
    );
    o += &render_owners(r);
    o += "\n";
    o += &format!(
        "{:<28}{:>14}{:>20}\n",
        "memory per rank", "this run", "bf16, unsharded"
    );
    for ((name, a), (_, b)) in memory_rows(&r.memory).iter().zip(memory_rows(&r.baseline)) {
        o += &format!("  {name:<26}{:>14}{:>20}\n", mib(*a), mib(b));
    }
    o += &format!(
        "\n{:<28}{:>14}{:>14}\n",
        "collectives (rank 0)", "calls", "bytes"
    );
    for (name, calls, bytes) in comm_rows(&r.comm) {
        o += &format!("  {name:<26}{calls:>14}{:>14}\n", mib(bytes as usize));
    }
    let p = &r.phases;
    o += &format!("\n{:<28}{:>14}\n", "time per phase (rank 0)", "seconds");
    for (name, d) in [
        ("forward + backward", p.forward_backward),
        ("grad sync", p.grad_sync),
        ("optimizer step", p.optimizer),
        ("param sync", p.param_sync),
        ("eval", p.eval),
    ] {
        o += &format!("  {name:<26}{:>14.2}\n", d.as_secs_f64());
    }
    if r.resumed_from.is_some() || !r.saved.is_empty() {
        o += &format!(
            "  {:<26}{:>14.2}\n",
            "checkpoint load + save",
            p.checkpoint.as_secs_f64()
        );
    }
    o += &format!(
        "\nfp32 master checksum (fnv1a64): {:016x}\n",
        r.master_checksum
    );
    o
}

fn memory_json(m: &RankMemory) -> Json {
    Json::obj([
        ("weights", Json::uint(m.weights())),
        ("staging", Json::uint(m.staging())),
        ("grads", Json::uint(m.grads())),
        ("masters", Json::uint(m.masters)),
        ("optimizer_state", Json::uint(m.optimizer_state)),
        ("grad_scratch", Json::uint(m.grad_scratch)),
        ("total", Json::uint(m.total())),
    ])
}

/// One entry of `param_owners`.
fn owner_json(p: &ParamOwner) -> Json {
    let whole = p.optimizer == "muon";
    Json::obj([
        ("name", Json::str(p.name.clone())),
        (
            "shape",
            Json::Arr(p.shape.iter().map(|&d| Json::uint(d)).collect()),
        ),
        ("optimizer", Json::str(p.optimizer)),
        ("owner_id", Json::uint(p.owner.0)),
        ("weight_decay", Json::F32(p.weight_decay)),
        (
            "sharding",
            Json::str(if whole { "layer_wise" } else { "distributed" }),
        ),
        (
            "ranks",
            Json::Arr(p.ranks.iter().map(|&r| Json::uint(r)).collect()),
        ),
        (
            "owner_rank",
            match (whole, &p.ranks[..]) {
                (true, [r]) => Json::uint(*r),
                _ => Json::Null,
            },
        ),
        (
            "muon_lr_factor",
            p.muon_lr_factor.map_or(Json::Null, Json::Num),
        ),
    ])
}

/// The `--json` object. Timing fields (wall time, time per phase) are all under `"timing"`;
/// everything else depends only on the flags, so two runs with the same seed print the same
/// bytes outside that key.
pub fn to_json(r: &TrainReport) -> Json {
    let c = &r.config;
    let bits = |v: f32| Json::str(format!("0x{:08x}", v.to_bits()));
    let steps = r
        .losses
        .iter()
        .zip(&r.grad_norms)
        .enumerate()
        .map(|(i, (&l, &g))| {
            Json::obj([
                ("step", Json::uint(r.first_step + i + 1)),
                ("loss", Json::F32(l)),
                ("loss_bits", bits(l)),
                ("grad_norm", Json::F32(g)),
                ("grad_norm_bits", bits(g)),
            ])
        })
        .collect();
    let evals = r
        .evals
        .iter()
        .map(|&(s, l)| {
            Json::obj([
                ("step", Json::uint(s)),
                ("loss", Json::F32(l)),
                ("loss_bits", bits(l)),
            ])
        })
        .collect();
    let comm = Json::Obj(
        comm_rows(&r.comm)
            .iter()
            .map(|&(n, calls, bytes)| {
                (
                    n.replace('-', "_"),
                    Json::obj([("calls", Json::uint(calls)), ("bytes", Json::uint(bytes))]),
                )
            })
            .collect(),
    );
    let p = &r.phases;
    let owners = r.owners.iter().map(owner_json).collect();
    let muon_ranks = r
        .muon_ranks
        .iter()
        .map(|l| {
            Json::obj([
                ("rank", Json::uint(l.rank)),
                ("params", Json::uint(l.params)),
                ("matrices", Json::uint(l.matrices)),
                ("elements", Json::uint(l.elements)),
            ])
        })
        .collect();
    let muon = match c.optimizer.muon() {
        None => Json::Null,
        Some(m) => Json::obj([
            ("lr", Json::F32(m.lr)),
            ("momentum", Json::F32(m.momentum)),
            ("nesterov", Json::Bool(true)),
            ("ns_steps", Json::uint(m.ns_steps)),
            ("ns_dtype", Json::str(m.ns_dtype.name())),
            ("lr_scale", Json::str(m.lr_scale.name())),
            ("weight_decay", Json::F32(m.weight_decay)),
            ("sharding", Json::str("layer_wise")),
        ]),
    };
    Json::obj([
        ("config", Json::str(describe(c))),
        ("optimizer", Json::str(c.optimizer.name())),
        ("lr", Json::F32(c.lr)),
        ("muon", muon),
        ("param_owners", Json::Arr(owners)),
        ("muon_ranks", Json::Arr(muon_ranks)),
        ("ranks", Json::uint(c.ranks)),
        ("precision", Json::str(c.precision.name())),
        ("compute", Json::str(c.compute.name())),
        ("batch", Json::uint(c.batch)),
        ("model", model_json(c)),
        ("param_gather", Json::Bool(c.param_gather)),
        ("sharding", Json::str(c.sharding.as_str())),
        ("fsdp", fsdp_json(c)),
        ("grouped_experts", Json::Bool(c.shape.grouped)),
        ("params", Json::uint(r.params)),
        ("seed", Json::uint(c.seed)),
        ("floor", r.floor.map_or(Json::Null, Json::Num)),
        ("eval_items", Json::uint(r.eval_set.0)),
        ("eval_exact", Json::Bool(r.eval_set.1)),
        ("first_step", Json::uint(r.first_step)),
        (
            "resumed_from",
            r.resumed_from
                .as_ref()
                .map_or(Json::Null, |d| Json::str(d.display().to_string())),
        ),
        (
            "saved",
            Json::Arr(
                r.saved
                    .iter()
                    .map(|d| Json::str(d.display().to_string()))
                    .collect(),
            ),
        ),
        ("steps", Json::Arr(steps)),
        ("evals", Json::Arr(evals)),
        (
            "master_checksum",
            Json::str(format!("{:016x}", r.master_checksum)),
        ),
        (
            "memory",
            Json::obj([
                ("per_rank", memory_json(&r.memory)),
                ("bf16_unsharded", memory_json(&r.baseline)),
                ("activations_per_rank", activations_json(&r.config)),
            ]),
        ),
        ("comm", comm),
        // Everything that varies between runs of the same flags, under one key (last).
        (
            "timing",
            Json::obj([
                ("wall_s", Json::Num(r.wall.as_secs_f64())),
                (
                    "phases_s",
                    Json::obj([
                        (
                            "forward_backward",
                            Json::Num(p.forward_backward.as_secs_f64()),
                        ),
                        ("grad_sync", Json::Num(p.grad_sync.as_secs_f64())),
                        ("optimizer", Json::Num(p.optimizer.as_secs_f64())),
                        ("param_sync", Json::Num(p.param_sync.as_secs_f64())),
                        ("eval", Json::Num(p.eval.as_secs_f64())),
                        ("checkpoint", Json::Num(p.checkpoint.as_secs_f64())),
                    ]),
                ),
            ]),
        ),
    ])
}
