//! The JSON codec: what it writes, what it reads, what it refuses.

use lowbit_io::json::{Json, Limits, Object, ParseError, Reader};

#[test]
fn prints_compact_json() {
    let v = Json::obj([
        ("a", Json::Int(-3)),
        ("b", Json::F32(0.1)),
        ("c", Json::Num(f64::NAN)),
        ("d", Json::str("q\"\n\u{1}")),
        ("e", Json::Arr(vec![Json::Bool(true), Json::Null])),
        ("f", Json::Num(1e-30)),
        ("g", Json::uint(7usize)),
    ]);
    assert_eq!(
        v.to_string(),
        r#"{"a":-3,"b":0.1,"c":null,"d":"q\"\n\u0001","e":[true,null],"f":1e-30,"g":7}"#
    );
}

#[test]
fn round_trips_and_refuses_bad_input() {
    let v = Json::obj([
        ("a\"b\n", Json::UInt(u64::MAX)),
        (
            "x",
            Json::Arr(vec![
                Json::Null,
                Json::Bool(true),
                Json::Str("é\u{1}".into()),
            ]),
        ),
    ]);
    assert_eq!(Json::parse(&v.to_text()).unwrap(), v);
    assert_eq!(Json::parse(&v.to_string()).unwrap(), v);
    for bad in [
        "",
        "{",
        "[1,]",
        "{\"a\":1,\"a\":2}",
        "-",
        "1.",
        "1e",
        "01",
        "-01",
        "18446744073709551616",
        "-9223372036854775809",
        "1e999",
        "\"\\ud800\"",
        "\"\\ud800\\u0041\"",
        "\"abc",
        "[1] x",
        &"[".repeat(10_000),
    ] {
        assert!(Json::parse(bad).is_err(), "{bad:.20}");
    }
    // Numbers that are not non-negative integers read, but not as a u64: a manifest's
    // counts refuse them.
    for not_u64 in ["1.5", "-1", "1e3"] {
        let v = Json::parse(not_u64).unwrap();
        assert_eq!(v.as_u64(), None, "{not_u64}");
    }
    let e = Json::parse_with(
        "[[1]]",
        Limits {
            max_depth: 1,
            max_len: 100,
        },
    )
    .unwrap_err();
    assert_eq!(e.at, 2, "{e}");
    assert!(
        Json::parse_with(
            "[1]",
            Limits {
                max_depth: 8,
                max_len: 2
            }
        )
        .is_err()
    );
}

#[test]
fn parses_cargo_like_messages() {
    let v = Json::parse(
        r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"nccl",
           "required-features":["cuda"]},"profile":{"test":true},"executable":"/t/x\u00e9\"y",
           "n":-1.5e3,"none":null,"list":[],"emoji":"\ud83d\ude00"}"#,
    )
    .unwrap();
    assert_eq!(v.get("reason").as_str(), Some("compiler-artifact"));
    assert!(v.get("target").get("kind").contains_str("test"));
    assert!(
        v.get("target")
            .get("required-features")
            .contains_str("cuda")
    );
    assert!(v.get("profile").get("test").is_true());
    assert_eq!(v.get("executable").as_str(), Some("/t/xé\"y"));
    assert_eq!(v.get("emoji").as_str(), Some("\u{1f600}"));
    assert_eq!(v.get("n"), &Json::Num(-1500.0));
    assert_eq!(v.get("missing"), &Json::Null);
    assert_eq!(v.member("missing"), None);
    assert_eq!(v.member("none"), Some(&Json::Null));
    assert!(Json::parse("{\"a\":}").is_err());
    assert!(Json::parse("[1,2] x").is_err());
}

