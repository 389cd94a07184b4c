//! Checkpoints through lowbit-optim's public API with the tiny MLP: round trip bitwise, resume
//! bit for bit, resharding 2↔4 (distributed and layer-wise, and across them), crash leftovers,
//! pruning, hostile manifests.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingStrategy,
};
use lowbit_buffers::{
    ComputeFormat, DataParallelBuffers, DdpConfig, Overlap, ParamCompute, PrecisionPolicy, Verify,
};
use lowbit_ckpt::json::Json;
use lowbit_ckpt::{Alias, Checkpoint, CkptError, LoadOptions, Meta, SaveOptions, Segment, save};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_optim::{
    AdamW, ChainedOptimizer, DistributedOptimizer, Muon, MuonConfig, NsDtype, OptimConfig,
    Optimizer, OptimizerState, Sgd, init_from_full,
};
use lowbit_testkit::model::Mlp;
use lowbit_testkit::{bits, run, seed, values, weight_parts};
use lowbit_train::Trainer;

const DIMS: [usize; 4] = [32, 64, 32, 32];
const BATCH: usize = 4;
const MXFP8: ParamStorage = ParamStorage::Quantized(QuantKind::Mxfp8);

fn tmp_root(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let p = std::env::temp_dir().join(format!(
        "lowbit-ckpt-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn specs() -> Vec<ParamSpec> {
    Mlp::params(&DIMS)
        .into_iter()
        .map(|(name, shape)| {
            let matrix = shape.len() == 2;
            let storage = if matrix { MXFP8 } else { ParamStorage::Bf16 };
            let owner = OptimizerId(u32::from(!matrix));
            ParamSpec::new(name, shape, BufferKey::new(storage, GradDType::F32, owner))
        })
        .collect()
}

fn init_values(specs: &[ParamSpec], salt: u64) -> Vec<Vec<f32>> {
    specs
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[p as u64, salt]), s.numel, 0.25))
        .collect()
}

fn make(
    dev: &mut Device,
    dp: usize,
    rank: usize,
    strategy: ShardingStrategy,
    init: &[Vec<f32>],
) -> Trainer {
    make_with(dev, dp, rank, strategy, init, false)
}

/// With `muon`, owner 0 (the matrices) is Muon (f32 Newton–Schulz; the strategy must be
/// layer-wise), else AdamW; owner 1 (the biases) is SGD.
fn make_with(
    dev: &mut Device,
    dp: usize,
    rank: usize,
    strategy: ShardingStrategy,
    init: &[Vec<f32>],
    muon: bool,
) -> Trainer {
    let specs = specs();
    let ddp = DdpConfig::default()
        .with_sharding(strategy)
        .with_overlap(Overlap::GradReduceAndParamGather)
        .with_bucket_size(Some(2500))
        .with_verify(Verify::Full);
    let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), ddp).unwrap();
    bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
    let adamw = AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let sgd = Sgd {
        momentum: 0.9,
        weight_decay: 0.01,
    };
    let a: Box<dyn Optimizer> = if muon {
        let cfg = MuonConfig::default()
            .with_weight_decay(0.01)
            .with_ns_dtype(NsDtype::F32);
        Box::new(
            Muon::new(
                dev,
                &bufs,
                OptimizerId(0),
                cfg,
                OptimConfig::new(2e-2),
                &mut init_from_full(init),
            )
            .unwrap(),
        )
    } else {
        Box::new(
            DistributedOptimizer::new(
                dev,
                &bufs,
                OptimizerId(0),
                adamw,
                OptimConfig::new(1e-2),
                &mut init_from_full(init),
            )
            .unwrap(),
        )
    };
    let b = DistributedOptimizer::new(
        dev,
        &bufs,
        OptimizerId(1),
        sgd,
        OptimConfig::new(5e-2),
        &mut init_from_full(init),
    )
    .unwrap();
    let parts: Vec<Box<dyn Optimizer>> = vec![a, Box::new(b)];
    let opt = ChainedOptimizer::new(parts).unwrap();
    let policy = PrecisionPolicy::new(
        specs
            .iter()
            .map(|s| {
                if s.shape.len() == 2 {
                    ParamCompute::new(ComputeFormat::Mxfp8 { two_d: false })
                } else {
                    ParamCompute::AS_STORED
                }
            })
            .collect(),
    );
    Trainer::new(dev, bufs, Box::new(opt), policy).unwrap()
}

