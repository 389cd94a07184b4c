//! Checkpoint throughput against the disk's own bandwidth, measured in the same run and the same
//! directory, and the cost of an asynchronous save to the training step.
//!
//! ```text
//! cargo bench -p lowbit-ckpt --bench ckpt_bench -- \
//!     [--params 256M] [--ranks 4] [--reps 3] [--dir DIR] [--json OUT.json] [--device cpu|cuda]
//! ```
//!
//! The state is AdamW's over `--params` fp32 parameters (masters, `exp_avg`, `exp_avg_sq`: 12
//! bytes a parameter; 256M parameters are 3 GiB), parameters of 4096 × 4096 (the last one
//! shorter). Every row moves the same bytes `B` (the checkpoint's data files) through files in
//! `--dir` (default: the system temp dir):
//! - `disk_write`: `B` bytes written to one file in 8 MiB writes, then fsync, by one thread
//!   (`disk_write_1stream`) and by as many threads as the save uses (`disk_write_Nstreams`,
//!   each its own contiguous range, positioned writes, each write handed to the disk at once
//!   with `sync_file_range` as the save does): the faster is the bound of a save;
//! - `disk_read`: the file read back in 8 MiB reads after `posix_fadvise(DONTNEED)` dropped its
//!   (clean, synced) pages from the page cache, by one and by N threads: the faster is the
//!   bound of a load;
//! - `save_1rank` / `save_Nranks`: `lowbit_ckpt::save` by one rank / `--ranks` thread ranks
//!   (each its own shard, CPU devices): streamed from the state (chunks downloaded, hashed and
//!   written by worker threads), fsyncs and commit;
//! - `load_1rank` / `load_Nranks`: open + `load_optimizer` (hash-checked, resharded to the
//!   loading plan) after dropping the checkpoint's pages the same way; every rep removes its
//!   checkpoint after the load, as the disk probe rewrites its file;
//! - `host_copy`: one copy of `B` bytes into fresh host memory, the bound of a snapshot;
//! - `async_snapshot`: what `AsyncSaver::save` blocks the training thread for (the host copy
//!   of the state and a barrier; its ratio is over `host_copy`), `async_total` the time to its committed wait while
//!   optimizer steps run, `async_write` the difference (files, fsyncs, commit: the save's
//!   part after the snapshot); `step_idle` / `step_during_write`: the median optimizer step
//!   (`Optimizer::apply`, synchronized) without a save and while the background write runs.
//!
//! Times are medians of `--reps`; GB/s are `B / t` (10^9 bytes); `ratio` is the bound's time
//! over the row's: save over `disk_write` and load over `disk_read` (the target is ≥ 0.8). The table goes to stdout and
//! the same numbers as JSON to `--json`. `crates/lowbit-ckpt/benches/torch_dcp.py` writes the
//! same tensors with `torch.distributed.checkpoint` (the GPU bundle's `ckpt-bench` step runs
//! both). With `--device cuda` (feature `cuda`) the one-rank optimizer lives on GPU 0, so the
//! snapshot is the device-to-host copy a real step pays.

#[path = "support/mod.rs"]
mod support;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lowbit_ckpt::{AsyncSaver, Checkpoint, Meta, SaveOptions, save};
use lowbit_comm::{Communicator, GroupConfig, LocalComm};
use lowbit_device::Device;
use lowbit_testkit::run;
use support::{Rank, specs};

const SIDE: usize = 4096;
const CHUNK: usize = 8 << 20;

struct Args {
    params: usize,
    ranks: usize,
    reps: usize,
    dir: PathBuf,
    json: Option<PathBuf>,
    device: String,
}

fn usage(msg: &str) -> ! {
    eprintln!(
        "ckpt_bench: {msg}\nusage: ckpt_bench [--params N[K|M|G]] [--ranks N] [--reps N] \
         [--dir DIR] [--json OUT] [--device cpu|cuda]"
    );
    std::process::exit(2)
}