#[test]
fn parses_nested_and_empty_containers() {
    let v = Json::parse(r#"[ 1 , [2, {}], {"k": [true, null], "e": []} ]"#).unwrap();
    let a = v.arr();
    assert_eq!(a.len(), 3);
    assert_eq!(a[0], Json::UInt(1));
    assert_eq!(a[0].as_f64(), Some(1.0));
    assert_eq!(a[1].arr()[0].as_f64(), Some(2.0));
    assert_eq!(a[1].arr()[1].keys(), Vec::<&str>::new());
    assert!(a[2].get("k").arr()[0].is_true());
    assert_eq!(a[2].get("k").arr()[1], Json::Null);
    assert_eq!(a[2].get("e"), &Json::Arr(Vec::new()));
    assert_eq!(a[2].keys(), ["k", "e"], "members keep the file's order");
    assert_eq!(Json::parse("{}").unwrap(), Json::Obj(Object::new()));
    for bad in [
        "[1 2]",
        "[1,]",
        "{\"a\":1,}",
        "{1:2}",
        "{\"a\" 1}",
        "[",
        "{",
    ] {
        assert!(Json::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn sorted_keys_are_canonical() {
    let mut a = Json::obj([
        ("b", Json::obj([("y", Json::Null), ("x", Json::Null)])),
        ("a", Json::Null),
    ]);
    let mut b = Json::obj([
        ("a", Json::Null),
        ("b", Json::obj([("x", Json::Null), ("y", Json::Null)])),
    ]);
    assert_ne!(a.to_text(), b.to_text());
    a.sort_keys();
    b.sort_keys();
    assert_eq!(a.to_text(), b.to_text());
    assert_eq!(
        a.to_text(),
        "{\n  \"a\": null,\n  \"b\": {\n    \"x\": null,\n    \"y\": null\n  }\n}\n"
    );
}

/// Every container walked through [`Reader`] (keys checked for duplicates by the walker, as a
/// streaming caller does), every scalar taken whole.
fn walk(r: &mut Reader<'_>) -> Result<Json, ParseError> {
    match r.peek() {
        Some(b'{') => {
            r.begin_object()?;
            let mut m = Object::new();
            while let Some((k, at)) = r.next_key()? {
                let v = walk(r)?;
                if m.get(k.as_str()).is_some() {
                    return Err(ParseError {
                        what: format!("duplicate key `{k}`"),
                        at,
                    });
                }
                m.insert(k, v);
            }
            Ok(Json::Obj(m))
        }
        Some(b'[') => {
            r.begin_array()?;
            let mut v = Vec::new();
            while r.next_element()? {
                v.push(walk(r)?);
            }
            Ok(Json::Arr(v))
        }
        _ => r.value(),
    }
}

fn streamed(text: &str, limits: Limits) -> Result<Json, ParseError> {
    let mut r = Reader::new(text, limits)?;
    let v = walk(&mut r)?;
    r.finish()?;
    Ok(v)
}

/// The pull reader reads what the tree reader reads and refuses what it refuses, with the same
/// error at the same byte: valid documents, every prefix of them, and classic bad input.
#[test]
fn the_pull_reader_agrees_with_the_tree_reader() {
    let docs = [
        r#"{"a": [1, {"b": null, "c": [true, false]}, "x"], "d": {}, "e": [], "f": -2.5e3}"#,
        r#"[[], [[]], {"k": "\u00e9\ud83d\ude00\n"}, 18446744073709551615, -9223372036854775808]"#,
        r#"{"a": 1, "a": 2}"#,
        r#"{"a": [1, 2,], "b": 1}"#,
        r#"[1 2]"#,
        r#"{"a" 1}"#,
        r#"{1: 2}"#,
        r#"[01]"#,
        r#"["\ud800"]"#,
        "[\"a\u{1}\"]",
        r#"{"a": 1} x"#,
        "  [ 1 , [ 2 , { \"z\" : [ ] } ] ]  ",
    ];
    let mut compared = 0;
    for doc in docs {
        for end in (0..=doc.len()).filter(|&e| doc.is_char_boundary(e)) {
            let text = &doc[..end];
            assert_eq!(
                streamed(text, Limits::default()),
                Json::parse(text),
                "{text:?}"
            );
            compared += 1;
        }
    }
    assert!(compared > 250, "{compared}");
    // Nesting counts the same: depth 3 passes a limit of 3, depth 4 does not.
    let limits = Limits {
        max_depth: 3,
        max_len: 1 << 20,
    };
    for text in [
        "[[[[]]]]",
        "[[[]]]",
        r#"{"a": {"b": [[]]}}"#,
        r#"{"a": {"b": [1]}}"#,
    ] {
        assert_eq!(
            streamed(text, limits),
            Json::parse_with(text, limits),
            "{text}"
        );
    }
    let long = Limits {
        max_depth: 64,
        max_len: 4,
    };
    assert_eq!(streamed("[1, 2]", long), Json::parse_with("[1, 2]", long));
    assert!(streamed("[1, 2]", long).is_err());
}

/// Large objects are checked for duplicate keys in linear time (a hash set beyond a few
/// members): 200,000 members parse in well under a second, and a duplicate far in is found.
#[test]
fn large_objects_are_checked_for_duplicates_in_linear_time() {
    let members: Vec<String> = (0..200_000).map(|i| format!("\"k{i}\": {i}")).collect();
    let text = format!("{{{}}}", members.join(", "));
    let start = std::time::Instant::now();
    let v = Json::parse(&text).expect("parses");
    assert!(start.elapsed().as_secs_f64() < 5.0, "{:?}", start.elapsed());
    let Json::Obj(m) = &v else {
        panic!("an object")
    };
    assert_eq!(m.len(), 200_000);
    assert_eq!(v.get("k199999").as_u64(), Some(199_999));
    let dup = format!("{{{}, \"k123456\": 0}}", members.join(", "));
    let e = Json::parse(&dup).unwrap_err();
    assert_eq!(e.what, "duplicate key `k123456`");
    assert_eq!(e.at, dup.rfind("\"k123456\"").unwrap());
}
