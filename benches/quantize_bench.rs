//! `lowbit quantize` and `lowbit dequantize` against `cp` + `sync` of the same file, in the same
//! run: wall time ratio and the child's peak resident memory beside the input
//! file's size, for (a) one 8192x8192 bf16 tensor (128 MiB) and (b) a 256 MiB file of two
//! tensors (an 8192x8192 bf16 and a 4096x8192 f32 one).
//!
//! ```sh
//! cargo build --release --bin lowbit && cargo bench --bench quantize_bench -- \
//!     [--bin PATH] [--dir DIR] [--reps N] [--json]
//! ```
//!
//! `--bin` picks the binary (default: `lowbit` in the folder above this program's, i.e. the
//! release build: benches run from `target/release/deps/`), so an older build can be measured the same way. Inputs go to `--dir` (default: the
//! system temporary directory) and are removed afterwards. Each figure is the median of `--reps`
//! runs (default 3). The peak memory comes from `wait4`'s resource usage of the child itself,
//! so the binary needs no instrumentation and older builds are measured alike.
//!
//! Targets: wall ≤ 3× cp + sync, peak RSS ≤ 1.5× the input file + 64 MiB.

use std::ffi::{c_int, c_long};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use lowbit::formats::bf16;
use lowbit_dev_support::cpu_load::CpuTimes;
use lowbit_dev_support::rng::{XorShift64, unit24};

const MIB: f64 = 1024.0 * 1024.0;

/// `struct timeval` on 64-bit Linux and macOS.
#[repr(C)]
#[derive(Default)]
struct Timeval {
    sec: i64,
    usec: i64,
}

impl Timeval {
    fn secs(&self) -> f64 {
        self.sec as f64 + self.usec as f64 * 1e-6
    }
}

/// CPU seconds of every child measured so far, so the load figure can leave them out.
static CHILD_CPU_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `struct rusage`: two timevals, then 14 longs of which `ru_maxrss` is the first (KiB on Linux).
#[repr(C)]
#[derive(Default)]
struct Rusage {
    utime: Timeval,
    stime: Timeval,
    maxrss: c_long,
    rest: [c_long; 13],
}

// SAFETY: the C library's `wait4`, with the `struct rusage` layout above (LP64).
unsafe extern "C" {
    fn wait4(pid: c_int, status: *mut c_int, options: c_int, rusage: *mut Rusage) -> c_int;
}

/// One finished child: wall seconds and peak RSS in bytes.
struct Run {
    wall: f64,
    rss: f64,
}

