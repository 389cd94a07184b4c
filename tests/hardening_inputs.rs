//! Inputs that are not regular files, bounded reads and the words of errors: FIFOs, devices
//! and directories given as `--data` or as a quantize/dequantize input are refused at once,
//! naming the file and what it is; an oversized `--data` file is refused with the limit;
//! `dequantize` refuses quantized components whose metadata key was stripped; paths with
//! control characters are escaped in errors.
//!
//! Every run of the binary is under a kill timer ([`lowbit`]), so a regression that blocks in
//! `open` or reads without end fails the test instead of hanging it.

use lowbit_dev_support::tempdir::TempDir;
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

const BIN: &str = env!("CARGO_BIN_EXE_lowbit");

/// How long one refusal may take: it happens before any work, so far less than this.
const LIMIT: Duration = Duration::from_secs(60);

/// Runs `lowbit ARGS`, killing it after [`LIMIT`] (then the test fails, naming the command).
fn lowbit<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    let shown: Vec<_> = args.iter().map(|a| a.as_ref().to_string_lossy()).collect();
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run lowbit");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`lowbit {}` still ran after {LIMIT:?}", shown.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect output")
}

/// Asserts exit status 1 with one line on stderr that holds every needle.
#[track_caller]
fn assert_refused(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
}