/// One step; returns (sum of microbatch losses' bits, grad norm bits).
fn step(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    t: &mut Trainer,
    mlp: &Mlp,
    data_step: usize,
) -> (Vec<u32>, u32) {
    let rank = comm.rank();
    let mut losses = Vec::new();
    let mut it = t.begin(dev, comm).unwrap();
    for m in 0..2 {
        let (x, y) = mlp.sample(rank, data_step, m);
        let mut hooks = it.microbatch(comm, m == 1);
        losses.push(
            mlp.forward_backward(dev, &mut hooks, &x, &y, 0.5)
                .unwrap()
                .to_bits(),
        );
    }
    let r = it
        .finish_grad_sync(dev, comm)
        .unwrap()
        .step(dev, comm)
        .unwrap();
    (losses, r.grad_norm.to_bits())
}

fn weights(dev: &mut Device, t: &Trainer) -> Vec<Vec<u8>> {
    (0..t.buffers().specs().len())
        .map(|p| weight_parts(dev, t.buffers(), p).concat())
        .collect()
}

fn meta(step: u64) -> Meta {
    let mut m = Meta {
        step,
        ..Meta::default()
    };
    m.config.insert("dims".into(), format!("{DIMS:?}"));
    m.data.insert("next_step".into(), step.to_string());
    m.rng.insert("seed".into(), "0x1234".into());
    m
}

/// Full tensors `(param, state name) → bits` from every rank's exported state.
fn assemble(states: &[Vec<OptimizerState>]) -> BTreeMap<(usize, String), Vec<Option<u32>>> {
    let specs = specs();
    let mut out: BTreeMap<(usize, String), Vec<Option<u32>>> = BTreeMap::new();
    for st in states.iter().flatten() {
        for t in &st.tensors {
            let full = out
                .entry((t.param, t.name.clone()))
                .or_insert_with(|| vec![None; specs[t.param].numel]);
            for (i, v) in t.range.clone().zip(&t.values) {
                assert!(full[i].is_none(), "element twice");
                full[i] = Some(v.to_bits());
            }
        }
    }
    for v in out.values() {
        assert!(v.iter().all(Option::is_some), "hole");
    }
    out
}

fn train_and_save(
    dp: usize,
    strategy: ShardingStrategy,
    steps: usize,
    root: &Path,
) -> Vec<Vec<OptimizerState>> {
    train_and_save_with(dp, strategy, steps, root, false)
}

fn train_and_save_with(
    dp: usize,
    strategy: ShardingStrategy,
    steps: usize,
    root: &Path,
    muon: bool,
) -> Vec<Vec<OptimizerState>> {
    let specs = specs();
    let init = init_values(&specs, 1);
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        let mut t = make_with(dev, dp, comm.rank(), strategy, &init, muon);
        for s in 0..steps {
            step(dev, &mut comm, &mut t, &mlp, s);
        }
        let specs = t.buffers().specs().to_vec();
        save(
            dev,
            &mut comm,
            root,
            &meta(steps as u64),
            &specs,
            t.optimizer(),
            SaveOptions::default(),
        )
        .unwrap();
        t.optimizer().export_state(dev).unwrap()
    })
}

fn load_states(dp: usize, strategy: ShardingStrategy, root: &Path) -> Vec<Vec<OptimizerState>> {
    load_states_with(dp, strategy, root, false)
}

fn load_states_with(
    dp: usize,
    strategy: ShardingStrategy,
    root: &Path,
    muon: bool,
) -> Vec<Vec<OptimizerState>> {
    let specs = specs();
    let other = init_values(&specs, 99);
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let ck = Checkpoint::open(root).unwrap();
        let mut t = make_with(dev, dp, comm.rank(), strategy, &other, muon);
        t.load_checkpoint(dev, &mut comm, &ck, &LoadOptions::default())
            .unwrap();
        t.optimizer().export_state(dev).unwrap()
    })
}

