//! Tests of the data pipeline: tokenizers against known ids, streaming tokenization against
//! whole-text tokenization, prepare → open → windows, the sample order, and every bad input
//! the reader must refuse with a typed error naming the file.

use std::fs;
use std::path::{Path, PathBuf};

use lowbit_dev_support::tempdir::TempDir;
use lowbit_io::Json;

use super::prepare::{DocTokenizer, assign, lone_split_point};
use super::*;

#[test]
fn gpt2_encodes_known_strings_to_known_ids() {
    let t = Tokenizer::Gpt2;
    // Ids of tiktoken's r50k_base (= Hugging Face's `gpt2` tokenizer).
    assert_eq!(t.encode("Hello world"), vec![15496, 995]);
    assert_eq!(t.encode(" the"), vec![262]);
    assert_eq!(t.encode("\n\n"), vec![628]);
    assert_eq!(t.decode(&[15496, 995]).unwrap(), "Hello world");
    assert_eq!(t.decode(&[50256]).unwrap(), "<|endoftext|>");
    // A literal end-of-text string is ordinary text, never the id.
    assert!(!t.encode("<|endoftext|>").contains(&50256));
    for s in [
        "To be, or not to be: that is the question.",
        "héllo wörld — ünïcode ✓",
        "",
    ] {
        assert_eq!(t.decode(&t.encode(s)).unwrap(), s);
    }
    let e = t.decode(&[1, 50257]).unwrap_err().to_string();
    assert!(e.contains("50257") && e.contains("position 1"), "{e}");
    assert_eq!((t.vocab(), t.eot(), t.name()), (50257, 50256, "gpt2"));
}

#[test]
fn bytes_tokenizer_round_trips_and_decodes_lossily() {
    let t = Tokenizer::Bytes;
    assert_eq!(t.encode("Ab"), vec![65, 98]);
    let s = "héllo ✓";
    assert_eq!(t.decode(&t.encode(s)).unwrap(), s);
    // A cut multi-byte character decodes as U+FFFD rather than failing.
    assert_eq!(t.decode(&[0xC3]).unwrap(), "\u{FFFD}");
    assert_eq!(t.decode(&[256]).unwrap(), "<|endoftext|>");
    assert!(t.decode(&[257]).is_err());
    assert_eq!((t.vocab(), t.eot()), (257, 256));
    assert_eq!(Tokenizer::from_name("bytes").unwrap(), t);
    assert_eq!(Tokenizer::from_name("gpt2").unwrap(), Tokenizer::Gpt2);
    let e = Tokenizer::from_name("llama3").unwrap_err().to_string();
    assert!(e.contains("llama3") && e.contains("gpt2"), "{e}");
}

/// Feeds `text` in pieces of `piece` bytes; returns both parts' ids.
fn stream_doc(
    text: &str,
    tok: Tokenizer,
    piece: usize,
    split_at: Option<u64>,
) -> (Vec<u32>, Vec<u32>) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut d = DocTokenizer::new(tok, Path::new("t"), 1 << 20, split_at, &mut a).unwrap();
    for c in text.as_bytes().chunks(piece) {
        d.feed(c, &mut a, &mut b).unwrap();
    }
    d.finish(&mut a, &mut b).unwrap();
    (a, b)
}

#[test]
fn streaming_gpt2_gives_the_ids_of_the_whole_text() {
    // Real text with blank lines, indentation and punctuation; pieces split words, whitespace
    // runs and (in the second text) multi-byte characters.
    let sample = &embedded_sample()[..30_000];
    let uni = "Ünïcödé wörds — split ✓ across pieces,\n\n   indented  lines\tand tabs. ".repeat(50);
    for text in [sample, uni.as_str()] {
        let mut whole = vec![50256];
        whole.extend(Tokenizer::Gpt2.encode(text));
        for piece in [1, 7, 64, 4096] {
            let (a, b) = stream_doc(text, Tokenizer::Gpt2, piece, None);
            assert_eq!(a, whole, "piece {piece}");
            assert!(b.is_empty());
        }
    }
}