/// `s` as a count (an optional K, M or G suffix) in `range`, else the usage and exit.
fn count(s: &str, range: std::ops::RangeInclusive<usize>) -> usize {
    let (digits, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|n| range.contains(n))
        .unwrap_or_else(|| {
            usage(&format!(
                "`{s}` is not a count in {}..={}",
                range.start(),
                range.end()
            ))
        })
}

fn args() -> Args {
    let mut a = Args {
        params: 256 << 20,
        ranks: 4,
        reps: 3,
        dir: std::env::temp_dir(),
        json: None,
        device: "cpu".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue; // what `cargo bench` passes
        }
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            // Absurd sizes are refused, not met as an aborted allocation (the state is built
            // in host memory first: 12 bytes a parameter) or a thread per rank by the thousand.
            "--params" => a.params = count(&value, 1..=4 << 30),
            "--ranks" => a.ranks = count(&value, 1..=64),
            "--reps" => a.reps = count(&value, 1..=1000),
            "--dir" => a.dir = value.into(),
            "--json" => a.json = Some(value.into()),
            "--device" => a.device = value,
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    a
}

fn device(name: &str) -> Device {
    match name {
        "cpu" => Device::cpu(),
        #[cfg(feature = "cuda")]
        "cuda" => Device::cuda(0).unwrap_or_else(|e| usage(&format!("CUDA device 0: {e}"))),
        _ => usage(&format!(
            "device `{name}` (cuda needs the `cuda` feature of lowbit-ckpt)"
        )),
    }
}

/// Parameters of `SIDE` columns, `SIDE` rows each but the last.
fn model(params: usize) -> Vec<(String, Vec<usize>)> {
    let rows = params.div_ceil(SIDE);
    (0..rows.div_ceil(SIDE))
        .map(|i| {
            let r = (rows - i * SIDE).min(SIDE);
            (format!("layers.{i}.weight"), vec![r, SIDE])
        })
        .collect()
}

/// Drops a synced file's pages from the page cache, so the next read comes from the disk.
/// Returns whether the kernel accepted the advice.
fn drop_cached(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        unsafe extern "C" {
            fn posix_fadvise(fd: i32, offset: i64, len: i64, advice: i32) -> i32;
        }
        const POSIX_FADV_DONTNEED: i32 = 4;
        let Ok(f) = File::open(path) else {
            return false;
        };
        // SAFETY: `f` is an open file for the whole call; offset 0 and length 0 mean "the whole
        // file"; the call only gives advice about cached pages (no memory is passed in).
        unsafe { posix_fadvise(f.as_raw_fd(), 0, 0, POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

/// Every file under `dir`.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("list").flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn data_bytes(step_dir: &Path) -> u64 {
    files(step_dir)
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| std::fs::metadata(p).expect("stat").len())
        .sum()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn timed(reps: usize, mut f: impl FnMut(usize) -> Duration) -> Duration {
    median((0..reps).map(&mut f).collect())
}

/// `bytes` written to `path` by `streams` threads, each its own contiguous range in `CHUNK`
/// positioned writes, then fsync; the file stays for the read. One stream is the classic
/// sequential probe; several are what a writer that spreads its pieces over threads (the
/// streaming save) can get from the page cache and the disk.
fn disk_write(path: &Path, bytes: u64, streams: usize) -> Duration {
    use std::os::unix::fs::FileExt;
    let _ = std::fs::remove_file(path);
    // Not zeros: a file system that compresses or dedups must not get an easy case.
    let chunk: Vec<u8> = (0..CHUNK)
        .map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7])
        .collect();
    let t = Instant::now();
    let f = File::create(path).expect("create probe");
    let per = bytes
        .div_ceil(streams as u64)
        .next_multiple_of(CHUNK as u64);
    std::thread::scope(|s| {
        for k in 0..streams as u64 {
            let (f, chunk) = (&f, &chunk);
            s.spawn(move || {
                let (mut at, end) = ((k * per).min(bytes), ((k + 1) * per).min(bytes));
                while at < end {
                    let n = (end - at).min(CHUNK as u64) as usize;
                    f.write_all_at(&chunk[..n], at).expect("write probe");
                    if streams > 1 {
                        start_writeback(f, at, n as u64);
                    }
                    at += n as u64;
                }
            });
        }
    });
    f.sync_all().expect("fsync probe");
    t.elapsed()
}