#[test]
fn round_trip_is_bitwise_and_meta_survives() {
    let root = tmp_root("roundtrip");
    let saved = train_and_save(2, ShardingStrategy::Distributed, 3, &root);
    let ck = Checkpoint::open(&root).unwrap();
    assert_eq!(*ck.meta(), meta(3));
    assert!(ck.dir().ends_with("step-3"));
    ck.verify().unwrap();
    let loaded = load_states(2, ShardingStrategy::Distributed, &root);
    assert!(saved == loaded, "export after load differs");
    assert!(saved.iter().flatten().all(|s| s.steps == 3));
    // Every tensor of the manifest is named by parameter and state, in rank files.
    let names: Vec<&str> = ck
        .manifest()
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert!(names.contains(&"l0.weight/master") && names.contains(&"l0.weight/exp_avg_sq"));
    assert!(
        names.contains(&"l0.bias/momentum_buffer")
            || names.iter().any(|n| n.starts_with("l0.bias/"))
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn resume_is_bit_for_bit() {
    for (strategy, muon) in [
        (ShardingStrategy::Distributed, false),
        (ShardingStrategy::LayerWise, false),
        (ShardingStrategy::LayerWise, true),
    ] {
        let make = |dev: &mut Device, dp, rank, strategy, init: &[Vec<f32>]| {
            make_with(dev, dp, rank, strategy, init, muon)
        };
        let root = tmp_root("resume");
        let dp = 2;
        let n = 3;
        let specs = specs();
        let init = init_values(&specs, 1);
        let other = init_values(&specs, 7);
        run(dp, |mut comm, mut dev| {
            let dev = &mut dev;
            let rank = comm.rank();
            let mlp = Mlp::new(dev, &DIMS, BATCH);
            let mut straight = make(dev, dp, rank, strategy, &init);
            let mut want = Vec::new();
            for s in 0..2 * n {
                want.push(step(dev, &mut comm, &mut straight, &mlp, s));
            }
            let mut first = make(dev, dp, rank, strategy, &init);
            let mut got = Vec::new();
            for s in 0..n {
                got.push(step(dev, &mut comm, &mut first, &mlp, s));
            }
            let sp = first.buffers().specs().to_vec();
            save(
                dev,
                &mut comm,
                &root,
                &meta(n as u64),
                &sp,
                first.optimizer(),
                SaveOptions::default(),
            )
            .unwrap();
            drop(first);
            let mut resumed = make(dev, dp, rank, strategy, &other);
            let ck = Checkpoint::open(&root).unwrap();
            resumed
                .load_checkpoint(dev, &mut comm, &ck, &LoadOptions::default())
                .unwrap();
            let next = ck.meta().data["next_step"].parse::<usize>().unwrap();
            for s in next..2 * n {
                got.push(step(dev, &mut comm, &mut resumed, &mlp, s));
            }
            assert_eq!(got, want, "{strategy:?}: losses and grad norms");
            let m = |t: &Trainer, dev: &Device| {
                t.optimizer()
                    .masters(dev)
                    .unwrap()
                    .into_iter()
                    .map(|s| (s.param, s.range.start, bits(&s.values)))
                    .collect::<Vec<_>>()
            };
            assert!(
                m(&straight, dev) == m(&resumed, dev),
                "{strategy:?}: masters"
            );
            assert!(
                straight.optimizer().export_state(dev).unwrap()
                    == resumed.optimizer().export_state(dev).unwrap(),
                "{strategy:?}: state"
            );
            straight.force_param_sync(dev, &mut comm).unwrap();
            resumed.force_param_sync(dev, &mut comm).unwrap();
            assert!(
                weights(dev, &straight) == weights(dev, &resumed),
                "{strategy:?}: weights"
            );
        });
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// The weights after a load are Q(bf16(master)): equal to those of a trainer built from the
/// loaded masters as its init values.
#[test]
fn loaded_weights_are_quantized_masters() {
    let root = tmp_root("weights");
    let saved = train_and_save(2, ShardingStrategy::Distributed, 2, &root);
    let full = assemble(&saved);
    let specs = specs();
    let masters: Vec<Vec<f32>> = (0..specs.len())
        .map(|p| {
            full[&(p, "master".to_string())]
                .iter()
                .map(|b| f32::from_bits(b.unwrap()))
                .collect()
        })
        .collect();
    let other = init_values(&specs, 5);
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut fresh = make(dev, 2, comm.rank(), ShardingStrategy::Distributed, &masters);
        fresh.force_param_sync(dev, &mut comm).unwrap();
        let mut loaded = make(dev, 2, comm.rank(), ShardingStrategy::Distributed, &other);
        loaded
            .load_checkpoint(
                dev,
                &mut comm,
                &Checkpoint::open(&root).unwrap(),
                &LoadOptions::default(),
            )
            .unwrap();
        assert!(weights(dev, &fresh) == weights(dev, &loaded));
    });
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn resharding_keeps_every_bit() {
    use ShardingStrategy::{Distributed, LayerWise};
    for (a, sa, b, sb) in [
        (2, Distributed, 4, Distributed),
        (4, Distributed, 2, Distributed),
        (2, LayerWise, 4, LayerWise),
        (4, LayerWise, 2, LayerWise),
        (2, Distributed, 4, LayerWise),
        (4, LayerWise, 2, Distributed),
    ] {
        let root = tmp_root("reshard");
        let saved = train_and_save(a, sa, 2, &root);
        let loaded = load_states(b, sb, &root);
        assert!(
            assemble(&saved) == assemble(&loaded),
            "{a} {sa:?} → {b} {sb:?}: masters or state differ"
        );
        assert!(loaded.iter().flatten().all(|s| s.steps == 2));
        let _ = std::fs::remove_dir_all(&root);
    }
    // Muon (layer-wise matrices) chained with SGD.
    for (a, b) in [(2, 4), (4, 2)] {
        let root = tmp_root("reshard-muon");
        let saved = train_and_save_with(a, LayerWise, 2, &root, true);
        let loaded = load_states_with(b, LayerWise, &root, true);
        assert!(assemble(&saved) == assemble(&loaded), "Muon {a} → {b}");
        let _ = std::fs::remove_dir_all(&root);
    }
}

fn file_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn crash_leftovers_leave_the_previous_checkpoint_loadable() {
    let root = tmp_root("crash");
    let saved = train_and_save(2, ShardingStrategy::Distributed, 3, &root);
    let good = root.join("step-3");
    let before = file_bytes(&good);
    let rank_file = before
        .keys()
        .find(|k| k.ends_with(".safetensors"))
        .unwrap()
        .clone();

    // A save of step 6 killed before its rename: a temp directory with a partial file.
    std::fs::create_dir_all(root.join(".tmp-step-6")).unwrap();
    std::fs::write(root.join(".tmp-step-6").join(&rank_file), b"partial").unwrap();
    // A step directory whose manifest is torn (never pointed to by `latest`).
    let torn = root.join("step-7");
    copy_dir(&good, &torn);
    let m = std::fs::read(torn.join("manifest.json")).unwrap();
    std::fs::write(torn.join("manifest.json"), &m[..m.len() / 2]).unwrap();
    // A truncated data file.
    let trunc = root.join("step-8");
    copy_dir(&good, &trunc);
    let d = std::fs::read(trunc.join(&rank_file)).unwrap();
    std::fs::write(trunc.join(&rank_file), &d[..d.len() - 5]).unwrap();
    // A flipped bit in the last piece (same size).
    let flipped = root.join("step-9");
    copy_dir(&good, &flipped);
    let mut d = std::fs::read(flipped.join(&rank_file)).unwrap();
    let last = d.len() - 1;
    d[last] ^= 0x10;
    std::fs::write(flipped.join(&rank_file), &d).unwrap();
    // A torn `latest` temp file.
    std::fs::write(root.join(".latest.tmp"), b"step-").unwrap();

    assert!(matches!(
        Checkpoint::open(&root.join(".tmp-step-6")),
        Err(CkptError::NotACheckpoint(_))
    ));
    assert!(matches!(
        Checkpoint::open(&torn),
        Err(CkptError::Manifest { .. })
    ));
    let e = Checkpoint::open(&trunc).unwrap_err();
    assert!(matches!(e, CkptError::FileSize { .. }), "{e}");
    assert!(e.to_string().contains(&rank_file), "{e}");
    let ck = Checkpoint::open(&flipped).unwrap();
    let e = ck.verify().unwrap_err();
    assert!(matches!(e, CkptError::Hash { .. }), "{e}");
    // The corrupt piece is also refused by a load (a streaming load: the optimizer is not to
    // be used after the error; `verify` first refuses before anything is written).
    let specs = specs();
    let init = init_values(&specs, 3);
    let errs = run(2, |comm, mut dev| {
        let dev = &mut dev;
        let mut t = make(dev, 2, comm.rank(), ShardingStrategy::Distributed, &init);
        match ck.load_optimizer(dev, &specs, t.optimizer_mut()) {
            Ok(()) => false,
            Err(e @ CkptError::Hash { .. }) => {
                assert!(e.to_string().contains(&rank_file), "{e}");
                true
            }
            Err(e) => panic!("{e}"),
        }
    });
    // Rank 0 reads the flipped piece of its own file.
    assert!(errs[0]);

    // The root still opens the previous checkpoint, untouched, and it loads bitwise.
    let ck = Checkpoint::open(&root).unwrap();
    assert!(ck.dir().ends_with("step-3"));
    ck.verify().unwrap();
    let loaded = load_states(2, ShardingStrategy::Distributed, &root);
    assert!(assemble(&saved) == assemble(&loaded));
    assert!(
        file_bytes(&good) == before,
        "the previous checkpoint changed"
    );

    // A new save of step 6 replaces the leftover temp directory and commits.
    let _ = train_and_save(2, ShardingStrategy::Distributed, 6, &root);
    assert!(Checkpoint::open(&root).unwrap().dir().ends_with("step-6"));
    assert!(!root.join(".tmp-step-6").exists());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn keep_prunes_old_checkpoints_and_steps_are_never_overwritten() {
    let root = tmp_root("keep");
    let specs = specs();
    let init = init_values(&specs, 1);
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let t = make(dev, 2, comm.rank(), ShardingStrategy::Distributed, &init);
        for s in 1..=4 {
            save(
                dev,
                &mut comm,
                &root,
                &meta(s),
                &specs,
                t.optimizer(),
                SaveOptions { keep: Some(2) },
            )
            .unwrap();
        }
        let e = save(
            dev,
            &mut comm,
            &root,
            &meta(4),
            &specs,
            t.optimizer(),
            SaveOptions::default(),
        )
        .unwrap_err();
        assert!(matches!(e, CkptError::Exists(_)), "{e}");
    });
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["latest", "step-3", "step-4"]);
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap(),
        "step-4\n"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// Rewrites the manifest of `dir` through `edit` and returns what opening it gives.
fn open_edited(dir: &Path, edit: impl FnOnce(&mut Json)) -> Result<Checkpoint, CkptError> {
    let path = dir.join("manifest.json");
    let mut v = Json::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, v.to_text()).unwrap();
    Checkpoint::open(dir)
}

/// Appends a copy of the first element of the array at `path`.
fn push_copy_of_first(v: &mut Json, path: &[&str]) {
    let first = field(v, &[path, &["0"]].concat()).clone();
    if let Json::Arr(a) = field(v, path) {
        a.push(first);
    }
}

fn field<'a>(v: &'a mut Json, path: &[&str]) -> &'a mut Json {
    let mut v = v;
    for k in path {
        v = match v {
            Json::Obj(m) => m.get_mut(*k).unwrap(),
            Json::Arr(a) => &mut a[k.parse::<usize>().unwrap()],
            _ => panic!("no {k}"),
        };
    }
    v
}

