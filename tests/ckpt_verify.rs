//! `lowbit ckpt verify` proves a `lowbit train` checkpoint loadable, and `ckpt export` cannot
//! destroy what it reads: checkpoints that the hash-only verify passed but that do not load (a
//! tensor removed from the manifest, a swapped shape, a garbled rank-file header, a `step-30`
//! holding a step-20 manifest) are refused naming the file or tensor; an output inside the
//! checkpoint is refused before anything is written; a `latest` symlinked to a file with
//! secret text is refused without the text.

use std::path::Path;

use lowbit_dev_support::json::Json;
use lowbit_dev_support::tempdir::TempDir;

mod lowbit_cli;

use lowbit_cli::{refused, stdout_ok};

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A step directory's copy `name` beside it, and its manifest's path.
fn variant(step: &Path, name: &str) -> std::path::PathBuf {
    let dir = step.parent().unwrap().parent().unwrap().join(name);
    copy_dir(step, &dir);
    dir
}

#[test]
fn verify_refuses_what_does_not_load_and_export_refuses_the_checkpoint_itself() {
    let tmp = TempDir::new("ckpt-verify");
    let root = tmp.path("c");
    stdout_ok(&[
        "train",
        "--batch",
        "128",
        "--steps",
        "2",
        "--save",
        p(&root),
    ]);
    let step = root.join("step-2");
    let ok = stdout_ok(&["ckpt", "verify", p(&root)]);
    assert!(
        ok.starts_with("ok: ") && ok.contains("parameters of the reference model"),
        "{ok}"
    );
    let manifest = std::fs::read_to_string(step.join("manifest.json")).unwrap();
    let m = Json::parse(&manifest).unwrap();
    // A 2-D master that is not square, for the swapped shape.
    let t = m
        .key("tensors")
        .arr()
        .iter()
        .find(|t| {
            let s = t.key("shape").arr();
            s.len() == 2 && s[0].number() != s[1].number() && t.key("state").text() == "master"
        })
        .expect("a non-square matrix");
    let name = t.key("name").text().to_string();
    let param = t.key("param").text().to_string();
    let (r, c) = (
        t.key("shape").arr()[0].number() as u64,
        t.key("shape").arr()[1].number() as u64,
    );
    let cases = tmp.path("cases");
    std::fs::create_dir_all(&cases).unwrap();

    // A tensor removed from the manifest: its pieces are still in the rank files.
    let removed = variant(&step, "cases/removed");
    let mut mj = m.clone();
    if let Json::Obj(o) = &mut mj
        && let Some(Json::Arr(ts)) = o.get_mut("tensors")
    {
        ts.retain(|t| t.key("name").text() != name);
    }
    std::fs::write(removed.join("manifest.json"), mj.to_text()).unwrap();
    let e = refused(&["ckpt", "verify", p(&removed)]);
    assert!(
        e.contains("safetensors header") && e.contains("no piece of the manifest"),
        "removed: {e}"
    );

    // A swapped shape (same elements, so every piece still tiles and hashes).
    let swapped = variant(&step, "cases/swapped");
    let mut mj = m.clone();
    if let Json::Obj(o) = &mut mj
        && let Some(Json::Arr(ts)) = o.get_mut("tensors")
    {
        let t = ts
            .iter_mut()
            .find(|t| t.key("name").text() == name)
            .unwrap();
        if let Json::Obj(t) = t {
            t.insert("shape", Json::Arr(vec![Json::UInt(c), Json::UInt(r)]));
        }
    }
    std::fs::write(swapped.join("manifest.json"), mj.to_text()).unwrap();
    let e = refused(&["ckpt", "verify", p(&swapped)]);
    assert!(
        e.contains(&name) && e.contains(&param) && e.contains("has shape"),
        "swapped: {e}"
    );

    // A garbled rank-file header (other tools cannot read the file any more).
    let garbled = variant(&step, "cases/garbled");
    let file = garbled.join("rank-00002.safetensors");
    let mut d = std::fs::read(&file).unwrap();
    d[8] = b'#';
    std::fs::write(&file, d).unwrap();
    let e = refused(&["ckpt", "verify", p(&garbled)]);
    assert!(
        e.contains("rank-00002.safetensors") && e.contains("safetensors header"),
        "garbled: {e}"
    );

    // `step-30` holding the step-2 manifest.
    let renamed = variant(&step, "cases/step-30");
    let e = refused(&["ckpt", "verify", p(&renamed)]);
    assert!(
        e.contains("step-30") && e.contains("manifest is of step 2"),
        "renamed: {e}"
    );

    // Export: an output inside the checkpoint is refused before anything is written, --force
    // or not, and the rank files survive.
    let rank0 = step.join("rank-00000.safetensors");
    let before = std::fs::read(&rank0).unwrap();
    let e = refused(&["ckpt", "export", p(&root), p(&rank0), "--force"]);
    assert!(e.contains("inside the checkpoint"), "{e}");
    let new_file = step.join("w.safetensors");
    let e = refused(&["ckpt", "export", p(&root), p(&new_file)]);
    assert!(e.contains("inside the checkpoint"), "{e}");
    let dotted = root.join("step-2/../step-2/manifest.json");
    let e = refused(&["ckpt", "export", p(&step), p(&dotted), "--force"]);
    assert!(e.contains("inside the checkpoint"), "{e}");
    let e = refused(&[
        "ckpt",
        "export",
        p(&root),
        p(&root.join("latest")),
        "--force",
    ]);
    assert!(e.contains("inside the checkpoint"), "{e}");
    assert!(
        std::fs::read(&rank0).unwrap() == before,
        "the rank file changed"
    );
    assert!(!new_file.exists());
    stdout_ok(&["ckpt", "verify", p(&root)]);
    // Beside the checkpoint is fine.
    stdout_ok(&["ckpt", "export", p(&root), p(&tmp.path("w.safetensors"))]);

    // `latest` symlinked to a file with secret text: refused, the text never printed.
    #[cfg(unix)]
    {
        let secret = tmp.path("secret.txt");
        std::fs::write(&secret, "TOPSECRET-5e1d the key is 0xc0ffee\n").unwrap();
        let latest = root.join("latest");
        std::fs::remove_file(&latest).unwrap();
        std::os::unix::fs::symlink(&secret, &latest).unwrap();
        for cmd in ["verify", "inspect"] {
            let e = refused(&["ckpt", cmd, p(&root)]);
            assert!(e.contains("symbolic link"), "{e}");
            assert!(!e.contains("TOPSECRET") && !e.contains("c0ffee"), "{e}");
        }
        // A symlink to the root's own `step-2` resolves.
        std::fs::remove_file(&latest).unwrap();
        std::os::unix::fs::symlink("step-2", &latest).unwrap();
        let ok = stdout_ok(&["ckpt", "verify", p(&root)]);
        assert!(ok.contains("step 2"), "{ok}");
    }
}