/// Runs `cmd` to completion; fails on a non-zero exit.
fn measure(cmd: &mut Command) -> Result<Run, String> {
    let start = Instant::now();
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn {cmd:?}: {e}"))?;
    let pid = c_int::try_from(child.id()).map_err(|e| e.to_string())?;
    let (mut status, mut usage) = (0 as c_int, Rusage::default());
    // SAFETY: `pid` is our own child, not yet reaped (std's `Child` is never waited on here);
    // both pointers are to live, properly laid out locals.
    let r = unsafe { wait4(pid, &mut status, 0, &mut usage) };
    let wall = start.elapsed().as_secs_f64();
    if r != pid {
        return Err(format!("wait4 failed for {cmd:?}"));
    }
    // WIFEXITED and WEXITSTATUS.
    if status & 0x7f != 0 || (status >> 8) & 0xff != 0 {
        let mut err = String::new();
        if let Some(mut e) = child.stderr {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        return Err(format!("{cmd:?} failed (status {status:#x}): {err}"));
    }
    let cpu = usage.utime.secs() + usage.stime.secs();
    CHILD_CPU_US.fetch_add((cpu * 1e6) as u64, std::sync::atomic::Ordering::Relaxed);
    let rss = usage.maxrss as f64
        * if cfg!(target_os = "macos") {
            1.0
        } else {
            1024.0
        };
    Ok(Run { wall, rss })
}

/// `cp src dst && sync dst` as one timed unit (two children; the RSS is not used).
fn cp_sync(src: &Path, dst: &Path) -> Result<f64, String> {
    let a = measure(Command::new("cp").arg(src).arg(dst))?;
    let b = measure(Command::new("sync").arg(dst))?;
    std::fs::remove_file(dst).map_err(|e| e.to_string())?;
    Ok(a.wall + b.wall)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Name, dtype and shape of an input tensor.
type Tensor = (&'static str, &'static str, [usize; 2]);

/// A safetensors file of `tensors` with deterministic normal-ish values.
fn write_input(path: &Path, tensors: &[Tensor]) -> Result<u64, String> {
    use std::io::Write;
    let mut rng = XorShift64::new(15);
    let (mut header, mut offset) = (String::from("{"), 0usize);
    let size = |dt: &str| if dt == "F32" { 4 } else { 2 };
    for (i, (name, dt, [r, c])) in tensors.iter().enumerate() {
        let n = r * c * size(dt);
        let sep = if i > 0 { "," } else { "" };
        header += &format!(
            r#"{sep}"{name}":{{"dtype":"{dt}","shape":[{r},{c}],"data_offsets":[{offset},{}]}}"#,
            offset + n
        );
        offset += n;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let f = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut put = |b: &[u8]| w.write_all(b).map_err(|e| e.to_string());
    put(&(header.len() as u64).to_le_bytes())?;
    put(header.as_bytes())?;
    for (_, dt, [r, c]) in tensors {
        let mut row = Vec::with_capacity(c * 4);
        for _ in 0..*r {
            row.clear();
            for _ in 0..*c {
                // A sum of two uniforms: centred, with varied block amaxes.
                let v = 0.02 * (unit24(rng.next_u64()) + unit24(rng.next_u64()) - 1.0);
                if *dt == "F32" {
                    row.extend_from_slice(&v.to_le_bytes());
                } else {
                    row.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            put(&row)?;
        }
    }
    w.into_inner()
        .map_err(|e| e.to_string())?
        .sync_all()
        .map_err(|e| e.to_string())?;
    Ok(std::fs::metadata(path).map_err(|e| e.to_string())?.len())
}

/// One table row.
struct Row {
    case: &'static str,
    command: String,
    file_mib: f64,
    wall: f64,
    cp_sync: f64,
    rss_mib: f64,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.wall / self.cp_sync
    }
    fn rss_bound(&self) -> f64 {
        1.5 * self.file_mib + 64.0
    }
    fn ok(&self) -> bool {
        self.ratio() <= 3.0 && self.rss_mib <= self.rss_bound()
    }
}

/// Median wall and RSS of `lowbit ARGS` (writing `output`) and of cp + sync of `input`,
/// interleaved rep by rep so load from other processes hits both alike. Both write a new file:
/// replacing an existing one would add the cost of freeing its blocks.
fn bench(
    bin: &Path,
    args: &[&std::ffi::OsStr],
    input: &Path,
    output: &Path,
    reps: usize,
) -> Result<[f64; 3], String> {
    let (mut walls, mut rsss, mut cps) = (Vec::new(), Vec::new(), Vec::new());
    let copy = input.with_extension("copy");
    for _ in 0..reps {
        cps.push(cp_sync(input, &copy)?);
        let _ = std::fs::remove_file(output);
        let r = measure(Command::new(bin).args(args))?;
        walls.push(r.wall);
        rsss.push(r.rss / MIB);
    }
    Ok([median(walls), median(cps), median(rsss)])
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let json = args.iter().any(|a| a == "--json");
    let reps: usize =
        opt("--reps").map_or(Ok(3), |v| v.parse().map_err(|e| format!("--reps: {e}")))?;
    let bin = match opt("--bin") {
        Some(b) => PathBuf::from(b),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .parent()
            .and_then(Path::parent)
            .ok_or("no parent directory")?
            .join("lowbit"),
    };
    if !bin.is_file() {
        return Err(format!(
            "{} not found: run `cargo build --release --bin lowbit` first (or pass --bin)",
            bin.display()
        ));
    }
    let dir = opt("--dir")
        .map_or_else(std::env::temp_dir, PathBuf::from)
        .join(format!("lowbit-qbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let cases: [(&str, &[Tensor]); 2] = [
        ("64M bf16", &[("w", "BF16", [8192, 8192])]),
        (
            "2 tensors",
            &[("a", "BF16", [8192, 8192]), ("b", "F32", [4096, 8192])],
        ),
    ];
    let (load_before, started) = (CpuTimes::now(), Instant::now());
    let mut rows = Vec::new();
    for (case, tensors) in cases {
        let input = dir.join("in.safetensors");
        let q = dir.join("q.safetensors");
        let back = dir.join("back.safetensors");
        write_input(&input, tensors)?;
        for recipe in ["mxfp8", "nvfp4"] {
            let mut row = |command: String, args: &[&std::ffi::OsStr], from: &Path, to: &Path| {
                let [wall, cp_sync, rss_mib] = bench(&bin, args, from, to, reps)?;
                let file_mib =
                    std::fs::metadata(from).map_err(|e| e.to_string())?.len() as f64 / MIB;
                rows.push(Row {
                    case,
                    command,
                    file_mib,
                    wall,
                    cp_sync,
                    rss_mib,
                });
                Ok::<(), String>(())
            };
            let (i, q, b) = (input.as_os_str(), q.as_os_str(), back.as_os_str());
            let args = [
                "quantize".as_ref(),
                i,
                q,
                "--recipe".as_ref(),
                recipe.as_ref(),
            ];
            row(
                format!("quantize --recipe {recipe}"),
                &args,
                &input,
                q.as_ref(),
            )?;
            let args = ["dequantize".as_ref(), q, b];
            row(
                format!("dequantize ({recipe} file)"),
                &args,
                q.as_ref(),
                b.as_ref(),
            )?;
        }
        for p in [&input, &q, &back] {
            let _ = std::fs::remove_file(p);
        }
    }
    let _ = std::fs::remove_dir(&dir);
    // Busy cores other than this process's, minus what its children (the measured commands)
    // used.
    let children = CHILD_CPU_US.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-6;
    let others = load_before.zip(CpuTimes::now()).and_then(|(a, b)| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let busy = a.others_cores(b, cores)?;
        Some((busy - children / started.elapsed().as_secs_f64()).max(0.0))
    });
    if json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    r#"{{"case":"{}","command":"{}","file_mib":{:.1},"wall_s":{:.4},"cp_sync_s":{:.4},"ratio":{:.2},"peak_rss_mib":{:.1},"rss_bound_mib":{:.1},"ok":{}}}"#,
                    r.case, r.command, r.file_mib, r.wall, r.cp_sync, r.ratio(), r.rss_mib, r.rss_bound(), r.ok()
                )
            })
            .collect();
        println!(
            r#"{{"binary":"{}","reps":{reps},"other_load_cores":{},"rows":[{}]}}"#,
            bin.display(),
            others.map_or("null".into(), |o| format!("{o:.2}")),
            items.join(",")
        );
        return Ok(());
    }
    println!("binary {} ({} reps, medians)", bin.display(), reps);
    println!(
        "{:<10} {:<26} {:>8} {:>8} {:>9} {:>6} {:>9} {:>8} {:>9}",
        "case",
        "command",
        "file MiB",
        "wall s",
        "cp+sync s",
        "ratio",
        "RSS MiB",
        "RSS/file",
        "RSS bound"
    );
    for r in &rows {
        println!(
            "{:<10} {:<26} {:>8.1} {:>8.3} {:>9.3} {:>6.2} {:>9.1} {:>8.2} {:>9.1}{}",
            r.case,
            r.command,
            r.file_mib,
            r.wall,
            r.cp_sync,
            r.ratio(),
            r.rss_mib,
            r.rss_mib / r.file_mib,
            r.rss_bound(),
            if r.ok() { "" } else { "  (over a target)" }
        );
    }
    if let Some(o) = others {
        println!("other processes kept {o:.2} cores busy on average during the run");
        println!("(cp + sync: cp IN COPY, then sync COPY; both commands write a new file)");
    }
    Ok(())
}