#[test]
fn hostile_manifests_are_typed_errors() {
    let root = tmp_root("hostile");
    train_and_save(2, ShardingStrategy::Distributed, 1, &root);
    let good = root.join("step-1");
    let original = std::fs::read(good.join("manifest.json")).unwrap();
    type Edit = Box<dyn FnOnce(&mut Json)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "version",
            Box::new(|v| *field(v, &["version"]) = Json::UInt(2)),
            "version",
        ),
        (
            "absurd shape",
            Box::new(|v| {
                *field(v, &["tensors", "0", "shape"]) =
                    Json::Arr(vec![Json::UInt(1 << 40), Json::UInt(1 << 40)])
            }),
            "absurd",
        ),
        (
            "end out of range",
            Box::new(|v| *field(v, &["tensors", "0", "pieces", "0", "end"]) = Json::UInt(u64::MAX)),
            "out of range",
        ),
        (
            "offset past the file",
            Box::new(|v| {
                *field(v, &["tensors", "0", "pieces", "0", "offset"]) = Json::UInt(u64::MAX - 3)
            }),
            "past the end",
        ),
        (
            "duplicate piece",
            Box::new(|v| push_copy_of_first(v, &["tensors", "0", "pieces"])),
            "overlap",
        ),
        (
            "missing piece",
            Box::new(|v| {
                if let Json::Arr(a) = field(v, &["tensors", "0", "pieces"]) {
                    a.remove(0);
                }
            }),
            "missing",
        ),
        (
            "path traversal",
            Box::new(|v| *field(v, &["files", "0", "name"]) = Json::Str("../../etc/passwd".into())),
            "plain file name",
        ),
        (
            "unlisted file",
            Box::new(|v| {
                *field(v, &["tensors", "0", "pieces", "0", "file"]) = Json::Str("other".into())
            }),
            "not a listed file",
        ),
        (
            "duplicate tensor",
            Box::new(|v| push_copy_of_first(v, &["tensors"])),
            "twice",
        ),
        (
            "bad hash",
            Box::new(|v| {
                *field(v, &["tensors", "0", "pieces", "0", "fnv1a64"]) = Json::Str("xyz".into())
            }),
            "hash",
        ),
        (
            "wrong dtype",
            Box::new(|v| *field(v, &["tensors", "0", "dtype"]) = Json::Str("BF16".into())),
            "dtype",
        ),
        (
            "unknown owner",
            Box::new(|v| *field(v, &["tensors", "0", "owner"]) = Json::UInt(77)),
            "owner",
        ),
    ];
    for (what, edit, needle) in cases {
        std::fs::write(good.join("manifest.json"), &original).unwrap();
        match open_edited(&good, edit) {
            Err(e @ (CkptError::Manifest { .. } | CkptError::Version { .. })) => {
                assert!(e.to_string().contains(needle), "{what}: {e}")
            }
            Err(e) => panic!("{what}: unexpected error {e}"),
            Ok(_) => panic!("{what}: accepted"),
        }
    }
    // A tampered hash that still parses is caught when the piece is read.
    std::fs::write(good.join("manifest.json"), &original).unwrap();
    let ck = open_edited(&good, |v| {
        *field(v, &["tensors", "0", "pieces", "0", "fnv1a64"]) =
            Json::Str("0000000000000000".into())
    })
    .unwrap();
    assert!(matches!(ck.verify(), Err(CkptError::Hash { .. })));
    // Truncations and byte flips of the manifest never panic.
    let text = original.clone();
    for cut in (0..text.len()).step_by(37) {
        std::fs::write(good.join("manifest.json"), &text[..cut]).unwrap();
        assert!(Checkpoint::open(&good).is_err(), "cut at {cut}");
    }
    for i in (0..text.len()).step_by(13) {
        let mut t = text.clone();
        t[i] = t[i].wrapping_add(1 + (i % 7) as u8);
        std::fs::write(good.join("manifest.json"), &t).unwrap();
        if let Ok(ck) = Checkpoint::open(&good) {
            let _ = ck.verify();
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The manifest's scalars are under `scalars_fnv1a64`: a digit of an optimizer's step count
/// (or of the step, the data position) changed is refused at open, naming the manifest; the
/// unchanged manifest opens.
#[test]
fn corrupted_manifest_scalars_are_refused() {
    let root = tmp_root("scalars");
    train_and_save(2, ShardingStrategy::Distributed, 3, &root);
    let good = root.join("step-3");
    let path = good.join("manifest.json");
    let original = std::fs::read_to_string(&path).unwrap();
    let ck = Checkpoint::open(&good).unwrap();
    assert_eq!(ck.manifest().optimizers[0].steps, 3);
    for member in ["\"steps\": ", "\"step\": ", "\"next_step\": \""] {
        let at = original.find(member).expect(member) + member.len();
        let digit = original.as_bytes()[at];
        assert!(digit.is_ascii_digit(), "{member}");
        let mut text = original.clone();
        text.replace_range(at..=at, if digit == b'7' { "8" } else { "7" });
        std::fs::write(&path, &text).unwrap();
        match Checkpoint::open(&good) {
            Err(CkptError::Manifest { file, msg }) => {
                assert_eq!(file, path, "{member}");
                assert!(msg.contains("scalars_fnv1a64"), "{member}: {msg}");
            }
            Err(e) => panic!("{member}: unexpected error {e}"),
            Ok(_) => panic!("{member}: a corrupted scalar was accepted"),
        }
    }
    std::fs::write(&path, &original).unwrap();
    Checkpoint::open(&good).unwrap().verify().unwrap();
    let _ = std::fs::remove_dir_all(&root);
}

/// A load reads each piece once however often it is needed: a tensor assembled from the same
/// stored elements twice (whole pieces and parts of pieces) equals the pieces read one by one.
#[test]
fn a_piece_needed_twice_is_read_once_and_copied() {
    let root = tmp_root("twice");
    train_and_save(2, ShardingStrategy::Distributed, 1, &root);
    let ck = Checkpoint::open(&root).unwrap();
    let n = ck.manifest().tensor("l0.weight/master").unwrap().numel();
    let whole = ck.read_range("l0.weight/master", 0..n as usize).unwrap();
    let seg = |start, len| Segment {
        param: "l0.weight".into(),
        start,
        len,
    };
    let alias = Alias {
        param: "twice".into(),
        sources: vec![seg(0, n), seg(1, n - 2), seg(0, n)],
    };
    let options = LoadOptions::default().with_aliases([alias]);
    let got = ck
        .read_param("twice", "master", &[3 * n - 2], &options)
        .unwrap();
    let want: Vec<f32> = [&whole[..], &whole[1..n as usize - 1], &whole[..]].concat();
    assert_eq!(bits(&got), bits(&want));
    let _ = std::fs::remove_dir_all(&root);
}

/// A model that does not match is refused: another shape, a missing parameter.
#[test]
fn mismatched_models_are_refused() {
    let root = tmp_root("mismatch");
    train_and_save(2, ShardingStrategy::Distributed, 1, &root);
    let ck = Checkpoint::open(&root).unwrap();
    let e = ck.read_range("nope/master", 0..1).unwrap_err();
    assert!(matches!(e, CkptError::Mismatch { .. }));
    let e = ck
        .read_range("l0.weight/master", 0..usize::MAX)
        .unwrap_err();
    assert!(matches!(e, CkptError::Mismatch { .. }));
    let specs = specs();
    let init = init_values(&specs, 3);
    run(1, |_comm, mut dev| {
        let dev = &mut dev;
        let mut t = make(dev, 1, 0, ShardingStrategy::Distributed, &init);
        let mut renamed = specs.clone();
        renamed[0].name = "other.weight".into();
        let e = ck
            .load_optimizer(dev, &renamed, t.optimizer_mut())
            .unwrap_err();
        assert!(e.to_string().contains("other.weight/master"), "{e}");
        let mut reshaped = specs.clone();
        reshaped[0].shape = vec![32, 64];
        let e = ck
            .load_optimizer(dev, &reshaped, t.optimizer_mut())
            .unwrap_err();
        assert!(e.to_string().contains("shape"), "{e}");
    });
    let _ = ck.read_range("l0.weight/master", 0..3).unwrap();
    let _: Range<usize> = 0..0;
    let _ = std::fs::remove_dir_all(&root);
}

/// Seed 000: saving right after every optimizer step, under overlapped gather, changes nothing:
/// the run equals one that never saves, bit for bit (losses, grad norms, masters, weights).
#[test]
fn saving_every_step_changes_nothing() {
    let root = tmp_root("every");
    let specs = specs();
    let init = init_values(&specs, 1);
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        let mut plain = make(dev, 2, rank, ShardingStrategy::Distributed, &init);
        let mut saving = make(dev, 2, rank, ShardingStrategy::Distributed, &init);
        for s in 0..4 {
            let a = step(dev, &mut comm, &mut plain, &mlp, s);
            let b = step(dev, &mut comm, &mut saving, &mlp, s);
            assert_eq!(a, b, "step {s}");
            let opts = SaveOptions { keep: Some(1) };
            let m = meta(s as u64 + 1);
            save(dev, &mut comm, &root, &m, &specs, saving.optimizer(), opts).unwrap();
        }
        assert!(
            plain.optimizer().export_state(dev).unwrap()
                == saving.optimizer().export_state(dev).unwrap()
        );
        plain.force_param_sync(dev, &mut comm).unwrap();
        saving.force_param_sync(dev, &mut comm).unwrap();
        assert!(weights(dev, &plain) == weights(dev, &saving));
    });
    assert!(Checkpoint::open(&root).unwrap().dir().ends_with("step-4"));
    let _ = std::fs::remove_dir_all(&root);
}

