//! What one configuration of the step benchmark is: the parameter set (names and shapes as in
//! `benches/torch_step.py`'s `parameter_set()`), the precision of the primary weights, the
//! buffers and distributed AdamW built from them, and the gradients a kernel writes.

use lowbit_buffers::protocol::StepProtocol;
use std::error::Error;
use std::ops::Range;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingStrategy,
};
use lowbit_buffers::{
    DataParallelBuffers, DdpConfig, GradScaling, Mxfp8Gather, NanCheck, Overlap, Verify,
};
use lowbit_device::{DType, Device, View};
use lowbit_optim::{AdamW, DistributedOptimizer, OptimConfig};

/// Errors of the benchmark: every library error, or a message.
pub type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Models: name, (vocab, d, layers, kv, ffn); vocab 0 is a layer stack without embeddings.
pub const MODELS: [(&str, [usize; 5]); 3] = [
    ("tiny", [256, 64, 2, 32, 128]),
    ("llama-3.2-1b", [128_256, 2048, 16, 512, 8192]),
    ("llama-3-8b-layers", [0, 4096, 8, 1024, 14_336]),
];

/// One parameter of a model.
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub shape: Vec<usize>,
    /// A linear weight: low precision under the MXFP8 and NVFP4 precisions (embeddings and
    /// norms stay bf16, as in the torch baseline).
    pub linear: bool,
    /// The transformer layer it belongs to (the embedding to the first, the final norm to the
    /// last): the compute mode's unit of interleaving.
    pub layer: usize,
}

/// Every parameter of `model`, in model order (tied embeddings), as `torch_step.py` lists them.
pub fn parameter_set(model: &str) -> Res<Vec<Param>> {
    let [vocab, d, layers, kv, ffn] = MODELS
        .iter()
        .find(|(n, _)| *n == model)
        .map(|(_, dims)| *dims)
        .ok_or_else(|| format!("unknown model `{model}`"))?;
    let p = |name: String, shape: Vec<usize>, linear, layer| Param {
        name,
        shape,
        linear,
        layer,
    };
    let mut out = Vec::new();
    if vocab > 0 {
        out.push(p("embed_tokens.weight".into(), vec![vocab, d], false, 0));
    }
    for l in 0..layers {
        let n = |s: &str| format!("layers.{l}.{s}");
        out.extend([
            p(n("input_layernorm.weight"), vec![d], false, l),
            p(n("self_attn.q_proj.weight"), vec![d, d], true, l),
            p(n("self_attn.k_proj.weight"), vec![kv, d], true, l),
            p(n("self_attn.v_proj.weight"), vec![kv, d], true, l),
            p(n("self_attn.o_proj.weight"), vec![d, d], true, l),
            p(n("post_attention_layernorm.weight"), vec![d], false, l),
            p(n("mlp.gate_proj.weight"), vec![ffn, d], true, l),
            p(n("mlp.up_proj.weight"), vec![ffn, d], true, l),
            p(n("mlp.down_proj.weight"), vec![d, ffn], true, l),
        ]);
    }
    if vocab > 0 {
        out.push(p("norm.weight".into(), vec![d], false, layers - 1));
    }
    Ok(out)
}

/// The primary weights of the linear layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Bf16,
    /// MXFP8, staged through bf16 (1x32 blocks, both copies re-quantized after the gather).
    Mxfp8,
    /// MXFP8 with 32x32 scales, gathered as fp8 bytes.
    Mxfp8Direct,
    /// 2D NVFP4, gathered as packed bytes.
    Nvfp4,
}