#[test]
fn a_lone_document_splits_at_the_same_line_whatever_the_pieces() {
    let text = &embedded_sample()[..20_000];
    let t = lone_split_point(text.len() as u64, 0.1).unwrap();
    assert_eq!(t, 18_000);
    let cut = (t as usize..)
        .find(|&p| text.as_bytes()[p - 1] == b'\n')
        .unwrap();
    let mut head = vec![50256];
    head.extend(Tokenizer::Gpt2.encode(&text[..cut]));
    let mut tail = vec![50256];
    tail.extend(Tokenizer::Gpt2.encode(&text[cut..]));
    for piece in [3, 100, 1 << 16] {
        let (a, b) = stream_doc(text, Tokenizer::Gpt2, piece, Some(t));
        assert_eq!((&a, &b), (&head, &tail), "piece {piece}");
    }
    // No line start after the point: the first character boundary is the cut.
    // (Byte 2 is inside "é", so the cut is at 3.)
    let (a, b) = stream_doc("aéb", Tokenizer::Bytes, 1, lone_split_point(4, 0.5));
    assert_eq!((a, b), (vec![256, 97, 0xC3, 0xA9], vec![256, 98]));
}

#[test]
fn the_split_depends_on_content_with_one_document_at_least_in_each() {
    let hashes: Vec<u64> = (0..1000u64)
        .map(|i| lowbit_io::fnv1a64(&i.to_le_bytes()))
        .collect();
    let v = assign(&hashes, 0.1);
    let n = v.iter().filter(|&&x| x).count();
    assert!((60..140).contains(&n), "{n} of 1000 in validation at 0.1");
    // Reordering documents does not move any of them.
    let rev: Vec<u64> = hashes.iter().rev().copied().collect();
    let vr: Vec<bool> = assign(&rev, 0.1).into_iter().rev().collect();
    assert_eq!(v, vr);
    assert_eq!(assign(&hashes[..2], 1e-9).iter().filter(|&&x| x).count(), 1);
    assert_eq!(
        assign(&hashes[..2], 0.999_999)
            .iter()
            .filter(|&&x| x)
            .count(),
        1
    );
    assert!(assign(&hashes, 0.0).iter().all(|&x| !x));
}

fn write(dir: &TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path(name);
    fs::write(&p, text).unwrap();
    p
}

fn opts(tok: Tokenizer, fraction: f64, shard_tokens: u64) -> PrepareOptions {
    PrepareOptions {
        tokenizer: tok,
        validation_fraction: fraction,
        shard_tokens,
        read_bytes: 5,
        max_pending_bytes: 1 << 16,
    }
}

/// Three documents prepared with the byte tokenizer into small shards.
fn prepared(tmp: &TempDir, shard_tokens: u64) -> (Vec<PathBuf>, PathBuf, Manifest) {
    let docs = [
        ("a.txt", "First document, with some words in it.\n"),
        ("b.txt", "Second one: shorter.\n"),
        (
            "c.txt",
            "The third and last document of the test corpus, the longest of all.\n",
        ),
    ];
    let inputs: Vec<PathBuf> = docs.iter().map(|(n, t)| write(tmp, n, t)).collect();
    let out = tmp.path("shards");
    let m = prepare(&inputs, &out, &opts(Tokenizer::Bytes, 0.34, shard_tokens)).unwrap();
    (inputs, out, m)
}

#[test]
fn prepare_open_and_windows_across_shard_boundaries() {
    let tmp = TempDir::new("data-prepare");
    let (inputs, out, m) = prepared(&tmp, 16);
    assert_eq!(m.dtype, Dtype::U16);
    assert_eq!(m.train.documents + m.validation.documents, 3);
    assert!(m.train.documents >= 1 && m.validation.documents >= 1);
    assert!(m.train.shards.len() > 2, "16-token shards");
    let data = TokenShards::open(&out).unwrap();
    assert_eq!(data.tokenizer(), Tokenizer::Bytes);
    assert_eq!(data.manifest(), &m);
    // Each split's stream is its documents, in input order, each after end-of-text.
    for (kind, want_val) in [(SplitKind::Train, false), (SplitKind::Validation, true)] {
        let mut want = Vec::new();
        for (p, rec) in inputs.iter().zip(&m.inputs) {
            if (rec.split == "validation") == want_val {
                want.push(256);
                want.extend(fs::read(p).unwrap().into_iter().map(u32::from));
            }
        }
        let split = data.split(kind);
        assert_eq!(split.tokens(), want.len() as u64);
        let mut all = vec![0; want.len()];
        split.read(0, &mut all).unwrap();
        assert_eq!(all, want);
        let seq = 6;
        assert_eq!(split.windows(seq), want.len() as u64 / 7);
        let mut w = vec![0; seq + 1];
        for i in 0..split.windows(seq) {
            split.window(seq, i, &mut w).unwrap();
            assert_eq!(w, want[i as usize * 7..][..7]);
        }
        assert!(split.window(seq, split.windows(seq), &mut w).is_err());
        let (mut x, mut y) = (vec![0.0; 2 * seq], vec![0.0; 2 * seq]);
        split.batch_f32(seq, &[1, 0], &mut x, &mut y).unwrap();
        assert_eq!(x[0], want[7] as f32);
        assert_eq!(y[seq - 1], want[13] as f32);
        assert_eq!(x[seq], want[0] as f32);
    }
    // The fingerprint follows the tokens, not the sharding.
    let tmp2 = TempDir::new("data-prepare2");
    let (_, out2, _) = prepared(&tmp2, 1000);
    assert_eq!(
        TokenShards::open(&out2).unwrap().fingerprint(),
        data.fingerprint()
    );
    let other = TokenShards::from_text("different", Tokenizer::Bytes, 0.34).unwrap();
    assert_ne!(other.fingerprint(), data.fingerprint());
}