/// An optimizer without state views (the trait's default): everything delegated but
/// `state_views`, so checkpoints take the snapshot path (export, then files; template, then
/// import).
#[derive(Debug)]
struct NoViews<'a>(&'a mut dyn Optimizer);

impl Optimizer for NoViews<'_> {
    fn owners(&self) -> Vec<OptimizerId> {
        self.0.owners()
    }
    fn grad_pieces(&self) -> Vec<lowbit_optim::GradPiece> {
        self.0.grad_pieces()
    }
    fn fold_sum_squares(&self, sums: &[f64]) -> f64 {
        self.0.fold_sum_squares(sums)
    }
    fn clip_grad(&self) -> Option<f32> {
        self.0.clip_grad()
    }
    fn begin_step(&mut self) {
        self.0.begin_step();
    }
    fn update(
        &mut self,
        dev: &mut Device,
        clip: f32,
        scope: lowbit_optim::UpdateScope<'_>,
    ) -> lowbit_optim::Result<Vec<lowbit_optim::MasterPiece>> {
        self.0.update(dev, clip, scope)
    }
    fn masters_to_stage(&self) -> Vec<(OptimizerId, Vec<lowbit_optim::MasterPiece>)> {
        self.0.masters_to_stage()
    }
    fn set_lr(&mut self, lr: f32) -> lowbit_optim::Result<()> {
        self.0.set_lr(lr)
    }
    fn steps(&self) -> u64 {
        self.0.steps()
    }
    fn export_state(&self, dev: &Device) -> lowbit_optim::Result<Vec<OptimizerState>> {
        self.0.export_state(dev)
    }
    fn export_state_into(
        &self,
        dev: &Device,
        out: &mut Vec<OptimizerState>,
    ) -> lowbit_optim::Result<()> {
        self.0.export_state_into(dev, out)
    }
    fn export_template(&self, dev: &Device) -> lowbit_optim::Result<Vec<OptimizerState>> {
        self.0.export_template(dev)
    }
    fn check_import(&self, state: &[OptimizerState]) -> lowbit_optim::Result<()> {
        self.0.check_import(state)
    }
    fn import_state(
        &mut self,
        dev: &mut Device,
        state: &[OptimizerState],
    ) -> lowbit_optim::Result<()> {
        self.0.import_state(dev, state)
    }
    fn memory(&self) -> lowbit_optim::OptimizerMemory {
        self.0.memory()
    }
}

