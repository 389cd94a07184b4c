//! What the benchmark mains of the crates share: criterion configured one way and pointed at the
//! directory its results are read back from, the read-back of this run's medians, the load
//! note under a summary table, and a pool of rank threads whose timed work a benchmark's
//! `iter_custom` drives.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant, SystemTime};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion};
use lowbit_comm::{Communicator, GroupConfig, LocalComm, run_ranks};
use lowbit_dev_support::criterion_estimates as estimates;
use lowbit_device::Device;

/// One benchmark main's run: when it started and where criterion writes, so that the summary
/// reads back only the medians this run measured.
pub struct BenchRun {
    start: SystemTime,
    dir: PathBuf,
}

impl BenchRun {
    /// Starts a run: criterion with 10 samples, the given warm-up and measurement times, its
    /// output directory decided as criterion 0.7 decides it (and handed to it), then the
    /// command line's arguments (a name filter, `--sample-size`, …).
    pub fn start(warm_up: Duration, measurement: Duration) -> (BenchRun, Criterion) {
        let run = BenchRun {
            start: SystemTime::now(),
            dir: estimates::criterion_dir(),
        };
        let c = Criterion::default()
            .sample_size(10)
            .warm_up_time(warm_up)
            .measurement_time(measurement)
            .output_directory(&run.dir)
            .configure_from_args();
        (run, c)
    }

    /// The median time in ns of benchmark `group/id`, if this run measured it.
    pub fn median_ns(&self, group: &str, id: &str) -> Option<f64> {
        estimates::median_ns(&self.dir, group, id, self.start)
    }
}

/// Prints `title` and a table of the benchmarks `ids` of `group` that this run measured, each
/// moving `bytes`: median time, GB/s (`bytes / time`), the GB/s of the bound (benchmark
/// `bound`) and the ratio of the two. Without a measured bound it prints a note instead and
/// returns false.
pub fn print_bound_table(
    run: &BenchRun,
    group: &str,
    (ids, bound): (&[&str], &str),
    bytes: f64,
    title: &str,
) -> bool {
    let Some(bound_ns) = run.median_ns(group, bound) else {
        println!("\n({bound}, the bound, was not measured in this run: no summary)");
        return false;
    };
    let bound_gbs = bytes / bound_ns;
    let w = ids.iter().map(|id| id.len()).max().unwrap_or(0).max(2) + 3;
    println!("\n{title}");
    println!(
        "{:<w$} {:>10} {:>9} {:>12} {:>7}",
        "op", "time", "GB/s", "bound GB/s", "ratio"
    );
    for &id in ids {
        let Some(t) = run.median_ns(group, id) else {
            println!("{id:<w$} (not run)");
            continue;
        };
        let gbs = bytes / t;
        println!(
            "{id:<w$} {:>7.2} ms {gbs:>9.2} {bound_gbs:>12.2} {:>7.3}",
            t / 1e6,
            gbs / bound_gbs
        );
    }
    true
}

/// The number of cores this process may use (1 when unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Prints the one-minute load average (Linux) and the number of cores, with what a high load
/// means for the table above it; nothing where `/proc/loadavg` does not exist.
pub fn print_load_average(meaning: &str) {
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        let one_minute = load.split_whitespace().next().unwrap_or("?");
        println!(
            "(load average {one_minute} on {} cores: {meaning})",
            cores()
        );
    }
}

/// Rank threads spawned once that run timed commands (see [`with_rank_pool`]).
pub struct RankPool<K> {
    commands: Vec<Sender<Option<(K, u64)>>>,
    done: Receiver<Duration>,
    timeout: Duration,
}

impl<K: Copy> RankPool<K> {
    /// Has every rank run `kind` `iters` times; returns rank 0's time from the barrier before
    /// the first iteration to the barrier after the last.
    pub fn time(&self, kind: K, iters: u64) -> Duration {
        for tx in &self.commands {
            tx.send(Some((kind, iters))).expect("rank thread alive");
        }
        self.done
            .recv_timeout(self.timeout)
            .expect("rank 0 reports its time")
    }

    /// Benchmark `id` of group `g`: [`time`](Self::time) of `kind` as criterion's custom timing.
    pub fn bench(&self, g: &mut BenchmarkGroup<'_, WallTime>, id: &str, kind: K) {
        g.bench_function(id, |b| b.iter_custom(|iters| self.time(kind, iters)));
    }
}

/// Runs `world` in-process ranks (communicators configured by `config`) for the duration of
/// `drive`. Each rank first builds its state with `setup` (never timed); once every rank has,
/// `drive` gets the pool. For each command `(kind, iters)` every rank passes a barrier, runs
/// `step(state, comm, dev, kind)` `iters` times, passes a barrier, and rank 0 reports the time
/// between the two barriers; `timeout` bounds the wait for that report. The ranks stop when
/// `drive` returns; a failing rank fails the benchmark.
pub fn with_rank_pool<K, S>(
    world: usize,
    config: GroupConfig,
    timeout: Duration,
    setup: impl Fn(&mut LocalComm, &mut Device) -> S + Sync,
    step: impl Fn(&mut S, &mut LocalComm, &mut Device, K) + Sync,
    drive: impl FnOnce(&RankPool<K>),
) where
    K: Copy + Send,
{
    let (commands, receivers): (Vec<_>, Vec<_>) = (0..world)
        .map(|_| {
            let (tx, rx) = channel();
            (tx, Mutex::new(rx))
        })
        .unzip();
    let (done_tx, done) = channel::<Duration>();
    let ready = Barrier::new(world + 1);
    let rank_main = |mut comm: LocalComm, mut dev: Device| {
        let rank = comm.rank();
        let mut state = setup(&mut comm, &mut dev);
        ready.wait();
        let rx: &Mutex<Receiver<Option<(K, u64)>>> = &receivers[rank];
        while let Some((kind, iters)) = rx.lock().expect("commands").recv().expect("driver alive") {
            comm.barrier().expect("barrier");
            let start = Instant::now();
            for _ in 0..iters {
                step(&mut state, &mut comm, &mut dev, kind);
            }
            comm.barrier().expect("barrier");
            if rank == 0 {
                done_tx.send(start.elapsed()).expect("driver alive");
            }
        }
    };
    std::thread::scope(|s| {
        let ranks = s.spawn(|| run_ranks(world, config, rank_main));
        ready.wait();
        let pool = RankPool {
            commands,
            done,
            timeout,
        };
        drive(&pool);
        for tx in &pool.commands {
            let _ = tx.send(None);
        }
        for r in ranks.join().expect("rank driver") {
            r.expect("rank thread");
        }
    });
}