/// Hands `len` written bytes at `offset` to the disk at once (Linux `sync_file_range`), as the
/// save does with every chunk it writes.
fn start_writeback(f: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        unsafe extern "C" {
            fn sync_file_range(fd: i32, offset: i64, nbytes: i64, flags: u32) -> i32;
        }
        const SYNC_FILE_RANGE_WRITE: u32 = 2;
        // SAFETY: `f` is an open file for the whole call and no memory is passed; the call only
        // schedules writeback of the file's dirty pages in the range.
        unsafe {
            sync_file_range(
                f.as_raw_fd(),
                offset as i64,
                len as i64,
                SYNC_FILE_RANGE_WRITE,
            )
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, offset, len);
}

/// The probe file read back by `streams` threads (contiguous ranges, `CHUNK` reads) after its
/// pages were dropped from the page cache.
fn disk_read(path: &Path, streams: usize) -> Duration {
    use std::os::unix::fs::FileExt;
    drop_cached(path);
    let bytes = std::fs::metadata(path).expect("stat probe").len();
    let per = bytes
        .div_ceil(streams as u64)
        .next_multiple_of(CHUNK as u64);
    let t = Instant::now();
    let f = File::open(path).expect("open probe");
    std::thread::scope(|s| {
        for k in 0..streams as u64 {
            let f = &f;
            s.spawn(move || {
                let mut buf = vec![0u8; CHUNK];
                let (mut at, end) = ((k * per).min(bytes), ((k + 1) * per).min(bytes));
                while at < end {
                    let n = (end - at).min(CHUNK as u64) as usize;
                    f.read_exact_at(&mut buf[..n], at).expect("read probe");
                    at += n as u64;
                }
            });
        }
    });
    t.elapsed()
}

/// One copy of `bytes` into fresh memory (page faults included): the least a snapshot into
/// newly allocated host buffers costs.
fn host_copy(bytes: u64, reps: usize) -> Duration {
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    timed(reps, |_| {
        let t = Instant::now();
        let dst = std::hint::black_box(src.clone());
        let t = t.elapsed();
        drop(dst);
        t
    })
}

fn meta(step: u64) -> Meta {
    Meta {
        step,
        ..Meta::default()
    }
}

/// One row of the table.
struct Row {
    name: String,
    time: Duration,
    /// Bytes moved (none for step times).
    bytes: Option<u64>,
    /// The row it is compared with.
    bound: Option<&'static str>,
}

fn row(name: impl Into<String>, time: Duration, bytes: u64, bound: &'static str) -> Row {
    Row {
        name: name.into(),
        time,
        bytes: Some(bytes),
        bound: (!bound.is_empty()).then_some(bound),
    }
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Saves and loads with `ranks` thread ranks on CPU devices: (save, load) medians.
fn ranks_save_load(
    specs: &[lowbit_buffers::layout::ParamSpec],
    a: &Args,
    root: &Path,
) -> (Duration, Duration) {
    let times = run(a.ranks, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut r = Rank::new(dev, a.ranks, comm.rank(), specs);
        let mut saves = Vec::new();
        let mut loads = Vec::new();
        for rep in 0..a.reps {
            let step = 1000 + rep as u64;
            comm.barrier().expect("barrier");
            let t = Instant::now();
            let dir = save(
                dev,
                &mut comm,
                root,
                &meta(step),
                specs,
                &r.opt,
                SaveOptions::default(),
            )
            .expect("save");
            comm.barrier().expect("barrier");
            saves.push(t.elapsed());
            if comm.rank() == 0 {
                files(&dir).iter().for_each(|p| {
                    drop_cached(p);
                });
            }
            comm.barrier().expect("barrier");
            let t = Instant::now();
            Checkpoint::open(&dir)
                .and_then(|ck| ck.load_optimizer(dev, specs, &mut r.opt))
                .expect("load");
            comm.barrier().expect("barrier");
            loads.push(t.elapsed());
            if comm.rank() == 0 {
                std::fs::remove_dir_all(&dir).expect("remove");
            }
        }
        (median(saves), median(loads))
    });
    times[0]
}