impl Precision {
    pub const ALL: [Precision; 4] = [
        Precision::Bf16,
        Precision::Mxfp8,
        Precision::Mxfp8Direct,
        Precision::Nvfp4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Mxfp8 => "mxfp8",
            Precision::Mxfp8Direct => "mxfp8-2d",
            Precision::Nvfp4 => "nvfp4",
        }
    }

    pub fn parse(s: &str) -> Res<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown precision `{s}` (bf16, mxfp8, mxfp8-2d, nvfp4)").into())
    }

    /// The storage of a linear weight.
    fn linear_storage(self) -> ParamStorage {
        match self {
            Precision::Bf16 => ParamStorage::Bf16,
            Precision::Mxfp8 | Precision::Mxfp8Direct => ParamStorage::Quantized(QuantKind::Mxfp8),
            Precision::Nvfp4 => ParamStorage::Quantized(QuantKind::Nvfp4),
        }
    }

    /// Bytes of the parameter region (what the gather moves) of a buffer of `numel` elements.
    pub fn region_bytes(self, storage: ParamStorage, numel: usize) -> usize {
        match (storage, self) {
            (ParamStorage::Quantized(QuantKind::Nvfp4), _) => numel / 2,
            (ParamStorage::Quantized(_), Precision::Mxfp8Direct) => numel,
            _ => 2 * numel,
        }
    }
}

/// Parses `fp32` or `bf16`.
pub fn parse_grads(s: &str) -> Res<GradDType> {
    match s {
        "fp32" => Ok(GradDType::F32),
        "bf16" => Ok(GradDType::Bf16),
        _ => Err(format!("unknown gradient dtype `{s}` (fp32, bf16)").into()),
    }
}

pub fn grads_name(g: GradDType) -> &'static str {
    if g == GradDType::F32 { "fp32" } else { "bf16" }
}

/// One run of the benchmark.
#[derive(Clone, Debug)]
pub struct Config {
    pub model: String,
    pub precision: Precision,
    pub grads: GradDType,
    /// The strategy (FSDP's four; `Distributed` = `optim`, the default).
    pub sharding: ShardingStrategy,
    /// The gradient communication dtype (`None`: the gradients').
    pub comm: Option<GradDType>,
    /// The non-finite gradient check before each reduction.
    pub nan_check: bool,
}

/// The FSDP names of the strategies.
pub const SHARDINGS: [(&str, ShardingStrategy); 4] = [
    ("no_shard", ShardingStrategy::Replicated),
    ("optim", ShardingStrategy::Distributed),
    ("optim_grads", ShardingStrategy::OptimGrads),
    ("optim_grads_params", ShardingStrategy::OptimGradsParams),
];

pub fn parse_sharding(s: &str) -> Res<ShardingStrategy> {
    SHARDINGS
        .iter()
        .find(|(n, _)| *n == s)
        .map(|&(_, x)| x)
        .ok_or_else(|| {
            format!("--sharding {s}: no_shard, optim, optim_grads or optim_grads_params").into()
        })
}

pub fn sharding_name(s: ShardingStrategy) -> &'static str {
    SHARDINGS
        .iter()
        .find(|(_, x)| *x == s)
        .map_or("layer_wise", |(n, _)| n)
}

impl Config {
    /// The specs of the model's parameters, one owner (the distributed AdamW).
    pub fn specs(&self, params: &[Param]) -> Vec<ParamSpec> {
        params
            .iter()
            .map(|p| {
                let storage = if p.linear {
                    self.precision.linear_storage()
                } else {
                    ParamStorage::Bf16
                };
                let key = BufferKey::new(storage, self.grads, OptimizerId(0));
                ParamSpec::new(p.name.clone(), p.shape.clone(), key)
            })
            .collect()
    }

    /// The distributed optimizer's buffers: reduce-scatter with `Avg` (as the torch baseline),
    /// one bucket per buffer without overlap; with `bucket`, overlapped reductions and gathers.
    pub fn ddp(&self, bucket: Option<usize>) -> DdpConfig {
        let overlap = match (bucket, self.sharding) {
            (None, _) => Overlap::None,
            // Nothing to gather.
            (Some(_), ShardingStrategy::Replicated) => Overlap::GradReduce,
            (Some(_), _) => Overlap::GradReduceAndParamGather,
        };
        self.ddp_with(overlap, bucket)
    }