#[test]
fn from_text_is_prepare_of_one_file() {
    let tmp = TempDir::new("data-fromtext");
    let text = &embedded_sample()[..50_000];
    let p = write(&tmp, "sample.txt", text);
    let out = tmp.path("shards");
    for tok in Tokenizer::ALL {
        let mut o = opts(tok, 0.1, 1000);
        o.read_bytes = 4096;
        let m = prepare(&[&p], &out, &o).unwrap();
        assert_eq!((m.train.documents, m.validation.documents), (1, 1));
        assert_eq!(m.inputs[0].split, "both");
        let disk = TokenShards::open(&out).unwrap();
        let mem = TokenShards::from_text(text, tok, 0.1).unwrap();
        assert_eq!(disk.fingerprint(), mem.fingerprint(), "{tok}");
        let v = disk.validation().tokens();
        assert!(
            v > 0 && v < disk.train().tokens() / 5,
            "{tok}: {v} validation tokens"
        );
    }
}

#[test]
fn the_embedded_sample_is_ready_to_train_on() {
    let s = embedded_sample();
    assert_eq!(s.len(), 199_157);
    assert!(s.starts_with("THE TRAGEDY OF MACBETH") || s.contains("MACBETH"));
    assert!(s.contains("THE SONNETS"));
    let data = TokenShards::from_text(s, Tokenizer::Bytes, 0.1).unwrap();
    assert_eq!(
        data.train().tokens() + data.validation().tokens(),
        199_157 + 2
    );
    assert!(data.validation().windows(128) > 100);
}

#[test]
fn the_sample_order_is_a_deterministic_permutation_per_epoch() {
    let mut o = SampleOrder::new(42, 1000).unwrap();
    let p0 = o.permutation(0);
    let mut sorted = p0.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..1000).collect::<Vec<u32>>());
    assert_ne!(p0, (0..1000).collect::<Vec<u32>>());
    assert_eq!(p0, SampleOrder::new(42, 1000).unwrap().permutation(0));
    assert_ne!(p0, o.permutation(1));
    assert_ne!(p0, SampleOrder::new(43, 1000).unwrap().permutation(0));
    // window_of walks the epochs' permutations; a fresh order resumes at any sample index.
    let run: Vec<u64> = (0..2500).map(|i| o.window_of(i)).collect();
    assert_eq!(
        run[..1000],
        p0.iter().map(|&w| u64::from(w)).collect::<Vec<_>>()[..]
    );
    let mut resumed = SampleOrder::new(42, 1000).unwrap();
    assert_eq!(
        (1700..2500)
            .map(|i| resumed.window_of(i))
            .collect::<Vec<_>>(),
        run[1700..]
    );
    assert_eq!(o.epoch_of(2499), 2);
    // Pinned: the order is part of what a checkpoint's sample index means.
    // (Values from an independent Python transcription of the documented shuffle.)
    assert_eq!(
        SampleOrder::new(0, 5).unwrap().permutation(0),
        [2, 1, 4, 3, 0]
    );
    assert_eq!(
        SampleOrder::new(42, 8).unwrap().permutation(1),
        [6, 7, 2, 4, 5, 0, 3, 1]
    );
    assert!(SampleOrder::new(1, 0).is_err());
    assert_eq!(SampleOrder::new(7, 1).unwrap().window_of(12), 0);
}

/// The error of opening `dir`, as text.
fn open_err(dir: &Path) -> String {
    TokenShards::open(dir).unwrap_err().to_string()
}

fn edit_manifest(out: &Path, f: impl FnOnce(&mut Json)) {
    let p = out.join(MANIFEST_FILE);
    let mut j = Json::parse(&fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut j);
    fs::write(&p, j.to_text()).unwrap();
}