fn mkfifo(path: &Path) -> bool {
    Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

/// A FIFO that nothing ever writes: opening it for reading without `O_NONBLOCK` blocks
/// forever.
#[test]
fn a_fifo_is_refused_by_train_quantize_and_dequantize() {
    let dir = TempDir::new("inputs-fifo");
    let fifo = dir.path("fifo");
    if !mkfifo(&fifo) {
        eprintln!("skipped: no mkfifo");
        return;
    }
    let f = fifo.to_str().unwrap();
    let out = dir.path("out.safetensors");
    let o = out.to_str().unwrap();
    let want = format!("cannot read {f}: not a regular file (a FIFO)");
    assert_refused(&lowbit(&["train", "--data", f, "--steps", "1"]), &[&want]);
    assert_refused(&lowbit(&["quantize", f, o]), &[&want]);
    assert_refused(&lowbit(&["dequantize", f, o]), &[&want]);
    assert!(!out.exists());
}

/// `/dev/zero` never ends: read whole, it grows memory until the machine runs out.
#[test]
fn a_character_device_is_refused() {
    let want = "cannot read /dev/zero: not a regular file (a character device)";
    assert_refused(
        &lowbit(&["train", "--data", "/dev/zero", "--steps", "1"]),
        &[want],
    );
    let dir = TempDir::new("inputs-chardev");
    let out = dir.path("out.safetensors");
    let o = out.to_str().unwrap();
    assert_refused(&lowbit(&["quantize", "/dev/zero", o]), &[want]);
    assert_refused(&lowbit(&["dequantize", "/dev/zero", o]), &[want]);
}

#[test]
fn a_directory_is_refused() {
    let dir = TempDir::new("inputs-dir");
    let sub = dir.path("sub");
    std::fs::create_dir(&sub).unwrap();
    let s = sub.to_str().unwrap();
    let out = dir.path("out.safetensors");
    let o = out.to_str().unwrap();
    let want = format!("cannot read {s}: not a regular file (a directory)");
    assert_refused(&lowbit(&["train", "--data", s, "--steps", "1"]), &[&want]);
    assert_refused(&lowbit(&["quantize", s, o]), &[&want]);
    assert_refused(&lowbit(&["dequantize", s, o]), &[&want]);
}

/// A sparse file one byte over the limit: refused from its size, before any byte is read.
#[test]
fn a_data_file_over_the_limit_is_refused_with_the_limit() {
    let dir = TempDir::new("inputs-big");
    let big = dir.path("big.txt");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len((1 << 30) + 1).unwrap();
    drop(f);
    let b = big.to_str().unwrap();
    assert_refused(
        &lowbit(&["train", "--data", b, "--steps", "1"]),
        &[b, "1073741825 bytes", "at most 1073741824 bytes (1 GiB)"],
    );
}

/// Quantizes a 32×64 f32 tensor `w`, then rewrites the file with every `lowbit.tensor.*` key
/// removed (the file-level keys kept): the components are there, their original dtype and
/// shape are not.
#[test]
fn dequantize_refuses_components_whose_metadata_key_was_stripped() {
    let dir = TempDir::new("inputs-stripped");
    let input = dir.path("in.safetensors");
    let data: Vec<u8> = (0..32 * 64)
        .flat_map(|i| ((i as f32 * 0.37).sin()).to_le_bytes())
        .collect();
    let view = TensorView::new(safetensors::Dtype::F32, vec![32, 64], &data).unwrap();
    std::fs::write(&input, safetensors::serialize([("w", view)], None).unwrap()).unwrap();
    for recipe in ["mxfp8", "nvfp4"] {
        let q = dir.path(&format!("{recipe}.safetensors"));
        let o = lowbit(&[
            "quantize".as_ref(),
            input.as_os_str(),
            q.as_os_str(),
            "--recipe".as_ref(),
            recipe.as_ref(),
        ]);
        assert_eq!(o.status.code(), Some(0), "{o:?}");
        let bytes = std::fs::read(&q).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let metadata: HashMap<String, String> = header
            .metadata()
            .clone()
            .unwrap()
            .into_iter()
            .filter(|(k, _)| !k.starts_with("lowbit.tensor."))
            .collect();
        let tensors: Vec<(String, TensorView<'_>)> = st.tensors();
        let stripped = dir.path(&format!("{recipe}-stripped.safetensors"));
        std::fs::write(
            &stripped,
            safetensors::serialize(tensors, Some(metadata)).unwrap(),
        )
        .unwrap();
        let out = dir.path("out.safetensors");
        let o = lowbit(&["dequantize".as_ref(), stripped.as_os_str(), out.as_os_str()]);
        assert_refused(
            &o,
            &[
                "tensor w has quantized components",
                "_data, w.",
                "no metadata key lowbit.tensor.w",
            ],
        );
        assert!(!out.exists());
    }
}

/// A newline in a path would print as a second line of the error, which a reader (or a log
/// parser) takes for another message.
#[test]
fn a_newline_in_a_path_is_escaped_in_errors() {
    let dir = TempDir::new("inputs-newline");
    let odd = dir.path("a\nerror: forged");
    let shown = format!("{}\\nerror: forged", dir.path("a").to_str().unwrap());
    let out = dir.path("out.safetensors");
    let o = out.to_str().unwrap();
    let odd_s = odd.to_str().unwrap();
    // Missing, then present but not a safetensors file, then a directory.
    assert_refused(&lowbit(&["quantize", odd_s, o]), &[&shown]);
    assert_refused(
        &lowbit(&["train", "--data", odd_s, "--steps", "1"]),
        &[&shown],
    );
    std::fs::write(&odd, b"not safetensors").unwrap();
    assert_refused(&lowbit(&["quantize", odd_s, o]), &[&shown]);
    assert_refused(&lowbit(&["dequantize", odd_s, o]), &[&shown]);
    assert_refused(
        &lowbit(&["train", "--data", odd_s, "--steps", "1"]),
        &[&shown],
    );
    std::fs::remove_file(&odd).unwrap();
    std::fs::create_dir(&odd).unwrap();
    assert_refused(&lowbit(&["quantize", odd_s, o]), &[&shown]);
}

/// Errors of commands outside `lowbit_io` too: the whole message is escaped once, when it is
/// printed, so it stays one line whatever a path holds.
#[test]
fn a_newline_in_a_path_is_escaped_in_every_command() {
    let dir = TempDir::new("inputs-newline-cmds");
    let odd = dir.path("c\nerror: forged");
    let odd_s = odd.to_str().unwrap();
    let shown = format!("{}\\nerror: forged", dir.path("c").to_str().unwrap());
    assert_refused(&lowbit(&["ckpt", "verify", odd_s]), &[&shown]);
    assert_refused(&lowbit(&["data", "inspect", odd_s]), &[&shown]);
    std::fs::create_dir(&odd).unwrap();
    assert_refused(&lowbit(&["ckpt", "verify", odd_s]), &[&shown]);
}

/// A learning rate this large sends the weights to infinity after the first step, so the
/// second step's gradients are not finite: the `--nan-check` error names that step.
#[test]
fn nan_check_errors_name_the_step() {
    let o = lowbit(&[
        "train",
        "--ranks",
        "2",
        "--batch",
        "64",
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--lr",
        "1e30",
        "--nan-check",
        "grad",
    ]);
    assert_refused(&o, &["step 2/3: ", "non-finite (NaN or Inf) gradient in "]);
}