    /// The step without compute in buckets of `bucket` elements: reductions in buckets (all
    /// launched when the step starts, as the backward left them), gathers after the step, so
    /// that the norm trails the reductions and each group's gather its update.
    pub fn ddp_buckets(&self, bucket: usize) -> DdpConfig {
        self.ddp_with(Overlap::GradReduce, Some(bucket))
    }

    fn ddp_with(&self, overlap: Overlap, bucket: Option<usize>) -> DdpConfig {
        let gather = match self.precision {
            Precision::Mxfp8Direct => Mxfp8Gather::Direct2d,
            _ => Mxfp8Gather::Bf16Staging,
        };
        DdpConfig::default()
            .with_sharding(self.sharding)
            .with_grad_comm_dtype(self.comm)
            .with_nan_check(if self.nan_check {
                NanCheck::FirstParam
            } else {
                NanCheck::Off
            })
            .with_overlap(overlap)
            .with_bucket_size(bucket)
            .with_scaling(GradScaling::AverageInCollective)
            .with_mxfp8_gather(gather)
            .with_verify(Verify::Cheap)
    }
}

/// The buffers and the optimizer of one rank: AdamW as the torch baseline's (lr 1e-4, betas
/// 0.9/0.95, weight decay 0.1, clipping at 1). Weights are not initialized: every step rebuilds
/// them from the masters, so the warm-up steps write them.
pub fn build(
    dev: &mut Device,
    dp: usize,
    rank: usize,
    specs: Vec<ParamSpec>,
    ddp: DdpConfig,
) -> Res<(DataParallelBuffers, DistributedOptimizer)> {
    let bufs = DataParallelBuffers::new(dev, dp, rank, specs, ddp)?;
    let rule = AdamW {
        beta2: 0.95,
        weight_decay: 0.1,
        ..AdamW::default()
    };
    let cfg = OptimConfig::new(1e-4).with_clip_grad(Some(1.0));
    let mut init = |p: usize, r: Range<usize>| {
        let seed = lowbit_testkit::seed(&[p as u64, r.start as u64]);
        lowbit_testkit::values(seed, r.len(), 0.02)
    };
    let opt = DistributedOptimizer::new(dev, &bufs, OptimizerId(0), rule, cfg, &mut init)?;
    Ok((bufs, opt))
}

/// A short pattern of gradient values in both gradient dtypes, tiled into gradient views by
/// device copies: the "backward" of the benchmark.
pub struct GradSource {
    f32: View,
    bf16: View,
}

impl GradSource {
    pub fn new(dev: &mut Device, len: usize) -> Res<Self> {
        let f32 = lowbit_testkit::upload_f32(dev, &lowbit_testkit::values(7, len, 1e-3));
        let bf16 = dev.alloc(DType::Bf16, len);
        dev.cast(f32, bf16)?;
        Ok(GradSource { f32, bf16 })
    }

    pub fn bytes(&self) -> usize {
        self.f32.byte_len() + self.bf16.byte_len()
    }

    /// Fills `dst` (f32 or bf16): the pattern once, then doubling copies of what is written.
    pub fn fill(&self, dev: &mut Device, dst: View) -> Res<()> {
        let pattern = if dst.dtype() == DType::F32 {
            self.f32
        } else {
            self.bf16
        };
        let n = dst.len();
        let first = n.min(pattern.len());
        dev.copy(pattern.slice(0..first)?, dst.slice(0..first)?)?;
        let mut done = first;
        while done < n {
            let k = done.min(n - done);
            dev.copy(dst.slice(0..k)?, dst.slice(done..done + k)?)?;
            done += k;
        }
        Ok(())
    }

    /// Writes the gradients of `params` through the backward's accumulation views.
    pub fn backward(
        &self,
        dev: &mut Device,
        bufs: &mut DataParallelBuffers,
        params: impl Iterator<Item = usize>,
    ) -> Res<()> {
        for p in params {
            let dst = bufs.accumulation_view(dev, p)?;
            self.fill(dev, dst)?;
        }
        Ok(())
    }
}
