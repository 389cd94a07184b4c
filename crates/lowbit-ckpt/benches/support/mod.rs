//! One rank's AdamW optimizer over bf16 parameters with f32 gradients, for the asynchronous-save
//! tests and the checkpoint benchmark (included by both with `#[path]`): no model, an optimizer
//! step is `Optimizer::apply` over fixed gradients, which changes every master and moment.

use lowbit_buffers::layout::{BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, DdpConfig};
use lowbit_device::Device;
use lowbit_optim::{AdamW, DistributedOptimizer, OptimConfig, Optimizer, UpdateScope};
use lowbit_testkit::{seed, values};

/// Parameters `(name, shape)` as specs of one owner.
pub fn specs(params: &[(String, Vec<usize>)]) -> Vec<ParamSpec> {
    let key = BufferKey::new(ParamStorage::Bf16, GradDType::F32, OptimizerId(0));
    params
        .iter()
        .map(|(name, shape)| ParamSpec::new(name.clone(), shape.clone(), key))
        .collect()
}

/// Rank `rank` of `dp`: its buffers and its AdamW over its owned shards.
pub struct Rank {
    /// Held, never read: the optimizer's gradient views lie in these buffers.
    #[allow(dead_code)]
    pub bufs: DataParallelBuffers,
    pub opt: DistributedOptimizer,
    pub specs: Vec<ParamSpec>,
}

impl Rank {
    /// Initial values and gradients are deterministic per parameter (the same on every rank).
    pub fn new(dev: &mut Device, dp: usize, rank: usize, specs: &[ParamSpec]) -> Rank {
        let mut bufs =
            DataParallelBuffers::new(dev, dp, rank, specs.to_vec(), DdpConfig::default())
                .expect("buffers");
        let init = |p: usize| values(seed(&[p as u64, 1]), specs[p].numel, 0.5);
        bufs.initialize_all(dev, init).expect("initialize");
        let rule = AdamW {
            weight_decay: 0.1,
            ..AdamW::default()
        };
        let mut pieces = |p: usize, r: std::ops::Range<usize>| init(p)[r].to_vec();
        let (owner, cfg) = (OptimizerId(0), OptimConfig::new(1e-3));
        let opt = DistributedOptimizer::new(dev, &bufs, owner, rule, cfg, &mut pieces)
            .expect("optimizer");
        bufs.zero_grad_buffer(dev).expect("zero");
        for (p, s) in specs.iter().enumerate() {
            let g = bufs.accumulation_view(dev, p).expect("grad view");
            dev.upload(g, &values(seed(&[p as u64, 2]), s.numel, 1e-2))
                .expect("upload");
        }
        Rank {
            bufs,
            opt,
            specs: specs.to_vec(),
        }
    }

    /// One optimizer step (every master and moment changes), finished on the device.
    pub fn step(&mut self, dev: &mut Device) {
        self.opt.begin_step();
        self.opt.update(dev, 1.0, UpdateScope::All).expect("update");
        dev.synchronize().expect("synchronize");
    }
}