fn first_train_shard(out: &Path) -> PathBuf {
    out.join("train-00000.bin")
}

#[test]
fn corrupt_shards_are_refused_naming_the_file() {
    let tmp = TempDir::new("data-corrupt");
    let (_, out, _) = prepared(&tmp, 16);
    let shard = first_train_shard(&out);
    let good = fs::read(&shard).unwrap();

    // Truncated.
    fs::write(&shard, &good[..good.len() - 1]).unwrap();
    let e = open_err(&out);
    assert!(
        e.contains("train-00000.bin") && e.contains("truncated"),
        "{e}"
    );

    // One flipped byte.
    let mut bad = good.clone();
    bad[3] ^= 0x01;
    fs::write(&shard, &bad).unwrap();
    let e = open_err(&out);
    assert!(e.contains("train-00000.bin") && e.contains("FNV-1a"), "{e}");

    // An id ≥ the vocabulary, with a hash that matches (a consistent but wrong shard).
    let mut bad = good.clone();
    bad[2..4].copy_from_slice(&300u16.to_le_bytes());
    fs::write(&shard, &bad).unwrap();
    let h = format!("{:016x}", lowbit_io::fnv1a64(&bad));
    edit_manifest(&out, |j| {
        if let Json::Obj(top) = j
            && let Some(Json::Obj(splits)) = top.get_mut("splits")
            && let Some(Json::Obj(train)) = splits.get_mut("train")
            && let Some(Json::Arr(shards)) = train.get_mut("shards")
            && let Some(Json::Obj(s)) = shards.get_mut(0)
        {
            s.insert("fnv1a64", Json::str(h));
        }
    });
    let e = open_err(&out);
    assert!(
        e.contains("train-00000.bin") && e.contains("id 300") && e.contains("257"),
        "{e}"
    );

    // Missing.
    fs::remove_file(&shard).unwrap();
    let e = open_err(&out);
    assert!(
        e.contains("train-00000.bin") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn bad_manifests_are_refused_naming_the_key() {
    let tmp = TempDir::new("data-manifest");
    let (_, out, _) = prepared(&tmp, 16);
    let original = fs::read_to_string(out.join(MANIFEST_FILE)).unwrap();
    type Edit = Box<dyn Fn(&mut lowbit_io::json::Object)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "unknown key \"extra\"",
            Box::new(|o| {
                o.insert("extra", Json::UInt(1));
            }),
        ),
        (
            "missing key \"dtype\"",
            Box::new(|o| {
                o.remove("dtype");
            }),
        ),
        (
            "vocab must be a non-negative integer",
            Box::new(|o| {
                o.insert("vocab", Json::str("257"));
            }),
        ),
        (
            "version 2 is not supported",
            Box::new(|o| {
                o.insert("version", Json::UInt(2));
            }),
        ),
        (
            "format \"safetensors\"",
            Box::new(|o| {
                o.insert("format", Json::str("safetensors"));
            }),
        ),
        (
            "vocab 300 is not the bytes tokenizer's 257",
            Box::new(|o| {
                o.insert("vocab", Json::UInt(300));
            }),
        ),
        (
            "unknown tokenizer",
            Box::new(|o| {
                o.insert("tokenizer", Json::str("sentencepiece"));
            }),
        ),
        (
            "unknown key \"hash\" in splits.train.shards[0]",
            Box::new(|o| {
                if let Some(Json::Obj(s)) = o.get_mut("splits")
                    && let Some(Json::Obj(t)) = s.get_mut("train")
                    && let Some(Json::Arr(sh)) = t.get_mut("shards")
                    && let Some(Json::Obj(s0)) = sh.get_mut(0)
                {
                    s0.insert("hash", Json::UInt(0));
                }
            }),
        ),
        (
            "splits.train.tokens is 1",
            Box::new(|o| {
                if let Some(Json::Obj(s)) = o.get_mut("splits")
                    && let Some(Json::Obj(t)) = s.get_mut("train")
                {
                    t.insert("tokens", Json::UInt(1));
                }
            }),
        ),
        (
            "not a plain file name",
            Box::new(|o| {
                if let Some(Json::Obj(s)) = o.get_mut("splits")
                    && let Some(Json::Obj(t)) = s.get_mut("train")
                    && let Some(Json::Arr(sh)) = t.get_mut("shards")
                    && let Some(Json::Obj(s0)) = sh.get_mut(0)
                {
                    s0.insert("file", Json::str("../../etc/passwd"));
                }
            }),
        ),
    ];
    for (want, edit) in cases {
        fs::write(out.join(MANIFEST_FILE), &original).unwrap();
        edit_manifest(&out, |j| {
            if let Json::Obj(o) = j {
                edit(o);
            }
        });
        let e = open_err(&out);
        assert!(
            e.contains(MANIFEST_FILE) && e.contains(want),
            "want {want:?}, got {e}"
        );
    }
    fs::write(out.join(MANIFEST_FILE), "{\"format\": ").unwrap();
    let e = open_err(&out);
    assert!(e.contains("not JSON"), "{e}");
    fs::write(out.join(MANIFEST_FILE), &original).unwrap();
    TokenShards::open(&out).unwrap();
}