/// The streaming save and load (through `state_views`) and the snapshot path of an optimizer
/// without views write the same files byte for byte, and each loads the other's checkpoint
/// into either kind of optimizer with every bit of the state.
#[test]
fn streaming_and_snapshot_paths_agree() {
    let specs = specs();
    let (init, other) = (init_values(&specs, 1), init_values(&specs, 99));
    let (streamed, snapshot) = (tmp_root("streamed"), tmp_root("snapshot"));
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        let mut t = make(dev, 2, rank, ShardingStrategy::Distributed, &init);
        for s in 0..2 {
            step(dev, &mut comm, &mut t, &mlp, s);
        }
        let specs = t.buffers().specs().to_vec();
        assert!(t.optimizer().state_views().is_some());
        let opts = SaveOptions::default();
        save(
            dev,
            &mut comm,
            &streamed,
            &meta(2),
            &specs,
            t.optimizer(),
            opts,
        )
        .unwrap();
        let wrapped = NoViews(t.optimizer_mut());
        assert!(wrapped.state_views().is_none());
        save(dev, &mut comm, &snapshot, &meta(2), &specs, &wrapped, opts).unwrap();
        let want = t.optimizer().export_state(dev).unwrap();
        for root in [&streamed, &snapshot] {
            let ck = Checkpoint::open(root).unwrap();
            for views in [true, false] {
                let mut fresh = make(dev, 2, rank, ShardingStrategy::Distributed, &other);
                if views {
                    ck.load_optimizer(dev, &specs, fresh.optimizer_mut())
                        .unwrap();
                } else {
                    ck.load_optimizer(dev, &specs, &mut NoViews(fresh.optimizer_mut()))
                        .unwrap();
                }
                assert!(
                    fresh.optimizer().export_state(dev).unwrap() == want,
                    "rank {rank}: {} loaded {} state views",
                    root.display(),
                    if views { "through" } else { "without" }
                );
            }
        }
    });
    assert!(
        file_bytes(&streamed.join("step-2")) == file_bytes(&snapshot.join("step-2")),
        "the two saves wrote different files"
    );
    let _ = std::fs::remove_dir_all(&streamed);
    let _ = std::fs::remove_dir_all(&snapshot);
}
