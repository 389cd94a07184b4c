//! The JSON tree reader on arbitrary text: never a panic, and what it reads writes back to
//! the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lowbit_io::json::Json;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(v) = Json::parse(text) {
        assert_eq!(Json::parse(&v.to_string()).expect("compact"), v);
        assert_eq!(Json::parse(&v.to_text()).expect("diffable"), v);
    }
});