#[test]
fn inputs_that_are_not_regular_files_are_refused_before_opening() {
    let tmp = TempDir::new("data-inputs");
    let good = write(&tmp, "good.txt", "some text here");
    let out = tmp.path("out");
    let o = opts(Tokenizer::Bytes, 0.1, 100);
    let fifo = tmp.path("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    let mut cases = vec![
        (PathBuf::from("/dev/zero"), "character device"),
        (tmp.dir().to_path_buf(), "directory"),
        (tmp.path("absent.txt"), "absent.txt"),
    ];
    if made.is_ok_and(|s| s.success()) {
        cases.push((fifo, "FIFO"));
    }
    for (bad, want) in cases {
        let e = prepare(&[good.clone(), bad.clone()], &out, &o).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&*bad.to_string_lossy()) && text.contains(want),
            "{text}"
        );
        assert!(!out.join(MANIFEST_FILE).exists());
    }
    // Not UTF-8, after a first good input: a failed prepare leaves no manifest, not even an old
    // one.
    prepare(&[&good], &out, &o).unwrap();
    assert!(out.join(MANIFEST_FILE).exists());
    let latin1 = tmp.path("latin1.txt");
    fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let e = prepare(&[good.clone(), latin1], &out, &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("latin1.txt") && e.contains("UTF-8") && e.contains("offset 3"),
        "{e}"
    );
    assert!(!out.join(MANIFEST_FILE).exists());
    // Options.
    let e = prepare(&[&good], &out, &opts(Tokenizer::Bytes, 1.0, 100)).unwrap_err();
    assert!(e.to_string().contains("[0, 1)"), "{e}");
    let none: [&Path; 0] = [];
    assert!(prepare(&none, &out, &o).is_err());
    // An input inside the output directory (a shard of an earlier run) is refused.
    prepare(&[&good], &out, &o).unwrap();
    let e = prepare(&[out.join("train-00000.bin")], &out, &o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("inside the output directory"), "{e}");
    // A shard directory entry that is a FIFO is refused too, without blocking.
    let out2 = tmp.path("out2");
    prepare(&[&good], &out2, &o).unwrap();
    fs::remove_file(out2.join("train-00000.bin")).unwrap();
    if std::process::Command::new("mkfifo")
        .arg(out2.join("train-00000.bin"))
        .status()
        .is_ok_and(|s| s.success())
    {
        let e = open_err(&out2);
        assert!(e.contains("train-00000.bin") && e.contains("FIFO"), "{e}");
    }
}

#[test]
fn fraction_zero_makes_no_validation_split() {
    let tmp = TempDir::new("data-zero");
    let a = write(&tmp, "a.txt", "one two three");
    let b = write(&tmp, "b.txt", "four five six");
    let out = tmp.path("out");
    let m = prepare(&[&a, &b], &out, &opts(Tokenizer::Gpt2, 0.0, 100)).unwrap();
    assert_eq!((m.train.documents, m.validation.documents), (2, 0));
    let data = TokenShards::open(&out).unwrap();
    assert_eq!(data.validation().tokens(), 0);
    assert_eq!(data.validation().windows(4), 0);
    assert_eq!(data.train().tokens(), 2 + 3 + 3);
}

#[test]
fn text_without_a_cut_point_is_refused_at_the_memory_bound() {
    let tmp = TempDir::new("data-bound");
    let long = write(&tmp, "oneword.txt", &"x".repeat(100));
    let mut o = opts(Tokenizer::Gpt2, 0.0, 100);
    o.max_pending_bytes = 16;
    let e = prepare(&[&long], &tmp.path("out"), &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("oneword.txt") && e.contains("no word boundary"),
        "{e}"
    );
    // With room for the whole word it is one document.
    o.max_pending_bytes = 128;
    let m = prepare(&[&long], &tmp.path("out"), &o).unwrap();
    assert_eq!(m.train.documents, 1);
}