/// A decoder's checkpoint (`model = llama`) is checked against the decoder its config records:
/// a swapped shape of one of its matrices is refused naming the parameter and the decoder.
#[test]
fn verify_checks_a_decoder_checkpoint_against_its_recorded_decoder() {
    let tmp = TempDir::new("ckpt-verify-llama");
    let root = tmp.path("c");
    stdout_ok(&[
        "train",
        "--model",
        "llama-tiny",
        "--ranks",
        "2",
        "--batch",
        "4",
        "--seq",
        "32",
        "--steps",
        "1",
        "--save",
        p(&root),
    ]);
    let ok = stdout_ok(&["ckpt", "verify", p(&root)]);
    assert!(
        ok.contains("parameters of the decoder (llama-tiny)"),
        "{ok}"
    );
    let step = root.join("step-1");
    let mut m = Json::parse(&std::fs::read_to_string(step.join("manifest.json")).unwrap()).unwrap();
    let mut swapped = None;
    if let Json::Obj(o) = &mut m
        && let Some(Json::Arr(ts)) = o.get_mut("tensors")
    {
        for t in ts.iter_mut() {
            let s: Vec<u64> = t
                .key("shape")
                .arr()
                .iter()
                .map(|d| d.number() as u64)
                .collect();
            if s.len() == 2 && s[0] != s[1] && t.key("state").text() == "master" {
                swapped = Some(t.key("param").text().to_string());
                if let Json::Obj(t) = t {
                    t.insert("shape", Json::Arr(vec![Json::UInt(s[1]), Json::UInt(s[0])]));
                }
                break;
            }
        }
    }
    let param = swapped.expect("a non-square matrix");
    std::fs::write(step.join("manifest.json"), m.to_text()).unwrap();
    let e = refused(&["ckpt", "verify", p(&root)]);
    assert!(
        e.contains(&param) && e.contains("the decoder (llama-tiny)") && e.contains("has shape"),
        "{e}"
    );
}