fn main() {
    let a = args();
    let specs = specs(&model(a.params));
    let params: usize = specs.iter().map(|s| s.numel).sum();
    let work = a
        .dir
        .join(format!("lowbit-ckpt-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("create the bench directory");
    let root = work.join("ckpt");
    let mut dev = device(&a.device);
    let dev = &mut dev;
    let mut r = Rank::new(dev, 1, 0, &specs);
    let mut comm = LocalComm::create_group(1, GroupConfig::default())
        .pop()
        .expect("a rank");
    let mut rows = Vec::new();

    // The one-rank save and load, which also give B, the bytes every row moves. Each rep
    // removes its checkpoint, as the disk probe rewrites its file: every row writes to blocks
    // the file system has just freed.
    let mut bytes = 0;
    let mut loads = Vec::new();
    let save_1 = timed(a.reps, |rep| {
        let t = Instant::now();
        let opts = SaveOptions::default();
        let dir = save(
            dev,
            &mut comm,
            &root,
            &meta(rep as u64),
            &specs,
            &r.opt,
            opts,
        )
        .expect("save");
        let t = t.elapsed();
        bytes = data_bytes(&dir);
        files(&dir).iter().for_each(|p| {
            drop_cached(p);
        });
        let l = Instant::now();
        Checkpoint::open(&dir)
            .and_then(|ck| ck.load_optimizer(dev, &r.specs, &mut r.opt))
            .expect("load");
        loads.push(l.elapsed());
        std::fs::remove_dir_all(&dir).expect("remove");
        t
    });
    // The disk's bounds: one stream and as many streams as the save and load use; the bound
    // is the faster.
    let probe = work.join("disk-probe");
    let streams = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8);
    let write_1 = timed(a.reps, |_| disk_write(&probe, bytes, 1));
    let write_n = timed(a.reps, |_| disk_write(&probe, bytes, streams));
    let read_1 = timed(a.reps, |_| disk_read(&probe, 1));
    let read_n = timed(a.reps, |_| disk_read(&probe, streams));
    let cache_dropped = drop_cached(&probe);
    std::fs::remove_file(&probe).expect("remove probe");
    rows.push(row("host_copy", host_copy(bytes, a.reps), bytes, ""));
    rows.push(row("disk_write_1stream", write_1, bytes, ""));
    rows.push(row(
        format!("disk_write_{streams}streams"),
        write_n,
        bytes,
        "",
    ));
    rows.push(row("disk_read_1stream", read_1, bytes, ""));
    rows.push(row(
        format!("disk_read_{streams}streams"),
        read_n,
        bytes,
        "",
    ));
    rows.push(row("disk_write", write_1.min(write_n), bytes, ""));
    rows.push(row("disk_read", read_1.min(read_n), bytes, ""));
    rows.push(row("save_1rank", save_1, bytes, "disk_write"));
    rows.push(row("load_1rank", median(loads), bytes, "disk_read"));

    // Asynchronous: the step's cost and the whole save, with steps running meanwhile.
    let step_idle = timed(a.reps.max(3), |_| {
        let t = Instant::now();
        r.step(dev);
        t.elapsed()
    });
    let mut saver = AsyncSaver::new();
    let mut during = Vec::new();
    let mut totals = Vec::new();
    let mut writes = Vec::new();
    let snapshot = timed(a.reps, |rep| {
        let t0 = Instant::now();
        let opts = SaveOptions::default();
        saver
            .save(
                dev,
                &mut comm,
                &root,
                &meta(500 + rep as u64),
                &specs,
                &r.opt,
                opts,
            )
            .expect("async save");
        let snap = t0.elapsed();
        while !saver.is_written() {
            let t = Instant::now();
            r.step(dev);
            during.push(t.elapsed());
        }
        let dir = saver.wait(&mut comm).expect("wait").expect("pending");
        totals.push(t0.elapsed());
        writes.push(t0.elapsed() - snap);
        std::fs::remove_dir_all(&dir).expect("remove");
        snap
    });
    let steps_during = during.len();
    rows.push(row("async_snapshot", snapshot, bytes, "host_copy"));
    rows.push(row("async_write", median(writes), bytes, "disk_write"));
    rows.push(row("async_total", median(totals), bytes, "disk_write"));
    rows.push(Row {
        name: "step_idle".into(),
        time: step_idle,
        bytes: None,
        bound: None,
    });
    if !during.is_empty() {
        rows.push(Row {
            name: "step_during_write".into(),
            time: median(during),
            bytes: None,
            bound: None,
        });
    }
    drop(r);

    let (save_n, load_n) = ranks_save_load(&specs, &a, &root);
    rows.push(row(
        format!("save_{}ranks", a.ranks),
        save_n,
        bytes,
        "disk_write",
    ));
    rows.push(row(
        format!("load_{}ranks", a.ranks),
        load_n,
        bytes,
        "disk_read",
    ));
    let _ = std::fs::remove_dir_all(&work);

    report(&a, params, bytes, &rows, cache_dropped, steps_during);
}

fn report(
    a: &Args,
    params: usize,
    bytes: u64,
    rows: &[Row],
    cache_dropped: bool,
    steps_during: usize,
) {
    let time_of = |name: &str| rows.iter().find(|r| r.name == name).map(|r| r.time);
    println!(
        "lowbit-ckpt: AdamW state of {params} fp32 parameters, {bytes} bytes ({:.2} GiB) of data \
         files, {} reps (medians), device {}, directory {}",
        bytes as f64 / (1u64 << 30) as f64,
        a.reps,
        a.device,
        a.dir.display()
    );
    println!(
        "{:<20} {:>10} {:>9} {:>7}  vs",
        "case", "ms", "GB/s", "ratio"
    );
    let mut json = Vec::new();
    for r in rows {
        let ms = r.time.as_secs_f64() * 1e3;
        let rate = r.bytes.map(|b| gbps(b, r.time));
        let ratio = r
            .bound
            .and_then(time_of)
            .map(|bound| bound.as_secs_f64() / r.time.as_secs_f64());
        let show = |v: Option<f64>, p: usize| v.map_or("-".into(), |v| format!("{v:.p$}"));
        println!(
            "{:<20} {:>10.1} {:>9} {:>7}  {}",
            r.name,
            ms,
            show(rate, 3),
            show(ratio, 2),
            r.bound.unwrap_or("")
        );
        let num = |v: Option<f64>| v.map_or("null".into(), |v| format!("{v:.6}"));
        json.push(format!(
            "{{\"name\":\"{}\",\"seconds\":{:.6},\"bytes\":{},\"gb_per_s\":{},\"ratio\":{},\"vs\":{}}}",
            r.name,
            r.time.as_secs_f64(),
            r.bytes.map_or("null".into(), |b| b.to_string()),
            num(rate),
            num(ratio),
            r.bound.map_or("null".into(), |b| format!("\"{b}\"")),
        ));
    }
    let share = match (time_of("async_snapshot"), time_of("async_total")) {
        (Some(s), Some(t)) => s.as_secs_f64() / t.as_secs_f64(),
        _ => f64::NAN,
    };
    println!(
        "async: the step pays the snapshot, {:.1}% of the whole save; {steps_during} steps ran \
         during the writes",
        100.0 * share
    );
    if !cache_dropped {
        println!("note: posix_fadvise(DONTNEED) was refused: reads may come from the page cache");
    }
    if let Some(path) = &a.json {
        let text = format!(
            "{{\"bench\":\"lowbit-ckpt\",\"params\":{params},\"bytes\":{bytes},\"reps\":{},\
             \"device\":\"{}\",\"ranks\":{},\"cache_dropped\":{cache_dropped},\
             \"async_snapshot_share\":{share:.6},\"steps_during_write\":{steps_during},\
             \"results\":[{}]}}\n",
            a.reps,
            a.device,
            a.ranks,
            json.join(",")
        );
        std::fs::write(path, text).unwrap_or_else(|e| usage(&format!("{}: {e}", path.display())));
    }
}
